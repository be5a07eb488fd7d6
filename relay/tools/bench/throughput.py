"""Throughput scenarios of `relay bench`: the machine's limits (database, HTTP), the relay end
to end, what people write first instead (a naive relay), claims against a deep backlog, and
the relay's memory over a 1M-event run. The queues people pick instead are in `peers/`.

Events per second are distinct events received by the ingress over the time from the commit
of the backlog (the relay already running, idle) to the last receipt.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import anyio
import httpx
import orjson
import psycopg
from psycopg_pool import AsyncConnectionPool

from relay.edges.http_client import open_sender
from relay.edges.ingress import Batch, IngressClient
from relay.edges.store import CONNECT_KWARGS, ClaimedEvent, Store
from relay.tools.bench import cpu
from relay.tools.bench.kit import (
    BenchFailed,
    Env,
    Result,
    Scenario,
    backlog,
    median,
    positive,
    relay_processes,
    reset,
    rotated,
    statement_sizes,
    until_received,
)


def _arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("throughput")
    g.add_argument("--e2e-runs", type=positive(int), default=20_000, help="runs (20k)")
    g.add_argument("--e2e-per-run", type=positive(int), default=10, help="events per run (10)")
    g.add_argument("--e2e-reps", type=positive(int), default=2, help="repetitions (2)")
    g.add_argument("--replicas", default="1,2,4", help="replica counts (1,2,4)")
    g.add_argument(
        "--e2e-modes",
        type=e2e_modes,
        default=list(E2E_MODES),
        help="one replica's modes, paired per rep: default,httpx,fixed (all; the default always "
        "runs: the others are read against it)",
    )
    g.add_argument("--limit-runs", type=positive(int), default=10_000, help="db/http runs (10k)")
    g.add_argument("--tiny-runs", type=positive(int), default=50_000, help="1-event runs (50k)")
    g.add_argument("--naive-seconds", type=positive(float), default=10.0, help="(10 s)")
    g.add_argument("--claim-seconds", type=positive(float), default=3.0, help="per rep (3 s)")
    g.add_argument("--claim-big", type=positive(int), default=1_000_000, help="pending (1M)")
    g.add_argument("--rss-events", type=positive(int), default=1_000_000, help="(1M)")


SMOKE = {
    "e2e_runs": 200,
    "e2e_per_run": 10,
    "e2e_reps": 1,
    "replicas": "1,2",
    "limit_runs": 200,
    "tiny_runs": 500,
    "naive_seconds": 1.0,
    "claim_seconds": 0.5,
    "claim_big": 20_000,
    "rss_events": 5_000,
}

# -- the limits -----------------------------------------------------------------------------


async def _store(env: Env, size: int) -> tuple[AsyncConnectionPool[Any], Store]:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        env.url, min_size=size, max_size=size, kwargs=dict(CONNECT_KWARGS), open=False
    )
    await pool.open(wait=True)
    s = env.settings()
    store = Store(
        pool, env.schema, lease_ttl=s.lease_ttl, batch_size=s.batch_size, owner="bench-limit"
    )
    return pool, store


async def db_limit(env: Env, a: argparse.Namespace) -> Result:
    """The relay's own claim + grouped-ack SQL in a tight loop: what the database allows."""
    loops, claim_runs = 4, env.settings().claim_runs
    rates = []
    # the relay's code runs in this process (the in-process sink beside it stays idle)
    who, unseen = cpu.parties(server=await _server(env), relay=[os.getpid()], sink=None)
    usages: list[tuple[cpu.Usage, int]] = []
    for rep in range(a.reps):
        await reset(env)
        await backlog(env, a.limit_runs, a.e2e_per_run, f"d{rep}-", notify=False)
        pool, store = await _store(env, loops)
        done = 0

        async def loop(store: Store) -> None:
            nonlocal done
            while True:
                claims = await store.claim("ordinary", claim_runs)
                if not claims:
                    return
                await store.ack([(c, c.last_seq, False) for c in claims])
                done += sum(len(c.events) for c in claims)

        try:
            with env.console.status(f"db_limit_eps: rep {rep + 1}/{a.reps}"):
                with cpu.window(who, unseen) as w:
                    started = time.monotonic()
                    async with anyio.create_task_group() as tg:
                        for _ in range(loops):
                            tg.start_soon(loop, store)
                    rates.append(done / (time.monotonic() - started))
                usages.append((w.usage, done))
        finally:
            await pool.close()
    eps = median(rates)
    return Result(
        ["key", "events_per_s", "reps", "cpu_us_per_event"],
        [
            {
                "key": "db_limit_eps",
                "events_per_s": eps,
                "reps": [round(r) for r in rates],
                "cpu_us_per_event": _cpu_cell(usages),
            }
        ],
        [
            f"{loops} concurrent loops of Store.claim(ordinary, {claim_runs} runs) + one "
            f"grouped Store.ack; {a.limit_runs} runs of {a.e2e_per_run} events; no HTTP",
            cpu.note("db_limit", usages) + "; relay = the bench process running the loops",
        ],
        data={"cpu": [cpu.summary("db_limit", u, n) for u, n in usages]},
        metrics={"db_limit_eps": eps, "db_limit_cpu_us_per_event": cpu.median_split(usages)},
    )


async def _server(env: Env) -> int | None:
    return await anyio.to_thread.run_sync(cpu.server_pid, env.url)


def _cpu_cell(usages: list[tuple[cpu.Usage, int]]) -> float | None:
    """The table's cell: the median total µs of CPU per event over the reps."""
    return cpu.median_split(usages).get("total")


def _fake_batches(n_runs: int, per_run: int, tag: str) -> list[Batch]:
    now = datetime.now(UTC)
    batches = []
    for r in range(n_runs):
        run = f"h{tag}-{r}"
        events = [
            ClaimedEvent(
                i,
                f"{run}-{i}",
                "step",
                orjson.dumps({"run": run, "step": i, "note": "benchmark event"}).decode(),
                False,
                now,
                None,
                None,
            )
            for i in range(1, per_run + 1)
        ]
        batches.append(Batch(run, 1, events, now))
    return batches


async def http_limit(env: Env, a: argparse.Namespace) -> Result:
    """POSTs of the same batches (one run of `e2e_per_run` events each) to the same ingress
    with the relay's own IngressClient and default connection budget: what HTTP allows."""
    base = await env.external_sink()
    s = env.settings(ingress_url=base + "/runs/{run_id}/events")
    rates = []
    # the relay's IngressClient runs in this process; the server is idle but counted
    who, unseen = cpu.parties(
        server=await _server(env), relay=[os.getpid()], sink=env.external_sink_pid
    )
    usages: list[tuple[cpu.Usage, int]] = []
    for rep in range(a.reps):
        await reset(env)
        batches = _fake_batches(a.limit_runs, a.e2e_per_run, str(rep))
        it = iter(batches)
        done = 0
        async with open_sender(s, s.concurrency) as http:
            client = IngressClient(s, http)

            async def loop(client: IngressClient, it: Iterator[Batch]) -> None:
                nonlocal done
                for b in it:
                    answer = await client.post(b)
                    if answer.status != 200:
                        raise BenchFailed(f"http_limit: the sink answered {answer.status}")
                    done += len(b.events)

            with env.console.status(f"http_limit_eps: rep {rep + 1}/{a.reps}"):
                with cpu.window(who, unseen) as w:
                    started = time.monotonic()
                    async with anyio.create_task_group() as tg:
                        for _ in range(s.concurrency):
                            tg.start_soon(loop, client, it)
                    rates.append(done / (time.monotonic() - started))
                usages.append((w.usage, done))
    eps = median(rates)
    return Result(
        ["key", "events_per_s", "reps", "cpu_us_per_event"],
        [
            {
                "key": "http_limit_eps",
                "events_per_s": eps,
                "reps": [round(r) for r in rates],
                "cpu_us_per_event": _cpu_cell(usages),
            }
        ],
        [
            f"{s.concurrency} concurrent IngressClient.post loops, {a.limit_runs} runs of "
            f"{a.e2e_per_run} events each, to `relay sink` in its own process; no database",
            cpu.note("http_limit", usages) + "; relay = the bench process running the loops",
        ],
        data={"cpu": [cpu.summary("http_limit", u, n) for u, n in usages]},
        metrics={"http_limit_eps": eps, "http_limit_cpu_us_per_event": cpu.median_split(usages)},
    )


# -- end to end -----------------------------------------------------------------------------


async def e2e_once(
    env: Env,
    what: str,
    replicas: int,
    runs: int,
    per_run: int,
    *,
    batched: bool = False,
    watch_rss: bool = False,
    settings: dict[str, str] | None = None,
    environ: dict[str, str] | None = None,
) -> tuple[float, float]:
    """One repetition: replicas ready and idle, backlog committed, wait for the last receipt.
    Returns (events/s, the first replica's peak RSS in MB). `environ`: more variables for the
    replicas (the tracing scenario's OTEL_*)."""
    one = await _e2e_run(
        env, what, replicas, runs, per_run, batched, watch_rss, settings or {}, environ
    )
    return one.eps, one.peak_rss_mb


@dataclass
class E2ERun:
    eps: float
    peak_rss_mb: float
    events: int
    cpu: cpu.Usage  # from the backlog's commit to the last receipt
    sizes: dict[str, float | None]  # runs per claim, per ack statement, events per POST (kit)


async def _e2e_run(
    env: Env,
    what: str,
    replicas: int,
    runs: int,
    per_run: int,
    batched: bool,
    watch_rss: bool,
    settings: dict[str, str],
    environ: dict[str, str] | None,
) -> E2ERun:
    await reset(env)
    base = await env.external_sink()
    server = await _server(env)
    extra = {"ingress_batch_url": base + "/batch"} if batched else {}
    async with relay_processes(env, replicas, base, environ=environ, **extra, **settings) as procs:
        peak = 0.0

        def tick() -> None:
            nonlocal peak
            if watch_rss:
                peak = max(peak, procs[0].peak_rss_mb())

        who, unseen = cpu.parties(
            server=server,
            relay=[p.proc.pid for p in procs],
            sink=env.external_sink_pid,
            bench=True,
        )
        committed = await backlog(env, runs, per_run, "e")
        # The window starts once the backlog is committed (writing it is not the relay's
        # work), a few ms after the replicas woke up to it; it ends on the last receipt.
        with cpu.window(who, unseen) as w:
            total = runs * per_run
            finished = await until_received(
                env, base, total, what, on_tick=tick, timeout=max(120, total / 200)
            )
        tick()
        sizes = await statement_sizes(procs)
    return E2ERun(total / (finished - committed), peak, total, w.usage, sizes)


# The modes of one replica measured side by side (issues 16, 40, 42): the default settings
# (httpx's client over the aiohttp transport, the adaptive POST limit), httpx's own transport,
# and the fixed POST limit (each lane's own concurrency, the relay before issue 42). Reps rotate
# which goes first, so all see the same machine, and the targets (main.py) compare like with
# like: issue 42's "a fast ingress loses nothing to the limit" is the median of the paired
# reps' e2e_eps / e2e_eps_fixed (`e2e_adaptive_ratio`). httpx's own transport keeps connections
# as the default's does (`ingress_keepalive=true`; unset, it would connect per POST, issue 48
# item 1): the sink answers each POST once, and the transports are compared, not a connect.
E2E_MODES: dict[str, dict[str, str]] = {
    "e2e_eps": {},
    "e2e_eps_httpx": {"http_transport": "httpx", "ingress_keepalive": "true"},
    "e2e_eps_fixed": {"post_limit": "fixed"},
}
MODE_NAMES = {"default": "e2e_eps", "httpx": "e2e_eps_httpx", "fixed": "e2e_eps_fixed"}


def e2e_modes(text: str) -> list[str]:
    """`--e2e-modes`: the named modes' keys, in E2E_MODES' order, the default's always. Pairing
    the adaptive limit with the fixed one alone halves a rep (httpx's own transport is the
    slowest mode), so more pairs fit the same minutes."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODE_NAMES]
    if unknown:
        known = ", ".join(MODE_NAMES)
        raise argparse.ArgumentTypeError(f"no e2e mode {', '.join(unknown)} (the modes: {known})")
    keys = {MODE_NAMES[n] for n in names} | {"e2e_eps"}
    return [key for key in E2E_MODES if key in keys]


async def e2e(env: Env, a: argparse.Namespace) -> Result:
    counts = [int(n) for n in a.replicas.split(",") if n.strip()]
    if 1 not in counts:
        counts.insert(0, 1)
    rows: list[dict[str, Any]] = []
    by: dict[str, float] = {}
    modes: list[str] = a.e2e_modes
    paired: dict[str, list[float]] = {key: [] for key in modes}
    usages: dict[str, list[tuple[cpu.Usage, int]]] = {key: [] for key in modes}
    sizes: list[dict[str, float | None]] = []  # the default mode's, per rep
    for rep in range(a.e2e_reps):
        for key in rotated(modes, rep):
            one = await _e2e_run(
                env,
                f"{key} 1 replica, rep {rep + 1}",
                1,
                a.e2e_runs,
                a.e2e_per_run,
                False,
                False,
                E2E_MODES[key],
                None,
            )
            paired[key].append(one.eps)
            usages[key].append((one.cpu, one.events))
            if key == "e2e_eps":
                sizes.append(one.sizes)
    metrics: dict[str, Any] = {key: median(rates) for key, rates in paired.items()}
    if "e2e_eps_fixed" in paired:
        adaptive = zip(paired["e2e_eps"], paired["e2e_eps_fixed"], strict=True)
        metrics["e2e_adaptive_ratio"] = round(statistics.median(d / f for d, f in adaptive), 3)
    defaults = env.settings()
    for key, rates in paired.items():
        transport = E2E_MODES[key].get("http_transport", defaults.http_transport)
        rows.append(
            {
                "replicas": 1,
                "http_transport": transport,
                "post_limit": E2E_MODES[key].get("post_limit", defaults.post_limit),
                "events_per_s": metrics[key],
                "reps": [round(r) for r in rates],
                "cpu_us_per_event": _cpu_cell(usages[key]),
            }
        )
    by["1"] = metrics["e2e_eps"]
    for n in counts:
        if n == 1:
            continue
        rates = []
        for rep in range(a.e2e_reps):
            eps, _ = await e2e_once(
                env, f"e2e {n} replica(s), rep {rep + 1}", n, a.e2e_runs, a.e2e_per_run
            )
            rates.append(eps)
        by[str(n)] = median(rates)
        rows.append(
            {
                "replicas": n,
                "http_transport": defaults.http_transport,
                "post_limit": defaults.post_limit,
                "events_per_s": by[str(n)],
                "reps": [round(r) for r in rates],
            }
        )
    ratios = "; ".join(
        f"{key.removeprefix('e2e_eps_')} / default: "
        + ", ".join(f"{x / d:.2f}" for d, x in zip(paired["e2e_eps"], paired[key], strict=True))
        for key in modes
        if key != "e2e_eps"
    )
    return Result(
        ["replicas", "http_transport", "post_limit", "events_per_s", "reps", "cpu_us_per_event"],
        rows,
        [
            f"`relay run` subprocesses with default settings, `relay sink` subprocess; backlog "
            f"{a.e2e_runs * a.e2e_per_run:,} events over {a.e2e_runs:,} runs committed while "
            "the replicas were idle; events/s from that commit to the last receipt",
            "one replica: the defaults (aiohttp under httpx's client, the adaptive POST limit), "
            "http_transport=httpx (its own) and post_limit=fixed in rotating, paired reps; per "
            f"rep {ratios}; e2e_adaptive_ratio = the median of default / fixed",
            cpu.note("e2e (the default, 1 replica)", usages["e2e_eps"])
            + "; relay = the `relay run` process, bench = this process polling the sink",
            "runs per claim statement / per ack statement, events per POST (the default, 1 "
            "replica, per rep; the relay's claims_total, ack_groups_total, "
            "delivered_events_total and ingress_requests_total): "
            + ", ".join(
                f"{s['runs_per_claim']} / {s['runs_per_ack']}, {s['events_per_post']}"
                for s in sizes
            ),
        ],
        data={
            "cpu": {key: [cpu.summary(key, u, n) for u, n in runs] for key, runs in usages.items()},
            "statement_sizes": sizes,
        },
        metrics={
            **metrics,
            "e2e_eps_by_replicas": by,
            "e2e_cpu_us_per_event": cpu.median_split(usages["e2e_eps"]),
        },
    )


async def tiny_runs(env: Env, a: argparse.Namespace) -> Result:
    rows, metrics = [], {}
    for key, batched in (("tiny_runs_eps", False), ("tiny_runs_eps_batched", True)):
        rates = []
        for rep in range(a.e2e_reps):
            eps, _ = await e2e_once(env, f"{key} rep {rep + 1}", 1, a.tiny_runs, 1, batched=batched)
            rates.append(eps)
        metrics[key] = median(rates)
        rows.append({"key": key, "events_per_s": metrics[key], "reps": [round(r) for r in rates]})
    return Result(
        ["key", "events_per_s", "reps"],
        rows,
        [
            f"{a.tiny_runs:,} runs of one event, one `relay run`; batched: ingress_batch_url = "
            "the sink's /batch (several runs per POST)"
        ],
        metrics=metrics,
    )


async def peak_rss(env: Env, a: argparse.Namespace) -> Result:
    per_run = 10
    runs = max(1, a.rss_events // per_run)
    eps, peak = await e2e_once(env, "peak_rss_mb", 1, runs, per_run, watch_rss=True)
    peak = round(peak, 1)
    return Result(
        ["key", "value", "events", "events_per_s"],
        [
            {
                "key": "peak_rss_mb",
                "value": peak,
                "events": runs * per_run,
                "events_per_s": round(eps),
            }
        ],
        ["VmHWM of the `relay run` process (read from /proc while it ran), default settings"],
        metrics={"peak_rss_mb": peak, "e2e_eps_1m": round(eps, 2)},
    )


# -- naive ----------------------------------------------------------------------------------

NAIVE_HEADERS = {"content-type": "application/json", "relay-lease-epoch": "1"}


async def naive(env: Env, a: argparse.Namespace) -> Result:
    """The hand-rolled relay people write first: poll every 100 ms, then one transaction and
    one POST per event."""
    base = await env.external_sink()
    rates = []
    for rep in range(a.reps):
        await reset(env)
        await backlog(env, 2000, a.e2e_per_run, "n", notify=False)
        done = 0
        # pending: after the run's cursor (schema version 7); one event at a time under the
        # run's row lock, the cursor moved past it
        select = env.q(
            "select o.run_id, o.seq, o.event_id, o.event_type, o.payload::text, o.created_at"
            " from {s}.outbox o join {s}.runs r on r.run_id = o.run_id"
            " where o.seq > r.delivered_seq order by o.created_at, o.run_id, o.seq limit 100"
        )
        lock = env.q(
            "select 1 from {s}.runs where run_id = %s and delivered_seq = %s - 1"
            " for update skip locked"
        )
        mark = env.q(
            "update {s}.runs set delivered_seq = %s, delivered_at = clock_timestamp()"
            " where run_id = %s and delivered_seq = %s - 1"
        )
        async with (
            await psycopg.AsyncConnection.connect(env.url, autocommit=True) as conn,
            httpx.AsyncClient() as http,
        ):
            with env.console.status(f"naive_eps: rep {rep + 1}/{a.reps}") as status:
                started = time.monotonic()
                end = started + a.naive_seconds
                while time.monotonic() < end:
                    rows = await (await conn.execute(select)).fetchall()
                    for run_id, seq, event_id, etype, payload, created in rows:
                        if time.monotonic() >= end:
                            break
                        async with conn.transaction():
                            if not await (await conn.execute(lock, (run_id, seq))).fetchone():
                                continue
                            body = orjson.dumps(
                                {
                                    "run_id": run_id,
                                    "epoch": 1,
                                    "events": [
                                        {
                                            "event_id": event_id,
                                            "seq": seq,
                                            "type": etype,
                                            "terminal": False,
                                            "payload": orjson.Fragment(payload),
                                            "created_at": created,
                                        }
                                    ],
                                }
                            )
                            r = await http.post(
                                f"{base}/runs/{run_id}/events",
                                content=body,
                                headers=NAIVE_HEADERS,
                            )
                            if r.status_code != 200:
                                raise BenchFailed(f"naive: the sink answered {r.status_code}")
                            await conn.execute(mark, (seq, run_id, seq))
                        done += 1
                    status.update(f"naive_eps: rep {rep + 1}/{a.reps}, {done} events")
                    await anyio.sleep(0.1)
                rates.append(done / (time.monotonic() - started))
    eps = median(rates)
    return Result(
        ["key", "events_per_s", "reps"],
        [{"key": "naive_eps", "events_per_s": eps, "reps": [round(r) for r in rates]}],
        [
            f"in the bench process: poll 100 events every 100 ms, then per event BEGIN, SELECT "
            f"FOR UPDATE SKIP LOCKED, POST (httpx), UPDATE, COMMIT; {a.naive_seconds:g} s per rep"
        ],
        metrics={"naive_eps": eps},
    )


# -- claims against a deep backlog ----------------------------------------------------------


async def _claim_rate(env: Env, store: Store, seconds: float, label: str) -> float:
    claim_runs = env.settings().claim_runs
    done = 0
    with env.console.status(label):
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            claims = await store.claim("ordinary", claim_runs)
            if not claims:
                raise BenchFailed(f"{label}: nothing to claim")
            async with anyio.create_task_group() as tg:
                for c in claims:
                    tg.start_soon(store.release, c)
            done += sum(len(c.events) for c in claims)
        return done / (time.monotonic() - started)


async def claims(env: Env, a: argparse.Namespace) -> Result:
    rows, metrics = [], {}
    for key, pending in (("claim_eps_10k_pending", 10_000), ("claim_eps_1m_pending", a.claim_big)):
        await reset(env)
        with env.console.status(f"{key}: writing {pending:,} pending events"):
            await backlog(env, max(1, pending // 10), 10, "c", notify=False)
        pool, store = await _store(env, 20)
        try:
            rates = [
                await _claim_rate(env, store, a.claim_seconds, f"{key}: rep {rep + 1}/{a.reps}")
                for rep in range(a.reps)
            ]
        finally:
            await pool.close()
        metrics[key] = median(rates)
        rows.append({"key": key, "events_per_s": metrics[key], "reps": [round(r) for r in rates]})
    return Result(
        ["key", "events_per_s", "reps"],
        rows,
        [
            "a loop of Store.claim(ordinary, 16 runs of 10 events) then Store.release of each "
            f"claim (concurrently), {a.claim_seconds:g} s per rep; events claimed per second"
        ],
        metrics=metrics,
    )


SCENARIOS = [
    Scenario(
        "db_limit",
        "the relay's claim + ack SQL in a tight loop, no HTTP",
        db_limit,
        _arguments,
        SMOKE,
        ("db_limit_eps",),
    ),
    Scenario(
        "http_limit",
        "POSTs of the same batches with the relay's IngressClient, no database",
        http_limit,
        keys=("http_limit_eps",),
    ),
    Scenario(
        "e2e",
        "the relay end to end (relay run + relay sink subprocesses), 1/2/4 replicas; one "
        "replica over each transport under httpx (aiohttp, the default; httpx's own)",
        e2e,
        keys=(
            "e2e_eps",
            "e2e_eps_httpx",
            "e2e_eps_fixed",
            "e2e_adaptive_ratio",
            "e2e_eps_by_replicas",
        ),
    ),
    Scenario(
        "tiny_runs",
        "runs of one event, one POST per run and with the multi-run /batch",
        tiny_runs,
        keys=("tiny_runs_eps", "tiny_runs_eps_batched"),
    ),
    Scenario(
        "naive",
        "a naive relay: poll, one event per POST and transaction",
        naive,
        keys=("naive_eps",),
    ),
    Scenario(
        "claim",
        "claim throughput with 10k and with 1M pending events",
        claims,
        keys=("claim_eps_10k_pending", "claim_eps_1m_pending"),
    ),
    Scenario(
        "peak_rss",
        "peak RSS of `relay run` over a 1M-event backlog",
        peak_rss,
        keys=("peak_rss_mb",),
    ),
]
