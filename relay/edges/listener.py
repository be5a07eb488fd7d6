"""The LISTEN connection (DESIGN §4.1): one dedicated connection, never through a pooler.

It turns notifications into wakes: a terminal commit becomes a targeted drain of that run on
the critical lane, anything on `absurd_wake` (or unknown) a discovery pass. It never delivers
anything itself, so while it is down the relay goes on by polling. The connection's life —
a dead server noticed within bounded time, reconnection with capped backoff — is
relay/edges/listening.py's, shared with the Absurd wake listener; this module is its hooks. Every
(re)connect triggers a full discovery pass, because NOTIFY is not durable.

It is also the replica's proof of life (issue 18, DESIGN §4.2): right after LISTEN, each session
takes the replica's liveness lock (`hold_liveness(owner)`, a session advisory lock), which the
database drops the moment the process dies, so other replicas may claim its runs at once. A
frozen process keeps its connection and so the lock. While this connection is down the replica
looks dead and may lose its leases before they expire: duplicates at most, the fence holds.
A lock another session still holds (our previous session, not yet dropped by the server) is
tried again at every check. A clean stop (`stop()`, once the lanes finished or released their
work) is said on that session before it closes (`replica_stopped`), which gives the lock up:
the replica is then not listed as dead (issue 41), and no later session takes the lock again.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import anyio
import orjson
import psycopg
from psycopg import sql

from relay import logs
from relay.edges.listening import Listening, ping
from relay.edges.store import CONNECT_KWARGS

MAX_PAYLOAD = 8000


@dataclass(slots=True)
class ListenerState:
    """The LISTEN connection as it stands, which the listener keeps up to date; observers are
    handed a copy (`Listener.view`, relay/serving/progress.py's `ListenerView`)."""

    up: bool = False
    reconnects: int = 0  # successful connects, the first one included
    received: int = 0  # notifications received
    # While down: since when (wall clock, the first failure of the outage) and why, for a
    # fleet's status page (relay/serving/ui/fleet.py); None while up and before any try.
    down_since: float | None = None
    error: str | None = None
    malformed: int = 0  # notifications on the terminal channel that were not ours, ignored
    backend_pid: int | None = None  # the session's server process, while up


class Listener:
    def __init__(
        self,
        conninfo: str,
        terminal_channel: str,
        *,
        on_terminal: Callable[[str], None],
        on_delivered: Callable[[str], None],
        on_wake: Callable[[], None],
        on_connected: Callable[[], None],
        check_interval: float = 5.0,
        check_timeout: float = 5.0,
        max_backoff: float = 10.0,
        liveness: tuple[str, str] | None = None,
    ) -> None:
        """`liveness` is (schema, owner): the liveness lock to hold on every session. The lock is
        taken with this listener's incarnation (random, one per listener: one per relay run), so
        that a restart under the same owner id ends its dead predecessor's leases at once.
        A run an operator made due (`relay retry`: kind `run_due`) is a wake like any other: its
        waiver of the retry budget is on the run's row, which the claim returns."""
        self.listening = Listening(
            conninfo,
            (terminal_channel, "absurd_wake"),
            CONNECT_KWARGS,
            check_interval=check_interval,
            check_timeout=check_timeout,
            max_backoff=max_backoff,
        )
        self.terminal_channel = terminal_channel
        self.on_terminal = on_terminal
        self.on_delivered = on_delivered
        self.on_wake = on_wake
        self.on_connected = on_connected
        self.state = ListenerState()
        self._hold = (
            None
            if liveness is None
            else (
                sql.SQL("select {}.hold_liveness(%s, %s)").format(sql.Identifier(liveness[0])),
                liveness[1],
            )
        )
        self._stopped = (
            None
            if liveness is None
            else sql.SQL("select {}.replica_stopped(%s)").format(sql.Identifier(liveness[0]))
        )
        self._stop = anyio.Event()
        self._ended = anyio.Event()
        self.incarnation = secrets.token_hex(8)
        self.liveness_held = False
        self._liveness_conn: psycopg.AsyncConnection[Any] | None = None  # the session holding it
        # Set once the first session came up (LISTEN done, liveness lock tried): the runner
        # lets the lanes claim only then, so no replica takes a fresh one for dead.
        self.first_session = anyio.Event()

    async def run(self) -> None:
        """Until stop(); the session holding the liveness lock then gives it up cleanly."""
        try:
            await self.listening.run_until(self, self._stop)
        finally:
            self._ended.set()

    @property
    def up(self) -> bool:
        """A session is up now (read by relay/edges/listening.py when one fails)."""
        return self.state.up

    def view(self) -> ListenerState:
        """A copy of the state, for an observer: what it reads stays as it was when it asked."""
        return replace(self.state)

    async def stop(self) -> None:
        """A clean stop: call it once the lanes finished or released their work (DESIGN §4.2).
        While a session holds the liveness lock, waits until it said so and gave the lock up
        (bounded: one step of the session, then the statement); else returns at once, with
        nothing to say."""
        self._stop.set()
        if self.liveness_held:
            with anyio.move_on_after(2 * self.listening.check_timeout + 1):
                await self._ended.wait()

    # -- the hooks of relay/edges/listening.py
    # -------------------------------------------------------

    async def prepare(self, conn: psycopg.AsyncConnection[Any]) -> None:
        await self._hold_liveness(conn)

    def connected(self, conn: psycopg.AsyncConnection[Any]) -> None:
        state = self.state
        state.backend_pid = conn.info.backend_pid
        if state.reconnects or state.up:
            logs.info("listen_reconnected", backend_pid=state.backend_pid)
        state.reconnects += 1
        state.up = True
        state.down_since = state.error = None
        # NOTIFY is not durable: whatever was sent while we were away is found by a full pass.
        self.on_connected()
        self.first_session.set()

    def notified(self, channel: str, payload: str) -> None:
        self.dispatch(channel, payload)

    async def quiet(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """A lock another session still held (our previous one, not yet dropped by the server)
        is tried again; otherwise a plain ping."""
        if self._hold is not None and not self.liveness_held:
            await self._hold_liveness(conn)
        else:
            await ping(conn)

    async def stopping(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """The replica stops cleanly: forgotten, its lock given up (`replica_stopped`). An owner
        that still holds a lease (a release that failed) is kept, so the others take its runs
        at once, as a dead one's. Never taken again: the lock stays given up."""
        hold, self._hold = self._hold, None
        if hold is None or self._stopped is None or not self.liveness_held:
            return
        owner = hold[1]
        try:
            cur = await conn.execute(self._stopped, (owner,))
        except (psycopg.errors.InsufficientPrivilege, psycopg.errors.UndefinedFunction) as exc:
            # A schema whose functions predate it: the lock goes with the session, as before.
            logs.warning("replica_stop_unrecorded", owner=owner, error=logs.error_text(exc))
            return
        row = await cur.fetchone()
        self.liveness_held = False
        self._liveness_conn = None
        if row and row[0]:
            logs.info("replica_stopped", owner=owner)
        else:
            logs.warning("replica_stopped_holding_leases", owner=owner)

    def lost(self, was_up: bool, exc: BaseException, retry_in: float) -> None:
        state = self.state
        state.up = False
        self.liveness_held = False
        self._liveness_conn = None
        state.backend_pid = None
        if state.down_since is None:
            state.down_since = time.time()
        state.error = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
        logs.warning(
            "listen_lost" if was_up else "listen_connect_failed",
            error=state.error,
            retry_in=round(retry_in, 3),
        )

    async def _hold_liveness(self, conn: psycopg.AsyncConnection[Any]) -> None:
        if self._hold is None or self._stop.is_set():
            return
        query, owner = self._hold
        try:
            cur = await conn.execute(query, (owner, self.incarnation))
        except (psycopg.errors.InsufficientPrivilege, psycopg.errors.UndefinedFunction) as exc:
            # Safe without it: an owner that never recorded itself is never judged dead.
            self._hold = None
            logs.warning("liveness_unavailable", error=logs.error_text(exc))
            return
        row = await cur.fetchone()
        held = bool(row and row[0])
        if not held:
            logs.warning("liveness_lock_busy", owner=owner, retry_in=self.listening.check_interval)
        else:
            logs.debug(
                "liveness_held",
                owner=owner,
                incarnation=self.incarnation,
                backend_pid=conn.info.backend_pid,
            )
        self.liveness_held = held
        self._liveness_conn = conn if held else None

    async def on_liveness_session(
        self, query: sql.Composed, params: Sequence[Any]
    ) -> list[tuple[Any, ...]]:
        """One statement on the session that holds the liveness lock: the replica report, which
        the database takes only from there (schema/functions_ui.sql). It waits for the
        connection between two waits for notifications (at most `check_interval`); the caller
        bounds it. Raises ConnectionError while no session holds the lock."""
        conn = self._liveness_conn
        if conn is None or conn.closed or not self.liveness_held:
            raise ConnectionError("no LISTEN session holds the liveness lock")
        cur = await conn.execute(query, params)
        return await cur.fetchall()

    def dispatch(self, channel: str, payload: str) -> None:
        self.state.received += 1
        if channel != self.terminal_channel:
            self.on_wake()
            return
        msg = self._parse(payload)
        if msg is None:
            self.state.malformed += 1
            logs.warning("notification_ignored", channel=channel, payload=payload[:200])
            self.on_wake()
            return
        kind, run_id = msg
        if kind == "terminal_committed":
            self.on_terminal(run_id)
        elif kind == "outbox_delivered":
            self.on_delivered(run_id)
        else:  # a wake: run_due (an operator's retry) and run_unblocked among them
            self.on_wake()

    @staticmethod
    def _parse(payload: str) -> tuple[str, str] | None:
        # PostgreSQL's NOTIFY limit is in bytes; a str of 3000 '€' is 9000 of them.
        if len(payload) > MAX_PAYLOAD:
            return None
        if len(payload.encode("utf-8", "surrogatepass")) > MAX_PAYLOAD:
            return None
        try:
            msg: Any = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(msg, dict):
            return None
        kind, run_id = msg.get("kind"), msg.get("run_id")
        if not isinstance(kind, str) or not isinstance(run_id, str) or not run_id:
            return None
        return kind, run_id
