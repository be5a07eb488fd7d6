"""The demo's workload: what a scheduler would commit (pure: `plan_workload`), and the
producer threads that commit it (`run_producers`), tallying each event as `Committed`."""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from relay.producer import Event, enqueue_many

QUEUE = "demo"
PRODUCER_WINDOW = 8  # runs a producer has open at once, interleaving their transactions
MIN_LIVE_RATE, MAX_LIVE_RATE = 50.0, 20_000.0  # events/s

WORKFLOWS = ("invoice-reconciliation", "nightly-settlement", "kyc-refresh", "payout-batch")
STEPS = ("fetch-ledger", "match-entries", "compute-fees", "post-journal", "notify-owner")


# -- the plan (pure) -------------------------------------------------------------------------


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


@dataclass(frozen=True)
class Committed:
    """An enqueued event as the producer saw it committed."""

    event_id: str
    run_id: str
    terminal: bool
    live: bool  # committed while the relays ran (not part of the initial backlog)


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
