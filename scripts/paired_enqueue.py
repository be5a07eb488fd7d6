"""What `enqueue` costs in one source tree against another, paired and alternating (issue 50).

A machine shared with other work moves by more between two runs than the 5–10% a cost target
allows, so one tree's figure beside another's, taken minutes apart, cannot judge such a target.
This script takes both trees' figures in one sitting, round by round, the order rotated each
round, and reads the ratio *within* each round; the median of those ratios, their quartiles
(how far the machine let the rounds wander) and the median's 95% interval by order statistics
(whether the median lies on one side of a target) are the result.

    git archive e36234b | (mkdir -p /tmp/pe-e36234b && tar -x -C /tmp/pe-e36234b)
    git archive HEAD    | (mkdir -p /tmp/pe-HEAD    && tar -x -C /tmp/pe-HEAD)
    PYTHONPATH=. .venv/bin/python scripts/paired_enqueue.py enqueue /tmp/pe-e36234b /tmp/pe-HEAD \\
        --rounds 30 --json /tmp/enqueue.json
    PYTHONPATH=. .venv/bin/python scripts/paired_enqueue.py bench /tmp/pe-e36234b /tmp/pe-HEAD \\
        --pairs 4 --json /tmp/wal.json -- --only wal

**`enqueue`**: one embedded PostgreSQL (or `--database-url`; the server must be on this machine
for the CPU figures) holds one schema per variant, each installed by its own tree's
`relay.maintenance.migrate.migrate` (run in a subprocess with PYTHONPATH at that tree):

- `before`: the first tree, `enqueue` without a fairness key (the tree may have none), or
  under `--before-key` (to compare two trees that both have keys, key against key);
- `now`: the second tree, without a key;
- `now+key`: the second tree, every run under one key (`p_fairness_key => 'k1'`, `--key`).

Each variant has its own connection (plpgsql keeps its plans per session), warmed by one
untimed round. Every round then runs, per part, each variant in turn, the order rotated by one
variant each round:

- `small`: `--small-reps` transactions of `--small` events of one new run each
  (`select count(enqueue(run, run || g, …)) from generate_series(1, n) g`, as
  `relay bench --only enqueue_scaling` does);
- `large`: one transaction of `--large` events of one new run;
- `runs`: one transaction of one event in each of `--runs` new runs;
- `producers`: `--producers` connections (in 2 processes: one Python loop would cap them
  first), each warmed by one enqueue, then committing `--producer-tx` transactions of one
  event of a new run, autocommit, all started at once; events per second from the start to
  the last commit.

For the statements: wall time per event (the statement alone: its commit is outside) and the
backend's CPU time per event, read from `/proc/<pid>/schedstat` (nanoseconds on CPU) of
`pg_backend_pid()` just before and after the statement; for the producers also their backends'
CPU per event. Every transaction commits, as the bench's does; each variant's schema grows alike.
Ratios per round: `now / before` and `now+key / before`; `large / small` per variant says
whether the cost per event stays flat as the transaction grows.

**`bench`**: `relay bench <args after --> --json F` run `--pairs` times per tree, cwd /tmp and
PYTHONPATH at the tree (so the bench, its `relay run` and `relay sink` subprocesses are that
tree's), the trees alternating and the first of each pair swapped each pair; every numeric
summary metric both trees report is paired into `now / before` ratios.

Both print the load average (`os.getloadavg`) at the start and the end; `--json` keeps every
round's figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

PAYLOAD = '{"i":1}'
INSTALL = (
    "import sys; from relay.maintenance.migrate import migrate; migrate(sys.argv[1], sys.argv[2])"
)


@dataclass(frozen=True)
class Variant:
    name: str
    tree: Path
    schema: str
    key: str | None


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def backend_cpu_ns(pid: int) -> int | None:
    """Nanoseconds the process has run on a CPU, or None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def enqueue_call(schema: str, run: str, event: str, key: str | None) -> sql.Composed:
    """`schema.enqueue(<run>, <event>, 'step', payload[, p_fairness_key => key])`: run and
    event are SQL expressions with placeholders."""
    named = sql.SQL(", p_fairness_key => {}").format(sql.Literal(key)) if key else sql.SQL("")
    return sql.SQL("{}.enqueue({}, {}, 'step', {}::jsonb{})").format(
        sql.Identifier(schema), sql.SQL(run), sql.SQL(event), sql.Literal(PAYLOAD), named
    )


def one_run(v: Variant) -> sql.Composed:
    call = enqueue_call(v.schema, "%(run)s", "%(run)s || g", v.key)
    return sql.SQL("select count({}) from generate_series(1, %(n)s::int) g").format(call)


def many_runs(v: Variant) -> sql.Composed:
    call = enqueue_call(v.schema, "%(run)s || g", "%(run)s || g", v.key)
    return sql.SQL("select count({}) from generate_series(1, %(n)s::int) g").format(call)


class Session:
    """One variant's connection, and its backend's pid for the CPU figure."""

    def __init__(self, url: str, v: Variant) -> None:
        self.v = v
        self.conn = psycopg.connect(url, autocommit=True)
        row = self.conn.execute("select pg_backend_pid()").fetchone()
        assert row is not None
        self.pid = int(row[0])
        self.one_run = one_run(v)
        self.many_runs = many_runs(v)

    def statement(self, query: sql.Composed, run: str, n: int) -> tuple[float, float | None]:
        """(wall s, backend CPU s or None) of one statement of n events, in its transaction."""
        with self.conn.transaction():
            cpu0 = backend_cpu_ns(self.pid)
            t0 = time.perf_counter()
            row = self.conn.execute(query, {"run": run, "n": n}).fetchone()
            wall = time.perf_counter() - t0
            cpu1 = backend_cpu_ns(self.pid)
        if row != (n,):
            raise SystemExit(f"{self.v.name}: {row} of {n} events enqueued")
        cpu = None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) / 1e9
        return wall, cpu


def per_event(samples: list[tuple[float, float | None]], events: int) -> dict[str, float | None]:
    wall = sum(w for w, _ in samples) / events * 1e6
    cpus = [c for _, c in samples]
    cpu = None if any(c is None for c in cpus) else sum(c or 0.0 for c in cpus) / events * 1e6
    return {"wall_us": wall, "cpu_us": cpu}


def tag() -> str:
    return secrets.token_hex(5)


def part_small(s: Session, a: argparse.Namespace) -> dict[str, float | None]:
    samples = [s.statement(s.one_run, f"s{tag()}-", a.small) for _ in range(a.small_reps)]
    return per_event(samples, a.small * a.small_reps)


def part_large(s: Session, a: argparse.Namespace) -> dict[str, float | None]:
    return per_event([s.statement(s.one_run, f"l{tag()}-", a.large)], a.large)


def part_runs(s: Session, a: argparse.Namespace) -> dict[str, float | None]:
    return per_event([s.statement(s.many_runs, f"m{tag()}-", a.runs)], a.runs)


# -- producers: 2 processes of threads, one connection each ----------------------------------


def producer_main(argv: Sequence[str]) -> None:
    """`_producer URL SCHEMA KEY THREADS TX TAG`: THREADS connections, each committing TX
    one-event transactions of new runs once a line `go` arrives; prints `ready`, then one JSON
    line: events and the backends' CPU seconds."""
    url, schema, key, threads, tx, run_tag = argv
    query = sql.SQL("select {}").format(
        enqueue_call(schema, "%(run)s", "%(run)s || '-1'", key or None)
    )
    conns = [psycopg.connect(url, autocommit=True) for _ in range(int(threads))]
    pids = []
    for conn in conns:
        row = conn.execute("select pg_backend_pid()").fetchone()
        assert row is not None
        pids.append(int(row[0]))
    for i, conn in enumerate(conns):  # a new session compiles enqueue and plans its statements
        conn.execute(query, {"run": f"{run_tag}-{i}-warm"})
    print("ready", flush=True)
    sys.stdin.readline()
    cpu0 = [backend_cpu_ns(p) for p in pids]

    failed: list[BaseException] = []

    def work(i: int, conn: psycopg.Connection[Any]) -> None:
        try:
            for n in range(int(tx)):
                conn.execute(query, {"run": f"{run_tag}-{i}-{n}"})
        except BaseException as exc:
            failed.append(exc)
            raise

    workers = [threading.Thread(target=work, args=(i, c)) for i, c in enumerate(conns)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    cpu1 = [backend_cpu_ns(p) for p in pids]
    if failed:
        raise SystemExit(f"a producer's transaction failed: {failed[0]}")
    known = all(c is not None for c in cpu0 + cpu1)
    cpu = sum((b or 0) - (a or 0) for a, b in zip(cpu0, cpu1, strict=True)) / 1e9
    print(json.dumps({"events": int(threads) * int(tx), "cpu_s": cpu if known else None}))
    for conn in conns:
        conn.close()


def part_producers(url: str, v: Variant, a: argparse.Namespace) -> dict[str, float | None]:
    counts = [a.producers // 2 + a.producers % 2, a.producers // 2]
    procs = []
    try:
        for p, threads in enumerate(c for c in counts if c):
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "_producer",
                        url,
                        v.schema,
                        v.key or "",
                        str(threads),
                        str(a.producer_tx),
                        f"p{tag()}{p}",
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for proc in procs:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise SystemExit("a producer did not start")
        t0 = time.perf_counter()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = []
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line.strip():
                raise SystemExit("a producer failed (its error is above)")
            results.append(json.loads(line))
        wall = time.perf_counter() - t0
        for proc in procs:
            if proc.wait(timeout=60) != 0:
                raise SystemExit("a producer failed")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    events = sum(int(r["events"]) for r in results)
    cpus = [r["cpu_s"] for r in results]
    cpu = None if any(c is None for c in cpus) else sum(cpus) / events * 1e6
    return {"events_per_s": events / wall, "cpu_us": cpu}


# -- the sitting --------------------------------------------------------------------------------


@contextmanager
def database(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    from relay.tools.embedded import EmbeddedPostgres

    with tempfile.TemporaryDirectory(prefix="paired-enqueue-") as tmp:
        os.chmod(tmp, 0o755)
        server = EmbeddedPostgres(Path(tmp) / "pg", durable=True)
        started = server.start()
        try:
            yield started
        finally:
            server.stop()


def install(url: str, v: Variant) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(v.schema)))
    env = {**os.environ, "PYTHONPATH": str(v.tree)}
    subprocess.run([sys.executable, "-c", INSTALL, url, v.schema], check=True, cwd="/tmp", env=env)
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL("select max(version) from {}.schema_migrations").format(
                sql.Identifier(v.schema)
            )
        ).fetchone()
    print(f"{v.name}: {v.tree} -> schema {v.schema}, version {row[0] if row else '?'}")


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median: the order statistics k and n+1-k with
    P(k <= Binomial(n, 1/2) < n+1-k) >= level (nan when n is too small for the level)."""
    ordered, n = sorted(values), len(values)
    below, k = 0.0, 0
    while k < n // 2:  # below = P(Binomial(n, 1/2) <= k)
        below += math.comb(n, k) / 2**n
        if 2 * below > 1 - level:
            break
        k += 1
    if k == 0:
        return float("nan"), float("nan")
    return ordered[k - 1], ordered[n - k]


def quartiles(values: list[float]) -> dict[str, float]:
    """q1, median, q3, and the median's 95% interval (ci_lo, ci_hi)."""
    if len(values) < 2:
        only = values[0] if values else float("nan")
        return {"q1": only, "median": only, "q3": only, "ci_lo": only, "ci_hi": only}
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    lo, hi = median_interval(values)
    return {"q1": q1, "median": median, "q3": q3, "ci_lo": lo, "ci_hi": hi}


def ratios_of(
    rounds: list[dict[str, dict[str, dict[str, float | None]]]], base: str, other: str
) -> dict[str, dict[str, Any]]:
    """Per figure (`part.measure`): other / base in each round, and their quartiles."""
    out: dict[str, dict[str, Any]] = {}
    for part, measures in rounds[0][base].items():
        for measure in measures:
            values = []
            for r in rounds:
                b, o = r[base][part][measure], r[other][part][measure]
                if b is not None and o is not None and b > 0:
                    values.append(o / b)
            if values:
                out[f"{part}.{measure}"] = {"n": len(values), **quartiles(values)}
    return out


def flatness(rounds: list[dict[str, dict[str, dict[str, float | None]]]], v: str) -> dict[str, Any]:
    """large / small wall and CPU per event, per round, for one variant."""
    out: dict[str, Any] = {}
    for measure in ("wall_us", "cpu_us"):
        values = []
        for r in rounds:
            big, small = r[v]["large"][measure], r[v]["small"][measure]
            if big is not None and small:
                values.append(big / small)
        if values:
            out[measure] = {"n": len(values), **quartiles(values)}
    return out


PARTS = ("small", "large", "runs", "producers")
Figures = dict[str, dict[str, dict[str, float | None]]]  # variant -> part -> measure -> value


def one_round(
    url: str, sessions: dict[str, Session], order: list[Variant], a: argparse.Namespace
) -> Figures:
    """Every part, each variant in `order` in turn."""
    figures: Figures = {v.name: {} for v in order}
    for part in PARTS:
        for v in order:
            s = sessions[v.name]
            if part == "small":
                figures[v.name][part] = part_small(s, a)
            elif part == "large":
                figures[v.name][part] = part_large(s, a)
            elif part == "runs":
                figures[v.name][part] = part_runs(s, a)
            else:
                figures[v.name][part] = part_producers(url, v, a)
    return figures


def headline(f: dict[str, dict[str, float | None]]) -> str:
    """One variant's round: µs per event of the statements, events/s of the producers."""
    shown = [f"{p}={f[p]['wall_us'] or 0:.1f}" for p in PARTS[:3]]
    return " ".join([*shown, f"producers={f['producers']['events_per_s'] or 0:.0f}/s"])


def sitting(
    url: str, variants: list[Variant], a: argparse.Namespace
) -> tuple[list[Figures], list[str]]:
    """The schemas, a warm-up round, then `a.rounds` rounds, the order rotated each round."""
    for v in variants:
        install(url, v)
    sessions = {v.name: Session(url, v) for v in variants}
    rounds: list[Figures] = []
    loads: list[str] = []
    try:
        one_round(url, sessions, variants, a)  # warm-up: plans, caches
        for rnd in range(a.rounds):
            shift = rnd % len(variants)
            order = variants[shift:] + variants[:shift]
            rounds.append(one_round(url, sessions, order, a))
            loads.append(load())
            print(
                f"round {rnd + 1}/{a.rounds} (order {', '.join(v.name for v in order)};"
                f" load {loads[-1]}): "
                + "; ".join(f"{name} {headline(f)}" for name, f in rounds[-1].items()),
                flush=True,
            )
    finally:
        for s in sessions.values():
            s.conn.close()
    return rounds, loads


def medians(rounds: list[Figures], v: str) -> dict[str, float]:
    out = {}
    for p in PARTS:
        for m in rounds[0][v][p]:
            values = [x for r in rounds if (x := r[v][p][m]) is not None]
            out[f"{p}.{m}"] = statistics.median(values) if values else float("nan")
    return out


def show(q: dict[str, float]) -> str:
    return (
        f"{q['median']:.3f} [{q['q1']:.3f}, {q['q3']:.3f}]"
        f"  median's 95%: {q['ci_lo']:.3f}–{q['ci_hi']:.3f}"
    )


def run_enqueue(a: argparse.Namespace) -> None:
    variants = [
        Variant("before", Path(a.before).resolve(), "pe_before", a.before_key),
        Variant("now", Path(a.now).resolve(), "pe_now", None),
        Variant("now+key", Path(a.now).resolve(), "pe_now_key", a.key),
    ]
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_start = load()
    print(f"start {started}, load average {load_start}")
    with database(a.database_url) as url:
        rounds, loads = sitting(url, variants, a)
    ended = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_end = load()
    ratios = {
        "now / before": ratios_of(rounds, "before", "now"),
        "now+key / before": ratios_of(rounds, "before", "now+key"),
    }
    flat = {v.name: flatness(rounds, v.name) for v in variants}
    middle = {v.name: medians(rounds, v.name) for v in variants}
    print(f"end {ended}, load average {load_end}")
    for label, table in ratios.items():
        print(f"\n{label}: median [q1, q3] of {a.rounds} rounds' ratios")
        for figure, q in table.items():
            print(f"  {figure:24} {show(q)}")
    print(f"\nlarge ({a.large}) / small ({a.small}) per event, per variant")
    for name, by_measure in flat.items():
        for measure, q in by_measure.items():
            print(f"  {name:8} {measure:8} {show(q)}")
    print("\nmedians per variant")
    for name, values in middle.items():
        print(f"  {name:8} " + ", ".join(f"{k} {v:.1f}" for k, v in values.items()))
    if a.json:
        settings = ("rounds", "small", "small_reps", "large", "runs", "producers", "producer_tx")
        result = {
            "started": started,
            "ended": ended,
            "load_start": load_start,
            "load_end": load_end,
            "load_per_round": loads,
            "trees": {v.name: str(v.tree) for v in variants},
            "settings": {k: getattr(a, k) for k in settings},
            "ratios": ratios,
            "large / small": flat,
            "medians": middle,
            "rounds": rounds,
        }
        Path(a.json).write_text(json.dumps(result, indent=1))
        print(f"written to {a.json}")


# -- relay bench, paired ------------------------------------------------------------------------


def flatten(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in metrics.items():
        name = f"{prefix}[{k}]" if prefix else k
        if isinstance(v, dict):
            out.update(flatten(v, name))
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[name] = float(v)
    return out


def run_bench(a: argparse.Namespace) -> None:
    trees = {"before": Path(a.before).resolve(), "now": Path(a.now).resolve()}
    relay = Path(sys.executable).parent / "relay"
    args = list(a.bench_args)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_start = load()
    print(f"start {started}, load average {load_start}; relay bench {' '.join(args)}")
    pairs: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="paired-bench-") as tmp:
        for i in range(a.pairs):
            order = ["before", "now"] if i % 2 == 0 else ["now", "before"]
            pair: dict[str, dict[str, float]] = {}
            for name in order:
                out = Path(tmp) / f"{name}-{i}.json"
                env = {**os.environ, "PYTHONPATH": str(trees[name])}
                done = subprocess.run(
                    [str(relay), "bench", *args, "--json", str(out)],
                    cwd="/tmp",
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                if done.returncode != 0 or not out.exists():
                    raise SystemExit(f"{name}: relay bench failed:\n{done.stderr[-3000:]}")
                pair[name] = flatten(json.loads(out.read_text())["metrics"])
            pairs.append(pair)
            print(f"pair {i + 1}/{a.pairs} (load {load()}): {json.dumps(pair)}", flush=True)
    common = sorted(set(pairs[0]["before"]) & set(pairs[0]["now"]))
    ratios = {}
    for m in common:
        values = [p["now"][m] / p["before"][m] for p in pairs if p["before"].get(m)]
        if values:
            ratios[m] = {"n": len(values), "values": values, **quartiles(values)}
    ended = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_end = load()
    print(f"end {ended}, load average {load_end}")
    print(f"now / before: median [q1, q3] of {a.pairs} pairs")
    for m, q in ratios.items():
        print(
            f"  {m:40} {q['median']:.3f} [{q['q1']:.3f}, {q['q3']:.3f}]"
            f"  median's 95%: {q['ci_lo']:.3f}–{q['ci_hi']:.3f}"
        )
    if a.json:
        result = {
            "started": started,
            "ended": ended,
            "load_start": load_start,
            "load_end": load_end,
            "bench_args": args,
            "trees": {k: str(v) for k, v in trees.items()},
            "pairs": pairs,
            "ratios": ratios,
        }
        Path(a.json).write_text(json.dumps(result, indent=1))
        print(f"written to {a.json}")


def main(argv: Sequence[str]) -> None:
    if argv and argv[0] == "_producer":
        producer_main(argv[1:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("enqueue", help="enqueue's statements and 8 producers, paired by round")
    e.add_argument("before", help="source tree of the base (ratios are to it)")
    e.add_argument("now", help="source tree measured against it")
    e.add_argument("--rounds", type=int, default=30)
    e.add_argument("--small", type=int, default=100, help="events of one run (100)")
    e.add_argument("--small-reps", type=int, default=10, help="small transactions a round (10)")
    e.add_argument("--large", type=int, default=2_000, help="events of one run (2,000)")
    e.add_argument("--runs", type=int, default=1_000, help="new runs of one event (1,000)")
    e.add_argument("--producers", type=int, default=8, help="producer connections (8)")
    e.add_argument("--producer-tx", type=int, default=150, help="transactions each (150)")
    e.add_argument("--key", default="k1", help="the fairness key of `now+key` (k1)")
    e.add_argument("--before-key", help="a fairness key for `before` too (default: none)")
    e.add_argument("--database-url", help="a PostgreSQL on this machine (default: embedded)")
    e.add_argument("--json", help="write every round's figures here")
    b = sub.add_parser(
        "bench", help="`relay bench` in each tree, alternating, paired; its arguments after --"
    )
    b.add_argument("before")
    b.add_argument("now")
    b.add_argument("--pairs", type=int, default=3)
    b.add_argument("--json")
    argv = list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    a = p.parse_args(argv[:cut])
    a.bench_args = argv[cut + 1 :]
    if a.command == "bench" and not a.bench_args:
        p.error("bench: relay bench's arguments after --")
    if a.command == "enqueue":
        run_enqueue(a)
    else:
        run_bench(a)


if __name__ == "__main__":
    main(sys.argv[1:])
