"""Latency and steady-state scenarios of `relay bench`: commit-to-ingress latency of terminal
and ordinary events (idle, and terminal behind a saturated ordinary lane), producer commit
throughput with ordinary notifications on and off, and the outbox's size over a soak.

Latency = the first receipt of the event at the in-process reference sink (`time.time()`)
minus the moment the producer's commit returned (`time.time()`): one clock, one machine. The
relay runs as a `relay run` subprocess, so it does not share the bench's event loop.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
from typing import Any

import anyio
import orjson
import psycopg
from anyio.streams.buffered import BufferedByteReceiveStream

from relay.producer import Event, enqueue_async, enqueue_many_async
from relay.runner import Relay
from relay.tools.bench.kit import (
    BenchFailed,
    Env,
    Result,
    Scenario,
    backlog,
    median,
    positive_options,
    relay_processes,
    reset,
)
from relay.tools.demo import percentile

ARGUMENTS = positive_options(
    "latency",
    ("--samples", int, 200, "events per rep (200)"),
    ("--pace", float, 0.02, "mean gap (0.02 s)"),
    ("--slow-ingress", float, 0.5, "backlog (0.5 s)"),
    ("--producer-seconds", float, 5.0, "(5 s)"),
    ("--soak-seconds", float, 300.0, "(300 s)"),
    ("--soak-rate", int, 1000, "events/s (1000)"),
    ("--soak-retention", float, 10.0, "(10 s)"),
)


SMOKE = {
    "samples": 10,
    "pace": 0.01,
    "slow_ingress": 0.2,
    "producer_seconds": 0.5,
    "soak_seconds": 6.0,
    "soak_rate": 200,
    "soak_retention": 1.0,
}


async def _samples(
    env: Env, a: argparse.Namespace, tag: str, *, terminal: bool, rng: random.Random
) -> list[float]:
    """Commit `a.samples` events one per transaction (each its own run), paced at random
    around `a.pace`; returns their commit-to-first-receipt latencies (s)."""
    committed: dict[str, float] = {}
    seen = env.sink.state.first_seen_at
    async with await psycopg.AsyncConnection.connect(env.url, autocommit=True) as conn:
        for i in range(a.samples):
            run = f"{tag}-{i}"
            eid = f"{run}-e"
            await enqueue_async(
                conn,
                run,
                eid,
                "run_finished" if terminal else "step",
                {"i": i},
                terminal=terminal,
                schema=env.schema,
            )
            committed[eid] = time.time()
            await anyio.sleep(rng.uniform(0, 2 * a.pace))
    deadline = time.monotonic() + 30
    while any(e not in seen for e in committed):
        if time.monotonic() > deadline:
            missing = sum(1 for e in committed if e not in seen)
            raise BenchFailed(f"{tag}: {missing} events never reached the sink")
        await anyio.sleep(0.005)
    return [seen[e] - t for e, t in committed.items()]


def _summary(rows: list[dict[str, Any]], key: str, reps: list[list[float]]) -> dict[str, float]:
    p50 = median([percentile(r, 50) * 1000 for r in reps])  # type: ignore[operator]
    p99 = median([percentile(r, 99) * 1000 for r in reps])  # type: ignore[operator]
    rows.append(
        {
            "case": key,
            "p50_ms": p50,
            "p99_ms": p99,
            "max_ms": round(max(max(r) for r in reps) * 1000, 2),
            "samples": sum(len(r) for r in reps),
        }
    )
    return {"p50": p50, "p99": p99}


async def latency(env: Env, a: argparse.Namespace) -> Result:
    rng = random.Random(a.seed)
    rows: list[dict[str, Any]] = []
    metrics: dict[str, Any] = {}
    await reset(env)
    cases = [
        ("terminal_idle", True, "on"),
        ("ordinary_idle", False, "on"),
        ("ordinary_idle_notify_off", False, "off"),
    ]
    async with relay_processes(env, 1, env.ingress_url.removesuffix("/runs/{run_id}/events")):
        async with await psycopg.AsyncConnection.connect(env.url, autocommit=True) as conn:
            for key, terminal, notify in cases:
                await conn.execute(
                    env.q("update {s}.settings set value = %s where key = 'notify_ordinary'"),
                    (notify,),
                )
                reps = []
                for rep in range(a.reps):
                    with env.console.status(f"latency {key}: rep {rep + 1}/{a.reps}"):
                        reps.append(
                            await _samples(env, a, f"{key}-{rep}", terminal=terminal, rng=rng)
                        )
                got = _summary(rows, key, reps)
                kind = key.split("_")[0]
                suffix = key.removeprefix(f"{kind}_")
                metrics[f"{kind}_p50_ms_{suffix}"] = got["p50"]
                metrics[f"{kind}_p99_ms_{suffix}"] = got["p99"]
        # Terminal events while the ordinary lane is saturated behind a slow ingress.
        env.sink.slow_prefix, env.sink.slow_seconds = "slow", a.slow_ingress
        try:
            s = env.settings()
            # enough ordinary work to keep the whole lane busy for the whole measurement
            runs = int(s.concurrency * (a.samples * a.pace * 2 * a.reps + 5) / a.slow_ingress) + 100
            await backlog(env, runs, 10, "slow")
            await anyio.sleep(1.0)  # let the ordinary lane fill up
            reps = []
            for rep in range(a.reps):
                with env.console.status(f"latency terminal_backlog: rep {rep + 1}/{a.reps}"):
                    reps.append(await _samples(env, a, f"tb-{rep}", terminal=True, rng=rng))
            got = _summary(rows, "terminal_backlog", reps)
            metrics["terminal_p50_ms_backlog"] = got["p50"]
            metrics["terminal_p99_ms_backlog"] = got["p99"]
        finally:
            env.sink.slow_prefix = None
    await reset(env)
    return Result(
        ["case", "p50_ms", "p99_ms", "max_ms", "samples"],
        rows,
        [
            "commit returned -> first receipt at the in-process sink, one `relay run` with default "
            f"settings (poll_interval 1 s); {a.samples} events per rep, one per transaction and "
            f"run, ~{a.pace * 1000:g} ms apart; figures: median over {a.reps} reps",
            f"backlog: ordinary runs whose POSTs the sink holds {a.slow_ingress:g} s each, "
            "enough to keep every ordinary slot busy throughout",
        ],
        metrics=metrics,
    )


# -- producers ------------------------------------------------------------------------------


async def _producer(
    url: str, schema: str, conns: int, notify: str, tag: str, seconds: float
) -> None:
    opened = [await psycopg.AsyncConnection.connect(url, autocommit=True) for _ in range(conns)]
    for c in opened:
        await c.execute(f"set relay.notify_ordinary = '{notify}'")
    print("ready", flush=True)
    await anyio.to_thread.run_sync(sys.stdin.readline)  # "go": all producers start together
    stop = time.monotonic() + seconds
    done = 0

    async def loop(k: int, conn: psycopg.AsyncConnection[Any]) -> None:
        nonlocal done
        i = 0
        while time.monotonic() < stop:
            await enqueue_async(
                conn, f"{tag}-{k}-{i}", f"{tag}-{k}-{i}-e", "step", {"i": i}, schema=schema
            )
            i += 1
            done += 1

    async with anyio.create_task_group() as tg:
        for k, c in enumerate(opened):
            tg.start_soon(loop, k, c)
    print(orjson.dumps({"transactions": done}).decode(), flush=True)
    for c in opened:
        await c.close()


def producer_main(argv: list[str]) -> None:
    url, schema, conns, notify, tag, seconds = argv
    anyio.run(_producer, url, schema, int(conns), notify, tag, float(seconds))


async def _producers_once(env: Env, notify: str, seconds: float, tag: str) -> float:
    """8 producer connections in 2 processes (the bench's one loop would cap them first)."""
    code = (
        "import sys; from relay.tools.bench.latency import producer_main;"
        " producer_main(sys.argv[1:])"
    )
    procs = []
    lines: list[BufferedByteReceiveStream] = []
    try:
        for p in range(2):
            procs.append(
                await anyio.open_process(
                    [
                        sys.executable,
                        "-c",
                        code,
                        env.url,
                        env.schema,
                        "4",
                        notify,
                        f"{tag}{p}",
                        str(seconds),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=None,
                )
            )
        for proc in procs:
            assert proc.stdout is not None
            lines.append(BufferedByteReceiveStream(proc.stdout))
            with anyio.fail_after(60):
                if not (await lines[-1].receive_until(b"\n", 1 << 16)).startswith(b"ready"):
                    raise BenchFailed("a producer did not start")
        for proc in procs:
            assert proc.stdin is not None
            await proc.stdin.send(b"go\n")
        total = 0
        for proc, out in zip(procs, lines, strict=True):
            with anyio.fail_after(seconds + 60):
                line = await out.receive_until(b"\n", 1 << 16)
            total += int(orjson.loads(line)["transactions"])
            await proc.wait()
        return total / seconds
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def producers(env: Env, a: argparse.Namespace) -> Result:
    rows, metrics = [], {}
    rates: dict[str, list[float]] = {"on": [], "off": []}
    for rep in range(a.reps):
        for notify in ("on", "off"):  # interleaved: drift hits both alike
            await reset(env)
            with env.console.status(f"producer_tps notify {notify}: rep {rep + 1}/{a.reps}"):
                rates[notify].append(
                    await _producers_once(env, notify, a.producer_seconds, f"p{notify}{rep}-")
                )
    for notify in ("on", "off"):
        key = f"producer_tps_notify_{notify}"
        metrics[key] = median(rates[notify])
        rows.append({"key": key, "tps": metrics[key], "reps": [round(r) for r in rates[notify]]})
    await reset(env)
    return Result(
        ["key", "tps", "reps"],
        rows,
        [
            "8 connections (2 processes × 4), each committing `relay.enqueue` of one ordinary "
            f"event per transaction (autocommit) for {a.producer_seconds:g} s; notify via "
            "`set relay.notify_ordinary`; no relay running"
        ],
        metrics=metrics,
    )


# -- soak -----------------------------------------------------------------------------------


async def soak(env: Env, a: argparse.Namespace) -> Result:
    """Steady enqueue and delivery with a short retention: the table must level off."""
    await reset(env)
    prune_interval = max(0.5, a.soak_retention / 2)
    settings = env.settings(retention=str(a.soak_retention))
    # The outbox and the runs (`events` is a view since schema version 7: it has no size). The
    # outbox is partitioned since version 8, and a partitioned table has no storage of its own:
    # its partitions are summed (pg_partition_tree of a plain table is the table itself).
    size_q = env.q(
        "select ((select sum(pg_total_relation_size(relid)) from pg_partition_tree(%s::regclass))"
        " + pg_total_relation_size(%s::regclass))::float8 / 1048576"
    )
    names = (f'"{env.schema}".outbox', f'"{env.schema}".runs')
    sizes: list[tuple[float, float]] = []
    per_tick = max(1, a.soak_rate // 10)
    sent = 0
    async with (
        Relay(settings, prune_interval=prune_interval).running(),
        await psycopg.AsyncConnection.connect(env.url, autocommit=True) as conn,
    ):
        started = time.monotonic()
        next_size = started
        with env.console.status("soak") as status:
            while (now := time.monotonic()) - started < a.soak_seconds:
                run = f"s{sent}"
                events = [Event(f"{run}-{i}", "step", {"i": i}) for i in range(per_tick)]
                await enqueue_many_async(conn, run, events, schema=env.schema)
                sent += per_tick
                if now >= next_size:
                    row = await (await conn.execute(size_q, names)).fetchone()
                    assert row is not None
                    sizes.append((round(now - started, 1), round(row[0], 3)))
                    next_size += 1.0
                    status.update(
                        f"soak: {now - started:.0f}/{a.soak_seconds:g} s, {sent:,} events, "
                        f"outbox {row[0]:.2f} MB"
                    )
                await anyio.sleep(max(0.0, started + sent / a.soak_rate - time.monotonic()))
            row = await (await conn.execute(size_q, names)).fetchone()
            assert row is not None
            sizes.append((round(time.monotonic() - started, 1), round(row[0], 3)))
    # Start after the warm-up: the retention filled, and two rounds of autovacuum (its naptime
    # is 60 s by default; until its first pass, pruned rows' space is not reusable). Retention
    # removes a whole part of the outbox at a time (schema version 8): its size is a saw tooth
    # of one part's turn, holding between `retention` and 1.5 x `retention` of events. So each
    # end is the highest size over one tooth (plus prune's own period), not one sample.
    warm = max(a.soak_retention + 3 * prune_interval, 0.4 * a.soak_seconds)
    tooth = 1.5 * a.soak_retention + prune_interval
    last = sizes[-1][0]
    start = max((mb for t, mb in sizes if warm <= t < warm + tooth), default=sizes[-1][1])
    end = max(mb for t, mb in sizes if t >= last - tooth)
    await reset(env)
    return Result(
        ["key", "mb", "events_sent"],
        [
            {"key": "soak_table_mb_start", "mb": start, "events_sent": sent},
            {"key": "soak_table_mb_end", "mb": end, "events_sent": sent},
            {"key": "soak_table_mb_max", "mb": max(mb for _, mb in sizes), "events_sent": sent},
        ],
        [
            f"{a.soak_rate} events/s for {a.soak_seconds:g} s (runs of {per_tick} events), relay "
            f"in process with retention {a.soak_retention:g} s and prune every ~"
            f"{prune_interval:g} s; size = outbox (its parts) + runs tables with indexes and "
            f"TOAST, sampled every second; start = the highest over {tooth:g} s from {warm:g} s, "
            f"end = the highest over the last {tooth:g} s"
        ],
        data={"sizes_mb": sizes},
        metrics={"soak_table_mb_start": start, "soak_table_mb_end": end},
    )


SCENARIOS = [
    Scenario(
        "latency",
        "commit-to-ingress latency: terminal idle and behind a backlog, ordinary notify on/off",
        latency,
        ARGUMENTS,
        SMOKE,
        (
            "terminal_p50_ms_idle",
            "terminal_p99_ms_idle",
            "terminal_p99_ms_backlog",
            "ordinary_p50_ms_idle",
            "ordinary_p99_ms_idle",
            "ordinary_p50_ms_idle_notify_off",
            "ordinary_p99_ms_idle_notify_off",
        ),
    ),
    Scenario(
        "producer",
        "enqueue transactions/s from 8 connections, ordinary notifications on and off",
        producers,
        keys=("producer_tps_notify_on", "producer_tps_notify_off"),
    ),
    Scenario(
        "soak",
        "outbox size over a sustained run with short retention",
        soak,
        keys=("soak_table_mb_start", "soak_table_mb_end"),
    ),
]
