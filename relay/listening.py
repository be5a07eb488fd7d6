"""A LISTEN connection that stays up (DESIGN §4.1), shared by the relay's listener
(relay/listener.py) and the Absurd wake listener (relay/engine.py).

One loop: connect, LISTEN on the channels, hand every notification on, and whenever the
connection has been quiet for `check_interval` prove the server is still there within
`check_timeout` (a dead server is otherwise noticed only by TCP keepalives). After any failure
it reconnects with capped, jittered backoff (`policy.backoff`); a session that came up resets
the backoff, so only consecutive failures grow it. What each listener does on top — take the
liveness lock, trigger a full pass, wake a worker — it says through a `Hooks` object.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

import anyio
import psycopg
from psycopg import sql

from relay.policy import backoff

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
        failures = 0
        while True:
            try:
                await self._session(hooks)
            except (psycopg.Error, OSError, TimeoutError) as exc:
                was_up = hooks.up
                failures = 1 if was_up else failures + 1
                delay = backoff(
                    failures - 1, base=BACKOFF_BASE, cap=self.max_backoff, rand=random.random()
                )
                hooks.lost(was_up, exc, delay)
                await anyio.sleep(delay)

    async def _session(self, hooks: Hooks) -> None:
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
            while True:
                async for note in conn.notifies(timeout=self.check_interval):
                    hooks.notified(note.channel, note.payload)
                with anyio.fail_after(self.check_timeout):
                    await hooks.quiet(conn)


async def ping(conn: Conn) -> None:
    """The plainest proof that the server is still there."""
    await conn.execute("select 1")
