"""Start-up and outages (issue 15 item 3): `relay run` waits for its database (capped backoff,
each attempt logged) unless `startup_timeout` bounds the wait; SIGTERM during start-up exits 0;
/readyz turns not-ready on its own short probe deadline."""

from __future__ import annotations

import signal
import socket
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import psycopg
import pytest

from relay.runner import Relay
from relay.startup import MAX_DELAY, permanent, remaining, startup_delay
from relay.tools.sink import Sink, serve_sink
from tests.faults.proxy import FaultProxy, via
from tests.support import count, settings, wait_for
from tests.test_cli import RELAY, relay_env
from tests.test_logs import dead_port, parse_lines
from tests.test_metrics import get, relay_port
from tests.test_relay import enqueue_runs

# -- the pure parts -----------------------------------------------------------------------------


def test_startup_delay_doubles_up_to_its_cap() -> None:
    assert [startup_delay(n, 0.999999) for n in (1, 2, 3)] == pytest.approx([0.5, 1.0, 2.0])
    assert startup_delay(1, 0.0) == pytest.approx(0.25)  # jitter over the upper half
    assert startup_delay(50, 0.999999) == pytest.approx(MAX_DELAY)


def test_remaining_time_of_the_startup_timeout() -> None:
    assert remaining(0.0, 100.0, 1e9) is None  # 0: wait forever
    assert remaining(10.0, 100.0, 104.0) == pytest.approx(6.0)
    assert remaining(10.0, 100.0, 200.0) == 0.0


# -- the real command ---------------------------------------------------------------------------


async def _open(env: dict[str, str], err: Path) -> Any:
    with err.open("wb") as f:
        return await anyio.open_process(
            [*RELAY, "run"], env=env, stdout=subprocess.DEVNULL, stderr=f
        )


async def _finish(proc: Any) -> int:
    try:
        with anyio.fail_after(30):
            code: int = await proc.wait()
        return code
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.anyio
async def test_sigterm_while_waiting_for_the_database_exits_zero(
    pg_url: str, schema: str, tmp_path: Path
) -> None:
    down = via(pg_url, dead_port())
    err = tmp_path / "stderr.log"
    ops = dead_port()
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.setblocking(False)
    env = relay_env(down, schema, "http://127.0.0.1:9", RELAY_METRICS_ADDR=f"127.0.0.1:{ops}",
                    NOTIFY_SOCKET=str(tmp_path / "notify"))  # fmt: skip
    proc = await _open(env, err)
    try:
        await wait_for(lambda: '"event":"database_wait"' in err.read_text(), what="a wait")
        # Waiting is alive but not ready: no liveness or startup probe restarts it.
        assert (await get(ops, "/healthz")).status_code == 200
        readyz = await get(ops, "/readyz")
        assert readyz.status_code == 503 and readyz.json()["checks"]["database"] is False
        # Under systemd each attempt extends the start timeout.
        await anyio.wait_readable(notify)
        message = notify.recv(4096).decode()
        assert "EXTEND_TIMEOUT_USEC=" in message and "WATCHDOG=1" in message, message
        proc.send_signal(signal.SIGTERM)
    finally:
        notify.close()
        code = await _finish(proc)
    text = err.read_text()
    assert code == 0, text
    events = [r.get("event") for r in parse_lines(text)]
    assert "shutdown" in events and "refused_to_start" not in events


def test_startup_timeout_gives_up_with_one_line(pg_url: str, schema: str, tmp_path: Path) -> None:
    down = via(pg_url, dead_port())
    env = relay_env(down, schema, "http://127.0.0.1:9", RELAY_STARTUP_TIMEOUT="1s")
    got = subprocess.run(
        [*RELAY, "run"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert got.returncode == 2, got.stderr
    records = [r for r in parse_lines(got.stderr) if r["level"] == "error"]
    assert len(records) == 1 and records[0]["event"] == "refused_to_start", got.stderr
    assert "startup_timeout" in records[0]["reason"]


@pytest.mark.anyio
async def test_relay_started_before_its_database_delivers_once_it_is_up(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    target = urlsplit(pg_url)
    assert target.hostname and target.port
    sink = Sink()
    err = tmp_path / "stderr.log"
    enqueue_runs(conn, schema, 3, 2)
    async with serve_sink(sink) as sink_url, anyio.create_task_group() as tg:
        proxy = FaultProxy("127.0.0.1", dead_port(), "db")  # the database is not there yet
        await proxy.start(tg)
        proc = await _open(relay_env(via(pg_url, proxy.port), schema, sink_url), err)
        try:
            await wait_for(
                lambda: err.read_text().count('"event":"database_wait"') >= 2, what="two waits"
            )
            proxy.target = (target.hostname, target.port)  # the database comes up
            await wait_for(lambda: count(conn, schema, "state <> 'delivered'") == 0, what="drain")
            proc.send_signal(signal.SIGTERM)
        finally:
            code = await _finish(proc)
        tg.cancel_scope.cancel()
    assert code == 0, err.read_text()
    assert len(sink.state.deliveries) == 6
    events = [r.get("event") for r in parse_lines(err.read_text())]
    assert events.index("database_reachable") < events.index("started")


# -- readiness on its own deadline --------------------------------------------------------------


@pytest.mark.anyio
async def test_readyz_turns_not_ready_on_a_silent_partition_without_waiting_for_statements(
    pg_url: str, schema: str
) -> None:
    target = urlsplit(pg_url)
    assert target.hostname and target.port
    sink = Sink()
    async with serve_sink(sink) as sink_url, anyio.create_task_group() as tg:
        proxy = FaultProxy(target.hostname, target.port, "db")
        await proxy.start(tg)
        # Statements may take a minute and the backlog refresh runs every 5 s: the readiness
        # probe must not wait for either to notice that the database went silent.
        cfg = settings(via(pg_url, proxy.port), schema, sink_url, metrics_addr="127.0.0.1:0",
                       statement_timeout="60s", poll_interval="1s")  # fmt: skip
        async with Relay(cfg).running() as r:
            port = relay_port(r)

            async def ready() -> bool:
                return (await get(port, "/readyz")).status_code == 200

            async def database_down() -> bool:  # the probe's own verdict, not LISTEN's
                body = (await get(port, "/readyz")).json()
                return body["ready"] is False and body["checks"]["database"] is False

            await wait_for(ready, what="ready")
            proxy.blackhole()
            # A deadline well under the statement timeout, generous for the ~2 s it takes.
            await wait_for(database_down, timeout=30, what="not ready on the partition")
            proxy.heal()
            await wait_for(ready, timeout=30, what="ready again after the partition")
            r.stop()
        tg.cancel_scope.cancel()


def test_refusals_are_not_waited_out() -> None:
    assert permanent('FATAL:  password authentication failed for user "relay"')
    assert permanent('FATAL:  role "nobody" does not exist')
    assert not permanent("connection refused")
    assert not permanent("server closed the connection unexpectedly")
