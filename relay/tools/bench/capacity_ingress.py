"""A capacity-limited ingress for `relay bench` (issue 42): the reference sink behind a small
worker pool, and what it recorded.

A runtime behind an ingress serves a fixed number of requests at a time and queues the rest
first come first served. `Workers` is that pool: `workers` POSTs in service at once, each for
`service` seconds, the rest waiting in arrival order; `set()` changes either while it runs (the
capacity drop). `CapacitySink` puts the sink's run route behind it, so dedupe, per-run order and
stale epochs are still the sink's (`SinkState`), and keeps one `Post` per request: its arrival,
the start and end of its service, its answer, and the terminal events it carried.

The figures (in flight at the ingress, queueing, goodput, terminal delay) are pure functions of
those records and of the capacity's changes over time, on one monotonic clock.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import orjson

from relay.tools.demo import percentile
from relay.tools.sink import Reply, Sink


@dataclass(frozen=True)
class Post:
    """One POST as the ingress saw it (monotonic seconds)."""

    arrival: float  # the request reached the app (its body read)
    start: float  # a worker took it
    end: float  # its answer was ready
    status: int
    events: int
    terminals: tuple[str, ...] = ()  # event ids of the terminal events it carried
    run_id: str = ""  # the run its URL named

    @property
    def queued(self) -> float:
        return self.start - self.arrival


@dataclass(frozen=True)
class Capacity:
    """What the ingress serves from `at` on: `workers` at a time, `service` seconds each."""

    at: float
    workers: int
    service: float

    @property
    def per_second(self) -> float:
        return self.workers / self.service


class Workers:
    """A pool of `workers` serving one POST at a time each, the rest waiting first come first
    served. A freed worker goes straight to the oldest waiter (no newcomer passes it)."""

    def __init__(
        self, workers: int, service: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.clock = clock
        self.changes: list[Capacity] = [Capacity(clock(), workers, service)]
        self.busy = 0
        self._waiting: deque[anyio.Event] = deque()

    @property
    def now(self) -> Capacity:
        return self.changes[-1]

    def set(self, workers: int, service: float) -> None:
        """Change the capacity from now on; POSTs in service keep the service time they began
        with. Fewer workers take effect as POSTs finish, more at once."""
        self.changes.append(Capacity(self.clock(), workers, service))
        self._grant()

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[float]:
        """Wait for a worker; yields the service time in force when it was taken."""
        if self.busy < self.now.workers and not self._waiting:
            self.busy += 1
        else:
            granted = anyio.Event()
            self._waiting.append(granted)
            try:
                await granted.wait()
            except BaseException:
                if granted.is_set():  # the worker was ours already: hand it on
                    self._release()
                else:
                    self._waiting.remove(granted)
                raise
        try:
            yield self.now.service
        finally:
            self._release()

    def _release(self) -> None:
        self.busy -= 1
        self._grant()

    def _grant(self) -> None:
        while self._waiting and self.busy < self.now.workers:
            self.busy += 1
            self._waiting.popleft().set()


def _carried(body: bytes) -> tuple[int, tuple[str, ...]]:
    """How many events a run batch carries, and its terminal events' ids; (0, ()) for a body
    the sink refuses."""
    try:
        events: Any = orjson.loads(body).get("events")
        terminals = tuple(
            str(e["event_id"]) for e in events if isinstance(e, dict) and e.get("terminal") is True
        )
        return len(events), terminals
    except (orjson.JSONDecodeError, AttributeError, TypeError, KeyError):
        return 0, ()


class CapacitySink(Sink):
    """The reference sink's run route behind `Workers`: every POST waits for a worker, holds it
    for the service time, then is recorded by the sink (its first receipt is the end of its
    service). `/batch` and the controls are not limited: the relay at its defaults does not
    use them."""

    def __init__(self, workers: int, service: float) -> None:
        super().__init__()
        self.state.keep_received = False
        self.pool = Workers(workers, service)
        self.posts: list[Post] = []

    async def _run_events(self, url_run_id: str, body: bytes, headers: dict[str, str]) -> Reply:
        clock = self.pool.clock
        arrival = clock()
        async with self.pool.slot() as service:
            start = clock()
            await anyio.sleep(service)
            reply = await super()._run_events(url_run_id, body, headers)
            end = clock()
        self.posts.append(Post(arrival, start, end, reply.status, *_carried(body), url_run_id))
        return reply


# -- the figures ----------------------------------------------------------------------------


def in_flight(posts: Sequence[Post], t0: float, t1: float, step: float) -> list[int]:
    """POSTs at the ingress (arrived, not yet answered: queued or in service) at t0, t0 + step,
    ... up to t1."""
    arrivals = sorted(p.arrival for p in posts)
    ends = sorted(p.end for p in posts)
    out = []
    for k in range(int((t1 - t0) / step) + 1):
        t = t0 + k * step
        out.append(bisect.bisect_right(arrivals, t) - bisect.bisect_right(ends, t))
    return out


def servable(changes: Sequence[Capacity], t0: float, t1: float) -> float:
    """POSTs the ingress could have served from t0 to t1 at its capacity over that time."""
    total = 0.0
    for i, c in enumerate(changes):
        until = changes[i + 1].at if i + 1 < len(changes) else t1
        lo, hi = max(c.at, t0), min(until, t1)
        if hi > lo:
            total += (hi - lo) * c.per_second
    return total


def at(changes: Sequence[Capacity], t: float) -> Capacity:
    """The capacity in force at `t`."""
    current = changes[0]
    for c in changes:
        if c.at <= t:
            current = c
    return current


@dataclass(frozen=True)
class Figures:
    """Issue 42's figures over one window [t0, t1] of a run at a capacity-limited ingress."""

    posts: int  # answered 2xx in the window
    in_flight_p90: int
    in_flight_max: int
    queueing_p99: float  # s, of the POSTs that arrived in the window
    goodput: float  # POSTs answered 2xx / what the capacity could serve
    terminal_p99: float | None  # s, commit -> the end of its POST's service
    terminals: int
    workers: int  # the capacity in force at the window's start, for the multiples
    service: float

    @property
    def in_flight_x(self) -> float:
        return self.in_flight_p90 / self.workers

    @property
    def queueing_x(self) -> float:
        return self.queueing_p99 / self.service

    @property
    def terminal_x(self) -> float | None:
        return None if self.terminal_p99 is None else self.terminal_p99 / self.service


STEP = 0.01  # s between samples of in flight


def figures(
    posts: Sequence[Post],
    changes: Sequence[Capacity],
    t0: float,
    t1: float,
    committed: dict[str, float] | None = None,
) -> Figures:
    """The figures of [t0, t1]; `committed`: terminal event id -> the monotonic time its commit
    returned (the delays of those committed in the window count)."""
    ok = [p for p in posts if 200 <= p.status < 300]
    served = [p for p in ok if t0 <= p.end <= t1]
    arrived = [p.queued for p in posts if t0 <= p.arrival <= t1]
    samples = in_flight(posts, t0, t1, STEP)
    inside = {e: c for e, c in (committed or {}).items() if t0 <= c <= t1}
    delays = list(terminal_delays(ok, inside).values())
    can = servable(changes, t0, t1)
    c = at(changes, t0)
    return Figures(
        posts=len(served),
        in_flight_p90=int(percentile(samples, 90) or 0),
        in_flight_max=max(samples, default=0),
        queueing_p99=percentile(arrived, 99) or 0.0,
        goodput=len(served) / can if can else 0.0,
        terminal_p99=percentile([d for d, _ in delays], 99),
        terminals=len(delays),
        workers=c.workers,
        service=c.service,
    )


def terminal_delays(
    ok: Sequence[Post], committed: dict[str, float]
) -> dict[str, tuple[float, float]]:
    """Terminal event id -> (commit to the end of the first 2xx POST that carried it, that
    end), for the committed ones that arrived."""
    first: dict[str, float] = {}
    for p in ok:
        for event_id in p.terminals:
            if event_id in committed and (event_id not in first or p.end < first[event_id]):
                first[event_id] = p.end
    return {e: (end - committed[e], end) for e, end in first.items()}


def follows(
    samples: Sequence[int],
    t0: float,
    step: float,
    start: float,
    until: float,
    fits: Callable[[int], bool],
) -> float | None:
    """Seconds from `start` until in flight fits (`fits`) at every sample up to `until`; None
    if it never does. `samples` are `in_flight(..., t0, ..., step)`."""
    first = max(0, math.ceil((start - t0) / step - 1e-9))
    last = min(len(samples), round((until - t0) / step))
    since: int | None = None
    for k in range(first, last):
        if fits(samples[k]):
            since = k if since is None else since
        else:
            since = None
    return None if since is None else round(since * step + t0 - start, 3)


# -- the limit following the capacity --------------------------------------------------------

FOLLOW_WITHIN = 5.0  # s: issue 42's "the limit follows within 5 s each way"
FOLLOW_DOWN = 3  # after a fall, the replicas' summed limit fits this many times the new workers


@dataclass(frozen=True)
class LimitSample:
    """The replicas' `ledger_relay_post_limit` summed, scraped at `at` (monotonic s)."""

    at: float
    total: float


def settles(
    series: Sequence[LimitSample], start: float, until: float, fits: Callable[[float], bool]
) -> float | None:
    """Seconds from `start` to the first sample in [start, until) from which every sample up to
    `until` fits (for good, not a dip); None if the last one before `until` does not fit."""
    since: float | None = None
    for s in series:
        if not start <= s.at < until:
            continue
        if fits(s.total):
            since = s.at if since is None else since
        else:
            since = None
    return None if since is None else round(since - start, 3)


def reaches(
    series: Sequence[LimitSample], start: float, until: float, fits: Callable[[float], bool]
) -> float | None:
    """Seconds from `start` to the first sample in [start, until) that fits; None if none does
    (a rise is followed once it is reached: the sawtooth below it afterwards is the limit
    probing the ingress, not failing to follow it)."""
    for s in series:
        if start <= s.at < until and fits(s.total):
            return round(s.at - start, 3)
    return None


@dataclass(frozen=True)
class Follow:
    """How soon the summed limit followed a capacity drop and its recovery (issue 42).

    - `down_s`: from the drop to the first scrape from which the summed limit stays
      <= `FOLLOW_DOWN` x the workers of the dropped capacity, or the replicas' summed floor if
      that is higher (`down_to`; the limit never goes below its floor, docs/admission.md §1),
      until the recovery;
    - `up_s`: from the recovery to the first scrape at which the summed limit is >= the
      workers of the capacity before the drop, or the replicas' summed ceiling if that is lower
      (`up_to`), until the end of the run.
    None: never within the phase. Met when both are <= `FOLLOW_WITHIN`."""

    down_s: float | None
    up_s: float | None
    down_to: float
    up_to: float

    @property
    def met(self) -> bool:
        return all(s is not None and s <= FOLLOW_WITHIN for s in (self.down_s, self.up_s))

    @property
    def worst(self) -> float | None:
        """The slower of the two ways (None if either never followed)."""
        if self.down_s is None or self.up_s is None:
            return None
        return max(self.down_s, self.up_s)


def limit_follows(
    series: Sequence[LimitSample],
    changes: Sequence[Capacity],
    fell: float,
    back: float,
    end: float,
    floor: float,
    ceiling: float,
) -> Follow:
    """`Follow` of a drop at `fell` and a recovery at `back`, the run ending at `end`;
    `floor`, `ceiling`: the replicas' least and most limits summed."""
    down_to = max(float(FOLLOW_DOWN * at(changes, fell).workers), floor)
    up_to = min(float(at(changes, fell - 1e-9).workers), ceiling)
    return Follow(
        down_s=settles(series, fell, back, lambda n: n <= down_to),
        up_s=reaches(series, back, end, lambda n: n >= up_to),
        down_to=down_to,
        up_to=up_to,
    )
