"""`relay bench`: measured scenarios on one machine, printed side by side and as JSON.

It starts what it needs (an embedded PostgreSQL unless `--database-url`/RELAY_DATABASE_URL,
a fresh relay schema, the Absurd schema, the reference sink in process) and runs the selected
scenarios (`--only a,b`; all by default). Everything it creates is dropped at the end.

Scenarios live in `SCENARIOS`: a name, a one-line summary, its own command-line options, and
an async function from the shared `Env` to a `Result` (a table of rows plus notes). Adding a
scenario is adding one entry.

- `wake`: ack-to-task-resumed latency of an Absurd task sleeping on `run-created:<run_id>`,
  with absurd-sdk's stock polling worker and with `relay.engine.WakeWorker`, same poll
  interval, in one run. Latency = the task's `clock_timestamp()` just after `await_event`
  returns minus the event's `delivered_at` (set by the ack), both on the database clock.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import orjson
import psycopg
from psycopg import sql
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from relay import __version__, logs
from relay.engine import WakeWorker
from relay.maintenance.migrate import migrate
from relay.producer import enqueue_async
from relay.runner import Relay
from relay.settings import redact_url
from relay.tools.absurd import install_absurd
from relay.tools.bench import capacity as bench_capacity
from relay.tools.bench import cpu as bench_cpu
from relay.tools.bench import enqueue_scaling as bench_enqueue_scaling
from relay.tools.bench import fairness as bench_fairness
from relay.tools.bench import flaky as bench_flaky
from relay.tools.bench import fleet as bench_fleet
from relay.tools.bench import latency as bench_latency
from relay.tools.bench import throughput as bench_throughput
from relay.tools.bench import tracing_cost as bench_tracing
from relay.tools.bench import wal as bench_wal
from relay.tools.bench.capacity_ingress import FOLLOW_WITHIN
from relay.tools.bench.kit import BenchFailed, BenchSink, Env, Result, Scenario, positive
from relay.tools.bench.peers import graphile as bench_graphile
from relay.tools.bench.peers import pgqueuer as bench_pgqueuer
from relay.tools.demo import percentile
from relay.tools.sink import serve_sink

# -- scenario: wake ----------------------------------------------------------------------------

TASK = "bench-await-run-created"


def _wake_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("wake")
    g.add_argument("--tasks", type=positive(int), default=100, help="tasks per mode (100)")
    g.add_argument(
        "--poll-interval", type=positive(float), default=0.25, help="worker poll (0.25 s)"
    )
    g.add_argument("--seed", type=int, default=None, help="seed of the commit pauses")


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 2)


def _latency_row(mode: str, samples: Samples, resumed_by_wake: str) -> dict[str, Any]:
    latencies = samples.resumed
    return {
        "mode": mode,
        "tasks": len(latencies),
        "claimed_p50_ms": _ms(percentile(samples.claimed, 50)),
        "p50_ms": _ms(percentile(latencies, 50)),
        "p99_ms": _ms(percentile(latencies, 99)),
        "max_ms": _ms(max(latencies, default=None)),
        "mean_ms": _ms(sum(latencies) / len(latencies) if latencies else None),
        "resumed_by_wake": resumed_by_wake,
    }


@dataclass
class Samples:
    resumed: list[float]  # ack -> the task's code runs again (s)
    claimed: list[float]  # ack -> the worker's claim of the woken run (s)
    by_wake: int  # resumes claimed by the wake path


def _worker_id(mode: str) -> str:
    return f"bench-{mode}"


async def _absurd_worker(url: str, queue: str, mode: str, poll_interval: float) -> None:
    """The worker process of one mode: absurd-sdk's stock worker ("poll") or WakeWorker
    ("wake"). Prints "ready" once it can be measured; exits when its stdin closes."""
    from absurd_sdk import AsyncAbsurd, AsyncTaskContext

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as clock:
        worker = AsyncAbsurd(url, queue_name=queue)

        @worker.register_task(TASK)
        async def await_run_created(params: dict[str, Any], ctx: AsyncTaskContext) -> Any:
            await ctx.await_event(f"run-created:{params['run_id']}")
            row = await (await clock.execute("select clock_timestamp()")).fetchone()
            assert row is not None
            return {"resumed_at": row[0].isoformat()}

        wake = WakeWorker(url, queue, worker_id=_worker_id(mode), poll_interval=poll_interval)
        async with anyio.create_task_group() as tg:
            if mode == "wake":
                tg.start_soon(wake.run, worker)
                while not wake.listener.up:  # noqa: ASYNC110 - a flag of the listener's loop
                    await anyio.sleep(0.01)
            else:
                tg.start_soon(
                    partial(worker.start_worker, _worker_id(mode), 120, 1, None, poll_interval)
                )
            print("ready", flush=True)
            await anyio.to_thread.run_sync(sys.stdin.read)
            tg.cancel_scope.cancel()
        await worker.close()


def worker_main(argv: Sequence[str]) -> None:
    """Entry point of a worker process (`_wake_mode` starts it)."""
    url, queue, mode, poll = argv
    anyio.run(_absurd_worker, url, queue, mode, float(poll))


@asynccontextmanager
async def _worker_process(env: Env, queue: str, mode: str, poll: float) -> AsyncIterator[None]:
    """An Absurd worker in its own process, as in production: neither the relay nor the
    bench's own waiting shares its event loop."""
    code = "import sys; from relay.tools.bench.main import worker_main; worker_main(sys.argv[1:])"
    args = [sys.executable, "-c", code, env.url, queue, mode, str(poll)]
    proc = await anyio.open_process(
        args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        with anyio.fail_after(60):
            line = await proc.stdout.receive()
        if not line.startswith(b"ready"):
            raise BenchFailed(f"the {mode} worker did not start: {line[:200]!r}")
        yield
        await proc.stdin.aclose()
        with anyio.move_on_after(10):
            await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _wake_mode(env: Env, a: argparse.Namespace, mode: str, rng: random.Random) -> Samples:
    """One mode ("poll": absurd-sdk's start_worker; "wake": WakeWorker): N tasks sleep on
    their events, whose acks come one at a time."""
    try:
        from absurd_sdk import AsyncAbsurd
    except ImportError:
        raise BenchFailed("the wake scenario needs absurd-sdk: pip install absurd-sdk") from None
    queue = env.new_queue(mode)
    t = sql.Identifier("absurd", f"t_{queue}")
    r = sql.Identifier("absurd", f"r_{queue}")
    async with AsyncExitStack() as stack:
        producer = await psycopg.AsyncConnection.connect(env.url, autocommit=True)
        stack.push_async_callback(producer.close)
        spawner = AsyncAbsurd(producer, queue_name=queue)
        await stack.enter_async_context(_worker_process(env, queue, mode, a.poll_interval))
        await stack.enter_async_context(Relay(env.settings()).running())
        runs = [f"{mode}-{i}" for i in range(a.tasks)]
        tasks = {}
        for run_id in runs:
            spawned = await spawner.spawn(TASK, {"run_id": run_id}, queue=queue)
            tasks[run_id] = str(spawned["task_id"])
        sleeping = sql.SQL("select count(*) = %s from {} where state = 'sleeping'").format(t)
        await _until(producer, sleeping, (a.tasks,), 60, "every task to sleep on its event")
        done = sql.SQL("select state = 'completed' from {} where task_id = %s").format(t)
        with env.console.status(f"wake: {mode}…") as status:
            for i, run_id in enumerate(runs):
                # An independent producer commits at any phase of the worker's poll: without a
                # pause the polling worker would always have just begun its sleep.
                await anyio.sleep(rng.uniform(0, a.poll_interval))
                async with producer.transaction():
                    await enqueue_async(
                        producer,
                        run_id,
                        f"{run_id}-created",
                        "run_created",
                        {"run_id": run_id},
                        wake=(queue, f"run-created:{run_id}"),
                        schema=env.schema,
                    )
                await _until(producer, done, (tasks[run_id],), 30, f"{run_id}'s task to resume")
                status.update(f"wake: {mode} {i + 1}/{a.tasks}")
        cur = await producer.execute(
            sql.SQL(
                "select e.delivered_at, (t.completed_payload ->> 'resumed_at')::timestamptz,"
                " r.started_at, r.claimed_by from {}.events e"
                " join {} t on t.params ->> 'run_id' = e.run_id"
                " join {} r on r.run_id = t.last_attempt_run where e.event_type = 'run_created'"
                " and t.task_id = any(%s::uuid[])"
            ).format(sql.Identifier(env.schema), t, r),
            (list(tasks.values()),),
        )
        rows = await cur.fetchall()
    woken_by = f"{_worker_id(mode)}/wake"
    return Samples(
        resumed=[(resumed - acked).total_seconds() for acked, resumed, _, _ in rows],
        claimed=[(claimed - acked).total_seconds() for acked, _, claimed, _ in rows],
        by_wake=sum(1 for *_, who in rows if who == woken_by),
    )


async def _until(
    conn: psycopg.AsyncConnection[Any],
    query: sql.Composed,
    params: Sequence[Any],
    timeout: float,  # noqa: ASYNC109 - a deadline for waiting, not an I/O timeout
    what: str,
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        row = await (await conn.execute(query, params)).fetchone()
        if row and row[0]:
            return
        if time.monotonic() > deadline:
            raise BenchFailed(f"timed out after {timeout:g}s waiting for {what}")
        await anyio.sleep(0.002)


async def wake_scenario(env: Env, a: argparse.Namespace) -> Result:
    rng = random.Random(a.seed)
    polled = await _wake_mode(env, a, "poll", rng)
    woken = await _wake_mode(env, a, "wake", rng)
    polling = _latency_row("stock polling", polled, "—")
    listener = _latency_row("wake listener", woken, f"{woken.by_wake}/{len(woken.resumed)}")
    ratio: dict[str, Any] = {"mode": "ratio polling / listener"}
    for key in ("claimed_p50_ms", "p50_ms", "p99_ms", "max_ms", "mean_ms"):
        p, w = polling[key], listener[key]
        ratio[key] = f"{p / w:.0f}×" if p is not None and w else None
    p50 = listener["p50_ms"]
    verdict = "met" if p50 is not None and p50 < 10 else "NOT met"
    return Result(
        columns=[
            "mode",
            "tasks",
            "claimed_p50_ms",
            "p50_ms",
            "p99_ms",
            "max_ms",
            "mean_ms",
            "resumed_by_wake",
        ],
        rows=[polling, listener, ratio],
        notes=[
            f"poll interval {a.poll_interval:g} s in both modes; {a.tasks} tasks each; "
            f"commit pauses seeded {a.seed}",
            "latency: the task's clock_timestamp() after await_event returns minus the event's "
            "delivered_at (its ack), both on the database clock; claimed: the worker's claim of "
            "the woken run (Absurd's started_at) minus delivered_at",
            f"target wake listener p50 < 10 ms: {verdict} ({p50} ms)",
        ],
        data={
            "poll": {"resumed": polled.resumed, "claimed": polled.claimed},
            "wake": {"resumed": woken.resumed, "claimed": woken.claimed},
        },
    )


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        *bench_throughput.SCENARIOS,
        *bench_graphile.SCENARIOS,
        *bench_pgqueuer.SCENARIOS,
        *bench_latency.SCENARIOS,
        *bench_wal.SCENARIOS,
        *bench_enqueue_scaling.SCENARIOS,
        *bench_tracing.SCENARIOS,
        *bench_capacity.SCENARIOS,
        *bench_fairness.SCENARIOS,
        *bench_flaky.SCENARIOS,
        *bench_fleet.SCENARIOS,
        Scenario(
            "wake",
            "ack-to-task-resumed latency: stock Absurd polling vs the wake listener",
            wake_scenario,
            _wake_arguments,
            {"tasks": 5},
        ),
    ]
}


ALIASES = {"peer": ["peer_graphile", "peer_pgqueuer"]}

# -- targets (issue 6): ratios from one run ------------------------------------------------------


class _Judged:
    """The targets judged so far, and the metrics they are judged from."""

    def __init__(self, m: dict[str, Any], settings: dict[str, str]) -> None:
        self.m = m
        self.settings = settings
        self.out: list[dict[str, Any]] = []

    def add(self, target: str, have: Any, need: float, ok: bool) -> None:
        self.out.append(
            {
                "target": target,
                "measured": round(have, 3),
                "needed": round(need, 3),
                "verdict": "met" if ok else "MISSED",
            }
        )

    def has(self, *keys: str) -> bool:
        return all(isinstance(self.m.get(k), int | float) and self.m[k] > 0 for k in keys)


def targets(m: dict[str, Any], settings: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Each target (issues 6, 16, 31 and 42) that this run's metrics can judge: its measured ratio
    and verdict. `settings`: how a figure was run (the peers'), printed beside its target."""
    judged = _Judged(m, settings or {})
    families = (
        _throughput,
        _order,
        _one_event_runs,
        _latency,
        _costs,
        _enqueue,
        _tracing,
        _capacity,
        _fairness,
        _flaky,
        _fleet,
    )
    for family in families:
        family(judged)
    return judged.out


def _throughput(j: _Judged) -> None:
    """End-to-end events/s against the limits, the other senders, the naive loop, the peers."""
    m, add, has = j.m, j.add, j.has
    # Retired by issue 40: e2e ≥ 0.5 × min(db_limit, http_limit) (its issue showed it needs a
    # different runtime, not a lever), and the ratios of the relay's own senders to each other
    # (one client now). What stays: the default transport must earn its place over httpx's own.
    if has("e2e_eps", "e2e_eps_httpx"):
        r = m["e2e_eps"] / m["e2e_eps_httpx"]
        add("e2e_eps ≥ e2e_eps_httpx (the default transport beats httpx's own)", r, 1, r >= 1)
    # Issue 42: a fast ingress loses nothing to the adaptive limit (the median of paired reps'
    # ratios to post_limit = fixed, one replica, the e2e scenario).
    if has("e2e_adaptive_ratio"):
        r = m["e2e_adaptive_ratio"]
        add("e2e_eps ≥ 0.95 × e2e_eps_fixed (the adaptive limit, paired reps)", r, 0.95, r >= 0.95)
    if has("e2e_eps", "naive_eps"):
        r = m["e2e_eps"] / m["naive_eps"]
        add("e2e_eps ≥ 10 × naive_eps", r, 10, r >= 10)
    # Issue 40: standing on httpx must still leave the relay 10× ahead of tuned Graphile Worker.
    for peer, need in (("peer_graphile_eps", 10.0), ("peer_pgqueuer_eps", 1.0)):
        if has("e2e_eps", peer):
            r = m["e2e_eps"] / m[peer]
            how = f" ({j.settings[peer]})" if peer in j.settings else ""
            if need > 1:
                add(f"e2e_eps ≥ {need:g} × {peer}{how}", r, need, r >= need)
            else:
                add(f"e2e_eps > {peer}{how}", r, 1, r > 1)


def _order(j: _Judged) -> None:
    """The relay's per-run order, beside the peers' violations."""
    m = j.m
    if "relay_order_violations" in m:
        peers = ", ".join(
            f"{name} {m[key]:,}"
            for name, key in (
                ("Graphile Worker", "peer_graphile_order_violations"),
                ("PgQueuer", "peer_pgqueuer_order_violations"),
            )
            if key in m
        )
        have = m["relay_order_violations"]
        j.add(
            f"relay keeps per-run order: 0 violations (peers: {peers or 'not run'})",
            have,
            0,
            have == 0,
        )


def _one_event_runs(j: _Judged) -> None:
    """Runs of one event (tiny runs), against the relay's own figure and PgQueuer's."""
    m, add, has = j.m, j.add, j.has
    if has("e2e_eps", "tiny_runs_eps"):
        r = m["tiny_runs_eps"] / m["e2e_eps"]
        add("tiny_runs_eps ≥ 0.25 × e2e_eps", r, 0.25, r >= 0.25)
    if has("e2e_eps", "tiny_runs_eps_batched"):
        r = m["tiny_runs_eps_batched"] / m["e2e_eps"]
        add("tiny_runs_eps_batched ≥ 0.25 × e2e_eps", r, 0.25, r >= 0.25)
    # Runs of one event (issue 16): PgQueuer's cost per job does not depend on the run, so its
    # figure holds there; the relay's per-run costs become per-event costs. With one POST per
    # run on both sides it is the closest race, and two figures taken minutes apart differ by
    # more than the two do: where the PgQueuer scenario ran its paired reps (relay and PgQueuer
    # alternating, as many events each), the median of the pairs' ratios judges it.
    for key in ("tiny_runs_eps_batched", "tiny_runs_eps"):
        if key == "tiny_runs_eps" and has("tiny_runs_paired_ratio"):
            r = m["tiny_runs_paired_ratio"]
            add(f"{key} > peer_pgqueuer_eps (runs of one event, paired reps)", r, 1, r > 1)
        elif has(key, "peer_pgqueuer_eps"):
            r = m[key] / m["peer_pgqueuer_eps"]
            add(f"{key} > peer_pgqueuer_eps (runs of one event)", r, 1, r > 1)


def _latency(j: _Judged) -> None:
    """Claims behind a backlog, the terminal event's latency, the table under a steady load."""
    m, add, has = j.m, j.add, j.has
    if has("claim_eps_1m_pending", "claim_eps_10k_pending"):
        r = m["claim_eps_1m_pending"] / m["claim_eps_10k_pending"]
        add("claim_eps_1m_pending ≥ 0.8 × claim_eps_10k_pending", r, 0.8, r >= 0.8)
    if has("terminal_p99_ms_backlog", "terminal_p99_ms_idle"):
        need = 2 * m["terminal_p99_ms_idle"] + 10
        have = m["terminal_p99_ms_backlog"]
        add("terminal_p99_ms_backlog ≤ 2 × terminal_p99_ms_idle + 10 ms", have, need, have <= need)
    if has("terminal_p50_ms_idle"):
        have = m["terminal_p50_ms_idle"]
        add("terminal_p50_ms_idle ≤ 5 ms", have, 5, have <= 5)
    if has("soak_table_mb_start", "soak_table_mb_end"):
        r = m["soak_table_mb_end"] / m["soak_table_mb_start"]
        add("soak_table_mb_end ≤ 1.25 × soak_table_mb_start (levels off)", r, 1.25, r <= 1.25)


def _costs(j: _Judged) -> None:
    """What a delivered event costs the application's database (issue 28), and the memory."""
    m, add, has = j.m, j.add, j.has
    if has("wal_total_bytes_per_event", "wal_lean_bytes_per_event"):
        r = m["wal_total_bytes_per_event"] / m["wal_lean_bytes_per_event"]
        add("wal_total ≤ 1.3 × the leanest queue's WAL per event", r, 1.3, r <= 1.3)
    if has("wal_claim_ack_bytes_per_event", "wal_enqueue_bytes_per_event"):
        r = m["wal_claim_ack_bytes_per_event"] / m["wal_enqueue_bytes_per_event"]
        add("wal_claim_ack ≤ 0.25 × wal_enqueue per event", r, 0.25, r <= 0.25)
    if has("peak_rss_mb"):
        have = m["peak_rss_mb"]
        add(
            f"peak_rss_mb ≤ 150 (at {m.get('rss_events', 1_000_000):,} events)",
            have,
            150,
            have <= 150,
        )


def _enqueue(j: _Judged) -> None:
    """Enqueue as one transaction grows (issue 28): flat per event; any number of runs, each
    looked up by its key (issue 52 item 4)."""
    m, add, has = j.m, j.add, j.has
    if has("enqueue_16k_ratio"):
        r = m["enqueue_16k_ratio"]
        how = j.settings.get("enqueue_16k_ratio", "16,000 / 100 events of one run")
        add(f"enqueue_16k_ratio ≤ 1.2 (per event, {how})", r, 1.2, r <= 1.2)
    if "enqueue_100k_runs_missing" in m:
        done, missing = m.get("enqueue_100k_runs_done", 0), m["enqueue_100k_runs_missing"]
        how = j.settings.get("enqueue_100k_runs_done", "100,000 runs in one transaction")
        add(f"{how}: done", done, done + missing, missing == 0 and done > 0)
    if "enqueue_100k_runs_tuples_scanned" in m:  # 0 is the figure wanted
        # issue 52 item 4: every lookup of a run by its key, whatever the statistics say
        scanned = m["enqueue_100k_runs_tuples_scanned"]
        what = "runs in one transaction: no sequential scan reads a run's rows"
        add(what, scanned, 0, scanned == 0)


def _tracing(j: _Judged) -> None:
    """Issue 40: a span for every delivery (100% sampled, the SDK's batch span processor and
    stock OTLP exporter) keeps 0.6 of the untraced relay's events/s, judged on the median of
    paired reps' ratios."""
    if j.has("tracing_on_ratio"):
        r = j.m["tracing_on_ratio"]
        need = bench_tracing.NEEDED
        j.add(
            f"tracing_on_ratio ≥ {need} (tracing_on_eps / tracing_off_eps, paired reps, "
            "always_on, batch span processor)",
            r,
            need,
            r >= need,
        )


def _capacity(j: _Judged) -> None:
    """Issue 42: at an ingress that serves a few POSTs at a time and queues the rest (the
    capacity scenario), the relay is not the cause of its queue: in flight at it p90 ≤ 3× what
    it serves at once, its queueing p99 ≤ 5× its service time, goodput ≥ 0.85 of its capacity,
    terminal events p99 ≤ 10× its service time, nothing lost and order kept; and when its
    capacity drops 10× and recovers, the replicas' summed limit follows within 5 s each way
    (capacity_ingress.limit_follows)."""
    m, add, has = j.m, j.add, j.has
    how = j.settings.get("capacity_in_flight_ratio", "the capacity scenario")
    for key, rule, need, below in (
        ("capacity_in_flight_ratio", "in flight at the ingress p90 ≤ 3 × its workers", 3, True),
        ("capacity_queueing_ratio", "queueing at the ingress p99 ≤ 5 × its service time", 5, True),
        ("capacity_goodput", "goodput ≥ 0.85 × the ingress's capacity", 0.85, False),
        ("capacity_terminal_ratio", "terminal p99 ≤ 10 × the ingress's service time", 10, True),
    ):
        if has(key):
            have = m[key]
            add(f"capacity: {rule} ({how})", have, need, have <= need if below else have >= need)
    if "capacity_lost" in m and "capacity_order_violations" in m:
        wrong = m["capacity_lost"] + m["capacity_order_violations"]
        add(f"capacity: nothing lost, order kept ({how})", wrong, 0, wrong == 0)
    if "capacity_follow_down_s" in m and "capacity_follow_up_s" in m:
        # the slower way; a limit that never followed (None) is infinitely late
        ways = [m["capacity_follow_down_s"], m["capacity_follow_up_s"]]
        worst = float("inf") if None in ways else max(ways)
        need = FOLLOW_WITHIN
        add(
            f"capacity: the summed limit follows a 10× drop within {need:g} s each way "
            f"(down {ways[0]} s, up {ways[1]} s; {how})",
            worst,
            need,
            worst <= need,
        )


def _fairness(j: _Judged) -> None:
    """Issue 50: a quiet key's runs beside a noisy key's backlog p99 ≤ 10× the service time with
    the ingress ≥ 0.85 busy; weights 5:3:2 give each key its share of the first POSTs within 5
    points."""
    m, add, has = j.m, j.add, j.has
    for key, rule, need, below in (
        ("fairness_quiet_ratio", "a quiet key's runs p99 ≤ 10 × the service time", 10, True),
        ("fairness_quiet_goodput", "beside it the ingress ≥ 0.85 busy", 0.85, False),
        ("fairness_share_worst_points", "weights 5:3:2: shares within 5 points", 5, True),
    ):
        if has(key):
            have = m[key]
            add(f"fairness: {rule}", have, need, have <= need if below else have >= need)


def _flaky(j: _Judged) -> None:
    """Issue 42: an ingress answering 503 to half of all POSTs while producers commit a steady
    stream sees at most 1.2 POSTs per first attempt (the retry budget; the rest wait in the
    outbox), and everything arrives once it recovers (flaky.py)."""
    m, add, has = j.m, j.add, j.has
    how = j.settings.get("flaky_posts_per_first", "the flaky scenario")
    if has("flaky_posts_per_first"):
        r = m["flaky_posts_per_first"]
        add(f"flaky: POSTs ≤ 1.2 × first attempts while half fail ({how})", r, 1.2, r <= 1.2)
    if "flaky_lost" in m and "flaky_order_violations" in m:
        wrong = m["flaky_lost"] + m["flaky_order_violations"]
        rule = "everything delivered after the recovery, order kept"
        add(f"flaky: {rule} ({how})", wrong, 0, wrong == 0)


def _fleet(j: _Judged) -> None:
    """Issue 51: the same backlog spread over three databases served by one fleet drains at
    least 0.9 × as fast as in one database by one relay (the median of paired reps, fleet.py);
    with one of three servers killed, the other two's commit→receipt p99 during the outage ≤
    2 × their p99 before it + 100 ms, nothing lost and order kept, and a replica started while
    it is down delivers the other two's new events within 10 s of its start (fleet_outage.py)."""
    m, add, has = j.m, j.add, j.has
    if has("fleet_ratio"):
        r = m["fleet_ratio"]
        how = j.settings.get("fleet_eps", "the fleet scenario")
        add(f"fleet: e2e over {how} ≥ 0.9 × one database's (paired reps)", r, 0.9, r >= 0.9)
    if "fleet_outage_lost" in m and "fleet_outage_order_violations" in m:
        wrong = m["fleet_outage_lost"] + m["fleet_outage_order_violations"]
        add("fleet: one server killed: nothing lost, order kept", wrong, 0, wrong == 0)
    if has("fleet_outage_ratio"):
        r = m["fleet_outage_ratio"]
        rule = "one server killed: the others' p99 during ≤ 2 × before + 100 ms (ratio ≤ 1)"
        add(f"fleet: {rule}", r, 1, r <= 1)
    if has("fleet_outage_new_replica_s"):
        s = m["fleet_outage_new_replica_s"]
        rule = "a replica started while one server is down delivers the others' within 10 s"
        add(f"fleet: {rule}", s, 10, s <= 10)


# -- the shell ---------------------------------------------------------------------------------


@asynccontextmanager
async def environment(url: str | None, console: Console) -> AsyncIterator[Env]:
    """Database (embedded unless `url`), fresh schema, Absurd, the sink; all gone afterwards."""
    async with AsyncExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="relay-bench-")))
        if not url:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # pgserver's platformdirs about XDG_RUNTIME_DIR
                from relay.tools.embedded import EmbeddedPostgres

                server = EmbeddedPostgres(tmp / "pg", durable=True)
            with console.status("starting an embedded PostgreSQL…"):
                url = await anyio.to_thread.run_sync(server.start)
            stack.callback(server.stop)
            console.print(f"embedded PostgreSQL at {url}")
        else:
            console.print(f"PostgreSQL at {redact_url(url)}")
        schema = f"bench_{secrets.token_hex(4)}"
        await anyio.to_thread.run_sync(migrate, url, schema)
        install_absurd(url)
        sink = BenchSink()
        sink.state.keep_received = False
        base = await stack.enter_async_context(serve_sink(sink))
        env = Env(url, schema, sink, base + "/runs/{run_id}/events", console, tmp, stack)
        stack.callback(_drop, env)
        yield env


def _drop(env: Env) -> None:
    with psycopg.connect(env.url, autocommit=True) as conn:
        for queue in env.queues:
            conn.execute("select absurd.drop_queue(%s)", (queue,))
        conn.execute(sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(env.schema)))


def render(name: str, result: Result) -> Table:
    table = Table(title=f"relay bench: {name} — {SCENARIOS[name].summary}", title_justify="left")
    for col in result.columns:
        table.add_column(col.replace("_ms", " (ms)").replace("_", " "), justify="right")
    for row in result.rows:
        table.add_row(*("" if row.get(c) is None else str(row.get(c)) for c in result.columns))
    if result.notes:
        table.caption = "\n".join(result.notes)
        table.caption_justify = "left"
    return table


def _flat(metrics: dict[str, Any]) -> list[tuple[str, float]]:
    out = []
    for key, value in metrics.items():
        if isinstance(value, dict):
            out += [(f"{key}[{k}]", v) for k, v in value.items()]
        else:
            out.append((key, value))
    return out


def summary(metrics: dict[str, Any], judged: list[dict[str, Any]]) -> list[Table]:
    table = Table(title="relay bench: summary", title_justify="left")
    table.add_column("key")
    table.add_column("value", justify="right")
    for key, value in _flat(metrics):
        # escaped: rich would read a label such as "[server]" as a style tag and drop it
        table.add_row(escape(key), f"{value:,.2f}" if isinstance(value, float) else str(value))
    checks = Table(title="relay bench: targets (ratios from this run)", title_justify="left")
    for col in ("target", "measured", "needed", "verdict"):
        checks.add_column(col, justify="left" if col == "target" else "right")
    for t in judged:
        checks.add_row(t["target"], str(t["measured"]), str(t["needed"]), t["verdict"])
    return [table, checks]


def plot(path: Path, metrics: dict[str, Any]) -> None:
    """Throughput (events or transactions per second) and latency (ms) per scenario, as PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchFailed("--plot needs matplotlib: pip install 'ledger-relay[bench]'") from None
    flat = _flat(metrics)
    # peer_eps is peer_pgqueuer_eps under its old name: one bar for it
    rates = [(k, v) for k, v in flat if ("_eps" in k or "_tps" in k) and k != "peer_eps"]
    lat = [(k, v) for k, v in flat if "_ms" in k]
    # The relay beside each peer doing its job (one job per event, a POST each), with each
    # one's per-run order violations; peers in orange.
    peers = [
        (f"{label}\n{metrics[viol]:,} order violations" if viol in metrics else label, metrics[key])
        for key, label, viol in (
            ("e2e_eps", "relay (e2e_eps)", "relay_order_violations"),
            ("tiny_runs_eps_batched", "relay, runs of 1 event, /batch", ""),
            ("tiny_runs_eps", "relay, runs of 1 event", ""),
            ("peer_graphile_eps", "Graphile Worker", "peer_graphile_order_violations"),
            ("peer_pgqueuer_eps", "PgQueuer", "peer_pgqueuer_order_violations"),
            ("tiny_runs_eps_paired", "relay, runs of 1 event, paired", ""),
            ("peer_pgqueuer_eps_paired", "PgQueuer, paired with it", ""),
        )
        if isinstance(metrics.get(key), int | float)
    ]
    panels = [
        (rates, "throughput", "per second"),
        (lat, "latency (commit → ingress)", "ms"),
    ]
    if any(name.startswith(("Graphile", "PgQueuer")) for name, _ in peers):
        panels.append((peers, "the relay beside its peers (events/s)", "per second"))
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 6.5))
    for ax, (items, title, unit) in zip(axes, panels, strict=True):
        names = [k for k, _ in items]
        values = [v for _, v in items]
        colors = ["#dd8833" if k.startswith(("Graphile", "PgQueuer")) else "#4477aa" for k in names]
        bars = ax.barh(names, values, color=colors)
        ax.invert_yaxis()
        ax.set_title(title)
        ax.set_xlabel(unit)
        if title == "latency (commit → ingress)" and values and max(values) > 50 * min(values):
            ax.set_xscale("log")
        ax.bar_label(
            bars,
            labels=[f"{v:,.0f}" if v >= 100 else f"{v:.1f}" for v in values],
            fontsize=8,
            padding=2,
        )
    fig.suptitle(f"relay bench {__version__} — {os.cpu_count()} CPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="relay bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(SCENARIOS), help=f"of: {', '.join(SCENARIOS)}")
    p.add_argument("--json", dest="json_path", type=Path, help="also write the results here")
    p.add_argument("--plot", dest="plot_path", type=Path, help="write a PNG chart here")
    p.add_argument("--reps", type=positive(int), default=3, help="repetitions per figure (3)")
    p.add_argument(
        "--smoke", action="store_true", help="a tiny version of every scenario (seconds)"
    )
    p.add_argument(
        "--database-url",
        default=os.environ.get("RELAY_DATABASE_URL"),
        help="use this PostgreSQL instead of an embedded one [RELAY_DATABASE_URL]",
    )
    for s in SCENARIOS.values():
        s.add_arguments(p)
    a = p.parse_args(argv)
    # `peer` (one scenario before issue 16) names both peers
    a.only = [
        m for n in a.only.split(",") if n.strip() for m in ALIASES.get(n.strip(), [n.strip()])
    ]
    unknown = [n for n in a.only if n not in SCENARIOS]
    if unknown or not a.only:
        p.error(f"--only: unknown scenario {unknown}; choose from {', '.join(SCENARIOS)}")
    if a.smoke:
        a.reps = 1
        for s in SCENARIOS.values():
            for option, value in s.smoke.items():
                setattr(a, option, value)
    if a.seed is None:
        a.seed = random.randrange(2**31)
    return a


@dataclass
class _Run:
    """What the scenarios of one `relay bench` gave."""

    results: dict[str, Result] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # scenario -> its error
    order: dict[str, int] = field(default_factory=dict)  # the relay's per-run order violations


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    console = Console(highlight=False)
    logs.configure("text", "warning")
    run = _Run()
    failure: BaseException | None = None
    try:
        anyio.run(_run_all, a, console, run)
    except* (BenchFailed, psycopg.OperationalError) as group:
        failure = group
        while isinstance(failure, BaseExceptionGroup):
            failure = failure.exceptions[0]
    if failure is not None:
        console.print(f"[bold red]relay bench failed:[/bold red] {failure}")
        return 1
    metrics, settings = _metrics(a, run)
    judged = targets(metrics, settings)
    metrics.pop("rss_events", None)
    for table in summary(metrics, judged):
        console.print(table)
    if "e2e_ceiling_ratio" in metrics:
        console.print(_ceiling_line(metrics))
    if a.json_path is not None:
        _write_json(a, run, metrics, settings, judged)
        console.print(f"results written to {a.json_path}")
    if a.plot_path is not None:
        plot(a.plot_path, metrics)
        console.print(f"chart written to {a.plot_path}")
    return 1 if run.failed else 0


async def _run_all(a: argparse.Namespace, console: Console, run: _Run) -> None:
    async with environment(a.database_url, console) as env:
        for i, name in enumerate(a.only):
            console.rule(f"[{i + 1}/{len(a.only)}] {name}: {SCENARIOS[name].summary}")
            started = time.monotonic()
            try:
                run.results[name] = await SCENARIOS[name].run(env, a)
            except Exception as exc:
                # One scenario's failure does not lose the others' figures.
                run.failed[name] = _what_failed(exc)
                console.print(f"[bold red]{name} failed:[/bold red] {run.failed[name]}")
                continue
            console.print(render(name, run.results[name]))
            if env.relay_order_violations is not None:
                run.order["relay"] = env.relay_order_violations
            console.print(f"({time.monotonic() - started:.0f} s)")


def _metrics(a: argparse.Namespace, run: _Run) -> tuple[dict[str, Any], dict[str, str]]:
    """Every scenario's metrics and settings in one mapping each, for the targets."""
    metrics: dict[str, Any] = {}
    settings: dict[str, str] = {}
    for r in run.results.values():
        metrics.update(r.metrics)
        settings.update(r.settings)
    if "relay" in run.order:
        metrics["relay_order_violations"] = run.order["relay"]
    if "peak_rss" in run.results:
        metrics["rss_events"] = a.rss_events
    _ceiling(metrics)
    return metrics, settings


def _ceiling(m: dict[str, Any]) -> None:
    """What end to end can reach at best on this machine: each limit's CPU per event (its
    server, relay and sink together) paid once per event, on all the cores. A figure beside
    the e2e target, not a target: it explains the target's standing."""
    db, http = m.get("db_limit_cpu_us_per_event", {}), m.get("http_limit_cpu_us_per_event", {})
    if db.get("total") and http.get("total"):
        m["e2e_ceiling_eps"] = round(bench_cpu.ceiling_eps([db["total"], http["total"]]), 2)
        if isinstance(m.get("e2e_eps"), int | float):
            m["e2e_ceiling_ratio"] = round(m["e2e_eps"] / m["e2e_ceiling_eps"], 3)
        e2e = m.get("e2e_cpu_us_per_event", {}).get("total")
        if e2e:
            # what the load of the machine changes least: the relay end to end against the
            # two limits' parts, in CPU per event (1: end to end adds nothing to them)
            m["e2e_cpu_over_limits"] = round(e2e / (db["total"] + http["total"]), 3)


def _ceiling_line(m: dict[str, Any]) -> str:
    db, http = m["db_limit_cpu_us_per_event"]["total"], m["http_limit_cpu_us_per_event"]["total"]
    return (
        f"e2e_eps / e2e_ceiling_eps = {m['e2e_ceiling_ratio']:.2f} (a figure, not a target): "
        f"e2e_ceiling_eps = {bench_cpu.CORES} cores × 1e6 / (db_limit {db:,.1f} + http_limit "
        f"{http:,.1f} µs of CPU per event) = {m['e2e_ceiling_eps']:,.0f} events/s; end to end "
        f"{m.get('e2e_cpu_us_per_event', {}).get('total', 0):,.1f} µs per event, "
        f"{m.get('e2e_cpu_over_limits', 0):.2f}× the limits' sum"
    )


def _write_json(
    a: argparse.Namespace,
    run: _Run,
    metrics: dict[str, Any],
    settings: dict[str, str],
    judged: list[dict[str, Any]],
) -> None:
    out = {
        "relay_version": __version__,
        "at": datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": sys.platform},
        "reps": a.reps,
        "smoke": a.smoke,
        "metrics": metrics,
        "settings": settings,
        "targets": judged,
        "failed": run.failed,
        "scenarios": {
            n: {"rows": r.rows, "notes": r.notes, "samples_s": r.data}
            for n, r in run.results.items()
        },
    }
    a.json_path.write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2) + b"\n")


def _what_failed(exc: BaseException) -> str:
    """A scenario's failure, named: through task groups, the exceptions they wrapped (a
    `BenchFailed` raised in one reads as itself, not as "unhandled errors in a TaskGroup")."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_what_failed(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"
