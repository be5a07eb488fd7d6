"""`relay bench --only enqueue_scaling`: what `enqueue` costs as one transaction grows (issue 28).

Until schema version 7 enqueue serialised a run's writers with a transaction advisory lock per
run, and rewrote the run's `run_seqs` row for every event. Both grew with the transaction: many
events of one run in one transaction cost more per event the more there were (279 µs per event
at 2,000, 579 at 16,000), and one transaction writing events of many runs took one entry of the
server's lock table per run, which ran out ("out of shared memory") at a few thousand runs
with default server settings. The scenario measures, in the bench's database and with the
server as it is set (max_locks_per_transaction untouched):

- **one run, one transaction**: `select count(enqueue(run, 'e' || g, 'step', '{"i":1}'))
  from generate_series(1, n) g` in one transaction, a new run each time, for n = 100 (several
  times, median) and n = 16,000; the statement's time per event, and the ratio of the two
  (target: at most 1.2);
- **many runs, one transaction**: the same statement with one event in each of 100,000
  distinct runs (target: it completes, and every event is there). `enqueue_100k_runs_s` is the
  statement's time, its commit timed apart. Before it the tables enqueue reads a run from are
  ANALYZEd, `runs` and `run_seqs` holding the few runs of the transactions above and two of the
  outbox's three parts empty: the statistics of a small database, on which enqueue's lookups
  of a run were planned as sequential scans until schema functions of issue 52 item 4, so the
  transaction's cost grew with the square of its runs (a full run of the bench read 412 s, the
  scenario alone ~13 s, depending on whether autovacuum had taken such statistics first). The
  tuples its sequential scans of those tables read are reported beside it: 0 when every lookup
  is the point lookup it should be.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import time
from dataclasses import dataclass
from typing import Any

import psycopg

from relay.tools.bench.kit import BenchFailed, Env, Result, Scenario, positive_options, reset

ARGUMENTS = positive_options(
    "enqueue_scaling",
    ("--enqueue-small", int, 100, "events, small transaction (100)"),
    ("--enqueue-large", int, 16_000, "events, large transaction (16,000)"),
    ("--enqueue-small-reps", int, 7, "small transactions per rep (7; --reps large ones)"),
    ("--enqueue-runs", int, 100_000, "distinct runs in one transaction (100,000)"),
)


SMOKE = {
    "enqueue_small": 20,
    "enqueue_large": 400,
    "enqueue_small_reps": 2,
    "enqueue_runs": 2_000,
}

ONE_RUN = (
    "select count({s}.enqueue(%s, %s || g, 'step', '{{\"i\":1}}'::jsonb))"
    " from generate_series(1, %s::int) g"
)
MANY_RUNS = (
    "select count({s}.enqueue(%s || g, %s || g, 'step', '{{\"i\":1}}'::jsonb))"
    " from generate_series(1, %s::int) g"
)
# The tables enqueue reads a run's rows from; `outbox` is partitioned: ANALYZE takes its parts too.
RUN_TABLES = ("runs", "run_seqs", "outbox")
# What this transaction's sequential scans of them read so far (the parts are outbox_p0..p2).
SCANNED = (
    "select coalesce(sum(seq_tup_read), 0) from pg_stat_xact_user_tables"
    " where schemaname = %s and (relname in ('runs', 'run_seqs') or relname like 'outbox\\_p%%')"
)


@dataclass(frozen=True)
class ManyRuns:
    """One transaction of one event in each of many new runs."""

    seconds: float | None  # the statement's, None if it failed
    commit_seconds: float | None
    tuples_scanned: int | None  # by its sequential scans of RUN_TABLES
    committed: int  # the events there afterwards
    error: str | None


async def _one_run(env: Env, conn: psycopg.AsyncConnection[Any], n: int) -> float:
    """µs per event of n events of one new run in one transaction (the statement's time)."""
    run = f"es-{secrets.token_hex(6)}"
    async with conn.transaction():
        started = time.perf_counter()
        cur = await conn.execute(env.q(ONE_RUN), (run, f"{run}-", n))
        elapsed = time.perf_counter() - started
        row = await cur.fetchone()
    if row != (n,):
        raise BenchFailed(f"enqueue_scaling: {row} of {n} events enqueued")
    return elapsed / n * 1e6


async def _scanned(env: Env, conn: psycopg.AsyncConnection[Any]) -> int:
    cur = await conn.execute(SCANNED, (env.schema,))
    row = await cur.fetchone()
    return int(row[0]) if row else 0


async def _many_runs(env: Env, conn: psycopg.AsyncConnection[Any], runs: int) -> ManyRuns:
    """One event into each of `runs` new runs in one transaction, on statistics taken now."""
    for table in RUN_TABLES:
        await conn.execute(env.q(f"analyze {{s}}.{table}"))
    prefix = f"em-{secrets.token_hex(4)}-"
    seconds = commit_seconds = None
    tuples = error = None
    try:
        async with conn.transaction():
            before = await _scanned(env, conn)
            started = time.perf_counter()
            await conn.execute(env.q(MANY_RUNS), (prefix, prefix, runs))
            seconds = time.perf_counter() - started
            tuples = await _scanned(env, conn) - before
            started = time.perf_counter()
        commit_seconds = time.perf_counter() - started
    except psycopg.Error as exc:
        seconds = tuples = None
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    cur = await conn.execute(
        env.q("select count(*) from {s}.outbox where run_id like %s and seq = 1"), (prefix + "%",)
    )
    row = await cur.fetchone()
    return ManyRuns(seconds, commit_seconds, tuples, int(row[0]) if row else 0, error)


async def enqueue_scaling(env: Env, a: argparse.Namespace) -> Result:
    await reset(env)
    small: list[float] = []
    large: list[float] = []
    async with await psycopg.AsyncConnection.connect(env.url, autocommit=True) as conn:
        cur = await conn.execute("show max_locks_per_transaction")
        row = await cur.fetchone()
        max_locks = row[0] if row else "?"
        cur = await conn.execute("show max_connections")
        row = await cur.fetchone()
        max_connections = row[0] if row else "?"
        await _one_run(env, conn, a.enqueue_small)  # warm-up: plans, caches
        with env.console.status("enqueue_scaling: one run per transaction…") as status:
            for rep in range(a.reps):
                # interleaved, so the machine's drift during the run touches both sizes alike
                for _ in range(a.enqueue_small_reps):
                    small.append(await _one_run(env, conn, a.enqueue_small))
                large.append(await _one_run(env, conn, a.enqueue_large))
                status.update(f"enqueue_scaling: one run per transaction, rep {rep + 1}/{a.reps}")
        with env.console.status(f"enqueue_scaling: {a.enqueue_runs:,} runs in one transaction…"):
            many = await _many_runs(env, conn, a.enqueue_runs)
    await reset(env)

    seconds = many.seconds
    small_us = statistics.median(small)
    large_us = statistics.median(large)
    ratio = large_us / small_us
    rows: list[dict[str, Any]] = [
        {
            "transaction": f"{a.enqueue_small:,} events of one run",
            "count": len(small),
            "us_per_event": round(small_us, 1),
            "spread_us": f"{min(small):.1f}–{max(small):.1f}",
        },
        {
            "transaction": f"{a.enqueue_large:,} events of one run",
            "count": len(large),
            "us_per_event": round(large_us, 1),
            "spread_us": f"{min(large):.1f}–{max(large):.1f}",
        },
        {
            "transaction": f"ratio {a.enqueue_large:,} / {a.enqueue_small:,}",
            "us_per_event": round(ratio, 3),
        },
        {
            "transaction": f"{a.enqueue_runs:,} runs, one event each",
            "count": 1,
            "us_per_event": None if seconds is None else round(seconds / a.enqueue_runs * 1e6, 1),
            "seconds": None if seconds is None else round(seconds, 2),
            "events_per_s": None if seconds is None else round(a.enqueue_runs / seconds),
            "committed": many.committed,
            "tuples_scanned": many.tuples_scanned,
        },
    ]
    notes = [
        f"server: max_locks_per_transaction {max_locks}, max_connections {max_connections} "
        "(as set; not raised for this scenario)",
        "one run: the statement's time per event (commit excluded), a new run each; median of "
        f"{len(small)} small and {len(large)} large transactions, interleaved",
        "many runs: the statement's time (its commit apart), after ANALYZE of runs, run_seqs"
        " and outbox (runs and run_seqs holding the one-run transactions' few runs);"
        " tuples_scanned: what its sequential scans of those tables read (0: every lookup of a"
        " run by its key)",
    ]
    if many.commit_seconds is not None:
        notes.append(f"many runs: the commit took {many.commit_seconds:.2f} s")
    if many.error is not None:
        notes.append(f"{a.enqueue_runs:,} runs in one transaction FAILED: {many.error}")
    metrics: dict[str, Any] = {
        "enqueue_us_per_event_100": round(small_us, 2),
        "enqueue_us_per_event_16k": round(large_us, 2),
        "enqueue_16k_ratio": round(ratio, 3),
        "enqueue_100k_runs_done": many.committed,
        "enqueue_100k_runs_missing": a.enqueue_runs - many.committed,
    }
    if seconds is not None:
        metrics["enqueue_100k_runs_s"] = round(seconds, 2)
        metrics["enqueue_100k_runs_eps"] = round(a.enqueue_runs / seconds)
    if many.commit_seconds is not None:
        metrics["enqueue_100k_runs_commit_s"] = round(many.commit_seconds, 2)
    if many.tuples_scanned is not None:
        metrics["enqueue_100k_runs_tuples_scanned"] = many.tuples_scanned
    sizes = f"{a.enqueue_large:,} / {a.enqueue_small:,} events of one run per transaction"
    return Result(
        [
            "transaction",
            "count",
            "us_per_event",
            "spread_us",
            "seconds",
            "events_per_s",
            "committed",
            "tuples_scanned",
        ],
        rows,
        notes,
        data={"small_us": small, "large_us": large, "error": many.error},
        metrics=metrics,
        settings={
            "enqueue_16k_ratio": sizes,
            "enqueue_100k_runs_done": f"{a.enqueue_runs:,} runs, one event each, one transaction",
            "enqueue_100k_runs_s": f"{a.enqueue_runs:,} runs, one event each, one transaction:"
            " the statement (commit apart), after ANALYZE of the tables while small",
        },
    )


SCENARIOS = [
    Scenario(
        "enqueue_scaling",
        "enqueue per event as one transaction grows: events of one run, events of many runs",
        enqueue_scaling,
        ARGUMENTS,
        SMOKE,
        (
            "enqueue_us_per_event_100",
            "enqueue_us_per_event_16k",
            "enqueue_16k_ratio",
            "enqueue_100k_runs_done",
            "enqueue_100k_runs_missing",
            "enqueue_100k_runs_s",
            "enqueue_100k_runs_eps",
            "enqueue_100k_runs_commit_s",
            "enqueue_100k_runs_tuples_scanned",
        ),
    ),
]
