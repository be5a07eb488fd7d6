"""The outage variant of the fleet scenario (issue 51's targets): three databases on three
servers of the bench's own, two `relay run` replicas over all three, producers committing a
steady trickle into each; one server SIGKILLed for `--fleet-outage-s`, then started again.

The ingress is the bench's in-process reference sink: commit→receipt is its first receipt of
an event (`time.time()`) minus the moment the producer's commit returned, one clock. Each
producer commits `--fleet-outage-rate` runs a second, each run `--fleet-outage-per-run` events
in one transaction, the last its terminal; the killed database's producer retries its
connection meanwhile, as an application would. Phases by commit time, for the two databases
that stay up: `before` (after the warm-up, until the kill), `during` (kill to restart), `after`.
The warm-up is long (15 s): on the loaded 2-core machine a fleet's first 20 s or so after its
start measured seconds of latency where the rest of the run measured hundreds of ms
(docs/performance.md); `data.series` has each database's latency per second of the run.
Target: during p99 ≤ 2 × before p99 + 100 ms (`fleet_outage_ratio` ≤ 1).

Checked, and printed beside the figures: nothing lost (every event of every database's outbox
at the end reached the sink, and every commit the producers saw is in its outbox), per-run
order kept (the sink's count), no replica exited, each replica's `/readyz` answered 200 at
every probe (every 250 ms), and `ledger_relay_database_up` of the killed database read 0 on
every replica between its detection and the restart.

Then the second target: both replicas stopped, the server killed again, a trickle committed
into the other two with no replica running, and one replica started alone: the seconds from
its start (the process spawned) to the receipt of every event committed before it.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import psycopg
from prometheus_client.parser import text_string_to_metric_families

from relay.maintenance.migrate import migrate
from relay.producer import Event, enqueue_many_async
from relay.tools.bench import kit
from relay.tools.demo import percentile

NAMES = ("s0", "s1", "s2")
KILLED = "s2"
PROBE_EVERY = 0.25  # seconds between two probes of each replica
TARGET_S = 10.0  # a replica started while one database is down: the others' events within


ARGUMENTS = kit.positive_options(
    "fleet outage (issue 51)",
    ("--fleet-outage-s", float, 15.0, "seconds the server stays down (15)"),
    ("--fleet-outage-before-s", float, 10.0, "measured before the kill (10)"),
    ("--fleet-outage-after-s", float, 5.0, "measured after the restart (5)"),
    ("--fleet-outage-warmup-s", float, 15.0, "from the replicas' start (15)"),
    ("--fleet-outage-rate", float, 20.0, "runs/s per database (20)"),
    ("--fleet-outage-per-run", int, 4, "events per run, the last its terminal (4)"),
)


SMOKE = {  # the servers' and replicas' starts are most of its ~40 s on a loaded machine
    "fleet_outage_s": 2.0,
    "fleet_outage_before_s": 2.0,
    "fleet_outage_after_s": 1.0,
    "fleet_outage_warmup_s": 1.0,
}
KEYS = (
    "fleet_outage_p50_ms_before",
    "fleet_outage_p99_ms_before",
    "fleet_outage_p50_ms_during",
    "fleet_outage_p99_ms_during",
    "fleet_outage_p99_ms_after",
    "fleet_outage_ratio",
    "fleet_outage_lost",
    "fleet_outage_order_violations",
    "fleet_outage_replica_exits",
    "fleet_outage_readyz_not_200",
    "fleet_outage_up_read_1_while_down",
    "fleet_outage_down_seen_s",
    "fleet_outage_new_replica_s",
    "fleet_outage_new_replica_ready_s",
)


# -- the servers ------------------------------------------------------------------------------


async def _servers(env: kit.Env) -> dict[str, Any]:
    """Three durable embedded servers in the bench's work directory, started side by side,
    each with the relay's schema in its `postgres` database: name -> EmbeddedPostgres."""
    from relay.tools.embedded import EmbeddedPostgres

    servers = {n: EmbeddedPostgres(env.workdir / f"outage-{n}", durable=True) for n in NAMES}
    for server in servers.values():
        env.stack.callback(server.stop, "immediate")

    async def start(server: EmbeddedPostgres) -> None:
        await anyio.to_thread.run_sync(server.start)
        await anyio.to_thread.run_sync(migrate, server.url, env.schema)

    with env.console.status("fleet outage: starting three PostgreSQL servers…"):
        async with anyio.create_task_group() as tg:
            for server in servers.values():
                tg.start_soon(start, server)
    return servers


# -- the producers ----------------------------------------------------------------------------


@dataclass
class Producer:
    """One database's application: `rate` runs a second, each in one transaction; reconnects
    when its server is gone. `committed`: event id -> wall time its commit returned."""

    name: str
    url: str
    schema: str
    rate: float
    per_run: int
    committed: dict[str, float] = field(default_factory=dict)
    failed: int = 0  # commits that raised (their runs may or may not be in the outbox)
    runs: int = 0

    async def run(self, prefix: str, stop: anyio.Event) -> None:
        conn: psycopg.AsyncConnection[Any] | None = None
        due = time.monotonic()
        try:
            while not stop.is_set():
                if conn is None:
                    try:
                        with anyio.fail_after(5):
                            conn = await psycopg.AsyncConnection.connect(
                                self.url, autocommit=True, connect_timeout=2
                            )
                    except (psycopg.Error, TimeoutError):
                        await anyio.sleep(0.2)
                        continue
                    due = max(due, time.monotonic())  # no burst to catch up after an outage
                run_id = f"{self.name}-{prefix}{self.runs}"
                self.runs += 1
                events = [
                    Event(
                        f"{run_id}-{k}",
                        "run_finished" if k == self.per_run else "step",
                        {"k": k},
                        terminal=k == self.per_run,
                    )
                    for k in range(1, self.per_run + 1)
                ]
                try:
                    with anyio.fail_after(5):
                        await enqueue_many_async(conn, run_id, events, schema=self.schema)
                except (psycopg.Error, TimeoutError):
                    self.failed += 1
                    await _close(conn)
                    conn = None
                    continue
                at = time.time()
                for e in events:
                    self.committed[e.event_id] = at
                due += 1 / self.rate
                await anyio.sleep(max(0.0, due - time.monotonic()))
        finally:
            if conn is not None:
                await _close(conn)


async def _close(conn: psycopg.AsyncConnection[Any]) -> None:
    with anyio.move_on_after(2):
        try:
            await conn.close()
        except psycopg.Error:
            pass


async def _outbox(url: str, schema: str) -> set[str]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(f'select event_id from "{schema}".outbox')
        return {str(r[0]) for r in await cur.fetchall()}


# -- the probes -------------------------------------------------------------------------------


@dataclass
class Probe:
    """What one replica's `metrics_addr` said: (wall time, /readyz status, the killed
    database's `ledger_relay_database_up` or None), and whether its process ended."""

    rp: kit.RelayProcess
    seen: list[tuple[float, int, float | None]] = field(default_factory=list)
    exited: int | None = None

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.rp.metrics_url, timeout=2) as http:
            while True:
                if self.rp.proc.returncode is not None:
                    self.exited = self.rp.proc.returncode
                    return
                at = time.time()
                try:
                    status = (await http.get("/readyz")).status_code
                except httpx.HTTPError:
                    status = 0
                up: float | None = None
                try:
                    text = (await http.get("/metrics")).text
                    up = _database_up(text).get(KILLED)
                except httpx.HTTPError:
                    pass
                self.seen.append((at, status, up))
                await anyio.sleep(PROBE_EVERY)


def _database_up(text: str) -> dict[str, float]:
    return {
        sample.labels.get("database", ""): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "ledger_relay_database_up"
        for sample in family.samples
    }


# -- the scenario -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Probed:
    """What the probes say: /readyz answers other than 200 (any time), probes in all; seconds
    from the kill until the killed database's gauge read 0 on every replica (None: never on
    some); between then and the restart, the probes where it read 1, or was not served."""

    not_200: int
    probes: int
    down_seen_s: float | None
    read_1: int
    unread: int
    while_down: int


def judge_probes(
    seen: list[list[tuple[float, int, float | None]]], kill: float, restart: float
) -> Probed:
    """`seen`: each replica's (wall time, /readyz status, the killed database's gauge)."""
    firsts = [next((at for at, _, up in one if at >= kill and up == 0), None) for one in seen]
    detected = max(f for f in firsts if f is not None) if None not in firsts and seen else None
    down = [x for one in seen for x in one if kill <= x[0] < restart]
    after = [x for x in down if detected is not None and x[0] > detected]
    return Probed(
        not_200=sum(1 for one in seen for x in one if x[1] != 200),
        probes=sum(len(one) for one in seen),
        down_seen_s=round(detected - kill, 2) if detected is not None else None,
        read_1=sum(1 for x in after if x[2] == 1),
        unread=sum(1 for x in down if x[2] is None),
        while_down=len(down),
    )


@dataclass
class Phases:
    """Wall times: measuring from `start`; the kill; the restart returned; the producers stopped."""

    start: float = 0.0
    kill: float = 0.0
    restart: float = 0.0
    end: float = 0.0


def _latencies(
    producers: dict[str, Producer],
    seen: dict[str, float],
    names: tuple[str, ...],
    lo: float,
    hi: float,
) -> list[float]:
    return [
        seen[e] - t
        for n in names
        for e, t in producers[n].committed.items()
        if lo <= t < hi and e in seen
    ]


def _series(producers: dict[str, Producer], seen: dict[str, float], t: Phases) -> dict[str, Any]:
    """Each database's commit→receipt p50 and max (ms) per second of commit, from `t.start`:
    where in the run the figures came from."""
    out: dict[str, Any] = {"kill_s": round(t.kill - t.start, 1)}
    out["restart_s"] = round(t.restart - t.start, 1)
    for name, p in producers.items():
        by: dict[int, list[float]] = {}
        for e, at in p.committed.items():
            if t.start <= at < t.end and e in seen:
                by.setdefault(int(at - t.start), []).append((seen[e] - at) * 1000)
        out[name] = {
            "second": sorted(by),
            "p50_ms": [round(percentile(by[k], 50) or 0.0) for k in sorted(by)],
            "max_ms": [round(max(by[k])) for k in sorted(by)],
        }
    return out


def _figures(values: list[float]) -> dict[str, Any]:
    ms = [v * 1000 for v in values]
    return {
        "p50_ms": round(percentile(ms, 50) or 0.0, 1),
        "p99_ms": round(percentile(ms, 99) or 0.0, 1),
        "max_ms": round(max(ms), 1) if ms else 0.0,
        "events": len(ms),
    }


async def _until_delivered(env: kit.Env, ids: set[str], within: float) -> int:
    """Wait until every event of `ids` reached the sink, for at most `within` seconds; the
    count still missing then (0 when all arrived)."""
    seen = env.sink.state.first_seen_at
    deadline = time.monotonic() + within
    while missing := sum(1 for e in ids if e not in seen):
        if time.monotonic() > deadline:
            break
        await anyio.sleep(0.1)
    return missing


async def _outage(
    env: kit.Env,
    a: argparse.Namespace,
    servers: dict[str, Any],
    listed: dict[str, str],
    producers: dict[str, Producer],
) -> tuple[Phases, list[Probe], dict[str, set[str]], int]:
    """Two replicas and the producers: warm-up, before, the kill, the restart, after; then,
    the producers returned, until every event in every outbox reached the sink (120 s at
    most). The phases' times, what the probes saw, each database's outbox (its event ids) read
    at the end, and how many of those events never reached the sink."""
    t = Phases()
    stop = anyio.Event()
    base = env.ingress_url.removesuffix("/runs/{run_id}/events")
    async with kit.relay_processes(env, 2, base, environ=listed) as replicas:
        probes = [Probe(rp) for rp in replicas]
        async with anyio.create_task_group() as tg:
            for p in probes:
                tg.start_soon(p.run)
            async with anyio.create_task_group() as producing:
                for producer in producers.values():
                    producing.start_soon(producer.run, "a", stop)
                with env.console.status("fleet outage: warm-up, then before the kill"):
                    await anyio.sleep(a.fleet_outage_warmup_s)
                    t.start = time.time()
                    await anyio.sleep(a.fleet_outage_before_s)
                with env.console.status(f"fleet outage: {KILLED} killed"):
                    t.kill = time.time()
                    await anyio.to_thread.run_sync(servers[KILLED].kill)
                    await anyio.sleep(a.fleet_outage_s)
                    await anyio.to_thread.run_sync(servers[KILLED].start_again)
                    t.restart = time.time()
                with env.console.status(f"fleet outage: {KILLED} restarted"):
                    await anyio.sleep(a.fleet_outage_after_s)
                    t.end = time.time()
                    stop.set()
            # Every producer has returned, so no commit lands after this read: a snapshot of
            # their commits taken at the stop missed one in flight (a run the replicas were
            # stopped before sending, counted lost), and a commit whose answer the kill cut off
            # is in its outbox without being in `committed`.
            outboxes = {n: await _outbox(s.url, env.schema) for n, s in servers.items()}
            everything = set().union(*outboxes.values())
            lost = await _until_delivered(env, everything, 120)
            tg.cancel_scope.cancel()
    return t, probes, outboxes, lost


async def fleet_outage(env: kit.Env, a: argparse.Namespace) -> kit.Result:
    began = time.monotonic()
    servers = await _servers(env)
    urls = {n: s.url for n, s in servers.items()}
    live = tuple(n for n in NAMES if n != KILLED)
    listed = {"RELAY_DATABASES": " ".join(f"{n}={u}" for n, u in urls.items())}
    env.sink.state.reset()
    seen = env.sink.state.first_seen_at
    producers = {
        n: Producer(n, u, env.schema, a.fleet_outage_rate, a.fleet_outage_per_run)
        for n, u in urls.items()
    }
    t, probes, outboxes, lost = await _outage(env, a, servers, listed, producers)
    exits = [p.exited for p in probes if p.exited is not None]
    # nothing lost: every event in every outbox reached the sink (`lost` counts those that had
    # not 120 s after the producers stopped), and every commit seen is in its outbox
    missing_rows = sum(1 for n, p in producers.items() for e in p.committed if e not in outboxes[n])
    order = env.sink.state.order_violations
    env.relay_order_violations = max(env.relay_order_violations or 0, order)
    probed = judge_probes([p.seen for p in probes], t.kill, t.restart)
    phases = {
        "before": _figures(_latencies(producers, seen, live, t.start, t.kill)),
        "during": _figures(_latencies(producers, seen, live, t.kill, t.restart)),
        "after": _figures(_latencies(producers, seen, live, t.restart, t.end)),
    }
    killed_after = _figures(_latencies(producers, seen, (KILLED,), t.restart, t.end))
    ready_s, new_replica_s = await _new_replica(env, servers, listed, producers)
    before, during = phases["before"]["p99_ms"], phases["during"]["p99_ms"]
    bound = 2 * before + 100
    ratio = round(during / bound, 3)
    rows: list[dict[str, Any]] = [
        {"phase": f"{'+'.join(live)}: {name}", **figures} for name, figures in phases.items()
    ]
    rows.append({"phase": f"{KILLED}: after its restart", **killed_after})
    verdict = "met" if ratio <= 1 else "NOT met"
    new_verdict = "met" if new_replica_s <= TARGET_S else "NOT met"
    return kit.Result(
        ["phase", "p50_ms", "p99_ms", "max_ms", "events"],
        rows,
        [
            f"three durable embedded servers, one database each; two `relay run` replicas at "
            f"their defaults over all three (RELAY_DATABASES), the in-process sink; "
            f"{a.fleet_outage_rate:g} runs/s per database of {a.fleet_outage_per_run} events "
            f"(the last a terminal), one transaction each; {KILLED} SIGKILLed after "
            f"{a.fleet_outage_warmup_s:g} s warm-up + {a.fleet_outage_before_s:g} s, started "
            f"again after {a.fleet_outage_s:g} s (down {t.restart - t.kill:.1f} s with its "
            f"restart), {a.fleet_outage_after_s:g} s after; {time.monotonic() - began:.0f} s",
            "commit returned → first receipt at the sink, by commit time; the killed "
            f"database's producer: {producers[KILLED].failed} commit(s) failed at the kill, "
            "then reconnecting until the restart",
            f"target during p99 ≤ 2 × before p99 + 100 ms = {bound:.1f} ms: {verdict} "
            f"({during:.1f} ms, ratio {ratio})",
            f"lost {lost} (of {sum(len(i) for i in outboxes.values()):,} outbox events), commits "
            f"missing from their outbox {missing_rows}, per-run order violations {order}, "
            f"replica exits {len(exits)}{f' {exits}' if exits else ''}",
            f"/readyz not 200 at {probed.not_200} of {probed.probes} probes; "
            f'ledger_relay_database_up{{database="{KILLED}"}} 0 on every replica '
            f"{probed.down_seen_s} s after the kill, then read 1 at {probed.read_1}, and not "
            f"served at {probed.unread}, of {probed.while_down} probes until the restart",
            f"a replica started alone while {KILLED} is down: the others' events committed "
            f"before its start all received {new_replica_s:.2f} s after it was spawned (its "
            f"/readyz 200 after {ready_s:.2f} s); target "
            f"≤ {TARGET_S:g} s: {new_verdict}",
        ],
        metrics={
            "fleet_outage_p50_ms_before": phases["before"]["p50_ms"],
            "fleet_outage_p99_ms_before": before,
            "fleet_outage_p50_ms_during": phases["during"]["p50_ms"],
            "fleet_outage_p99_ms_during": during,
            "fleet_outage_p99_ms_after": phases["after"]["p99_ms"],
            "fleet_outage_ratio": ratio,
            "fleet_outage_lost": lost + missing_rows,
            "fleet_outage_order_violations": order,
            "fleet_outage_replica_exits": len(exits),
            "fleet_outage_readyz_not_200": probed.not_200,
            "fleet_outage_up_read_1_while_down": probed.read_1,
            "fleet_outage_down_seen_s": probed.down_seen_s,
            "fleet_outage_new_replica_s": round(new_replica_s, 2),
            "fleet_outage_new_replica_ready_s": round(ready_s, 2),
        },
        data={"series": _series(producers, seen, t)},
        settings={
            "fleet_outage_ratio": f"{KILLED} SIGKILLed for {a.fleet_outage_s:g} s, two replicas",
        },
    )


async def _new_replica(
    env: kit.Env,
    servers: dict[str, Any],
    listed: dict[str, str],
    producers: dict[str, Producer],
) -> tuple[float, float]:
    """The killed server killed again with no replica running, a second of the trickle into
    the others, then one replica alone: seconds from its spawn until its /readyz answered 200,
    and until every event committed into the others before it reached the sink."""
    live = [n for n in NAMES if n != KILLED]
    base = env.ingress_url.removesuffix("/runs/{run_id}/events")
    seen = env.sink.state.first_seen_at
    await anyio.to_thread.run_sync(servers[KILLED].kill)
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        for n in live:
            tg.start_soon(producers[n].run, "n", stop)
        await anyio.sleep(1.0)
        stop.set()
    pending = {e for n in live for e, at in producers[n].committed.items() if e not in seen}
    if not pending:
        raise kit.BenchFailed("fleet outage: nothing committed for the new replica")
    spawned = time.time()
    with env.console.status("fleet outage: a replica started alone, one database down"):
        async with kit.relay_processes(env, 1, base, environ=listed, replica_id="bench-new") as rp:
            ready = time.time()  # its /readyz answered 200
            if missing := await _until_delivered(env, pending, 60):
                raise kit.BenchFailed(f"fleet outage: the new replica: {missing} never received")
            if rp[0].proc.returncode is not None:
                code = rp[0].proc.returncode
                raise kit.BenchFailed(f"fleet outage: the new replica exited {code}")
    return ready - spawned, max(seen[e] for e in pending) - spawned


SCENARIOS = [
    kit.Scenario(
        "fleet_outage",
        "one of three databases' servers SIGKILLed under a trickle into all three, two replicas: "
        "the others' commit→receipt p99 before and during, nothing lost, probes; a replica "
        "started while it is down (issue 51)",
        fleet_outage,
        ARGUMENTS,
        SMOKE,
        KEYS,
    ),
]
