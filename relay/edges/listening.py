"""A LISTEN connection that stays up (DESIGN §4.1), shared by the relay's listener
(relay/edges/listener.py) and the Absurd wake listener (relay/engine.py).

One loop: connect, LISTEN on the channels, hand every notification on, and whenever the
connection has been quiet for `check_interval` prove the server is still there within
`check_timeout` (a dead server is otherwise noticed only by TCP keepalives). After any failure
it reconnects with capped, jittered backoff (`policy.backoff`); a session that came up resets
the backoff, so only consecutive failures grow it. What each listener does on top — take the
liveness lock, trigger a full pass, wake a worker — it says through a `Hooks` object. A loop
run until a stop (`run_until`) ends its session with one last statement before it closes
(the relay's listener gives up its liveness lock cleanly: issue 41).
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

import anyio
import psycopg
from psycopg import sql

from relay.core.policy import backoff

Conn = psycopg.AsyncConnection[Any]
BACKOFF_BASE = 0.1  # seconds: the first retry's ceiling


class Hooks(Protocol):
    """What a listener does at each step of its connection's life."""

    @property
    def up(self) -> bool:
        """Whether a session is up now (read when it fails: was it up, or never came up?)."""
        ...

    async def prepare(self, conn: Conn) -> None:
        """Right after LISTEN, under the same deadline (e.g. take the liveness lock)."""

    def connected(self, conn: Conn) -> None:
        """The session is up: mark it, and catch up on what NOTIFY did not keep."""

    def notified(self, channel: str, payload: str) -> None:
        """One notification."""

    async def quiet(self, conn: Conn) -> None:
        """Nothing for `check_interval`: prove the server is there (runs under a deadline)."""

    def lost(self, was_up: bool, exc: BaseException, retry_in: float) -> None:
        """The session failed (or never came up); the next try is in `retry_in` seconds."""


class StoppingHooks(Hooks, Protocol):
    """Hooks of a loop that ends on a stop request."""

    async def stopping(self, conn: Conn) -> None:
        """The session's last statement before it closes on a stop (runs under a deadline)."""


@dataclass(frozen=True, slots=True)
class Listening:
    conninfo: str
    channels: Sequence[str]
    connect_kwargs: Mapping[str, Any] = field(default_factory=dict)
    check_interval: float = 5.0
    check_timeout: float = 5.0
    max_backoff: float = 10.0

    async def run(self, hooks: Hooks) -> NoReturn:
        """Keep a session up for `hooks`, forever."""
        await self._keep_up(hooks, anyio.Event(), None)  # an event nobody sets
        raise AssertionError("unreachable: nothing stops this loop")

    async def run_until(self, hooks: StoppingHooks, stop: anyio.Event) -> None:
        """Keep a session up for `hooks` until `stop` is set. The session then up ends with
        `hooks.stopping(conn)` as soon as no statement of its own runs (its wait for
        notifications is cut short); a wait to reconnect ends at once."""
        await self._keep_up(hooks, stop, hooks.stopping)

    async def _keep_up(
        self, hooks: Hooks, stop: anyio.Event, stopping: Callable[[Conn], Awaitable[None]] | None
    ) -> None:
        waiting = _Waiting()
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(waiting.cut_short_on, stop)
            failures = 0
            while not stop.is_set():
                try:
                    await self._session(hooks, stop, waiting, stopping)
                except (psycopg.Error, OSError, TimeoutError) as exc:
                    was_up = hooks.up
                    failures = 1 if was_up else failures + 1
                    delay = backoff(
                        failures - 1, base=BACKOFF_BASE, cap=self.max_backoff, rand=random.random()
                    )
                    hooks.lost(was_up, exc, delay)
                    with anyio.move_on_after(delay):
                        await stop.wait()
            tasks.cancel_scope.cancel()

    async def _session(
        self,
        hooks: Hooks,
        stop: anyio.Event,
        waiting: _Waiting,
        stopping: Callable[[Conn], Awaitable[None]] | None,
    ) -> None:
        # autocommit whatever the caller's options: a LISTEN takes effect only once committed.
        options = {**self.connect_kwargs, "autocommit": True}
        with anyio.fail_after(self.check_timeout + 5):
            conn = await psycopg.AsyncConnection.connect(self.conninfo, **options)
        async with conn:
            with anyio.fail_after(self.check_timeout):
                for channel in self.channels:
                    await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                await hooks.prepare(conn)
            hooks.connected(conn)
            while not stop.is_set():
                with anyio.CancelScope() as waiting.scope:
                    async for note in conn.notifies(timeout=self.check_interval):
                        hooks.notified(note.channel, note.payload)
                waiting.scope = None
                if stop.is_set():
                    break
                with anyio.fail_after(self.check_timeout):
                    await hooks.quiet(conn)
            if stopping is not None:
                with anyio.fail_after(self.check_timeout):
                    await stopping(conn)


@dataclass(slots=True)
class _Waiting:
    """The wait for notifications under way, which a stop cuts short: only the wait, never a
    statement, so the session stays usable for its last one. (psycopg holds the connection for
    the whole wait: a statement would otherwise wait up to `check_interval` for it.)"""

    scope: anyio.CancelScope | None = None

    async def cut_short_on(self, stop: anyio.Event) -> None:
        await stop.wait()
        if self.scope is not None:  # else no wait is under way, and none starts after the stop
            self.scope.cancel()


async def ping(conn: Conn) -> None:
    """The plainest proof that the server is still there."""
    await conn.execute("select 1")
