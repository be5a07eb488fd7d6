"""`relay demo`: the whole system on one machine, checked end to end.

It starts what it needs (an embedded PostgreSQL unless RELAY_DATABASE_URL is set, the Absurd
schema and queue `demo`, the reference sink in a thread, several `relay run` replicas as
subprocesses), enqueues a scheduler-like workload (half before the relays start, half while
they run), waits until everything is acknowledged, stops the replicas with SIGTERM and prints
a Jepsen-style report: enqueued, delivered, lost, duplicated, out of order, engine wakes,
throughput and commit-to-delivery latency. Exit code 0 only when nothing was lost, nothing was
out of order, every run woke the engine once and every replica exited 0.

The workload and the report are pure functions (`plan_workload`, `build_report`); `Demo` is the
I/O shell that owns every process and thread it starts and stops them on any exit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter, deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import orjson
import psycopg
from psycopg import sql
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from relay.migrate import SchemaError, migrate, validate_schema_name
from relay.producer import Event, enqueue_many
from relay.settings import redact_url
from relay.tools.absurd import install_absurd
from relay.tools.sink import Sink, SinkThread

QUEUE = "demo"
PRODUCER_WINDOW = 8  # runs a producer has open at once, interleaving their transactions
POLL_INTERVAL = 0.25
MIN_LIVE_RATE, MAX_LIVE_RATE = 50.0, 20_000.0  # events/s
REPLICA_STOP_TIMEOUT = 40.0  # the replica's shutdown_timeout (20 s) plus room

WORKFLOWS = ("invoice-reconciliation", "nightly-settlement", "kyc-refresh", "payout-batch")
STEPS = ("fetch-ledger", "match-entries", "compute-fees", "post-journal", "notify-owner")


# -- the workload (pure) ---------------------------------------------------------------------


@dataclass(frozen=True)
class RunPlan:
    """One run's events, grouped into the transactions a scheduler would commit them in."""

    run_id: str
    transactions: tuple[tuple[Event, ...], ...]

    @property
    def events(self) -> int:
        return sum(len(tx) for tx in self.transactions)


def plan_run(run_id: str, rng: random.Random) -> RunPlan:
    """`run_created` (waking the engine), 3-8 step events, then the terminal `run_finished`."""
    workflow = rng.choice(WORKFLOWS)
    created = Event(
        f"{run_id}:0",
        "run_created",
        {
            "workflow": workflow,
            "tenant": f"tenant-{rng.randint(1, 40):02d}",
            "requested_by": rng.choice(("scheduler", "api", "operator")),
            "params": {"batch": rng.randint(1, 500), "currency": rng.choice(("EUR", "USD"))},
        },
        wake_queue=QUEUE,
        wake_event=f"run-created:{run_id}",
    )
    steps = []
    total_ms = 0
    for i in range(rng.randint(3, 8)):
        step = STEPS[(i // 2) % len(STEPS)]
        ms = rng.randint(3, 900)
        total_ms += ms
        started = i % 2 == 0
        steps.append(
            Event(
                f"{run_id}:{i + 1}",
                "step_started" if started else "step_completed",
                {"step": step, "attempt": 1, "worker": f"worker-{rng.randint(1, 12)}"}
                if started
                else {"step": step, "duration_ms": ms, "rows": rng.randint(0, 10_000)},
            )
        )
    finished = Event(
        f"{run_id}:{len(steps) + 1}",
        "run_finished",
        {
            "workflow": workflow,
            "status": rng.choices(("succeeded", "failed", "cancelled"), (90, 8, 2))[0],
            "steps": len(steps),
            "duration_ms": total_ms,
        },
        terminal=True,
    )
    # The scheduler commits the creation with the first steps (maybe none), the other steps in
    # one or two later transactions, and the terminal event alone or with the last steps.
    head = rng.randint(0, 2)
    txs: list[list[Event]] = [[created, *steps[:head]]]
    rest = steps[head:]
    if len(rest) > 1 and rng.random() < 0.5:
        cut = rng.randint(1, len(rest) - 1)
        txs += [rest[:cut], rest[cut:]]
    elif rest:
        txs.append(rest)
    if rng.random() < 0.6:
        txs.append([finished])
    else:
        txs[-1].append(finished)
    return RunPlan(run_id, tuple(tuple(tx) for tx in txs))


def live_rate(backlog_runs: int, drain_seconds: float | None, events_per_tx: float) -> float:
    """Events/s for the live half, at about half the replicas' measured capacity.

    The cost is per POST, not per event: draining the backlog takes one POST per run, whereas
    live traffic that keeps up takes about one per producer transaction. So the capacity seen in
    the drain, in POSTs/s, is scaled by the live workload's events per transaction."""
    if not backlog_runs or not drain_seconds:
        return MIN_LIVE_RATE
    rate = 0.5 * backlog_runs / drain_seconds * events_per_tx
    return max(MIN_LIVE_RATE, min(MAX_LIVE_RATE, rate))


def plan_workload(runs: int, prefix: str, seed: int) -> list[RunPlan]:
    rng = random.Random(seed)
    return [plan_run(f"{prefix}{i:06d}", rng) for i in range(runs)]


# -- the report (pure) -----------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile (p in 0..100) of unsorted values; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * p // 100))  # ceil without floats drifting
    return ordered[int(rank) - 1]


@dataclass(frozen=True)
class Committed:
    """An enqueued event as the producer saw it committed."""

    event_id: str
    run_id: str
    terminal: bool
    live: bool  # committed while the relays ran (not part of the initial backlog)


@dataclass
class Report:
    runs: int
    replicas: int
    enqueued: int
    enqueued_backlog: int
    delivered: int
    lost: int
    duplicates: int
    order_violations: int
    wakes: int
    throughput_eps: float
    delivery_window_s: float
    drain_eps: float  # the backlog, drained with nothing else arriving: the replicas' capacity
    drain_s: float
    live_rate_eps: float  # the pace of the live half (0: unpaced)
    latency_ms: dict[str, float | None]
    replica_exit_codes: list[int | None]
    replica_log_events: dict[str, int]
    failed_events: int
    wall_s: float
    lost_examples: list[str] = field(default_factory=list)
    seed: int | None = None  # of the workload, to run the same one again (--seed)

    @property
    def replicas_clean(self) -> bool:
        return all(code == 0 for code in self.replica_exit_codes)

    @property
    def ok(self) -> bool:
        return (
            self.lost == 0
            and self.order_violations == 0
            and self.wakes == self.runs
            and self.replicas_clean
        )

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        return out


def build_report(
    *,
    runs: int,
    committed: Sequence[Committed],
    created_at: Mapping[str, float],
    deliveries: Mapping[str, int],
    first_seen_at: Mapping[str, float],
    first_order: Mapping[str, Sequence[int]],
    wakes: int,
    replica_exit_codes: list[int | None],
    replica_log_events: dict[str, int],
    failed_events: int,
    live_rate_eps: float,
    wall_s: float,
) -> Report:
    """Compare what producers committed with what the sink received.

    `created_at` (commit time, from the outbox) and `first_seen_at` (the sink) must be on the
    same clock: the caller corrects the database clock's offset first."""
    ids = [c.event_id for c in committed]
    lost = [i for i in ids if i not in deliveries]
    delivered = len(ids) - len(lost)
    duplicates = sum(max(0, deliveries.get(i, 0) - 1) for i in ids)
    violations = 0
    for run_id in {c.run_id for c in committed}:
        top = None
        for seq in first_order.get(run_id, ()):
            if top is not None and seq < top:
                violations += 1
            top = seq if top is None else max(top, seq)
    window, _ = _window([first_seen_at[i] for i in ids if i in first_seen_at])
    drain, drained = _window([first_seen_at[c.event_id] for c in committed
                              if not c.live and c.event_id in first_seen_at])  # fmt: skip
    lat: dict[str, list[float]] = {"ordinary": [], "terminal": []}
    for c in committed:
        if c.live and c.event_id in first_seen_at and c.event_id in created_at:
            kind = "terminal" if c.terminal else "ordinary"
            lat[kind].append((first_seen_at[c.event_id] - created_at[c.event_id]) * 1000)
    latency: dict[str, float | None] = {}
    for kind, values in lat.items():
        for p in (50, 99):
            v = percentile(values, p)
            latency[f"{kind}_p{p}"] = None if v is None else round(v, 1)
    return Report(
        runs=runs,
        replicas=len(replica_exit_codes),
        enqueued=len(ids),
        enqueued_backlog=sum(1 for c in committed if not c.live),
        delivered=delivered,
        lost=len(lost),
        duplicates=duplicates,
        order_violations=violations,
        wakes=wakes,
        throughput_eps=round(delivered / window, 1) if window > 0 else 0.0,
        delivery_window_s=round(window, 3),
        drain_eps=round(drained / drain, 1) if drain > 0 else 0.0,
        drain_s=round(drain, 3),
        live_rate_eps=round(live_rate_eps, 1),
        latency_ms=latency,
        replica_exit_codes=replica_exit_codes,
        replica_log_events=replica_log_events,
        failed_events=failed_events,
        wall_s=round(wall_s, 2),
        lost_examples=lost[:10],
    )


def _window(times: Sequence[float]) -> tuple[float, int]:
    """The span of `times` and how many there are."""
    return (max(times) - min(times) if len(times) > 1 else 0.0), len(times)


def render_report(report: Report) -> Table:
    def mark(good: bool) -> str:
        return "[green]✓[/green]" if good else "[bold red]✗[/bold red]"

    def ms(key: str) -> str:
        v = report.latency_ms.get(key)
        return "–" if v is None else f"{v:,.1f} ms"

    t = Table(
        title="relay demo",
        title_justify="left",
        header_style="bold",
        caption="latency: commit (outbox created_at) to first receipt at the sink, live events",
        caption_justify="left",
    )
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_column("", justify="center")
    live = report.enqueued - report.enqueued_backlog
    t.add_row("runs", f"{report.runs:,}", "")
    t.add_row(
        "events enqueued",
        f"{report.enqueued:,} ({report.enqueued_backlog:,} backlog, {live:,} live)",
        "",
    )
    t.add_row("delivered (unique at the sink)", f"{report.delivered:,}", "")
    t.add_row("lost", f"{report.lost:,}", mark(report.lost == 0))
    t.add_row("duplicates", f"{report.duplicates:,}", "")
    t.add_row("per-run order violations", f"{report.order_violations:,}", mark(
        report.order_violations == 0
    ))  # fmt: skip
    t.add_row("engine wakes emitted", f"{report.wakes:,} / {report.runs:,}", mark(
        report.wakes == report.runs
    ))  # fmt: skip
    if report.failed_events:
        t.add_row("events failed (runs blocked)", f"{report.failed_events:,}", "")
    t.add_row(
        "throughput, backlog drain",
        f"{report.drain_eps:,.0f} ev/s ({report.enqueued_backlog:,} in {report.drain_s:,.1f} s)",
        "",
    )
    t.add_row(
        "throughput, overall",
        f"{report.throughput_eps:,.0f} ev/s over {report.delivery_window_s:,.1f} s",
        "",
    )
    pace = f"{report.live_rate_eps:,.0f} ev/s" if report.live_rate_eps else "unpaced"
    t.add_row("live traffic paced at", pace, "")
    t.add_row("latency ordinary p50 / p99", f"{ms('ordinary_p50')} / {ms('ordinary_p99')}", "")
    t.add_row("latency terminal p50 / p99", f"{ms('terminal_p50')} / {ms('terminal_p99')}", "")
    codes = ", ".join("killed" if c is None else str(c) for c in report.replica_exit_codes)
    t.add_row("replicas (exit codes)", f"{report.replicas} ({codes})", mark(report.replicas_clean))
    if report.replica_log_events:
        noted = ", ".join(f"{k} ×{v}" for k, v in sorted(report.replica_log_events.items()))
        t.add_row("replica warnings/errors", noted, "")
    t.add_row("wall time", f"{report.wall_s:,.1f} s", "")
    return t


# -- producers -------------------------------------------------------------------------------


class Tally:
    """What the producers committed, shared across their threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.committed: list[Committed] = []

    def add(self, run_id: str, tx: Sequence[Event], live: bool) -> None:
        with self._lock:
            self.committed.extend(Committed(e.event_id, run_id, e.terminal, live) for e in tx)

    def __len__(self) -> int:
        return len(self.committed)


class Producer(threading.Thread):
    """One producer connection committing its runs' transactions, interleaved across a window
    of open runs (each run's transactions in order), optionally paced to `rate` events/s."""

    def __init__(
        self,
        url: str,
        schema: str,
        plans: Sequence[RunPlan],
        tally: Tally,
        stop: threading.Event,
        *,
        live: bool,
        rate: float,
        seed: int,
    ) -> None:
        super().__init__(name="demo-producer", daemon=True)
        self.url, self.schema, self.plans = url, schema, plans
        self.tally, self.stop_event, self.live, self.rate = tally, stop, live, rate
        self.rng = random.Random(seed)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._produce()
        except BaseException as exc:
            self.error = exc

    def _produce(self) -> None:
        waiting = deque(self.plans)
        open_runs: list[list[Any]] = []  # [plan, index of its next transaction]
        sent = 0
        started = time.monotonic()
        with psycopg.connect(self.url, autocommit=True, application_name="relay-demo") as conn:
            while (waiting or open_runs) and not self.stop_event.is_set():
                while waiting and len(open_runs) < PRODUCER_WINDOW:
                    open_runs.append([waiting.popleft(), 0])
                i = self.rng.randrange(len(open_runs))
                plan, step = open_runs[i]
                tx = plan.transactions[step]
                for attempt in range(5):
                    try:
                        with conn.transaction():
                            enqueue_many(conn, plan.run_id, tx, schema=self.schema)
                        break
                    except psycopg.errors.LockNotAvailable:
                        if attempt == 4:
                            raise
                self.tally.add(plan.run_id, tx, self.live)
                if step + 1 == len(plan.transactions):
                    open_runs[i] = open_runs[-1]
                    open_runs.pop()
                else:
                    open_runs[i][1] = step + 1
                sent += len(tx)
                if self.rate > 0:
                    ahead = sent / self.rate - (time.monotonic() - started)
                    if ahead > 0:
                        self.stop_event.wait(ahead)


def run_producers(
    url: str,
    schema: str,
    plans: Sequence[RunPlan],
    tally: Tally,
    stop: threading.Event,
    *,
    n: int,
    live: bool,
    rate: float,
    seed: int,
) -> list[Producer]:
    n = max(1, min(n, len(plans)))
    producers = [
        Producer(url, schema, plans[k::n], tally, stop, live=live, rate=rate / n, seed=seed + k)
        for k in range(n)
    ]
    for p in producers:
        p.start()
    return producers


# -- the shell -------------------------------------------------------------------------------


class DemoFailed(Exception):
    """The demo could not finish; the message says why and where to look."""


class Interrupted(BaseException):
    """SIGTERM/SIGINT: clean up and leave."""


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signal.Signals(signum).name)


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


class Replica:
    def __init__(self, index: int, env: dict[str, str], log_path: Path) -> None:
        self.index = index
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "relay.cli", "run"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # our Ctrl-C must not reach it: we stop it with SIGTERM
        )
        self.exit_code: int | None = None

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None when it had to be killed."""
        try:
            self.exit_code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self.exit_code = None
        self._log.close()
        return self.exit_code

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


def count_log_events(paths: Sequence[Path]) -> dict[str, int]:
    """Warning and error decisions logged by the replicas, by event name."""
    counts: Counter[str] = Counter()
    for path in paths:
        with contextlib.suppress(OSError), path.open("rb") as f:
            for line in f:
                try:
                    obj = orjson.loads(line)
                    name = obj.get("event") or obj.get("msg") or "unknown"
                except (orjson.JSONDecodeError, AttributeError):
                    name = "non-json output"
                counts[str(name)] += 1
    return dict(counts)


@dataclass
class Options:
    runs: int
    replicas: int
    producers: int
    schema: str
    rate: float | None
    timeout: float
    seed: int
    json_path: Path | None
    database_url: str | None


class Demo:
    def __init__(self, opts: Options, console: Console) -> None:
        self.o = opts
        self.console = console
        self.stack = contextlib.ExitStack()
        self.tmp = Path(tempfile.mkdtemp(prefix="relay-demo-"))
        self.keep_logs = False
        self.stop_producers = threading.Event()
        self.producers: list[Producer] = []
        self.replicas: list[Replica] = []
        self.tally = Tally()
        self.prefix = f"{opts.schema}-{secrets.token_hex(3)}-"
        self.url = ""
        self.clock_offset = 0.0  # database clock minus this machine's
        self.deadline = float("inf")
        self.live_rate = 0.0

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        self.stop_producers.set()
        for p in self.producers:
            p.join(5)
        for r in self.replicas:
            r.terminate()
        for r in self.replicas:
            if r.exit_code is None and r.proc.returncode is None:
                r.wait(REPLICA_STOP_TIMEOUT)
        self.stack.close()
        if self.keep_logs and any(r.log_path.stat().st_size for r in self.replicas):
            shutil.rmtree(self.tmp / "pg", ignore_errors=True)
            self.console.print(f"replica logs kept in {self.tmp / 'logs'}")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def run(self) -> Report:
        started = time.monotonic()
        self._database()
        sink_url, sink = self._sink()
        plans = plan_workload(self.o.runs, self.prefix, self.o.seed)
        total = sum(p.events for p in plans)
        self.console.print(
            f"workload: {len(plans):,} runs, {total:,} events (--seed {self.o.seed}); "
            f"run ids start with {self.prefix!r}"
        )
        half = len(plans) // 2
        with self._progress() as progress:
            enq = progress.add_task("enqueued", total=total, info="")
            dlv = progress.add_task("delivered", total=total, info="")
            # 1. A backlog, as after an outage: half the runs, committed before any relay runs.
            self.producers = run_producers(
                self.url, self.o.schema, plans[:half], self.tally, self.stop_producers,
                n=self.o.producers, live=False, rate=0, seed=self.o.seed,
            )  # fmt: skip
            while any(p.is_alive() for p in self.producers):
                progress.update(enq, completed=len(self.tally), info="backlog, before the relays")
                time.sleep(0.1)
            self._check_producers()
            # 2. The replicas start and drain it.
            self._start_replicas(sink_url)
            self.deadline = time.monotonic() + self.o.timeout
            self._wait_listening(progress, enq)
            drain = self._wait_acked(progress, enq, dlv, total, sink, "draining the backlog")
            # 3. Live traffic while they run, paced below what the drain showed they can take,
            # so its latency is the relay's own and not time spent queued behind a backlog.
            live = plans[half:]
            per_tx = sum(p.events for p in live) / max(1, sum(len(p.transactions) for p in live))
            self.live_rate = live_rate(half, drain, per_tx) if self.o.rate is None else self.o.rate
            self.producers += run_producers(
                self.url, self.o.schema, live, self.tally, self.stop_producers,
                n=self.o.producers, live=True, rate=self.live_rate, seed=self.o.seed + 1000,
            )  # fmt: skip
            pace = f"{self.live_rate:,.0f}/s" if self.live_rate > 0 else "unpaced"
            self._wait_acked(progress, enq, dlv, total, sink, f"live, {pace}")
        codes = self._stop_replicas()
        return self._report(plans, sink, codes, time.monotonic() - started)

    # -- steps -------------------------------------------------------------------------------

    def _database(self) -> None:
        url = self.o.database_url
        if not url:
            with warnings.catch_warnings():
                # pgserver's platformdirs warns about XDG_RUNTIME_DIR; the demo does not use it.
                warnings.simplefilter("ignore")
                from relay.tools.embedded import EmbeddedPostgres

                try:
                    server = EmbeddedPostgres(self.tmp / "pg", durable=True)
                except RuntimeError as exc:  # no PostgreSQL binaries
                    raise DemoFailed(str(exc)) from None
            with self.console.status("starting an embedded PostgreSQL…"):
                self.stack.callback(server.stop)
                try:
                    url = server.start()
                except (OSError, subprocess.SubprocessError) as exc:
                    detail = getattr(exc, "stderr", None) or b""
                    text = detail.decode(errors="replace") if isinstance(detail, bytes) else ""
                    raise DemoFailed(
                        f"cannot start an embedded PostgreSQL ({exc}) {text.strip()[-500:]}\n"
                        "set RELAY_DATABASE_URL to use an existing server"
                    ) from None
            self.console.print(f"embedded PostgreSQL at {url} (data in {server.datadir})")
        else:
            self.console.print(f"PostgreSQL at {redact_url(url)} (RELAY_DATABASE_URL)")
        self.url = url
        with self.console.status("migrating…"):
            result = migrate(url, self.o.schema)
        self.console.print(f"schema {self.o.schema} at version {result.version}")
        if install_absurd(url, (QUEUE,)):
            self.console.print("installed the Absurd schema")
        with psycopg.connect(url, autocommit=True) as conn:
            self.clock_offset = _clock_offset(conn)
        self.console.print(f"Absurd queue {QUEUE!r} ready")

    def _sink(self) -> tuple[str, SinkThread]:
        sink = Sink()
        sink.state.keep_received = False
        thread = SinkThread(sink)
        base = thread.start()
        self.stack.callback(thread.stop)
        self.console.print(f"reference sink at {base}")
        return f"{base}/runs/{{run_id}}/events", thread

    def _start_replicas(self, ingress_url: str) -> None:
        base = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
        (self.tmp / "logs").mkdir(exist_ok=True)
        tag = secrets.token_hex(2)
        for i in range(self.o.replicas):
            env = {
                **base,
                "RELAY_DATABASE_URL": self.url,
                "RELAY_INGRESS_URL": ingress_url,
                "RELAY_SCHEMA": self.o.schema,
                "RELAY_LOG_LEVEL": "warning",
                "RELAY_REPLICA_ID": f"demo-{tag}-{i + 1}",
            }
            path = self.tmp / "logs" / f"replica-{i + 1}.log"
            self.replicas.append(Replica(i + 1, env, path))
        self.console.print(
            f"started {self.o.replicas} relay replicas (logs in {self.tmp / 'logs'})"
        )

    def _wait_acked(
        self,
        progress: Progress,
        enq: TaskID,
        dlv: TaskID,
        total: int,
        sink: SinkThread,
        phase: str,
    ) -> float | None:
        """Wait until the producers are done and every committed event is acknowledged.
        Returns the seconds from the phase's first receipt at the sink to then (None if none)."""
        count_q = sql.SQL(
            "select count(*) filter (where state = 'delivered'),"
            " count(*) filter (where state = 'failed') from {}.events"
            " where starts_with(run_id, %s)"
        ).format(sql.Identifier(self.o.schema))
        baseline = sink.stats()["unique_events"]
        first_receipt: float | None = None
        with psycopg.connect(self.url, autocommit=True, application_name="relay-demo") as conn:
            while True:
                self._check_producers()
                self._check_replicas()
                row = conn.execute(count_q, (self.prefix,)).fetchone()
                acked, failed = (int(row[0]), int(row[1])) if row else (0, 0)
                stats = sink.stats()
                now = time.monotonic()
                if first_receipt is None and stats["unique_events"] > baseline:
                    first_receipt = now - POLL_INTERVAL / 2
                enqueued = len(self.tally)
                producing = any(p.is_alive() for p in self.producers)
                progress.update(enq, completed=enqueued, info=phase)
                progress.update(
                    dlv,
                    completed=min(stats["unique_events"], total),
                    info=f"acked {acked:,} · duplicates {stats['duplicates']:,}",
                )
                if failed:
                    raise DemoFailed(
                        f"{failed} event(s) failed and blocked their runs: "
                        f"inspect with `relay inspect` (schema {self.o.schema})"
                    )
                if not producing and acked >= enqueued:
                    return None if first_receipt is None else now - first_receipt
                if now > self.deadline:
                    raise DemoFailed(
                        f"timed out after {self.o.timeout:g} s: {acked:,} of {enqueued:,} events "
                        f"acknowledged ({stats['unique_events']:,} at the sink)"
                    )
                time.sleep(POLL_INTERVAL)

    def _wait_listening(self, progress: Progress, enq: TaskID) -> None:
        """Wait (a bounded while) until every replica's LISTEN connection is up, so the live
        half does not start before anyone can hear it. Best effort: the replicas name their
        connections alike, so count LISTENing backends that started after ours were spawned."""
        progress.update(enq, info="waiting for the replicas to LISTEN")
        query = (
            "select count(*) from pg_stat_activity where application_name = 'ledger-relay'"
            " and query ilike 'listen%%' and backend_start >= to_timestamp(%s)"
        )
        since = time.time() - 1.0 + self.clock_offset
        until = min(self.deadline, time.monotonic() + 30.0)
        with psycopg.connect(self.url, autocommit=True, application_name="relay-demo") as conn:
            while time.monotonic() < until:
                self._check_replicas()
                row = conn.execute(query, (since,)).fetchone()
                if row and int(row[0]) >= len(self.replicas):
                    return
                time.sleep(0.05)

    def _check_producers(self) -> None:
        for p in self.producers:
            if p.error is not None:
                raise DemoFailed(f"a producer failed: {type(p.error).__name__}: {p.error}")

    def _check_replicas(self) -> None:
        for r in self.replicas:
            code = r.proc.poll()
            if code is not None:
                raise DemoFailed(
                    f"relay replica {r.index} exited with code {code}; its log ends:\n{r.tail()}"
                )

    def _stop_replicas(self) -> list[int | None]:
        with self.console.status("stopping the replicas (SIGTERM)…"):
            for r in self.replicas:
                r.terminate()
            return [r.wait(REPLICA_STOP_TIMEOUT) for r in self.replicas]

    def _report(
        self, plans: Sequence[RunPlan], sink: SinkThread, codes: list[int | None], wall: float
    ) -> Report:
        schema = sql.Identifier(self.o.schema)
        with psycopg.connect(self.url, autocommit=True) as conn:
            rows = conn.execute(
                sql.SQL(
                    "select event_id, extract(epoch from created_at)::float8 from {}.events"
                    " where starts_with(run_id, %s)"
                ).format(schema),
                (self.prefix,),
            ).fetchall()
            failed = conn.execute(
                sql.SQL(
                    "select count(*) from {}.events where starts_with(run_id, %s)"
                    " and state = 'failed'"
                ).format(schema),
                (self.prefix,),
            ).fetchone()
            wakes = conn.execute(
                sql.SQL("select count(*) from absurd.{} where starts_with(event_name, %s)").format(
                    sql.Identifier(f"e_{QUEUE}")
                ),
                (f"run-created:{self.prefix}",),
            ).fetchone()
        created_at = {r[0]: float(r[1]) - self.clock_offset for r in rows}
        # The replicas have exited: nothing writes the sink's state any more.
        state = sink.sink.state
        report = build_report(
            runs=len(plans),
            committed=self.tally.committed,
            created_at=created_at,
            deliveries=state.deliveries,
            first_seen_at=state.first_seen_at,
            first_order=state.first_order,
            wakes=int(wakes[0]) if wakes else 0,
            replica_exit_codes=codes,
            replica_log_events=count_log_events([r.log_path for r in self.replicas]),
            failed_events=int(failed[0]) if failed else 0,
            live_rate_eps=self.live_rate,
            wall_s=wall,
        )
        report.seed = self.o.seed
        if report.replica_log_events or not report.ok:
            self.keep_logs = True
        return report

    def _progress(self) -> Progress:
        return Progress(
            TextColumn("[bold]{task.description:>9}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self.console,
        )


def _clock_offset(conn: psycopg.Connection[Any], samples: int = 5) -> float:
    """The database clock minus this machine's, from the sample with the shortest round trip."""
    best: tuple[float, float] | None = None
    for _ in range(samples):
        t0 = time.time()
        row = conn.execute("select extract(epoch from clock_timestamp())::float8").fetchone()
        t1 = time.time()
        assert row is not None
        rtt, offset = t1 - t0, float(row[0]) - (t0 + t1) / 2
        if best is None or rtt < best[0]:
            best = (rtt, offset)
    assert best is not None
    return best[1]


# -- command line ----------------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> Options:
    p = argparse.ArgumentParser(
        prog="relay demo",
        description="Run PostgreSQL, the reference sink and several relay replicas on this "
        "machine, push a realistic workload through them and report what arrived.",
    )
    p.add_argument("--runs", type=int, default=3000, help="runs to enqueue (default 3000)")
    p.add_argument("--replicas", type=int, default=2, help="relay replicas (default 2)")
    p.add_argument("--producers", type=int, default=4, help="producer connections (default 4)")
    p.add_argument("--schema", default="relay", help="relay schema (default relay)")
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="events/s of the live half (committed while the relays run), 0 for unpaced; "
        "default: about half the capacity the replicas showed draining the backlog",
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait for delivery (default 600)"
    )
    p.add_argument("--seed", type=int, default=None, help="workload seed (default random)")
    p.add_argument("--json", dest="json_path", type=Path, help="also write the report here")
    p.add_argument(
        "--database-url",
        default=None,
        help="use this PostgreSQL instead of an embedded one [RELAY_DATABASE_URL]",
    )
    a = p.parse_args(argv)
    if a.runs < 1:
        p.error("--runs must be at least 1")
    if a.replicas < 1:
        p.error("--replicas must be at least 1")
    if a.rate is not None and a.rate < 0:
        p.error("--rate must be positive (0: unpaced)")
    if a.producers < 1:
        p.error("--producers must be at least 1")
    try:
        validate_schema_name(a.schema)
    except ValueError as exc:
        p.error(str(exc))
    return Options(
        runs=a.runs,
        replicas=a.replicas,
        producers=a.producers,
        schema=a.schema,
        rate=a.rate,
        timeout=a.timeout,
        seed=a.seed if a.seed is not None else random.randrange(2**31),
        json_path=a.json_path,
        database_url=a.database_url or os.environ.get("RELAY_DATABASE_URL") or None,
    )


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(list(sys.argv[1:] if argv is None else argv))
    console = Console(highlight=False)
    demo = Demo(opts, console)
    code = 1
    with _signals_interrupt():
        try:
            try:
                report = demo.run()
            except BaseException:
                demo.keep_logs = True
                raise
            finally:
                demo.close()
        except Interrupted as exc:
            console.print(f"[bold red]interrupted ({exc}); everything it started is stopped")
            return 130
        except (DemoFailed, SchemaError) as exc:
            console.print(f"[bold red]relay demo failed:[/bold red] {exc}")
            return 1
        except psycopg.OperationalError as exc:
            console.print(f"[bold red]relay demo: database error:[/bold red] {exc}")
            return 1
    console.print(render_report(report))
    if opts.json_path is not None:
        opts.json_path.write_bytes(
            orjson.dumps(report.as_json(), option=orjson.OPT_INDENT_2) + b"\n"
        )
    if report.ok:
        console.print("[bold green]PASS[/bold green]: nothing lost, per-run order kept, "
                      "every run woke the engine once")  # fmt: skip
        code = 0
    else:
        console.print("[bold red]FAIL[/bold red]: see the ✗ rows above")
    return code
