"""The capacity-limited ingress scenario of `relay bench` (issue 42, item 6).

The ingress (`capacity_ingress.CapacitySink`, in the bench's process) serves
`--capacity-workers` POSTs at a time for `--capacity-service-ms` each and queues the rest first
come first served, as a runtime behind a small worker pool does. Two `relay run` replicas at
their defaults deliver a backlog committed up front (`--capacity-events` over `--capacity-runs`)
while a terminal event, its run otherwise empty, is committed every `--capacity-terminal-every`
seconds until the backlog has drained.

Four variants:
- `steady`: the capacity fixed throughout, the backlog's runs finished: each ends in its
  terminal event, as the backlog an ingress outage leaves behind does (issue 50); its figures
  are judged against issue 42's and issue 50's targets (main.py's `_capacity`);
- `plain`: the same with a backlog that carries no terminal event (the scenario before issue
  50, kept beside it: a terminal-free backlog cannot compete with a fresh terminal);
- `drop`: the capacity divided by `--capacity-drop-factor` (10) from `--capacity-drop-at`
  seconds after the backlog's commit for `--capacity-drop-for` seconds, then back. By default
  (`--capacity-drop-kind workers`) the pool shrinks from `--capacity-drop-workers` (20) to a
  tenth of them at the same service time, as issue 42's simulation (40 -> 4) does: the
  concurrency the ingress serves at once falls, which is what a limit on POSTs in flight has
  to follow. (`service`: the service time × the factor with the same workers, a slower
  dependency behind the same pool: the concurrency it serves at once does not change, only
  its queue's wait.) The drop's backlog is `--capacity-drop-events`, sized to outlast it.
  Figures per phase, the in-flight series and each replica's `ledger_relay_post_limit`,
  scraped from its metrics endpoint every 100 ms, in the JSON (`samples_s["<mode>.drop"]`),
  and a chart of them (`--capacity-chart`, capacity_chart.py);
- `outage`: the steady backlog made as an outage makes it. The ingress answers every POST 503
  (after its service time) from before the backlog's commit for `--capacity-outage-s` seconds,
  so the runs the replicas reach are attempted, fail and wait as retries, with the retry
  budget spent by the outage's failures; then it serves again. The figures are from the
  recovery on (the fresh terminals committed after it), with the time the backlog took to
  drain. Not judged: the steady variant's targets are beside it to read against.

**The limit follows within 5 s each way** (`capacity_ingress.limit_follows`), on the
replicas' limits summed, scrape by scrape: after the drop, the time until it is <= 3 × the
dropped capacity's workers and stays there until the recovery (`down_s`); after the recovery,
the time until it is first >= the workers before the drop, or the replicas' summed ceiling if
that is lower (`up_s`). Judged on the adaptive mode: both <= 5 s.

The figures: POSTs in flight at the ingress (arrived, not answered: queued or in service),
sampled every 10 ms, p90 and its multiple of the workers; queueing inside the ingress p99 and
its multiple of the service time; goodput = POSTs answered 2xx / what the capacity could serve
over the window (the backlog's commit to its last POST's answer); terminal events' delay from
their commit to the end of their POST's service, p99 and its multiple of the service time;
events lost and per-run order violations (the sink's own checks).

`MODES` are the relay settings measured side by side in one run: `post_limit = fixed` (each
lane's own concurrency, the relay before issue 42) and the defaults (the adaptive limit,
docs/admission.md). The targets are judged on the adaptive rows; the fixed ones print beside
them (and fill `capacity_fixed_*`).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import psycopg
from prometheus_client.parser import text_string_to_metric_families

from relay.admission.limit import MIN_LIMIT
from relay.producer import enqueue_async
from relay.tools.bench import capacity_chart
from relay.tools.bench.capacity_ingress import (
    STEP,
    CapacitySink,
    Figures,
    Follow,
    LimitSample,
    Post,
    at,
    figures,
    follows,
    in_flight,
    limit_follows,
)
from relay.tools.bench.kit import (
    BenchFailed,
    Env,
    RelayProcess,
    Result,
    Scenario,
    backlog,
    positive,
    relay_processes,
    reset,
)
from relay.tools.sink import serve_sink

# mode -> (its label, the relay settings it runs with)
MODES: dict[str, tuple[str, dict[str, str]]] = {
    "fixed": ("fixed limit", {"post_limit": "fixed"}),
    "adaptive": ("adaptive limit (the defaults)", {}),
}
JUDGED = "adaptive"  # the mode whose figures fill the judged keys
VARIANTS = ("steady", "plain", "drop", "outage")
STEADY_STATE = ("steady", "plain", "outage")  # the variants of one capacity: one row per mode
LIMIT = "ledger_relay_post_limit"  # a replica's limit now (relay/serving/metrics.py)
CEILING = "ledger_relay_post_limit_ceiling"
DEFERRED = "ledger_relay_retries_deferred_total"
SCRAPE_EVERY = 0.1  # s


def _arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("capacity (issue 42)")
    g.add_argument("--capacity-events", type=positive(int), default=20_000, help="(20k)")
    g.add_argument("--capacity-runs", type=positive(int), default=2_000, help="(2,000)")
    g.add_argument("--capacity-workers", type=positive(int), default=4, help="at once (4)")
    g.add_argument("--capacity-service-ms", type=positive(float), default=40.0, help="(40)")
    g.add_argument("--capacity-replicas", type=positive(int), default=2, help="relay run (2)")
    g.add_argument(
        "--capacity-terminal-every", type=positive(float), default=1.0, help="terminals (1 s)"
    )
    g.add_argument(
        "--capacity-variants",
        default=",".join(VARIANTS),
        help=f"of: {', '.join(VARIANTS)} (all)",
    )
    g.add_argument(
        "--capacity-outage-s", type=positive(float), default=15.0, help="outage: 503s for (15 s)"
    )
    g.add_argument("--capacity-drop-at", type=positive(float), default=5.0, help="(5 s)")
    g.add_argument("--capacity-drop-for", type=positive(float), default=5.0, help="(5 s)")
    g.add_argument(
        "--capacity-drop-factor", type=positive(float), default=10.0, help="capacity ÷ (10)"
    )
    g.add_argument(
        "--capacity-drop-kind",
        choices=("workers", "service"),
        default="workers",
        help="what drops: the workers, or the service time × the factor (workers)",
    )
    g.add_argument(
        "--capacity-drop-workers", type=positive(int), default=20, help="before the drop (20)"
    )
    g.add_argument(
        "--capacity-drop-events", type=positive(int), default=60_000, help="its backlog (60k)"
    )
    g.add_argument("--capacity-chart", type=Path, help="write the drop's chart (PNG) here")


SMOKE = {
    "capacity_events": 200,
    "capacity_runs": 40,
    "capacity_workers": 2,
    "capacity_service_ms": 20.0,
    "capacity_terminal_every": 0.1,
    "capacity_drop_at": 0.2,
    "capacity_drop_for": 0.3,
    "capacity_drop_workers": 10,
    "capacity_drop_events": 600,
    "capacity_outage_s": 0.5,
}


@dataclass
class Outcome:
    """One variant's run: the ingress's records and what the bench committed."""

    sink: CapacitySink
    committed_at: float  # the backlog's commit (monotonic); outage: the ingress's recovery
    drained_at: float  # the end of the POST that completed the backlog
    terminals: dict[str, float]  # event id -> its commit (monotonic)
    backlog: tuple[str, int, int]  # its run id prefix, runs, events per run (kit.backlog's ids)
    drop: tuple[float, float] | None  # when the capacity fell and came back
    scrapes: list[Scrape]  # the replicas' limits, every SCRAPE_EVERY s
    deferred: int = 0  # outage: retries the budgets held back from the recovery to the drain

    @property
    def lost(self) -> int:
        """Events committed (the backlog's and the terminals) the ingress never answered 2xx."""
        prefix, runs, per_run = self.backlog
        seen = self.sink.state.deliveries
        missing = sum(
            f"{prefix}{r}-{i}" not in seen
            for r in range(1, runs + 1)
            for i in range(1, per_run + 1)
        )
        return missing + sum(e not in seen for e in self.terminals)


async def _terminals(
    env: Env, every: float, tag: str, committed: dict[str, float], drained: anyio.Event
) -> None:
    """A terminal event in a run of its own every `every` s until the backlog has drained (at
    least one, so a tiny backlog still has a terminal figure)."""
    async with await psycopg.AsyncConnection.connect(env.url, autocommit=True) as conn:
        k = 0
        while True:
            with anyio.move_on_after(every):
                await drained.wait()
            if drained.is_set() and committed:
                return
            run = f"{tag}{k}"
            await enqueue_async(
                conn, run, f"{run}-e", "run_finished", {"k": k}, terminal=True, schema=env.schema
            )
            committed[f"{run}-e"] = time.monotonic()
            k += 1


async def _drop(sink: CapacitySink, a: argparse.Namespace, start: float) -> tuple[float, float]:
    base = sink.pool.now
    await anyio.sleep(max(0.0, start + a.capacity_drop_at - time.monotonic()))
    if a.capacity_drop_kind == "workers":
        sink.pool.set(max(1, round(base.workers / a.capacity_drop_factor)), base.service)
    else:
        sink.pool.set(base.workers, base.service * a.capacity_drop_factor)
    fell = sink.pool.now.at
    await anyio.sleep(a.capacity_drop_for)
    sink.pool.set(base.workers, base.service)
    return fell, sink.pool.now.at


def _environ(mode: str) -> dict[str, str]:
    return {f"RELAY_{k.upper()}": v for k, v in MODES[mode][1].items()}


@dataclass(frozen=True)
class Scrape:
    """Each replica's limit and ceiling (None: not on its /metrics) at `at` (monotonic s), and
    the retries their budgets held back so far, summed over replicas and lanes (None: a replica
    not read)."""

    at: float
    limits: tuple[float | None, ...]
    ceilings: tuple[float | None, ...]
    deferred: float | None


def _sums(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Each of `names` on a /metrics page, summed over its labels."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


class Scrapes:
    """The scrapes taken so far, and a wait for the next one."""

    def __init__(self) -> None:
        self.taken: list[Scrape] = []
        self._next = anyio.Event()

    def add(self, scrape: Scrape) -> None:
        self.taken.append(scrape)
        self._next.set()
        self._next = anyio.Event()

    async def after(self, at: float) -> None:
        """Wait for a scrape taken after `at` (SCRAPE_EVERY s at most while the scrapes run)."""
        while not (self.taken and self.taken[-1].at > at):
            await self._next.wait()


async def _scrape(procs: list[RelayProcess], out: Scrapes) -> None:
    """Every replica's `ledger_relay_post_limit` (and ceiling) and its retries held back, every
    SCRAPE_EVERY s, until cancelled; a scrape that fails is a None for that replica."""
    async with httpx.AsyncClient() as client:
        while True:
            got: list[dict[str, float]] = []
            for rp in procs:
                try:
                    text = (await client.get(rp.metrics_url + "/metrics", timeout=2)).text
                    got.append(_sums(text, (LIMIT, CEILING, DEFERRED)))
                except httpx.HTTPError:
                    got.append({})
            deferred = [g.get(DEFERRED) for g in got]
            out.add(
                Scrape(
                    time.monotonic(),
                    tuple(g.get(LIMIT) for g in got),
                    tuple(g.get(CEILING) for g in got),
                    None if None in deferred else sum(v for v in deferred if v is not None),
                )
            )
            await anyio.sleep(SCRAPE_EVERY)


def _deferred_between(scrapes: list[Scrape], start: float, end: float) -> int:
    """Retries the budgets held back from `start` to `end`: the count at the first full scrape
    from `end` on, less the count at the last one up to `start` (each within SCRAPE_EVERY s of
    its time while the scrapes succeed)."""
    read = [(s.at, s.deferred) for s in scrapes if s.deferred is not None]
    before = [n for at, n in read if at <= start]
    after = [n for at, n in read if at >= end]
    if not before or not after:
        raise BenchFailed("capacity: no scrape of retries_deferred_total around the drain")
    return round(after[0] - before[-1])


def _summed(scrapes: list[Scrape]) -> list[LimitSample]:
    """The replicas' limits summed, at the scrapes where every replica gave one."""
    return [
        LimitSample(s.at, sum(v for v in s.limits if v is not None))
        for s in scrapes
        if s.limits and None not in s.limits
    ]


def _sizes(a: argparse.Namespace, variant: str) -> tuple[int, int, int]:
    """The variant's backlog (runs, events per run) and the workers it starts with."""
    per_run = max(1, a.capacity_events // a.capacity_runs)
    if variant == "drop":
        runs = max(1, a.capacity_drop_events // per_run)
        by_workers = a.capacity_drop_kind == "workers"
        return runs, per_run, a.capacity_drop_workers if by_workers else a.capacity_workers
    return a.capacity_runs, per_run, a.capacity_workers


async def _variant(env: Env, a: argparse.Namespace, mode: str, variant: str) -> Outcome:
    await reset(env)
    runs, per_run, workers = _sizes(a, variant)
    sink = CapacitySink(workers, a.capacity_service_ms / 1000)
    committed: dict[str, float] = {}
    drop: list[tuple[float, float]] = []
    scrapes = Scrapes()
    drained = anyio.Event()
    deferred = 0
    prefix = f"cap{variant[0]}"  # the backlog's runs: cap<the variant's initial><n>
    tag = f"{prefix}t"  # the terminals' runs
    async with (
        serve_sink(sink) as base,
        relay_processes(env, a.capacity_replicas, base, environ=_environ(mode)) as procs,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(_scrape, procs, scrapes)
        if variant == "outage":
            sink.faults.set_default(503)  # down before the backlog's commit wakes the replicas
        start = await backlog(env, runs, per_run, prefix, terminals=variant != "plain")
        if variant == "outage":
            with env.console.status(
                f"capacity outage: the ingress answers 503 for {a.capacity_outage_s:g} s"
            ):
                await anyio.sleep(a.capacity_outage_s)
            sink.faults.set_default(None)
            start = time.monotonic()
        if variant == "drop":

            async def dropping() -> None:
                drop.append(await _drop(sink, a, start))

            tg.start_soon(dropping)
        total = runs * per_run
        timeout = max(120.0, 5 * total / per_run / sink.pool.now.per_second)
        async with anyio.create_task_group() as producer:
            producer.start_soon(_terminals, env, a.capacity_terminal_every, tag, committed, drained)
            drained_at = await _until_drained(env, sink, total, committed, timeout, variant)
            drained.set()
        if variant == "outage":
            await scrapes.after(drained_at)
            deferred = _deferred_between(scrapes.taken, start, drained_at)
        # the producer has returned: every terminal it committed is in `committed`
        await _until_terminals(sink, committed, variant)
        tg.cancel_scope.cancel()  # the scrapes, and the drop's schedule if it drained first
    return Outcome(
        sink,
        start,
        drained_at,
        committed,
        (prefix, runs, per_run),
        drop[0] if drop else None,
        scrapes.taken,
        deferred,
    )


async def _until_drained(
    env: Env,
    sink: CapacitySink,
    total: int,
    terminals: dict[str, float],
    timeout: float,  # noqa: ASYNC109 - a deadline for waiting, not an I/O timeout
    what: str,
) -> float:
    """Wait until the backlog's `total` events are in; the end of the POST that completed it."""
    deadline = time.monotonic() + timeout
    seen = sink.state.deliveries
    with env.console.status(f"capacity {what}: 0/{total}") as status:
        while True:
            got = len(seen) - sum(1 for e in terminals if e in seen)
            if got >= total:
                return max(p.end for p in sink.posts)
            if time.monotonic() > deadline:
                raise BenchFailed(f"capacity {what}: {got}/{total} delivered after {timeout:g}s")
            status.update(f"capacity {what}: {got:,}/{total:,} events, {sink.pool.busy} busy")
            await anyio.sleep(0.01)


async def _until_terminals(sink: CapacitySink, committed: dict[str, float], what: str) -> None:
    seen = sink.state.deliveries
    with anyio.move_on_after(60):
        while any(e not in seen for e in committed):  # noqa: ASYNC110 - the sink's own dict
            await anyio.sleep(0.01)
    missing = sum(1 for e in committed if e not in seen)
    if missing:
        raise BenchFailed(f"capacity {what}: {missing} terminal events never arrived")


def _row(case: str, f: Figures, o: Outcome | None = None) -> dict[str, Any]:
    ms = f.service * 1000
    row = {
        "case": case,
        "capacity": f"{f.workers} × {ms:g} ms",
        "posts": f.posts,
        "in_flight_p90": f"{f.in_flight_p90} ({f.in_flight_x:.1f}×)",
        "in_flight_max": f.in_flight_max,
        "queueing_p99_ms": f"{f.queueing_p99 * 1000:,.0f} ({f.queueing_x:.1f}×)",
        "goodput": round(f.goodput, 3),
        "terminal_p99_ms": None
        if f.terminal_p99 is None
        else f"{f.terminal_p99 * 1000:,.0f} ({f.terminal_x:.1f}×) of {f.terminals}",
    }
    if o is not None:
        state = o.sink.state
        row |= {
            "lost": o.lost,
            "duplicates": state.duplicates,
            "order_violations": state.order_violations,
        }
    return row


COLUMNS = [
    "case",
    "capacity",
    "posts",
    "in_flight_p90",
    "in_flight_max",
    "queueing_p99_ms",
    "goodput",
    "terminal_p99_ms",
    "lost",
    "duplicates",
    "order_violations",
]


def _metrics(f: Figures, o: Outcome, prefix: str) -> dict[str, Any]:
    """A steady variant's keys: `capacity_*` (the judged mode's, main.py's `_capacity`) or
    `capacity_fixed_*` (beside them); `capacity_plain_*` for the terminal-free backlog."""
    m: dict[str, Any] = {
        "in_flight_p90": f.in_flight_p90,
        "in_flight_ratio": round(f.in_flight_x, 3),
        "queueing_p99_ms": round(f.queueing_p99 * 1000, 2),
        "queueing_ratio": round(f.queueing_x, 3),
        "goodput": round(f.goodput, 3),
        "lost": o.lost,
        "order_violations": o.sink.state.order_violations,
    }
    if f.terminal_p99 is not None and f.terminal_x is not None:
        m["terminal_p99_ms"] = round(f.terminal_p99 * 1000, 2)
        m["terminal_ratio"] = round(f.terminal_x, 3)
    return {f"{prefix}{k}": v for k, v in m.items()}


def _series(o: Outcome) -> dict[str, Any]:
    """In flight at the ingress every 100 ms from the backlog's commit, the capacity's changes
    and each replica's limit as scraped (None: not on its /metrics), all in seconds since that
    commit (the chart's data)."""
    t0 = o.committed_at
    every = 0.1
    samples = in_flight(o.sink.posts, t0, o.drained_at, every)
    return {
        "every_s": every,
        "in_flight": samples,
        "capacity": [
            {"at_s": round(max(0.0, c.at - t0), 3), "workers": c.workers, "service_s": c.service}
            for c in o.sink.pool.changes
        ],
        "limit": {
            "at_s": [round(s.at - t0, 3) for s in o.scrapes],
            "replicas": [list(s.limits) for s in o.scrapes],
            "summed": [
                None if None in s.limits else sum(v for v in s.limits if v is not None)
                for s in o.scrapes
            ],
        },
    }


def _ceiling(o: Outcome, default: float) -> float:
    """The replicas' ceilings summed, as their metrics said; `default` if they did not."""
    for s in reversed(o.scrapes):
        if s.ceilings and None not in s.ceilings:
            return sum(v for v in s.ceilings if v is not None)
    return default


def _drop_rows(
    label: str, o: Outcome, ceiling: float
) -> tuple[list[dict[str, Any]], dict[str, Any], Follow]:
    """Figures per phase (before, during, after the drop), how soon in flight followed, and
    how soon the replicas' summed limit did."""
    assert o.drop is not None
    fell, back = o.drop
    posts, changes = o.sink.posts, o.sink.pool.changes
    rows = [
        _row(f"{label}, drop: before", figures(posts, changes, o.committed_at, fell, o.terminals)),
        _row(f"{label}, drop: dropped", figures(posts, changes, fell, back, o.terminals)),
        _row(
            f"{label}, drop: recovered",
            figures(posts, changes, back, o.drained_at, o.terminals),
            o,
        ),
    ]
    samples = in_flight(posts, o.committed_at, o.drained_at, STEP)
    low = at(changes, fell).workers
    follow = {
        # in flight fits 3× what the slower ingress serves at once, to the recovery
        "down_s": follows(samples, o.committed_at, STEP, fell, back, lambda n: n <= 3 * low),
        # every worker busy again (in flight ≥ workers) for the next second
        "up_s": follows(
            samples, o.committed_at, STEP, back, min(back + 1, o.drained_at), lambda n: n >= low
        ),
    }
    floor = MIN_LIMIT * len(o.scrapes[0].limits) if o.scrapes else 0
    summed = _summed(o.scrapes)
    limit = limit_follows(summed, changes, fell, back, o.drained_at, floor, _ceiling(o, ceiling))
    return rows, follow, limit


def _after(s: float | None) -> str:
    return "never" if s is None else f"{s:g} s after"


def _drop_notes(label: str, follow: dict[str, Any], limit: Follow, scraped: bool) -> list[str]:
    notes = [
        f"{label}, drop: in flight ≤ 3× the workers for the rest of the drop: "
        f"{_after(follow['down_s'])} the fall; every worker busy for the next second: "
        f"{_after(follow['up_s'])} the recovery"
    ]
    if scraped:
        notes.append(
            f"{label}, drop: the summed limit ≤ {limit.down_to:g} for the rest of the drop: "
            f"{_after(limit.down_s)} the fall; ≥ {limit.up_to:g}: {_after(limit.up_s)} the "
            f"recovery ({'met' if limit.met else 'MISSED'}: within 5 s each way)"
        )
    return notes


async def capacity(env: Env, a: argparse.Namespace) -> Result:
    variants = [v.strip() for v in a.capacity_variants.split(",") if v.strip()]
    if unknown := set(variants) - set(VARIANTS):
        raise BenchFailed(f"--capacity-variants: unknown {sorted(unknown)}")
    rows: list[dict[str, Any]] = []
    metrics: dict[str, Any] = {}
    data: dict[str, Any] = {}
    notes = []
    defaults = env.settings()
    ceiling = (defaults.concurrency + defaults.critical_concurrency) * a.capacity_replicas
    # the modes of one variant one after the other: both see the machine as it is then
    for variant in variants:
        for mode, (label, _) in MODES.items():
            o = await _variant(env, a, mode, variant)
            data[f"{mode}.{variant}"] = _series(o)
            if variant in STEADY_STATE:
                f = figures(
                    o.sink.posts, o.sink.pool.changes, o.committed_at, o.drained_at, o.terminals
                )
                rows.append(_row(f"{label}, {variant}", f, o))
                prefix = "capacity_" if variant == "steady" else f"capacity_{variant}_"
                metrics |= _metrics(f, o, prefix if mode == JUDGED else f"{prefix}{mode}_")
                if variant == "outage":
                    notes.append(_outage_note(label, o, a.capacity_outage_s))
                    outage = "capacity_outage_" if mode == JUDGED else f"capacity_outage_{mode}_"
                    metrics[f"{outage}drain_s"] = round(o.drained_at - o.committed_at, 2)
                    metrics[f"{outage}failed_posts"] = len(_failed(o))
                    metrics[f"{outage}deferred"] = o.deferred
                continue
            if o.drop is None:
                raise BenchFailed("capacity drop: the backlog drained before the drop was over")
            phases, follow, limit = _drop_rows(label, o, ceiling)
            rows += phases
            scraped = bool(_summed(o.scrapes))
            data[f"{mode}.{variant}"] |= {
                "follow": follow,
                "limit_follow": {
                    "down_s": limit.down_s,
                    "up_s": limit.up_s,
                    "down_to": limit.down_to,
                    "up_to": limit.up_to,
                },
            }
            notes += _drop_notes(label, follow, limit, scraped)
            if mode == JUDGED and scraped:  # not judged without the replicas' gauge
                metrics |= {
                    "capacity_follow_down_s": limit.down_s,
                    "capacity_follow_up_s": limit.up_s,
                }
    if a.capacity_chart is not None and "drop" in variants:
        capacity_chart.draw(a.capacity_chart, data, a)
        notes.append(f"chart of the drop: {a.capacity_chart}")
    per_run = max(1, a.capacity_events // a.capacity_runs)
    service = a.capacity_service_ms
    return Result(
        COLUMNS,
        rows,
        [
            f"ingress: {a.capacity_workers} POSTs at a time, {service:g} ms each "
            f"({a.capacity_workers / service * 1000:g} POSTs/s), the rest queued first come first "
            f"served; {a.capacity_replicas} `relay run` replicas; backlog "
            f"{a.capacity_runs * per_run:,} events over {a.capacity_runs:,} runs committed up "
            "front, each run ending in its terminal event (steady, drop, outage) or in none "
            "(plain); "
            f"a fresh terminal event (its own run) every {a.capacity_terminal_every:g} s until "
            "it drained",
            "in flight: at the ingress (queued + in service) every 10 ms, p90 (× the workers); "
            "queueing p99 (× the service time); goodput: POSTs answered / what the capacity "
            "could serve, from the backlog's commit to its last answer; terminal: commit -> "
            "the end of its POST's service, p99 (× the service time) of the count shown",
            f"drop: {_drop_what(a)} from {a.capacity_drop_at:g} s after the commit for "
            f"{a.capacity_drop_for:g} s, a backlog of {_sizes(a, 'drop')[0] * per_run:,} "
            "events; "
            "each phase's multiples are of the capacity in force at its start; its queueing and "
            "terminals are of the POSTs that arrived (terminals committed) in it, served in it "
            "or later; the summed limit: each replica's ledger_relay_post_limit scraped every "
            "100 ms, summed (capacity_ingress.limit_follows)",
            *notes,
        ],
        data=data,
        metrics=metrics,
        settings={
            "capacity_in_flight_ratio": f"{a.capacity_replicas} replicas, {MODES[JUDGED][0]}"
        },
    )


def _failed(o: Outcome) -> list[Post]:
    """The POSTs the outage answered 503."""
    return [p for p in o.sink.posts if p.status == 503]


def _outage_note(label: str, o: Outcome, outage_s: float) -> str:
    """What the outage left behind, and how long the backlog took to drain after it."""
    failed = _failed(o)
    runs = len({p.run_id for p in failed})
    served = sum(1 for p in o.sink.posts if 200 <= p.status < 300 and p.end >= o.committed_at)
    ideal = served / o.sink.pool.now.per_second
    return (
        f"outage, {label}: {len(failed):,} POSTs answered 503 over {runs:,} runs in "
        f"{outage_s:g} s; from the recovery the backlog drained in "
        f"{o.drained_at - o.committed_at:.1f} s ({served:,} POSTs answered 2xx, which the "
        f"capacity alone serves in {ideal:.1f} s), {o.deferred:,} retries held back by the "
        "budgets meanwhile (each a claim handed back)"
    )


def _drop_what(a: argparse.Namespace) -> str:
    if a.capacity_drop_kind == "workers":
        low = max(1, round(a.capacity_drop_workers / a.capacity_drop_factor))
        return f"{a.capacity_drop_workers} -> {low} workers ({a.capacity_service_ms:g} ms each)"
    return f"service × {a.capacity_drop_factor:g} (same {a.capacity_workers} workers)"


STEADY = (  # each steady-state variant's figures, per mode
    "in_flight_p90",
    "in_flight_ratio",
    "queueing_p99_ms",
    "queueing_ratio",
    "goodput",
    "terminal_p99_ms",
    "terminal_ratio",
    "lost",
    "order_violations",
)
KEYS = (
    *(
        f"{prefix}{k}"
        for prefix in (
            "capacity_",
            "capacity_fixed_",
            "capacity_plain_",
            "capacity_plain_fixed_",
            "capacity_outage_",
            "capacity_outage_fixed_",
        )
        for k in STEADY
    ),
    "capacity_outage_drain_s",
    "capacity_outage_fixed_drain_s",
    "capacity_outage_failed_posts",
    "capacity_outage_fixed_failed_posts",
    "capacity_outage_deferred",
    "capacity_outage_fixed_deferred",
    "capacity_follow_down_s",
    "capacity_follow_up_s",
)

SCENARIOS = [
    Scenario(
        "capacity",
        "an ingress that serves 4 POSTs at a time (40 ms each) and queues the rest: in flight "
        "at it, its queueing, goodput, terminal delay; and its capacity dropping 10× midway; the "
        "adaptive limit (the defaults) beside post_limit=fixed",
        capacity,
        _arguments,
        SMOKE,
        KEYS,
    ),
]
