"""The fair-shares scenarios of `relay bench` (issue 50, item 5): tenants are uneven.

The ingress is the capacity scenario's (`capacity_ingress.CapacitySink`: `--fairness-workers`
POSTs at a time for `--fairness-service-ms` each, the rest queued first come first served), two
`relay run` replicas at their defaults (`--fairness-replicas`).

- `quiet`: a noisy key's backlog (`--fairness-noisy-runs` runs of `--fairness-per-run` events)
  committed up front, and a quiet key's run of `--fairness-per-run` events committed through
  `enqueue_many_async(..., fairness_key="quiet")` every `--fairness-quiet-every` s until the
  backlog has drained. Figures: the quiet runs' delay from commit to the end of their POST's
  service, p99 and its multiple of the service time (target ≤ 10×); the ingress's goodput over
  the window (target ≥ 0.85).
- `weights`: keys with weights 5:3:2 (`set_fairness_weight`), each with a backlog of
  `--fairness-weighted-runs` runs committed together; the share of each key among the first
  `--fairness-first-posts` POSTs to reach the ingress (target: each within 5 points of its
  weight's share).
- `keys`: the claim's own cost over many keys, at the SQL level (no relay, no ingress):
  `--fairness-keys` keys with `--fairness-key-runs` runs of `--fairness-per-key-run` events each
  (every other run ending in its terminal) written straight into the tables, then
  `--fairness-claims` claims of 64 runs per lane, each in a transaction rolled back (so each
  sees the same data), timed at the client, and as many again under EXPLAIN (ANALYZE, BUFFERS):
  the server's execution time, the shared buffers of the claim and of every statement under
  it, and the rows of each relation it read (the server's counters of the transaction, which
  count the nested statements that a top-level EXPLAIN shows as one function scan). In three
  states: every key's runs due; those of all keys but one in ten leased elsewhere (keys with no
  due work); all but one in a hundred. Target: p99 ≤ 20 ms (issue 50, at 1M events over 1,000
  keys: `--fairness-cases keys --fairness-key-runs 200`, about a minute to build).

`--fairness-cases` runs some of the three (all by default).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import anyio
import orjson
import psycopg

from relay.producer import Event, enqueue_many_async
from relay.tools.bench.capacity_ingress import CapacitySink, figures
from relay.tools.bench.kit import (
    BenchFailed,
    Env,
    Result,
    Scenario,
    backlog,
    positive,
    relay_processes,
    reset,
)
from relay.tools.demo import percentile
from relay.tools.sink import serve_sink

WEIGHTS = {"heavy": 5, "middle": 3, "light": 2}
CASES = ("quiet", "weights", "keys")


def _cases(text: str) -> tuple[str, ...]:
    named = tuple(c.strip() for c in text.split(",") if c.strip())
    if not named or set(named) - set(CASES):
        raise argparse.ArgumentTypeError(f"choose from {', '.join(CASES)}, got {text!r}")
    return named


def _arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fairness (issue 50)")
    g.add_argument("--fairness-workers", type=positive(int), default=4, help="at once (4)")
    g.add_argument("--fairness-service-ms", type=positive(float), default=40.0, help="(40)")
    g.add_argument("--fairness-replicas", type=positive(int), default=2, help="relay run (2)")
    g.add_argument("--fairness-noisy-runs", type=positive(int), default=1_500, help="(1,500)")
    g.add_argument("--fairness-per-run", type=positive(int), default=2, help="events (2)")
    g.add_argument("--fairness-quiet-every", type=positive(float), default=0.5, help="(0.5 s)")
    g.add_argument("--fairness-weighted-runs", type=positive(int), default=400, help="per key")
    g.add_argument("--fairness-first-posts", type=positive(int), default=600, help="(600)")
    g.add_argument("--fairness-keys", type=positive(int), default=1_000, help="(1,000)")
    g.add_argument("--fairness-key-runs", type=positive(int), default=20, help="per key (20)")
    g.add_argument("--fairness-per-key-run", type=positive(int), default=5, help="events (5)")
    g.add_argument("--fairness-claims", type=positive(int), default=100, help="per lane (100)")
    g.add_argument(
        "--fairness-cases",
        type=_cases,
        default=CASES,
        help=f"of {', '.join(CASES)} (all); the claim at 1M events over 1,000 keys alone: "
        "--fairness-cases keys --fairness-key-runs 200",
    )


SMOKE = {
    "fairness_workers": 2,
    "fairness_service_ms": 10.0,
    "fairness_noisy_runs": 60,
    "fairness_quiet_every": 0.1,
    "fairness_weighted_runs": 40,
    "fairness_first_posts": 60,
    "fairness_keys": 50,
    "fairness_key_runs": 4,
    "fairness_claims": 10,
}


async def _until(sink: CapacitySink, want: int, what: str) -> None:
    """Wait until `want` events reached the ingress, answered 2xx."""
    deadline = time.monotonic() + max(120.0, want * 0.05)
    while len(sink.state.deliveries) < want:
        if time.monotonic() > deadline:
            raise BenchFailed(f"fairness {what}: {len(sink.state.deliveries)}/{want} delivered")
        await anyio.sleep(0.01)


async def _quiet(env: Env, a: argparse.Namespace) -> dict[str, Any]:
    await reset(env)
    sink = CapacitySink(a.fairness_workers, a.fairness_service_ms / 1000)
    committed: dict[str, float] = {}  # quiet run -> its commit (monotonic)
    noisy = a.fairness_noisy_runs * a.fairness_per_run
    async with (
        serve_sink(sink) as base,
        relay_processes(env, a.fairness_replicas, base),
        await psycopg.AsyncConnection.connect(env.url, autocommit=True) as conn,
    ):
        start = await backlog(env, a.fairness_noisy_runs, a.fairness_per_run, "fn", key="noisy")
        k = 0
        while sum(1 for e in sink.state.deliveries if e.startswith("fn")) < noisy:
            run = f"fq{k}"
            events = [Event(f"{run}-{i}", "step", {"i": i}) for i in range(a.fairness_per_run)]
            await enqueue_many_async(conn, run, events, schema=env.schema, fairness_key="quiet")
            committed[run] = time.monotonic()
            k += 1
            await anyio.sleep(a.fairness_quiet_every)
        drained = max(p.end for p in sink.posts)
        await _until(sink, noisy + k * a.fairness_per_run, "quiet")
    ends: dict[str, float] = {}
    for post in sink.posts:
        if post.run_id in committed and 200 <= post.status < 300:
            ends[post.run_id] = max(ends.get(post.run_id, 0.0), post.end)
    delays = [ends[r] - committed[r] for r in committed if r in ends]
    service = a.fairness_service_ms / 1000
    f = figures(sink.posts, sink.pool.changes, start, drained, {})
    p99 = percentile(delays, 99)
    if p99 is None:
        raise BenchFailed("fairness quiet: no quiet run reached the ingress")
    return {
        "fairness_quiet_runs": len(delays),
        "fairness_quiet_p99_ms": round(p99 * 1000, 1),
        "fairness_quiet_ratio": round(p99 / service, 2),
        "fairness_quiet_goodput": round(f.goodput, 3),
    }


async def _weights(env: Env, a: argparse.Namespace) -> dict[str, Any]:
    await reset(env)
    async with await psycopg.AsyncConnection.connect(env.url, autocommit=True) as conn:
        for key, weight in WEIGHTS.items():
            await conn.execute(env.q("select {s}.set_fairness_weight(%s, %s)"), (key, weight))
    sink = CapacitySink(a.fairness_workers, a.fairness_service_ms / 1000)
    runs = a.fairness_weighted_runs
    async with serve_sink(sink) as base:
        # One transaction each, before the relays start: every key's backlog is there at once.
        for key in WEIGHTS:
            await backlog(env, runs, a.fairness_per_run, f"fw{key}-", key=key, notify=False)
        async with relay_processes(env, a.fairness_replicas, base):
            await _until(sink, len(WEIGHTS) * runs * a.fairness_per_run, "weights")
    first = sorted((p for p in sink.posts if 200 <= p.status < 300), key=lambda p: p.arrival)
    first = first[: a.fairness_first_posts]
    total = sum(WEIGHTS.values())
    out: dict[str, Any] = {}
    worst = 0.0
    for key, weight in WEIGHTS.items():
        share = sum(1 for p in first if p.run_id.startswith(f"fw{key}-")) / max(1, len(first))
        out[f"fairness_share_{key}"] = round(share, 3)
        worst = max(worst, abs(share - weight / total))
    out["fairness_share_worst_points"] = round(worst * 100, 1)
    return out


async def _claims(
    conn: psycopg.AsyncConnection[Any], env: Env, lane: str, n: int
) -> tuple[float, float]:
    """p50 and p99 (ms) of `n` claims of 64 runs in `lane`, each rolled back."""
    took = []
    for _ in range(n):
        async with conn.transaction(force_rollback=True):
            t0 = time.perf_counter()
            await conn.execute(
                env.q("select count(*) from {s}.claim('bench-keys', 64, 10, '1 hour', %s)"),
                (lane,),
            )
            took.append((time.perf_counter() - t0) * 1000)
    return percentile(took, 50) or 0.0, percentile(took, 99) or 0.0


# What each relation of the schema was read for by the statements since the last call, from the
# server's counters of this transaction (pg_stat_get_xact_*): an index's scans are its descents,
# its tuples the entries it returned (visited, whether or not a filter then dropped them), its
# fetched the table rows it led to; a table's tuples are the rows its sequential scans read. No
# extension needed (auto_explain is not in every build: not in the embedded PostgreSQL), and the
# statements nested in the claim's functions count too, which a top-level EXPLAIN shows only as
# one function scan.
READS = """
select c.relname, coalesce(t.relname, c.relname), pg_stat_get_xact_numscans(c.oid),
       pg_stat_get_xact_tuples_returned(c.oid), pg_stat_get_xact_tuples_fetched(c.oid)
from pg_class c join pg_namespace n on n.oid = c.relnamespace
left join pg_index i on i.indexrelid = c.oid left join pg_class t on t.oid = i.indrelid
where n.nspname = %s and c.relkind in ('r', 'i')
"""
COUNTS = ("scans", "tuples", "fetched")


async def _reads(conn: psycopg.AsyncConnection[Any], env: Env) -> dict[str, tuple[Any, ...]]:
    cur = await conn.execute(READS, (env.schema,))
    return {name: tuple(rest) for name, *rest in await cur.fetchall()}


@dataclass
class Explained:
    """A lane's claim as the server ran it: EXPLAIN (ANALYZE, BUFFERS) of the whole claim, `n`
    times (each rolled back), and what the last one read, by relation."""

    server_p50_ms: float
    server_p99_ms: float
    buffers: int  # shared buffers hit or read by the claim and every statement under it
    reads: dict[str, dict[str, Any]]  # relation -> its table, and its non-zero COUNTS

    def rows_of(self, table: str) -> int:
        """Rows of `table` read: by sequential scans, and fetched through any of its indexes
        (or a bitmap scan)."""
        return sum(
            r.get("fetched", 0) + (r.get("tuples", 0) if name == table else 0)
            for name, r in self.reads.items()
            if r["table"] == table
        )


async def _explained(conn: psycopg.AsyncConnection[Any], env: Env, lane: str, n: int) -> Explained:
    took: list[float] = []
    buffers: list[int] = []
    reads: dict[str, dict[str, Any]] = {}
    for _ in range(n):
        async with conn.transaction(force_rollback=True):
            before = await _reads(conn, env)
            cur = await conn.execute(
                env.q(
                    "explain (analyze, buffers, format json)"
                    " select count(*) from {s}.claim('bench-keys', 64, 10, '1 hour', %s)"
                ),
                (lane,),
            )
            row = await cur.fetchone()
            after = await _reads(conn, env)
        assert row is not None
        [plan] = row[0] if isinstance(row[0], list) else orjson.loads(row[0])
        took.append(plan["Execution Time"])
        top = plan["Plan"]
        buffers.append(top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0))
        reads = {}
        for name, (table, *counts) in after.items():
            was = before.get(name, (table, *(0 for _ in counts)))[1:]
            delta = {k: v - w for k, v, w in zip(COUNTS, counts, was, strict=True) if v != w}
            if delta:
                reads[name] = {"table": table, **delta}
    return Explained(
        round(percentile(took, 50) or 0.0, 2),
        round(percentile(took, 99) or 0.0, 2),
        sorted(buffers)[len(buffers) // 2],
        reads,
    )


# The key states measured: JSON prefix, label, and which keys' runs are leased elsewhere (keys
# with no due work), by the key's number k.
STATES = (
    ("", "every key due", None),
    ("idle_", "9 keys in 10 with no due work", 10),
    ("sparse_", "99 keys in 100 with no due work", 100),
)


async def _key_data(conn: psycopg.AsyncConnection[Any], env: Env, a: argparse.Namespace) -> None:
    """`--fairness-keys` keys k<k> with `--fairness-key-runs` runs fk<k>-<r> of
    `--fairness-per-key-run` events each, every other run ending in its terminal: the rows
    enqueue writes (as kit.backlog), in one transaction."""
    runs_of = "from generate_series(1, %(k)s) k, generate_series(1, %(r)s) r"
    args = {"k": a.fairness_keys, "r": a.fairness_key_runs, "e": a.fairness_per_key_run}
    async with conn.transaction():
        await conn.execute(
            env.q(
                "insert into {s}.run_seqs (run_id, last_seq)"
                " select 'fk' || k || '-' || r, %(e)s " + runs_of
            ),
            args,
        )
        await conn.execute(
            env.q(
                "insert into {s}.runs (run_id, next_attempt_at, fairness_key)"
                " select 'fk' || k || '-' || r, clock_timestamp(), 'k' || k " + runs_of
            ),
            args,
        )
        await conn.execute(
            env.q(
                "insert into {s}.outbox (run_id, seq, event_id, event_type, payload, terminal)"
                " select 'fk' || k || '-' || r, i, 'fk' || k || '-' || r || '-' || i, 'step',"
                " '{{}}', i = %(e)s and r %% 2 = 0 " + runs_of + ", generate_series(1, %(e)s) i"
            ),
            args,
        )
        await conn.execute(
            env.q(
                "insert into {s}.pending_terminals (run_id, seq, created_at, fairness_key)"
                " select o.run_id, o.seq, o.created_at, r.fairness_key"
                " from {s}.outbox o join {s}.runs r using (run_id) where o.terminal"
            )
        )
        await conn.execute(
            env.q(
                "insert into {s}.fairness_keys (key) select 'k' || k"
                " from generate_series(1, %(k)s) k on conflict do nothing"
            ),
            args,
        )
    await conn.execute(
        env.q("analyze {s}.outbox, {s}.runs, {s}.pending_terminals, {s}.fairness_keys")
    )


async def _keys(env: Env, a: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The claim over many keys: its metrics, and each state's reads by relation (the data)."""
    await reset(env)
    keys, runs, per = a.fairness_keys, a.fairness_key_runs, a.fairness_per_key_run
    out: dict[str, Any] = {"fairness_keys_events": keys * runs * per}
    data: dict[str, Any] = {}
    async with await psycopg.AsyncConnection.connect(env.url, autocommit=True) as conn:
        built = time.monotonic()
        await _key_data(conn, env, a)
        data["build_s"] = round(time.monotonic() - built, 1)
        for state, _, every in STATES:
            if every is not None:
                await conn.execute(
                    env.q(
                        "update {s}.runs set lease_owner = 'elsewhere',"
                        " lease_expires_at = now() + interval '1 hour',"
                        " next_attempt_at = now() + interval '1 hour'"
                        " where mod(substr(fairness_key, 2)::int, %s) <> 0"
                        " and lease_owner is null"
                    ),
                    (every,),
                )
                await conn.execute(env.q("analyze {s}.runs"))
            for lane in ("ordinary", "critical"):
                p50, p99 = await _claims(conn, env, lane, a.fairness_claims)
                x = await _explained(conn, env, lane, a.fairness_claims)
                at = f"fairness_keys_{state}{lane}"
                out[f"{at}_p50_ms"] = round(p50, 1)
                out[f"{at}_p99_ms"] = round(p99, 1)
                out[f"{at}_server_p50_ms"] = x.server_p50_ms
                out[f"{at}_server_p99_ms"] = x.server_p99_ms
                out[f"{at}_buffers"] = x.buffers
                out[f"{at}_keys_read"] = x.rows_of("fairness_keys")
                out[f"{at}_runs_read"] = x.rows_of("runs")
                data[f"{state}{lane}"] = x.reads
    return out, data


def _claim_rows(a: argparse.Namespace, many: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for state, label, _ in STATES:
        for lane in ("ordinary", "critical"):
            at = f"fairness_keys_{state}{lane}"
            rows.append(
                {
                    "case": f"{lane} claim of 64 over {a.fairness_keys:,} keys, {label}",
                    "figure": f"p50 {many[f'{at}_p50_ms']} / p99 {many[f'{at}_p99_ms']} ms; "
                    f"server p50 {many[f'{at}_server_p50_ms']} / p99 "
                    f"{many[f'{at}_server_p99_ms']} ms, {many[f'{at}_buffers']:,} buffers, "
                    f"{many[f'{at}_keys_read']:,} key rows and {many[f'{at}_runs_read']:,} "
                    "runs read",
                }
            )
    return rows


async def fairness(env: Env, a: argparse.Namespace) -> Result:
    quiet = await _quiet(env, a) if "quiet" in a.fairness_cases else {}
    weights = await _weights(env, a) if "weights" in a.fairness_cases else {}
    many, reads = await _keys(env, a) if "keys" in a.fairness_cases else ({}, {})
    service = a.fairness_service_ms
    rows = []
    notes = []
    if quiet or weights:
        notes.append(
            f"ingress: {a.fairness_workers} POSTs at a time, {service:g} ms each, the rest queued "
            f"first come first served; {a.fairness_replicas} `relay run` replicas at their "
            f"defaults; runs of {a.fairness_per_run} events"
        )
    if quiet:
        rows.append(
            {
                "case": "quiet key beside a noisy backlog",
                "figure": f"quiet runs p99 {quiet['fairness_quiet_p99_ms']:,} ms "
                f"({quiet['fairness_quiet_ratio']}× service) of {quiet['fairness_quiet_runs']}; "
                f"goodput {quiet['fairness_quiet_goodput']}",
            }
        )
        notes.append(
            f"quiet: a noisy key's {a.fairness_noisy_runs:,} runs committed up front, a quiet "
            f"key's run every {a.fairness_quiet_every:g} s until they drained; delay: commit -> "
            "the end of its POST's service"
        )
    if weights:
        rows.append(
            {
                "case": "weights 5:3:2",
                "figure": ", ".join(f"{k} {weights[f'fairness_share_{k}']:.1%}" for k in WEIGHTS)
                + f" of the first {a.fairness_first_posts} POSTs (worst "
                f"{weights['fairness_share_worst_points']} points off)",
            }
        )
        notes.append(
            f"weights: {a.fairness_weighted_runs:,} runs per key, committed before the relays "
            "start; shares of the first POSTs by their arrival at the ingress"
        )
    if many:
        rows += _claim_rows(a, many)
        notes.append(
            f"keys: {many['fairness_keys_events']:,} events in {a.fairness_key_runs:,} runs of "
            f"{a.fairness_per_key_run} per key (built in {reads['build_s']} s); "
            f"{a.fairness_claims} claims per lane, each rolled back, timed at the client (target "
            f"p99 ≤ 20 ms at 1M events over 1,000 keys), then {a.fairness_claims} more under "
            "EXPLAIN (ANALYZE, BUFFERS): the server's execution time, the shared buffers of the "
            "claim and every statement under it (median), and the rows of fairness_keys and runs "
            "read (the server's counters of the transaction; by relation in the JSON's samples)"
        )
    return Result(
        ["case", "figure"],
        rows,
        notes,
        data={"keys": reads} if reads else {},
        metrics=quiet | weights | many,
    )


KEYS = (
    "fairness_quiet_runs",
    "fairness_quiet_p99_ms",
    "fairness_quiet_ratio",
    "fairness_quiet_goodput",
    *(f"fairness_share_{k}" for k in WEIGHTS),
    "fairness_share_worst_points",
    "fairness_keys_events",
    *(
        f"fairness_keys_{state}{lane}_{figure}"
        for state, _, _ in STATES
        for lane in ("ordinary", "critical")
        for figure in (
            "p50_ms",
            "p99_ms",
            "server_p50_ms",
            "server_p99_ms",
            "buffers",
            "keys_read",
            "runs_read",
        )
    ),
)

SCENARIOS = [
    Scenario(
        "fairness",
        "uneven tenants: a quiet key's runs beside a noisy key's backlog, and three keys "
        "weighted 5:3:2 sharing an ingress that serves 4 POSTs at a time (issue 50)",
        fairness,
        _arguments,
        SMOKE,
        KEYS,
    ),
]
