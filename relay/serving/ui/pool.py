"""The status page's own database connection: at most one, opened when a page is first asked
for and closed after a minute without viewers, apart from the pools that deliver.

Whatever the page's viewers do, they hold at most one database backend, under the page's own
short statement timeout, in read-only transactions: a slow page query waits for itself and
never for (or in front of) a claim or an ack (issue 32, item 3: twelve viewers on the delivery
pool starved delivery). A viewer beyond `MAX_WAITING` waiting for the connection is refused at
once (psycopg_pool.TooManyRequests, which the page answers with 503).

The bounds are set per transaction, in the one message that carries the statement (as the
store does): `database_url` may lead through a transaction-mode pooler, where a session
setting would stay on a server connection that the delivery's transactions use next.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import psycopg
from psycopg import AsyncClientCursor, sql
from psycopg.pq import TransactionStatus
from psycopg.rows import TupleRow
from psycopg_pool import AsyncConnectionPool

from relay.edges.store import CONNECT_KWARGS

STATEMENT_TIMEOUT = 2.0  # seconds: the page's statements are index lookups and a small table
LOCK_TIMEOUT = 0.5
MAX_WAITING = 8  # requests queued for the connection; more are refused at once
WAIT_TIMEOUT = 5.0  # seconds a request may wait for the connection
MAX_IDLE = 60.0  # seconds before an unused connection is closed


class PagePool:
    def __init__(self, conninfo: str, statement_timeout: float = STATEMENT_TIMEOUT) -> None:
        self.statement_timeout = statement_timeout
        self.deadline = statement_timeout + 2.0  # the application deadline on a round trip
        self._pool: AsyncConnectionPool[psycopg.AsyncConnection[TupleRow]] = AsyncConnectionPool(
            conninfo,
            min_size=0,
            max_size=1,
            open=False,
            kwargs={**CONNECT_KWARGS, "application_name": "ledger-relay-status-page"},
            check=AsyncConnectionPool.check_connection,
            timeout=WAIT_TIMEOUT,
            max_waiting=MAX_WAITING,
            max_idle=MAX_IDLE,
            name="status-page",
        )
        self._opened = False
        self._opening = anyio.Lock()
        self._begin = (
            "begin read only; select"
            f" set_config('statement_timeout', '{int(statement_timeout * 1000)}ms', true),"
            f" set_config('lock_timeout', '{int(LOCK_TIMEOUT * 1000)}ms', true); "
        )

    async def query(self, query: sql.Composed, params: Sequence[Any]) -> list[TupleRow]:
        """One statement in its own read-only transaction with the page's bounds: BEGIN, the
        bounds, the statement and COMMIT in one message."""
        async with self._opening:
            if not self._opened:
                await self._pool.open(wait=False)
                self._opened = True
        async with self._pool.connection() as conn:
            text = self._begin + AsyncClientCursor(conn).mogrify(query, params) + "; commit"
            try:
                with anyio.fail_after(self.deadline):
                    cur = await conn.execute(text.encode())
                    cur.nextset()  # past BEGIN
                    cur.nextset()  # past the bounds
                    return await cur.fetchall()
            except BaseException:
                await _settle(conn)
                raise

    async def close(self) -> None:
        if self._opened:
            await self._pool.close()
            self._opened = False


async def _settle(conn: psycopg.AsyncConnection[Any]) -> None:
    """After a failed statement: roll the aborted transaction back (bounded) so the connection
    can serve the next view; a connection in any other unfinished state (a deadline or a
    cancellation mid-protocol) is closed, and the pool opens another when asked."""
    if conn.closed:
        return
    status = conn.info.transaction_status
    if status == TransactionStatus.INERROR:
        with anyio.move_on_after(2.0) as scope:
            await conn.execute("rollback")
        if not scope.cancelled_caught:
            return
    if conn.info.transaction_status != TransactionStatus.IDLE:
        await conn.close()
