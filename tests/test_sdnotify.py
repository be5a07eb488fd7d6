"""systemd notify (DESIGN §8.2) against a real unix datagram socket, a filesystem path and an
abstract one, in process and with the real `relay run` in a subprocess."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from relay.runner import Relay
from relay.serving.sdnotify import (
    Notifier,
    from_environ,
    ready_to_serve,
    socket_address,
    supervise,
    watchdog_interval,
)
from relay.tools.sink import Sink
from tests.support import settings
from tests.test_cli import relay_env, relay_run
from tests.test_health import FakeRelay


class NotifySocket:
    """What systemd does: bind an AF_UNIX datagram socket and read the assignments sent to it."""

    def __init__(self, address: str) -> None:
        self.env_value = address
        bound = socket_address(address)
        assert bound is not None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(bound)
        self.sock.setblocking(False)
        self.messages: list[str] = []

    async def receive(self) -> str:
        while True:
            try:
                data = self.sock.recv(4096)
            except BlockingIOError:
                await anyio.wait_readable(self.sock)
                continue
            message = data.decode()
            self.messages.append(message)
            return message

    async def until(self, assignment: str, *, within: float = 60.0) -> list[str]:
        """Messages received until one that contains `assignment` (a deadline, not a
        performance threshold)."""
        got = []
        with anyio.fail_after(within):
            while True:
                message = await self.receive()
                got.append(message)
                if assignment in message.split("\n"):
                    return got

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[NotifySocket]:
    if request.param == "path":
        address = str(tmp_path / "notify.sock")
    else:
        address = f"@ledger-relay-test-{uuid.uuid4().hex}"
    s = NotifySocket(address)
    yield s
    s.close()


# -- pure -----------------------------------------------------------------------------------


def test_socket_address_forms() -> None:
    assert socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert socket_address("@abstract/name") == "\0abstract/name"
    assert socket_address("") is None
    assert socket_address("@") is None
    assert socket_address("relative/path") is None
    assert from_environ({}) is None


def test_watchdog_interval_is_half_of_watchdog_usec() -> None:
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}, pid=7) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "7"}, pid=7) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "8"}, pid=7) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}, pid=7) is None
    assert watchdog_interval({"WATCHDOG_USEC": "soon"}, pid=7) is None
    assert watchdog_interval({}, pid=7) is None


@pytest.mark.anyio
async def test_notifier_sends_one_datagram_per_notification(notify_socket: NotifySocket) -> None:
    notifier = from_environ({"NOTIFY_SOCKET": notify_socket.env_value})
    assert notifier is not None
    try:
        assert notifier.notify("READY=1", "STATUS=delivering")
        assert notifier.notify("WATCHDOG=1")
        assert await notify_socket.receive() == "READY=1\nSTATUS=delivering"
        assert await notify_socket.receive() == "WATCHDOG=1"
    finally:
        notifier.close()


def test_a_missing_socket_never_fails_the_relay(tmp_path: Path) -> None:
    notifier = Notifier(str(tmp_path / "gone.sock"))
    try:
        assert notifier.notify("WATCHDOG=1") is False
        assert notifier.notify("WATCHDOG=1") is False
    finally:
        notifier.close()


# -- what the supervisor reads: a view, nothing else --------------------------------------------


def test_ready_to_serve_reads_the_view() -> None:
    relay = FakeRelay()
    view = relay.view()
    assert ready_to_serve(view)
    relay.turns = [2, 1]  # the ordinary lane's first discovery pass has not run yet
    assert not ready_to_serve(view)
    relay.turns = [2, 2]
    relay.listen_up = False
    assert not ready_to_serve(view)
    relay.listen_up = True
    relay.started = False
    assert not ready_to_serve(view)


@pytest.mark.anyio
async def test_supervise_reports_ready_watchdog_and_stopping_from_the_view(
    notify_socket: NotifySocket,
) -> None:
    relay = FakeRelay()
    notifier = from_environ({"NOTIFY_SOCKET": notify_socket.env_value})
    assert notifier is not None
    cfg = settings("postgresql://x@h/db", "relay", "http://sink")
    async with anyio.create_task_group() as tg:
        tg.start_soon(supervise, cfg, relay.view(), notifier, {"WATCHDOG_USEC": "100000"})
        await notify_socket.until("READY=1")
        await notify_socket.until("WATCHDOG=1")
        relay.stopping = True
        relay.stopped.set()
        await notify_socket.until("STOPPING=1")
        tg.cancel_scope.cancel()


# -- a running relay --------------------------------------------------------------------------


@pytest.mark.anyio
async def test_relay_reports_ready_watchdog_and_stopping(
    pg_url: str,
    schema: str,
    sink: tuple[Sink, str],
    notify_socket: NotifySocket,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, url = sink
    monkeypatch.setenv("NOTIFY_SOCKET", notify_socket.env_value)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # ping every 0.1 s
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    relay = Relay(settings(pg_url, schema, url))
    async with relay.running() as r:
        before = await notify_socket.until("READY=1")
        assert r.listener is not None and r.listener.up  # READY only once LISTEN is up
        assert all(lane.turns >= 2 for lane in r.lanes.values())  # and the first pass ran
        assert not any("WATCHDOG=1" in m for m in before)
        await notify_socket.until("WATCHDOG=1")
        await notify_socket.until("WATCHDOG=1")
        r.stop()
        await notify_socket.until("STOPPING=1")


@pytest.mark.anyio
async def test_relay_run_under_a_notify_socket(
    pg_url: str, schema: str, sink: tuple[Sink, str], tmp_path: Path
) -> None:
    """What systemd sees of `relay run` (Type=notify, WatchdogSec=1): READY, WATCHDOG, and on
    SIGTERM, STOPPING and a clean exit."""
    _, url = sink
    sock = NotifySocket(f"@ledger-relay-run-{uuid.uuid4().hex}")
    env = relay_env(pg_url, schema, url, NOTIFY_SOCKET=sock.env_value, WATCHDOG_USEC="1000000")
    log = (tmp_path / "relay.log").open("wb")
    try:
        async with relay_run(env, stdout=log, stderr=subprocess.STDOUT) as proc:
            await sock.until("READY=1")
            await sock.until("WATCHDOG=1")
            proc.send_signal(signal.SIGTERM)
            await sock.until("STOPPING=1")
            with anyio.fail_after(60):
                code = await proc.wait()
    finally:
        log.close()
        sock.close()
    text = (tmp_path / "relay.log").read_text()
    assert code == 0, text[-2000:]
    assert '"event":"sd_notify_ready"' in text
