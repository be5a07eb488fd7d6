"""Connecting: the relay's two database pools, opened once the database answers, and the stores.

Each lane has a pool of its own, so that no backlog of ordinary work can keep the critical lane
waiting for a connection (DESIGN §4.3); both go to `database_url`, and their sizes make the
connection budget of docs/operations.md, or fit within `server_connections` when one is set
(`split_share`: a fleet's database's share, or the one database's). The runner asks this part
for the open pools at start and for a store over each; it closes them itself, after the lanes
and the listener stopped.

A pool whose server went away reconnects by itself, in series of attempts psycopg_pool spaces
with a doubling delay (1 s, 2 s, 4 s, ...) until its `reconnect_timeout`. At its default (5
minutes) a server back after a 15 s outage waited up to 16 s for the pool's next attempt (10.9 s
measured by `relay bench --only fleet_outage`), after a 2-minute one up to 2 minutes. Each series
here lasts RECONNECT_WINDOW and the next starts at once (`rearm`): attempts are never much more
than half the window apart however long the outage, and no pool gives up while its relay runs.
"""

from __future__ import annotations

from typing import Any

import anyio
from psycopg_pool import AsyncConnectionPool

from relay.databases import own_share
from relay.edges.store import CONNECT_KWARGS, IdleCheck, Pool, Store
from relay.settings import Settings, redact_url

POOL_CHECK_IDLE = 1.0  # seconds idle after which a pooled connection is checked before use
# A lane's database work does not grow with its POST slots: one claim loop, one ack group and
# one renewer, plus the releases of failed POSTs, which may wait for a connection.
POOL_FOR_DELIVERIES = 8
# How long one series of reconnection attempts lasts (psycopg_pool's `reconnect_timeout`): its
# attempts at 0, ~1, ~3, ~7 and 10 s, the next series' first at once, so a server back is tried
# within about 4 s (docs/sharding.md, "How soon a server that is back is served again").
RECONNECT_WINDOW = 10.0


async def rearm(pool: AsyncConnectionPool[Any]) -> None:
    """psycopg_pool's `reconnect_failed`: a series of attempts ended without a connection. The
    next starts at once: `check()` grows a pool short of connections (a no-op while another
    series runs). Not once the pool is closed."""
    if not pool.closed:
        await pool.check()


def pool_size(concurrency: int) -> int:
    """A lane's pool: what its deliveries use at once (at most POOL_FOR_DELIVERIES), plus two
    (docs/operations.md, the connection budget)."""
    return min(concurrency, POOL_FOR_DELIVERIES) + 2


def split_share(settings: Settings, share: int) -> tuple[int, int]:
    """One database's share of `server_connections` as its ordinary and critical pool sizes: one
    connection for its LISTEN session, the critical pool a third of the rest (at least 2), the
    ordinary pool the remainder, neither above what its lane uses unbudgeted (`pool_size`); a
    share that holds both unbudgeted pools leaves them as they are."""
    full = pool_size(settings.concurrency), pool_size(settings.critical_concurrency)
    if share >= 1 + sum(full):
        return full
    rest = share - 1
    critical = min(pool_size(settings.critical_concurrency), max(2, rest // 3))
    return min(pool_size(settings.concurrency), rest - critical), critical


class Pools:
    """Opens the ordinary and the critical lane's pools, in that order, and builds a store over
    either with the settings' schema, lease and bounds. It keeps no pool: the caller holds what
    `open` returned and closes it."""

    def __init__(
        self,
        settings: Settings,
        sizes: tuple[int, int] | None = None,
        *,
        reconnect_window: float = RECONNECT_WINDOW,
    ) -> None:
        """`sizes`: the ordinary and the critical pool's most connections, when a fleet's budget
        sets them (its database's share of `server_connections`, relay/databases.py); else
        within the one database's share of it (`own_share`), or without one `pool_size` of
        each lane's concurrency. `reconnect_window`: RECONNECT_WINDOW but in tests."""
        self.settings = settings
        self.reconnect_window = reconnect_window
        share = own_share(settings)
        self.sizes = sizes or (
            split_share(settings, share)
            if share is not None
            else (pool_size(settings.concurrency), pool_size(settings.critical_concurrency))
        )

    async def open(self, stop: anyio.Event) -> list[Pool] | None:
        """The ordinary and the critical pool, open; None when a stop request came while the
        database was waited for (relay/startup.py), which comes first."""
        s = self.settings
        url = s.database_url.reveal()
        pools = [
            self._pool(url, "ordinary", self.sizes[0]),
            self._pool(url, "critical", self.sizes[1]),
        ]
        from relay.startup import wait_for_database

        waited = await wait_for_database(
            url,
            timeout=s.startup_timeout,
            stop=stop,
            replica=s.replica_id,
        )
        if not waited:
            return None
        try:
            for pool in pools:
                await pool.open(wait=True, timeout=s.statement_timeout + 5)
        except Exception as exc:
            for pool in pools:
                await pool.close()
            raise ConnectionError(
                f"cannot connect to the database at {redact_url(url)}: {type(exc).__name__}"
            ) from None
        return pools

    def store(self, pool: Pool) -> Store:
        s = self.settings
        return Store(
            pool,
            s.schema,
            lease_ttl=s.lease_ttl,
            batch_size=s.batch_size,
            owner=s.replica_id,
            max_batch_bytes=s.max_batch_bytes,
            statement_timeout=s.statement_timeout,
        )

    def _pool(self, url: str, name: str, size: int) -> Pool:
        return AsyncConnectionPool(
            url,
            min_size=1,
            max_size=size,
            kwargs=dict(CONNECT_KWARGS),
            name=f"relay-{name}",
            open=False,
            timeout=self.settings.statement_timeout,
            check=IdleCheck(POOL_CHECK_IDLE),
            reconnect_timeout=self.reconnect_window,
            reconnect_failed=rearm,
        )
