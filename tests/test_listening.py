"""relay/edges/listening.py: the one LISTEN loop of the relay's listener and the Absurd wake
listener (issue 27, item 5), against a real PostgreSQL."""

from __future__ import annotations

import socket
from typing import Any

import anyio
import psycopg
import pytest

from relay.edges.listener import Listener
from relay.edges.listening import Conn, Listening, ping
from relay.engine import WakeListener
from tests.support import wait_for

pytestmark = pytest.mark.anyio


class Recorder:
    """Hooks that write down what the loop told them."""

    def __init__(self) -> None:
        self.up = False
        self.pids: list[int] = []
        self.notes: list[tuple[str, str]] = []
        self.quiet_checks = 0
        self.losses: list[tuple[bool, float]] = []

    async def prepare(self, conn: Conn) -> None:
        pass

    def connected(self, conn: Conn) -> None:
        self.up = True
        self.pids.append(conn.info.backend_pid)

    def notified(self, channel: str, payload: str) -> None:
        self.notes.append((channel, payload))

    async def quiet(self, conn: Conn) -> None:
        self.quiet_checks += 1
        await ping(conn)

    def lost(self, was_up: bool, exc: BaseException, retry_in: float) -> None:
        self.up = False
        self.losses.append((was_up, retry_in))


async def test_it_listens_checks_when_quiet_and_comes_back_after_the_session_dies(
    pg_url: str, conn: psycopg.Connection[Any]
) -> None:
    rec = Recorder()
    listening = Listening(pg_url, ("chan_a", "chan b"), check_interval=0.1, max_backoff=0.2)
    async with anyio.create_task_group() as tg:
        tg.start_soon(listening.run, rec)
        await wait_for(lambda: rec.up, what="the first session")
        conn.execute("select pg_notify('chan b', 'hello')")
        await wait_for(lambda: ("chan b", "hello") in rec.notes, what="the notification")
        await wait_for(lambda: rec.quiet_checks >= 2, what="checks while quiet")
        conn.execute("select pg_terminate_backend(%s)", (rec.pids[0],))
        await wait_for(lambda: len(rec.pids) == 2, what="a new session")
        tg.cancel_scope.cancel()
    assert rec.losses and rec.losses[0][0] is True  # it had been up
    assert rec.pids[1] != rec.pids[0]


async def test_a_server_that_never_answers_is_retried_with_capped_backoff() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    rec = Recorder()
    url = f"postgresql://postgres@127.0.0.1:{port}/postgres?connect_timeout=1"
    listening = Listening(url, ("x",), max_backoff=0.05)
    async with anyio.create_task_group() as tg:
        tg.start_soon(listening.run, rec)
        await wait_for(lambda: len(rec.losses) >= 4, what="several failed connects")
        tg.cancel_scope.cancel()
    assert all(not was_up for was_up, _ in rec.losses)
    assert all(0 <= delay <= 0.05 for _, delay in rec.losses)


def test_the_relay_and_the_wake_listener_run_the_one_loop() -> None:
    relay = Listener(
        "postgresql://x/y",
        "s_terminal",
        on_terminal=lambda _: None,
        on_delivered=lambda _: None,
        on_wake=lambda: None,
        on_connected=lambda: None,
    )
    wake = WakeListener("postgresql://x/y", "q")
    assert isinstance(relay.listening, Listening) and isinstance(wake.listening, Listening)
    assert relay.listening.channels == ("s_terminal", "absurd_wake")
    assert wake.listening.channels == ("absurd_wake",)
    for own in (Listener, WakeListener):
        assert "_session" not in vars(own), f"{own.__name__} keeps a connection loop of its own"
