"""What every `relay bench` scenario shares: the environment, results, and the moving parts
(bulk backlogs, `relay sink` and `relay run` subprocesses, waiting for delivery, medians).

The relay and the reference ingress run as their own processes in the throughput scenarios, so
the bench process (which only builds backlogs and polls counters) is never the bottleneck.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.abc
import httpx
import psycopg
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql
from rich.console import Console

from relay.settings import Settings, load
from relay.tools.sink import JSON, Sink

Metrics = dict[str, Any]  # JSON key -> number, or {label: number} (e2e_eps_by_replicas)


class BenchFailed(Exception):
    pass


class BenchSink(Sink):
    """The reference ingress, plus one knob of its own: requests for runs whose id starts with
    `slow_prefix` wait `slow_seconds` first (a slow ingress for the ordinary backlog only, so
    terminal events of other runs show what the critical lane is worth)."""

    slow_prefix: str | None = None
    slow_seconds: float = 0.0

    async def _run_events(self, url_run_id: str, body: bytes, headers: dict[str, str]) -> Any:
        if self.slow_prefix and url_run_id.startswith(self.slow_prefix):
            await self._delay(self.slow_seconds)
        return await super()._run_events(url_run_id, body, headers)


@dataclass
class Env:
    """What every scenario gets: a migrated schema, Absurd, a running reference sink in process
    (`sink`, `ingress_url`) and, on demand, one in its own process (`external_sink()`)."""

    url: str
    schema: str
    sink: BenchSink
    ingress_url: str
    console: Console
    workdir: Path
    stack: AsyncExitStack
    queues: list[str] = field(default_factory=list)
    _external: str | None = None
    external_sink_pid: int | None = None  # its process, once started
    # the most per-run order violations the sink saw in one relay run (`until_received`)
    relay_order_violations: int | None = None

    def settings(self, **overrides: str) -> Settings:
        flags: dict[str, str | None] = {
            "database_url": self.url,
            "schema": self.schema,
            "ingress_url": self.ingress_url,
            "log_level": "warning",
            "retention": "0",
            **overrides,
        }
        return load(flags, environ={})

    def new_queue(self, suffix: str) -> str:
        name = f"{self.schema}_{suffix}"
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute("select absurd.create_queue(%s)", (name,))
        self.queues.append(name)
        return name

    def q(self, text: str) -> sql.Composed:
        """`text` with `{s}` replaced by the quoted schema."""
        return sql.SQL(text).format(s=sql.Identifier(self.schema))

    async def external_sink(self) -> str:
        """Base URL of a `relay sink` subprocess (started on first use, reset by `reset`)."""
        if self._external is None:
            started = await self.stack.enter_async_context(sink_process(self.workdir))
            self._external, self.external_sink_pid = started
        return self._external


@dataclass
class Result:
    columns: list[str]
    rows: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)  # extra machine-readable detail
    metrics: Metrics = field(default_factory=dict)  # the JSON keys
    settings: dict[str, str] = field(default_factory=dict)  # JSON key -> how it was run


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    run: Callable[[Env, argparse.Namespace], Awaitable[Result]]
    add_arguments: Callable[[argparse.ArgumentParser], None] = lambda p: None
    smoke: dict[str, Any] = field(default_factory=dict)  # option -> its value under --smoke
    keys: tuple[str, ...] = ()  # the JSON keys it fills


def positive(kind: Callable[[str], float]) -> Callable[[str], Any]:
    def parse(text: str) -> float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


Option = tuple[str, Callable[[str], float], float, str]  # flag, int or float, default, help


def positive_options(title: str, *options: Option) -> Callable[[argparse.ArgumentParser], None]:
    """A scenario's `add_arguments` when its options are positive numbers: one option group,
    `title`, of `options`, each (flag, int or float, default, help)."""

    def add_arguments(p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group(title)
        for flag, kind, default, text in options:
            g.add_argument(flag, type=positive(kind), default=default, help=text)

    return add_arguments


T = TypeVar("T")


def median(values: Sequence[float]) -> float:
    return round(statistics.median(values), 2) if values else 0.0


def rotated(items: Sequence[T], rep: int) -> list[T]:
    """`items` in the order of paired rep `rep`: each rep starts one further along, so every
    item goes first as often as the others (the machine drifts during a run)."""
    k = rep % len(items)
    return [*items[k:], *items[:k]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the database ---------------------------------------------------------------------------


async def reset(env: Env) -> None:
    """Empty the outbox between repetitions (and the external sink's memory)."""
    async with await psycopg.AsyncConnection.connect(env.url, autocommit=True) as conn:
        await conn.execute(
            env.q(
                "truncate {s}.outbox, {s}.runs, {s}.run_seqs, {s}.event_failures,"
                " {s}.event_skips, {s}.pending_terminals"
            )
        )
        await conn.execute(
            env.q("update {s}.settings set value = 'on' where key = 'notify_ordinary'")
        )
    env.sink.state.reset()
    if env._external is not None:
        async with httpx.AsyncClient() as client:
            await client.post(env._external + "/_sink/reset")


async def backlog(
    env: Env,
    runs: int,
    per_run: int,
    prefix: str = "b",
    *,
    notify: bool = True,
    terminals: bool = False,
    key: str | None = None,
) -> float:
    """A pending backlog written straight into the tables with generate_series (the rows
    `enqueue` writes, without 10^6 function calls; as tests/support.py `bulk_backlog`), in one
    transaction that also wakes the relay like one producer commit would. Returns the
    monotonic time of its commit. With `terminals`, each run's last event is its terminal
    (with its `pending_terminals` row, as enqueue writes it): the finished runs an outage
    leaves behind (issue 50). `key`: the runs' fairness key (schema version 9; '' is the
    default key, enqueue's without one), and its row in `fairness_keys` (version 10)."""
    async with await psycopg.AsyncConnection.connect(env.url, autocommit=True) as conn:
        async with conn.transaction():
            await conn.execute(
                env.q(
                    "insert into {s}.run_seqs (run_id, last_seq)"
                    " select %s || r, %s from generate_series(1, %s) r"
                ),
                (prefix, per_run, runs),
            )
            await conn.execute(
                env.q(
                    "insert into {s}.runs (run_id, next_attempt_at, fairness_key)"
                    " select %s || r, clock_timestamp(), %s from generate_series(1, %s) r"
                ),
                (prefix, key or "", runs),
            )
            await conn.execute(
                env.q(
                    "insert into {s}.outbox (run_id, seq, event_id, event_type, payload, terminal)"
                    " select %s || r, i, %s || r || '-' || i, 'step',"
                    " jsonb_build_object('run', %s || r, 'step', i, 'note', 'benchmark event'),"
                    " %s and i = %s"
                    " from generate_series(1, %s) r, generate_series(1, %s) i"
                ),
                (prefix, prefix, prefix, terminals, per_run, runs, per_run),
            )
            if terminals:
                await conn.execute(
                    env.q(
                        "insert into {s}.pending_terminals (run_id, seq, created_at, fairness_key)"
                        " select run_id, seq, created_at, %s from {s}.outbox"
                        " where run_id like %s and terminal"
                    ),
                    (key or "", f"{prefix}%"),
                )
            if key:  # the key's row, as enqueue's note_fairness_key writes it (version 10)
                await conn.execute(
                    env.q("insert into {s}.fairness_keys (key) values (%s) on conflict do nothing"),
                    (key,),
                )
            await conn.execute(env.q("analyze {s}.outbox, {s}.runs"))
            if notify:
                await conn.execute("select pg_notify('absurd_wake', 'bench')")
        return time.monotonic()


async def pending(env: Env) -> int:
    async with await psycopg.AsyncConnection.connect(env.url, autocommit=True) as conn:
        row = await (
            await conn.execute(
                env.q(  # pending: after the run's cursor (schema version 7)
                    "select count(*) from {s}.outbox o join {s}.runs r on r.run_id = o.run_id"
                    " where o.seq > r.delivered_seq"
                )
            )
        ).fetchone()
    return int(row[0]) if row else 0


# -- processes ------------------------------------------------------------------------------


def _clean_environ() -> dict[str, str]:
    """The bench's environment without the relay's settings and OpenTelemetry's variables: a
    process it starts runs with what its scenario gives it (untraced unless it asks)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("RELAY_", "OTEL_"))}


async def _wait_http(url: str, proc: anyio.abc.Process, what: str, log: Path) -> None:
    deadline = time.monotonic() + 60
    async with httpx.AsyncClient() as client:
        while True:
            if proc.returncode is not None:
                raise BenchFailed(f"{what} exited with {proc.returncode}: {_tail(log)}")
            try:
                if (await client.get(url, timeout=2)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise BenchFailed(f"{what} did not become ready: {_tail(log)}")
            await anyio.sleep(0.05)


def _tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-600:]
    except OSError:
        return "(no log)"


async def _stop(proc: anyio.abc.Process, grace: float = 20) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        with anyio.move_on_after(grace):
            await proc.wait()
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


@asynccontextmanager
async def sink_process(workdir: Path) -> AsyncIterator[tuple[str, int]]:
    """`relay sink` in its own process; yields its base URL and its pid."""
    port = free_port()
    log = workdir / f"sink-{port}.log"
    code = "import sys; from relay.cli import main; sys.exit(main(sys.argv[1:]))"
    with log.open("wb") as err:
        proc = await anyio.open_process(
            [
                sys.executable,
                "-c",
                code,
                "sink",
                "--port",
                str(port),
                "--accept-stale-epochs",
                "--fault-control",
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=_clean_environ(),
        )
    try:
        base = f"http://127.0.0.1:{port}"
        await _wait_http(base + "/healthz", proc, "relay sink", log)
        yield base, proc.pid
    finally:
        await _stop(proc)


@dataclass
class RelayProcess:
    proc: anyio.abc.Process
    metrics_url: str

    def peak_rss_mb(self) -> float:
        """VmHWM: the process's peak resident set size so far."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0


@asynccontextmanager
async def relay_processes(
    env: Env, n: int, ingress: str, *, environ: Mapping[str, str] | None = None, **settings: str
) -> AsyncIterator[list[RelayProcess]]:
    """`n` replicas of `relay run` (default settings unless given; `environ`: more variables,
    such as OTEL_*), ready (their /readyz answers 200) when the block starts; stopped
    gracefully (SIGTERM) when it ends. `environ` with `RELAY_DATABASES`: a fleet over those
    databases (issue 51) instead of `env.url` alone."""
    procs: list[RelayProcess] = []
    code = "import sys; from relay.cli import main; sys.exit(main(['run']))"
    async with AsyncExitStack() as stack:
        for i in range(n):
            port = free_port()
            variables = _clean_environ() | {
                "RELAY_DATABASE_URL": env.url,
                "RELAY_SCHEMA": env.schema,
                "RELAY_INGRESS_URL": ingress + "/runs/{run_id}/events",
                "RELAY_LOG_LEVEL": "warning",
                "RELAY_RETENTION": "0",
                "RELAY_METRICS_ADDR": f"127.0.0.1:{port}",
                "RELAY_REPLICA_ID": f"bench-{i}",
            }
            variables |= {f"RELAY_{k.upper()}": v for k, v in settings.items()}
            variables |= environ or {}
            if "RELAY_DATABASES" in variables:  # the list form names every database itself
                del variables["RELAY_DATABASE_URL"]
            log = env.workdir / f"relay-{port}.log"
            with log.open("wb") as err:
                proc = await anyio.open_process(
                    [sys.executable, "-c", code],
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    env=variables,
                )
            stack.push_async_callback(_stop, proc)
            rp = RelayProcess(proc, f"http://127.0.0.1:{port}")
            procs.append(rp)
        for i, rp in enumerate(procs):
            await _wait_http(rp.metrics_url + "/readyz", rp.proc, f"relay replica {i}", log)
        yield procs


async def statement_sizes(procs: Sequence[RelayProcess]) -> dict[str, float | None]:
    """Runs per claim statement and per ack statement so far, and events per POST, summed over
    the replicas, from their own counters (`claims_total`, `ack_groups_total`,
    `delivered_events_total`, `ingress_requests_total`; docs/operations.md, Metrics)."""
    totals: dict[str, float] = {}
    async with httpx.AsyncClient() as client:
        for rp in procs:
            text = (await client.get(rp.metrics_url + "/metrics", timeout=10)).text
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value

    def per(runs: str, statements: str) -> float | None:
        n = totals.get(statements, 0.0)
        return round(totals.get(runs, 0.0) / n, 1) if n else None

    return {
        "runs_per_claim": per("ledger_relay_claimed_runs_total", "ledger_relay_claims_total"),
        "runs_per_ack": per(
            "ledger_relay_delivery_lag_seconds_count", "ledger_relay_ack_groups_total"
        ),
        "events_per_post": per(
            "ledger_relay_delivered_events_total", "ledger_relay_ingress_requests_total"
        ),
    }


async def sink_stats(client: httpx.AsyncClient, base: str) -> JSON:
    stats: JSON = (await client.get(base + "/_sink/stats", timeout=10)).json()
    return stats


async def until_received(
    env: Env,
    base: str,
    total: int,
    what: str,
    *,
    on_tick: Callable[[], None] = lambda: None,
    timeout: float = 600,  # noqa: ASYNC109 - a deadline for waiting, not an I/O timeout
) -> float:
    """Wait until the sink at `base` has `total` distinct events; returns the monotonic time
    it did (to 50 ms). Shows progress."""
    deadline = time.monotonic() + timeout
    started = time.monotonic()
    async with httpx.AsyncClient() as client:
        with env.console.status(f"{what}: 0/{total}") as status:
            while True:
                stats = await sink_stats(client, base)
                got = int(stats["unique_events"])
                now = time.monotonic()
                if got >= total:
                    seen = int(stats["order_violations"])
                    env.relay_order_violations = max(env.relay_order_violations or 0, seen)
                    return now
                on_tick()
                rate = got / max(now - started, 1e-9)
                status.update(f"{what}: {got:,}/{total:,} events ({rate:,.0f}/s)")
                if now > deadline:
                    raise BenchFailed(f"{what}: only {got}/{total} delivered after {timeout:g}s")
                await anyio.sleep(0.05)
