"""Acceptance tests: the real `relay` command in subprocesses, the real sink over sockets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest
from anyio.abc import Process

from relay.maintenance.migrate import code_version
from tests.support import Rig, assert_acked_only_if_received, count, q, wait_for
from tests.test_relay import enqueue_runs

pytestmark = pytest.mark.anyio

RELAY = [sys.executable, "-m", "relay.cli"]


def relay_env(
    pg_url: str, schema: str, sink_url: str | None = None, **extra: str
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update(
        RELAY_DATABASE_URL=pg_url,
        RELAY_SCHEMA=schema,
        RELAY_POLL_INTERVAL="0.2",
        RELAY_LOG_LEVEL="info",
        RELAY_SHUTDOWN_TIMEOUT="5s",
    )
    if sink_url:
        env["RELAY_INGRESS_URL"] = sink_url + "/runs/{run_id}/events"
    env.update(extra)
    return env


@asynccontextmanager
async def relay_run(env: dict[str, str], **streams: Any) -> AsyncIterator[Process]:
    """`relay run` in a subprocess for the block (`streams`: its stdout and stderr, as
    anyio.open_process takes them), killed on the way out if it still runs."""
    proc = await anyio.open_process([*RELAY, "run"], env=env, **streams)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@asynccontextmanager
async def replicas(n: int, env: dict[str, str], log_dir: Path) -> AsyncIterator[list[Process]]:
    procs = []
    logs = []
    try:
        for i in range(n):
            log = (log_dir / f"replica{i}.log").open("wb")
            logs.append(log)
            procs.append(
                await anyio.open_process(
                    [*RELAY, "run"],
                    env={**env, "RELAY_REPLICA_ID": f"replica-{i}"},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        yield procs
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
        for log in logs:
            log.close()


async def stop_all(procs: list[Process]) -> list[int]:
    for p in procs:
        if p.returncode is None:
            p.send_signal(signal.SIGTERM)
    codes = []
    with anyio.fail_after(60):
        for p in procs:
            codes.append(await p.wait())
    return codes


async def test_four_replicas_deliver_everything_in_order(rig: Rig, tmp_path: Path) -> None:
    s, conn, schema = rig.sink, rig.conn, rig.schema
    # Slow enough that no replica can drain it all alone before the others are up.
    s.faults.delay(0.02, times=100_000)
    enqueue_runs(conn, schema, 100, 6, prefix="a")
    async with replicas(4, relay_env(rig.pg_url, schema, rig.url), tmp_path) as procs:
        # The rest once all four listen (each records itself in `replicas` as its LISTEN
        # session takes its liveness lock): the first replica up may drain "a" alone on a
        # loaded machine, but not "b", which every replica is woken for.
        def up() -> int:
            row = conn.execute(q(schema, "select count(*) from {s}.replicas")).fetchone()
            return int(row[0]) if row else 0

        await wait_for(lambda: up() == 4, timeout=60, what="four replicas listening")
        enqueue_runs(conn, schema, 100, 6, prefix="b")
        await wait_for(lambda: len(s.state.deliveries) == 1200, timeout=120, what="1200 events")
        await wait_for(lambda: count(conn, schema, "state <> 'delivered'") == 0, what="acks")
        codes = await stop_all(procs)
    assert codes == [0, 0, 0, 0], [
        (tmp_path / f"replica{i}.log").read_text()[-2000:] for i in range(4)
    ]
    assert s.state.order_violations == 0
    assert_acked_only_if_received(conn, schema, s.state.deliveries)
    for prefix in "ab":
        for r in range(100):
            assert s.state.first_order[f"{prefix}{r}"] == [1, 2, 3, 4, 5, 6]
    owners = conn.execute(q(schema, "select count(*) from {s}.runs where lease_owner is not null"))
    assert owners.fetchone() == (0,)
    # The work was shared: more than one replica logged deliveries.
    delivering = [
        i for i in range(4) if '"event":"delivered"' in (tmp_path / f"replica{i}.log").read_text()
    ]
    assert len(delivering) >= 2


async def test_sigkill_of_one_replica_loses_nothing(rig: Rig, tmp_path: Path) -> None:
    s, conn, schema = rig.sink, rig.conn, rig.schema
    s.faults.delay(0.02, times=100_000)  # slow enough that the kill lands mid-run
    enqueue_runs(conn, schema, 150, 4)
    env = relay_env(rig.pg_url, schema, rig.url, RELAY_LEASE_TTL="3s", RELAY_HTTP_TIMEOUT="1s")
    async with replicas(2, env, tmp_path) as procs:
        await wait_for(lambda: len(s.state.deliveries) >= 60, timeout=60, what="some delivery")
        procs[0].kill()  # SIGKILL: no release, leases must expire
        await wait_for(
            lambda: count(conn, schema, "state <> 'delivered'") == 0, timeout=120, what="drain"
        )
        codes = await stop_all(procs[1:])
    assert codes == [0]
    assert len(s.state.deliveries) == 600
    assert s.state.order_violations == 0
    assert_acked_only_if_received(conn, schema, s.state.deliveries)


async def test_sigterm_exits_zero_and_hands_back_leases(rig: Rig, tmp_path: Path) -> None:
    s, conn, schema = rig.sink, rig.conn, rig.schema
    s.faults.delay(60.0, times=10)  # POSTs hang: SIGTERM arrives with work in flight
    enqueue_runs(conn, schema, 3, 2, terminal=False)
    env = relay_env(rig.pg_url, schema, rig.url, RELAY_SHUTDOWN_TIMEOUT="0.5s",
                    RELAY_HTTP_TIMEOUT="30s", RELAY_LEASE_TTL="60s")  # fmt: skip
    async with replicas(1, env, tmp_path) as procs:
        await wait_for(lambda: _leased(conn, schema) == 3, what="three leases")
        # Work really in flight when SIGTERM lands: every run's POST reached the ingress.
        await wait_for(lambda: s.faults.pending() <= 7, what="three POSTs held by the ingress")
        codes = await stop_all(procs)
    assert codes == [0]
    assert _leased(conn, schema) == 0
    text = (tmp_path / "replica0.log").read_text()
    assert '"event":"shutdown_requested"' in text and '"event":"shutdown"' in text
    # Its leases handed back, it said it stopped (issue 41): no row is left to look dead.
    assert '"event":"replica_stopped"' in text
    assert conn.execute(q(schema, "select owner from {s}.replicas")).fetchall() == []


@pytest.mark.parametrize(("setting", "running"), [("asyncio", "asyncio"), ("uvloop", "uvloop")])
async def test_the_event_loop_setting_chooses_the_loop_relay_run_runs_on(
    rig: Rig, tmp_path: Path, setting: str, running: str
) -> None:
    """The started line names the loop the relay runs on, the one `event_loop` chose (issue
    52 item 1; `auto`'s choice is relay/core/loop.py's, tests/test_loop_choice.py)."""
    env = relay_env(rig.pg_url, rig.schema, rig.url, RELAY_EVENT_LOOP=setting)
    log = tmp_path / "replica0.log"
    async with replicas(1, env, tmp_path) as procs:
        await wait_for(lambda: '"event":"started"' in log.read_text(), what="started")
        codes = await stop_all(procs)
    assert codes == [0]
    started = next(line for line in log.read_text().splitlines() if '"event":"started"' in line)
    assert json.loads(started)["event_loop"] == running


async def test_status_tells_a_replica_stopped_cleanly_from_a_killed_one(
    rig: Rig, tmp_path: Path
) -> None:
    """Two replicas: one SIGTERMed while the other runs, then the other SIGKILLed. `relay
    status` lists the killed one as dead and the one that stopped cleanly not at all (retention
    off: no prune forgets either row meanwhile)."""
    env = relay_env(rig.pg_url, rig.schema, rig.url, RELAY_RETENTION="0")

    def listed() -> dict[str, bool]:
        got = run_cli("status", "--json", env=env)
        assert got.returncode == 0, got.stderr
        return {r["owner"]: r["alive"] for r in json.loads(got.stdout)["replicas"]}

    async with replicas(2, env, tmp_path) as procs:
        up = {"replica-0": True, "replica-1": True}
        await wait_for(lambda: listed() == up, timeout=60, what="both replicas listening")
        assert await stop_all(procs[:1]) == [0]
        assert listed() == {"replica-1": True}
        procs[1].kill()  # SIGKILL: its LISTEN session ends with the process
        await procs[1].wait()
        await wait_for(lambda: listed() == {"replica-1": False}, timeout=30, what="one dead")
    text = run_cli("status", env=env).stdout
    assert "replica-1" in text and "dead" in text and "replica-0" not in text, text


def _leased(conn: psycopg.Connection[Any], schema: str) -> int:
    row = conn.execute(q(schema, "select count(lease_token) from {s}.runs")).fetchone()
    assert row is not None
    return int(row[0])


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RELAY, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_run_refuses_a_missing_older_or_newer_schema(pg_url: str, schema: str) -> None:
    env = relay_env(pg_url, "t_missing_schema", "http://127.0.0.1:9")
    got = run_cli("run", env=env)
    assert got.returncode == 3 and "run `relay migrate`" in got.stderr

    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute(q(schema, "insert into {s}.schema_migrations values (99, 'future', 'x')"))
    got = run_cli("run", env=relay_env(pg_url, schema, "http://127.0.0.1:9"))
    assert got.returncode == 3 and "upgrade the relay" in got.stderr

    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute(q(schema, "delete from {s}.schema_migrations"))
        c.execute(q(schema, "insert into {s}.schema_migrations values (0, 'old', 'x')"))
    got = run_cli("run", env=relay_env(pg_url, schema, "http://127.0.0.1:9"))
    assert got.returncode == 3 and "run `relay migrate`" in got.stderr


def test_migrate_cli_from_many_processes_at_once(pg_url: str) -> None:
    name = "t_cli_migrate_" + os.urandom(4).hex()
    env = relay_env(pg_url, name)
    procs = [
        subprocess.Popen(
            [*RELAY, "migrate"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(5)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 5, outs
    applied = [o[0].decode() for o in outs if "applied: none" not in o[0].decode()]
    assert (
        len(applied) == 1
    )  # exactly one process applied the migrations; the others found them done
    with psycopg.connect(pg_url, autocommit=True) as c:
        rows = c.execute(q(name, "select version from {s}.schema_migrations order by 1")).fetchall()
        assert rows == [(v,) for v in range(1, code_version() + 1)]
        c.execute(q(name, "drop schema {s} cascade"))


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"RELAY_BATCH_SIZE": "lots"}, "batch_size"),
        ({"RELAY_LEASE_TTL": "-3"}, "lease_ttl"),
        ({"RELAY_INGRESS_URL": "http://x/no-placeholder"}, "ingress_url"),
        ({"RELAY_SCHEMA": "Bad-Name"}, "schema"),
        ({"RELAY_EVENT_LOOP": "trio"}, "event_loop"),  # issue 52 item 1
        (  # OpenTelemetry's own variables are checked at start too (relay/edges/tracing.py)
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_TRACES_SAMPLER": "x"},
            "OTEL_TRACES_SAMPLER",
        ),
    ],
)
def test_invalid_configuration_fails_with_one_clear_line(
    pg_url: str, extra: dict[str, str], needle: str
) -> None:
    env = relay_env(pg_url, "relay", "http://127.0.0.1:9", **extra)
    got = run_cli("run", env=env)
    assert got.returncode == 2
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], got.stderr


def test_every_setting_has_its_help_line() -> None:
    """`relay run --help` describes each setting (ingress_keepalive and post_limit had only
    their variable's name)."""
    from relay.cli import _HELP
    from relay.settings import PARSERS

    assert [option for option in PARSERS if not _HELP.get(option)] == []
