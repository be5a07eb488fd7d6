"""Nothing a client of `metrics_addr` does ends the relay (issue 32, items 1 and 2).

The real `relay run` in a subprocess, attacked over real sockets: a malformed Accept on
/metrics (prometheus_client raised TypeError and the process exited 1), and more idle
connections than the process has file descriptors (accept() raised EMFILE and the process
exited 1). After each, the same process must still answer its probes and deliver."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from relay.serving import server as serving
from relay.serving.ui.web import Request, Response
from tests.support import Rig, wait_for
from tests.test_cli import RELAY, relay_env
from tests.test_relay import enqueue_runs

pytestmark = pytest.mark.anyio


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def relay_process(env: dict[str, str], log: Path, nofile: int | None = None) -> Iterator[Any]:
    """`relay run`, under `ulimit -n nofile` when given (prlimit, as systemd's LimitNOFILE)."""
    cmd = [*RELAY, "run"]
    if nofile is not None:
        cmd = ["prlimit", f"--nofile={nofile}:{nofile}", "--", *cmd]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            proc.kill()
            proc.wait(timeout=30)


# Descriptors this process may need beside the idle connections it holds: the in-process sink's
# connections from the relay, the probes' clients, the relay's log.
SPARE_DESCRIPTORS = 64


@contextmanager
def room_for_descriptors(more: int) -> Iterator[None]:
    """Room in this process for `more` descriptors beyond those it holds: its soft
    RLIMIT_NOFILE raised for the block (an ordinary user's is often 1024; any user may raise it
    up to the hard limit, and root past it), then put back. Skips, naming the limits, when the
    hard limit leaves no such room."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = len(os.listdir("/proc/self/fd")) + more + SPARE_DESCRIPTORS
    if soft == resource.RLIM_INFINITY or soft >= need:
        yield
        return
    try:
        fits = hard == resource.RLIM_INFINITY or hard >= need
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard if fits else need))
    except (ValueError, OSError):
        pytest.skip(
            f"the test process needs {need} file descriptors (RLIMIT_NOFILE) to hold {more} idle "
            f"connections; its hard limit is {hard} and cannot be raised here (ulimit -Hn)"
        )
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def get(port: int, path: str, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.get(f"http://127.0.0.1:{port}{path}", headers=headers)


async def healthy(port: int) -> bool:
    try:
        return (await get(port, "/healthz")).status_code == 200
    except httpx.HTTPError:
        return False


async def endpoints_up(port: int) -> bool:
    """The relay's own endpoints answer. Not `healthy`: while `relay run` waits for its database
    at start, a stand-in on the same address answers /healthz 200 (relay/startup.py), then
    closes before the endpoints bind, so a request just after it may find nothing listening.
    Only the endpoints answer /metrics 200 (the stand-in answers 503)."""
    try:
        return (await get(port, "/metrics")).status_code == 200
    except httpx.HTTPError:
        return False


async def delivers(rig: Rig, prefix: str) -> None:
    """One more run is enqueued and arrives: the process still does its job."""
    s = rig.sink
    before = len(s.state.deliveries)
    enqueue_runs(rig.conn, rig.schema, 1, 3, prefix=prefix)
    await wait_for(lambda: len(s.state.deliveries) >= before + 3, what=f"{prefix} delivered")
    # The sink counts a delivery as it answers it; the relay acks after that answer, in its own
    # transaction: wait for the ack to commit, not only for the ingress to have the events.
    await wait_for(lambda: rig.count("delivered_at is null") == 0, what=f"{prefix} acked")


async def test_a_malformed_accept_on_metrics_is_refused_and_the_relay_lives_on(
    rig: Rig, tmp_path: Path
) -> None:
    port = free_port()
    env = relay_env(rig.pg_url, rig.schema, rig.url, RELAY_METRICS_ADDR=f"127.0.0.1:{port}")
    with relay_process(env, tmp_path / "relay.log") as proc:
        await wait_for(lambda: endpoints_up(port), what="the endpoints")
        got = await get(port, "/metrics", accept="text/plain; version=x")
        assert got.status_code == 406, got.text
        assert proc.poll() is None, (tmp_path / "relay.log").read_text()[-3000:]
        assert (await get(port, "/metrics")).status_code == 200
        await delivers(rig, "after_bad_accept")


@pytest.mark.parametrize(
    ("nofile", "idle"),
    [
        (1024, 1100),  # systemd's default soft limit, the connections of the report
        (48, 300),  # so tight that accept() itself runs out of descriptors (EMFILE)
    ],
)
async def test_idle_connections_past_the_descriptor_limit_do_not_end_the_relay(
    rig: Rig, tmp_path: Path, nofile: int, idle: int
) -> None:
    port = free_port()
    log = tmp_path / "relay.log"
    env = relay_env(rig.pg_url, rig.schema, rig.url, RELAY_METRICS_ADDR=f"127.0.0.1:{port}")
    tight = nofile < serving.MAX_CONNECTIONS * 2
    expected = "endpoint_accept_failed" if tight else "endpoint_connections_shed"
    # The test process holds the client ends: more than its own soft limit may allow.
    with room_for_descriptors(idle), relay_process(env, log, nofile=nofile) as proc:
        await wait_for(lambda: endpoints_up(port), what="the endpoints")
        await delivers(rig, "before")
        held: list[socket.socket] = []
        try:
            for _ in range(idle):
                c = socket.socket()
                c.setblocking(False)
                c.connect_ex(("127.0.0.1", port))  # idle: never sends a request
                held.append(c)
            # The flood has reached the relay once it says so (shed, or accept() failing).
            await wait_for(
                lambda: f'"event":"{expected}"' in log.read_text(), what=f"{expected} logged"
            )
            assert proc.poll() is None, log.read_text()[-3000:]
            if nofile > serving.MAX_CONNECTIONS * 4:
                # Room to spare: delivery goes on while the connections are held.
                await delivers(rig, "during")
        finally:
            for c in held:
                c.close()
        assert proc.poll() is None, log.read_text()[-3000:]
        await wait_for(lambda: healthy(port), what="the endpoints after the flood")
        await delivers(rig, "after")
        assert proc.poll() is None
    text = log.read_text()
    assert f'"event":"{expected}"' in text, text[-3000:]


# -- the server's boundaries, in process ------------------------------------------------------


async def test_a_failing_endpoint_answers_500_and_the_server_goes_on() -> None:
    calls = 0

    async def respond(request: Request) -> Response:
        nonlocal calls
        calls += 1
        if request.path == "/boom":
            raise ValueError("a library raised")
        return Response(200, "text/plain", b"ok\n")

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(serving.serve_listeners, listener.listeners, respond)
        assert (await get(port, "/boom")).status_code == 500
        assert (await get(port, "/fine")).text == "ok\n"
        tg.cancel_scope.cancel()
    assert calls == 2


async def test_connections_past_the_limit_are_shed_and_idle_ones_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(serving, "MAX_CONNECTIONS", 3)
    monkeypatch.setattr(serving, "HEAD_DEADLINE", 4.0)

    async def respond(request: Request) -> Response:
        return Response(200, "text/plain", b"ok\n")

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(serving.serve_listeners, listener.listeners, respond)
        idle = [await anyio.connect_tcp("127.0.0.1", port) for _ in range(3)]
        shed = await anyio.connect_tcp("127.0.0.1", port)
        # The fourth is closed at once (long before the idle ones' deadline), not queued.
        with anyio.fail_after(serving.HEAD_DEADLINE / 2):
            with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                await shed.receive()
        # The idle three are dropped after HEAD_DEADLINE, and the server answers again.
        with anyio.fail_after(serving.HEAD_DEADLINE * 2):
            for c in idle:
                with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                    await c.receive()
        assert (await get(port, "/")).text == "ok\n"
        for c in (*idle, shed):
            await c.aclose()
        tg.cancel_scope.cancel()
