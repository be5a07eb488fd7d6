"""The adaptive limit on POSTs in flight to the ingress, per replica: additive increase while the
ingress keeps up, multiplicative decrease when its answers show queueing or overload (issue 42).

Each POST's answer is one `Sample`: its round trip, and whether it said the ingress is full
(429, 503, 504, a timeout). Samples are judged a window at a time, a window holding as many
answers as the limit allows (one round trip's worth when the limit is used), so the limit moves
about once per round trip, as TCP's congestion window does and as Vector's adaptive request
concurrency does:

- **decrease** when a sample of the window said "full" (halve), or when the window's median
  round trip is well above the recent minimum (queueing inside the ingress; the relay's own
  event loop running late, `Sample.lag`, is added to what is tolerated): multiply by
  min_rtt / median, at least 0.5 (Gradient2's gradient; at a saturated ingress that brings the
  limit to the concurrency at which nothing queues, by Little's law);
- **increase** by one otherwise, if the window's POSTs used at least half the limit (a limit
  that is not used proves nothing) and no `Retry-After` is running; until the first decrease,
  double instead (TCP's slow start), so a relay that starts at an ingress that keeps up reaches
  its ceiling in a few round trips, not one round trip per POST of it; and stop doubling once a
  window's median round trip has risen by an eighth over the minimum (4-16 ms: HyStart++'s
  bounds, RFC 9406): the ingress has begun to queue, and a doubling judged a window late would
  put twice its capacity in flight before the decrease that follows (each replica of a fleet
  doubling at once: issue 50's quiet key waited 0.3-0.6 s behind that in a drain's first second);
- answers to POSTs sent before the last decrease are not judged again: they queued under the
  old limit, and what they say was acted on already. One burst of 503s is one decrease.

The recent minimum is a windowed minimum over MIN_RTT_SPAN seconds (BBR's min_rtt filter), so
the limit re-learns an ingress that became slower for good. The limit stays within
[min_limit, ceiling]; the ceiling is the operator's `concurrency`. Replicas that share an
ingress converge on a fair share of it without talking: they see the same queue, so they
decrease together by the same factor, which shrinks the difference between their limits, and
they increase by the same step, which keeps it (Chiu and Jain, 1989). docs/admission.md has the
rules, the constants and the anchors.

Pure: no I/O, no event loop; `now` is the monotonic clock, passed in.
"""

from __future__ import annotations

import enum
import math
import statistics
from dataclasses import dataclass, field

from relay.admission.windows import WindowedMin

OVERLOAD_STATUSES = frozenset({429, 503, 504})  # the ingress says it is full (504: its upstream)
MIN_LIMIT = (
    2  # one POST for the critical reserve, one for the ordinary lane (relay/admission/permits.py)
)
INITIAL_LIMIT = 4  # a restart of many replicas does not hit the ingress with their ceilings
TOLERANCE = 1.5  # a median round trip above min_rtt * TOLERANCE + RTT_SLACK is queueing
RTT_SLACK = 0.005  # seconds: a 1 ms ingress is not queueing at 2 ms (scheduling noise)
OVERLOAD_FACTOR = 0.5  # 429/503/504/timeout: halve, as TCP does on a loss
QUEUEING_FLOOR = 0.5  # the gradient min_rtt / median, never below this (Netflix Gradient2)
MIN_RTT_SPAN = 10.0  # seconds: how long a minimum round trip is believed (BBR's min_rtt filter)
SHARP_FALL = 0.5  # a fall to this share of the level before it is reported...
SHARP_FALL_PERMITS = 4  # ...if it costs at least this many POSTs (not 4 -> 2 at a tiny ingress)
RECOVERED_SHARE = 0.9  # back to this share of the level it fell from: reported recovered
SUSTAINED = 60.0  # seconds fallen for queueing, not recovered: now a warning (docs/admission.md)
IDLE_SPAN = MIN_RTT_SPAN  # seconds with no POST in flight and no answer: the pressure is gone
# Slow start ends once a window's median round trip exceeds the minimum by an eighth of it,
# within these bounds (seconds; HyStart++'s RttThresh, RFC 9406 section 4.2)
SLOW_START_RISE_MIN = 0.004
SLOW_START_RISE_MAX = 0.016


class Signal(enum.Enum):
    """What one POST's answer says about the ingress's load."""

    ANSWERED = "answered"  # an answer came: its round trip tells how the ingress keeps up
    OVERLOADED = "overloaded"  # 429, 503, 504 or a timeout: the ingress is full
    SILENT = "silent"  # nothing about load (connection refused, abandoned): not judged


@dataclass(frozen=True, slots=True)
class Sample:
    """One POST's answer as the limit reads it: `rtt` from send to answer (or to the timeout),
    in seconds; `retry_after` the ingress's Retry-After, parsed and clamped
    (relay/core/policy.py)."""

    rtt: float
    signal: Signal
    retry_after: float | None = None
    # Seconds the relay's own event loop ran late around this answer (relay/delivery/post_turn.py's
    # `LoopLag`): a busy relay reads its answers late, which is its queueing, not the ingress's.
    lag: float = 0.0

    @classmethod
    def of(
        cls,
        status: int | None,
        rtt: float,
        *,
        timed_out: bool = False,
        retry_after: float | None = None,
        lag: float = 0.0,
    ) -> Sample:
        """The sample of an answer with `status` (None: no answer; `timed_out` says whether
        the POST ran out of time, which is overload, or failed otherwise, which is not)."""
        if timed_out or status in OVERLOAD_STATUSES:
            return cls(rtt, Signal.OVERLOADED, retry_after, lag)
        if status is None:
            return cls(rtt, Signal.SILENT, retry_after, lag)
        return cls(rtt, Signal.ANSWERED, retry_after, lag)


class Change(enum.Enum):
    FELL = "fell"  # the limit fell sharply: the caller logs `limit_fell`
    RECOVERED = "recovered"  # the pressure is gone: the caller logs `limit_recovered`


@dataclass(frozen=True, slots=True)
class LimitEvent:
    """A sharp fall of the limit or its recovery, for a log line. A fall is a warning
    (`warning`) when the ingress said it is full (429, 503, 504, a timeout), or when queueing
    has held the limit down for SUSTAINED seconds (`fallen_for`, then a second FELL of the same
    fall); a fall for queueing alone is the limit doing its job at a busy ingress."""

    change: Change
    limit: int  # the limit now
    level: int  # the level it fell from (for a recovery too)
    # What moved it: "overload" or "queueing" (fell); "growth" (back near its level), "unused"
    # (a window used less than half of it) or "idle" (nothing in flight for IDLE_SPAN): recovered
    reason: str
    warning: bool = False
    fallen_for: float = 0.0  # seconds since it fell (0.0 at the fall itself)


@dataclass(frozen=True, slots=True)
class LimitView:
    """The limit as observers (metrics, the status page, `relay status`) read it."""

    value: float  # the limit, unrounded (it grows by whole POSTs and shrinks by factors)
    allowed: int  # POSTs in flight it allows
    ceiling: int
    min_rtt: float | None  # seconds: the recent minimum round trip, None before any
    median_rtt: float | None  # seconds: the last judged window's median round trip
    paused_until: float  # no growth before this (a Retry-After)
    fallen: bool  # it fell sharply and has not recovered yet


@dataclass(slots=True)
class _Window:
    """What a round trip's worth of answers told, to be judged as one: `size` answers (the
    limit when the window opened), or fewer when one of them said the ingress is full."""

    size: int
    rtts: list[float] = field(default_factory=list)
    overloaded: bool = False
    busiest: int = 0  # the most POSTs in flight when one of the window's was sent
    lag: float = 0.0  # the most the relay's own event loop ran late around one of its answers


class Level(enum.Enum):
    STEADY = "steady"  # the limit moves within its usual range
    FALLEN = "fallen"  # it fell sharply and has not come back yet


class Limit:
    """One replica's limit on POSTs in flight: `observe()` each answer, read `allowed`."""

    def __init__(
        self,
        ceiling: int,
        *,
        min_limit: int = MIN_LIMIT,
        initial: int = INITIAL_LIMIT,
        slow_start: bool = True,
    ) -> None:
        if not 1 <= min_limit <= ceiling:
            raise ValueError(f"limits [{min_limit}, {ceiling}] are not a range")
        self.ceiling = ceiling
        self._min_limit = min_limit
        self._value: float  # the limit, unrounded, and `_allowed`, what it allows: set by `_move`
        self._allowed: int
        self._move(float(max(min_limit, min(ceiling, initial))))
        self._min_rtt = WindowedMin(MIN_RTT_SPAN)
        self._window: _Window | None = None
        self._median: float | None = None  # the last judged window's median round trip
        self._decreased_at = -math.inf  # answers to POSTs sent before this are not judged
        self._paused_until = -math.inf  # no growth before this (Retry-After)
        self._slow_start = slow_start  # doubles per window until the first decrease or rise
        self._level = Level.STEADY
        self._high = self.allowed  # the highest limit since it was last steady or reported
        self._fell_at = -math.inf  # when it last fell sharply
        self._warned = False  # this fall was reported as a warning already
        self._answered_at = -math.inf  # the last answer (idle: none for IDLE_SPAN)

    @property
    def min_limit(self) -> int:
        return self._min_limit

    @property
    def allowed(self) -> int:
        """POSTs in flight the limit allows now: read several times per POST (the permits'
        decisions, the windows), so kept as `_move` left it rather than worked out on each read."""
        return self._allowed

    def _move(self, value: float) -> None:
        """The limit's value becomes `value`, and what it allows with it: the only place either
        changes (`min_limit` is fixed at construction), so `allowed` is never stale."""
        self._value = value
        self._allowed = max(self._min_limit, math.floor(value))

    def view(self, now: float) -> LimitView:
        return LimitView(
            value=self._value,
            allowed=self.allowed,
            ceiling=self.ceiling,
            min_rtt=self._min_rtt.value(now),
            median_rtt=self._median,
            paused_until=self._paused_until,
            fallen=self._level is Level.FALLEN,
        )

    def observe(self, sample: Sample, *, inflight: int, now: float) -> LimitEvent | None:
        """Take one POST's answer, received at `now`; `inflight` counts the POSTs in flight
        once it was sent (itself included). Returns an event when the limit fell sharply or
        recovered."""
        self._answered_at = now
        if sample.retry_after is not None:
            self._paused_until = max(self._paused_until, now + sample.retry_after)
        if sample.signal is Signal.SILENT:
            return None
        if sample.signal is Signal.ANSWERED:
            self._min_rtt.add(sample.rtt, now)
        if now - sample.rtt < self._decreased_at:
            return None  # sent under a higher limit: what it says was acted on already
        window = self._window if self._window is not None else _Window(self.allowed)
        self._window = window
        window.busiest = max(window.busiest, inflight)
        window.lag = max(window.lag, sample.lag)
        if sample.signal is Signal.OVERLOADED:
            window.overloaded = True
        else:
            window.rtts.append(sample.rtt)
        if not window.overloaded and len(window.rtts) < window.size:
            return None
        self._window = None
        return self._judge(window, now)

    def settle(self, now: float, *, inflight: int) -> LimitEvent | None:
        """Called now and then (a second or so) with the POSTs in flight: a fallen limit with
        nothing in flight and no answer for IDLE_SPAN recovers ("idle"), since no pressure is
        left to hold it down and no window will close to say so."""
        idle = inflight == 0 and now - self._answered_at >= IDLE_SPAN
        return self._recover("idle", now) if idle else None

    def _judge(self, window: _Window, now: float) -> LimitEvent | None:
        """One decision for a window's answers: decrease, increase by one, or stay."""
        floor = self._min_rtt.value(now)
        median = statistics.median(window.rtts) if window.rtts else None
        if median is not None:
            self._median = median
        decrease = self._decrease(window, floor, median)
        if decrease is not None:
            factor, reason = decrease
            self._move(max(float(self.min_limit), self._value * factor))
            self._decreased_at = now
            self._slow_start = False
            return self._fall(reason, window, now)
        if window.busiest * 2 < self.allowed:
            # Unused: the limit holds back nothing (and does not grow, section 1 rule 3)
            return self._recover("unused", now)
        if window.rtts and now >= self._paused_until:
            if self._slow_start and self._rising(window, floor, median):
                self._slow_start = False
            step = self._value if self._slow_start else 1.0
            self._move(min(float(self.ceiling), self._value + step))
            return self._rise(now)
        return self._sustained(now)

    def _decrease(
        self, window: _Window, floor: float | None, median: float | None
    ) -> tuple[float, str] | None:
        """The factor to shrink the limit by, and why; None when the window shows neither
        overload nor queueing (its median round trip within tolerance of the minimum)."""
        if window.overloaded:
            return OVERLOAD_FACTOR, "overload"
        if floor is None or median is None:
            return None
        if median <= floor * TOLERANCE + RTT_SLACK + window.lag:
            return None  # the relay's own lateness is not the ingress's queueing
        return max(QUEUEING_FLOOR, floor / median), "queueing"

    @staticmethod
    def _rising(window: _Window, floor: float | None, median: float | None) -> bool:
        """The window's median round trip is above the minimum by more than an eighth of it,
        4-16 ms (and the relay's own lateness): the ingress queues."""
        if floor is None or median is None:
            return False
        rise = min(SLOW_START_RISE_MAX, max(SLOW_START_RISE_MIN, floor / 8))
        return median > floor + rise + window.lag

    def _fall(self, reason: str, window: _Window, now: float) -> LimitEvent | None:
        """A FELL event when the limit fell to SHARP_FALL of its level, by SHARP_FALL_PERMITS
        at least, and a fall for queueing holds back POSTs the window had out; a warning for
        overload. Fallen already: a warning once, for overload or sustained queueing."""
        allowed = self.allowed
        overload = reason == "overload"
        if self._level is Level.FALLEN:
            if overload and not self._warned:
                self._warned = True
                return self._fell(reason, now)
            return self._sustained(now)
        self._high = max(self._high, allowed)
        sharp = allowed <= self._high * SHARP_FALL and self._high - allowed >= SHARP_FALL_PERMITS
        if not sharp or not (overload or window.busiest > allowed):
            return None
        self._level, self._fell_at, self._warned = Level.FALLEN, now, overload
        return self._fell(reason, now)

    def _rise(self, now: float) -> LimitEvent | None:
        """After growth: RECOVERED once the limit is back near the level it fell from (or at the
        ceiling)."""
        allowed = self.allowed
        if self._level is Level.STEADY:
            self._high = max(self._high, allowed)
            return None
        if allowed >= min(self.ceiling, self._high * RECOVERED_SHARE):
            return self._recover("growth", now)
        return self._sustained(now)

    def _sustained(self, now: float) -> LimitEvent | None:
        """A warning, once, when queueing has kept the limit fallen for SUSTAINED seconds."""
        if self._level is Level.STEADY or self._warned or now - self._fell_at < SUSTAINED:
            return None
        self._warned = True
        return self._fell("queueing", now)

    def _fell(self, reason: str, now: float) -> LimitEvent:
        """The FELL event of this fall: a warning once `_warned` says one is due."""
        fallen_for = now - self._fell_at
        return LimitEvent(Change.FELL, self.allowed, self._high, reason, self._warned, fallen_for)

    def _recover(self, reason: str, now: float) -> LimitEvent | None:
        if self._level is Level.STEADY:
            return None
        fallen_for = now - self._fell_at
        event = LimitEvent(Change.RECOVERED, self.allowed, self._high, reason, False, fallen_for)
        self._level, self._high, self._warned = Level.STEADY, self.allowed, False
        return event
