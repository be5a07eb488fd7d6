"""The adaptive POST limit's rules, one test each (relay/admission/limit.py, issue 42), on a fake
clock: a "round" sends as many POSTs as asked at one instant and answers them all one round trip
later, so each round is one judging window and one decision."""

from __future__ import annotations

import math

import pytest

from relay.admission.limit import (
    MIN_RTT_SPAN,
    RTT_SLACK,
    Change,
    Limit,
    LimitEvent,
    Sample,
    Signal,
)

RTT = 0.040


class Ingress:
    """Drives a Limit round by round on a fake clock."""

    def __init__(self, limit: Limit, now: float = 100.0) -> None:
        self.limit = limit
        self.now = now
        self.events: list[LimitEvent] = []

    def round(
        self,
        rtt: float = RTT,
        *,
        signal: Signal = Signal.ANSWERED,
        used: int | None = None,
        retry_after: float | None = None,
        lag: float = 0.0,
    ) -> int:
        """`used` POSTs (all the limit allows, by default) sent now, answered `rtt` later with
        `signal`; returns the limit after them."""
        n = self.limit.allowed if used is None else used
        self.now += rtt
        for k in range(n):
            sample = Sample(rtt, signal, retry_after, lag)
            event = self.limit.observe(sample, inflight=k + 1, now=self.now)
            if event is not None:
                self.events.append(event)
        return self.limit.allowed

    def rounds(self, count: int, rtt: float = RTT, **kwargs: object) -> int:
        for _ in range(count):
            self.round(rtt, **kwargs)  # type: ignore[arg-type]
        return self.limit.allowed


def steady(ceiling: int = 64, initial: int = 20, rtt: float = RTT) -> Ingress:
    """A limit that has learnt the ingress's round trip (`rtt`) and sits at `initial`."""
    ingress = Ingress(Limit(ceiling, initial=initial - 1, slow_start=False))
    ingress.round(rtt)  # learns the minimum, and grows by one
    assert ingress.limit.allowed == initial
    return ingress


# --- increase ----------------------------------------------------------------------------------


def test_rises_by_one_per_round_trip_while_the_ingress_keeps_up() -> None:
    ingress = Ingress(Limit(64, slow_start=False))
    assert ingress.limit.allowed == 4
    assert ingress.rounds(10) == 14


def test_doubles_per_round_trip_until_the_first_decrease() -> None:
    """Slow start: 4, 8, 16, 32 at an ingress that keeps up; after a fall, one at a time."""
    ingress = Ingress(Limit(64))
    assert [ingress.round() for _ in range(3)] == [8, 16, 32]
    assert ingress.round(signal=Signal.OVERLOADED) == 16
    assert ingress.rounds(3) == 19


def test_slow_start_ends_once_the_round_trip_rises_by_an_eighth() -> None:
    """A window whose median is 10 ms above a 40 ms minimum (more than an eighth, 5 ms; within
    the queueing tolerance, so no decrease) ends the doubling: one at a time after it. A rise
    within the eighth, or one the relay's own lateness explains, doubles on."""
    ingress = Ingress(Limit(64))
    assert ingress.round() == 8  # learns the 40 ms minimum
    assert ingress.round(0.050) == 9
    assert ingress.rounds(2) == 11
    within = Ingress(Limit(64))
    assert [within.round(), within.round(0.045), within.round(0.050, lag=0.010)] == [8, 16, 32]


@pytest.mark.parametrize(
    ("minimum", "ends", "goes_on"), [(0.002, 0.0065, 0.0055), (0.4, 0.42, 0.41)]
)
def test_the_rise_that_ends_slow_start_is_4_to_16_ms(
    minimum: float, ends: float, goes_on: float
) -> None:
    """At a 2 ms ingress an eighth is 0.25 ms, noise: the rise must pass 4 ms. At a 400 ms
    one it is 50 ms: 16 ms of queueing is enough to stop doubling."""
    for rtt, after in ((goes_on, 16), (ends, 9)):
        ingress = Ingress(Limit(64))
        ingress.round(minimum)
        assert ingress.round(rtt) == after, rtt


def test_slow_start_stops_at_the_ceiling() -> None:
    ingress = Ingress(Limit(36))
    assert ingress.rounds(5) == 36


def test_does_not_grow_while_the_limit_is_not_used() -> None:
    ingress = steady(initial=20)
    assert ingress.rounds(20, used=9) == 20  # under half of it


def test_grows_while_half_the_limit_is_used() -> None:
    ingress = steady(initial=20)
    assert ingress.rounds(2, used=10) == 21  # a window holds 20 answers: two rounds of 10


# --- decrease ----------------------------------------------------------------------------------


def test_falls_on_queueing_by_the_minimum_over_the_median() -> None:
    ingress = steady(initial=20, rtt=0.200)
    assert ingress.round(0.330) == 12  # past 200 ms * 1.5 + 20 ms: 20 * 200 / 330 = 12.1
    assert ingress.limit.view(ingress.now).value == pytest.approx(20 * 0.200 / 0.330)


def test_the_relays_own_lateness_is_not_the_ingress_queueing() -> None:
    """Round trips a busy relay read late by `lag` (its event loop's, relay/delivery/post_turn.py
    LoopLag) are tolerated by that much: the same answers without it are a cut."""
    late = steady(initial=20)
    assert late.round(0.090, lag=0.030) == 21
    prompt = steady(initial=20)
    assert prompt.round(0.090) == 10


def test_a_fall_on_queueing_is_at_most_a_half() -> None:
    ingress = steady(initial=20)
    assert ingress.round(RTT * 10) == 10  # the gradient 0.1, held at 0.5


def test_answers_just_within_the_tolerance_are_not_queueing() -> None:
    ingress = steady(initial=20)
    assert ingress.round(RTT * 1.5 + RTT_SLACK - 0.0001) == 21


def test_the_median_not_one_slow_answer_decides() -> None:
    ingress = steady(initial=20)
    ingress.now += RTT
    for k in range(20):
        rtt = RTT * 10 if k < 9 else RTT  # 9 slow answers of 20
        ingress.limit.observe(Sample(rtt, Signal.ANSWERED), inflight=k + 1, now=ingress.now)
    assert ingress.limit.allowed == 21


@pytest.mark.parametrize("status", [429, 503, 504])
def test_an_overload_answer_halves_it(status: int) -> None:
    ingress = steady(initial=20)
    sample = Sample.of(status, RTT)
    assert sample.signal is Signal.OVERLOADED
    assert ingress.round(signal=sample.signal, used=1) == 10


def test_a_timeout_halves_it_and_a_connection_error_changes_nothing() -> None:
    ingress = steady(initial=20)
    timeout = Sample.of(None, 10.0, timed_out=True)
    assert timeout.signal is Signal.OVERLOADED
    refused = Sample.of(None, 0.001)
    assert refused.signal is Signal.SILENT
    assert ingress.round(0.001, signal=Signal.SILENT) == 20
    assert ingress.round(10.0, signal=Signal.OVERLOADED, used=1) == 10


@pytest.mark.parametrize("status", [200, 204, 409, 400, 422, 500, 502])
def test_other_answers_are_judged_by_their_round_trip(status: int) -> None:
    assert Sample.of(status, RTT).signal is Signal.ANSWERED


def test_a_burst_of_503s_halves_it_once_per_round_trip() -> None:
    """20 POSTs answered 503 at once: one decrease, not twenty; the answers to POSTs sent
    before that decrease do not cut it again, an answer to one sent after it does."""
    ingress = steady(initial=20)
    assert ingress.round(signal=Signal.OVERLOADED) == 10
    ingress.now += 0.5 * RTT  # more 503s, to POSTs sent before the decrease
    for _ in range(10):
        ingress.limit.observe(Sample(RTT * 1.5, Signal.OVERLOADED), inflight=20, now=ingress.now)
    assert ingress.limit.allowed == 10
    assert ingress.round(signal=Signal.OVERLOADED) == 5  # sent after it: a new round trip


def test_a_queue_that_outlives_the_decrease_is_not_judged_twice() -> None:
    ingress = steady(initial=20)
    assert ingress.round(RTT * 2.5) == 10
    # Answers still slow, but to POSTs sent before the decrease (their round trips say so).
    ingress.now += RTT
    for k in range(10):
        ingress.limit.observe(Sample(RTT * 3, Signal.ANSWERED), inflight=k + 1, now=ingress.now)
    assert ingress.limit.allowed == 10


# --- Retry-After -------------------------------------------------------------------------------


def test_retry_after_pauses_growth_until_it_runs_out() -> None:
    ingress = steady(initial=20)
    assert ingress.round(signal=Signal.OVERLOADED, used=1, retry_after=1.0) == 10
    paused = ingress.limit.view(ingress.now).paused_until
    assert paused == pytest.approx(ingress.now + 1.0)
    while ingress.now + RTT < paused:
        assert ingress.round() == 10
    assert ingress.round() == 11


def test_retry_after_on_any_answer_pauses_growth_without_a_fall() -> None:
    ingress = steady(initial=20)
    assert ingress.round(retry_after=1.0) == 20
    assert ingress.rounds(10) == 20
    ingress.now += 1.0
    assert ingress.round() == 21


# --- bounds ------------------------------------------------------------------------------------


def test_never_above_the_ceiling_nor_below_the_minimum() -> None:
    ingress = Ingress(Limit(8, min_limit=2))
    assert ingress.rounds(50) == 8
    assert ingress.rounds(20, signal=Signal.OVERLOADED) == 2
    assert ingress.limit.view(ingress.now).value == 2.0
    with pytest.raises(ValueError):
        Limit(4, min_limit=5)


def test_starts_at_the_initial_limit_within_its_bounds() -> None:
    assert Limit(64).allowed == 4
    assert Limit(3).allowed == 3
    assert Limit(64, initial=1, min_limit=2).allowed == 2


def test_what_the_limit_allows_follows_every_move_of_its_value() -> None:
    """`allowed` is kept, not worked out on each read (issue 52 item 3): after every answer of
    every kind of move (slow start, one by one, overload, queueing, the floor, the ceiling) it
    is what the value allows now, never what it allowed before the move."""
    ingress = Ingress(Limit(40, min_limit=3))
    ok, full = (RTT, Signal.ANSWERED), (RTT, Signal.OVERLOADED)
    moves = [ok] * 4 + [full] + [ok] * 3 + [(0.200, Signal.ANSWERED)] + [full] * 6 + [ok] * 3
    seen: set[int] = set()
    for rtt, signal in moves:  # slow start, overload, one by one, queueing, the floor, growth
        for k in range(ingress.limit.allowed):
            ingress.limit.observe(Sample(rtt, signal), inflight=k + 1, now=ingress.now + RTT)
            value = ingress.limit.view(ingress.now + RTT).value
            assert ingress.limit.allowed == max(3, math.floor(value)), (rtt, signal, k, value)
            seen.add(ingress.limit.allowed)
        ingress.now += RTT
    assert {3, 4, 40} <= seen  # the floor, the start and the ceiling were all reached


# --- the recent minimum ------------------------------------------------------------------------


def test_relearns_the_minimum_of_an_ingress_that_became_slower_for_good() -> None:
    """The ingress's round trip goes from 40 ms to 100 ms for good: it looks like queueing, so
    the limit falls to its floor; once the 40 ms minimum has aged out of its window, 100 ms is
    the minimum and the limit grows again."""
    ingress = steady(initial=20)
    learnt = ingress.now  # the last 40 ms answer
    slow = 0.100
    ingress.rounds(10, slow)
    assert ingress.limit.allowed == 2
    while ingress.now - learnt < MIN_RTT_SPAN - 2.0:
        ingress.round(slow)
    assert ingress.limit.allowed == 2
    while ingress.now - learnt < MIN_RTT_SPAN + 2.0:
        ingress.round(slow)
    assert ingress.limit.allowed > 10
    assert ingress.limit.view(ingress.now).min_rtt == pytest.approx(slow)


def test_an_ingress_that_became_faster_is_learnt_at_once() -> None:
    ingress = steady(initial=20)
    ingress.round(0.010)
    assert ingress.limit.view(ingress.now).min_rtt == pytest.approx(0.010)
    assert ingress.round(RTT) == 10  # 40 ms is now queueing


# --- events for the log ------------------------------------------------------------------------


def test_reports_a_sharp_fall_once_and_its_recovery_once() -> None:
    ingress = steady(initial=32, rtt=0.200)
    ingress.round(0.330)  # 32 -> 19: not sharp
    assert ingress.events == []
    ingress.round(0.200, signal=Signal.OVERLOADED)  # 19 -> 9: under half of 32
    ingress.round(0.200, signal=Signal.OVERLOADED)  # 9 -> 4: still fallen, no second line
    assert ingress.events == [LimitEvent(Change.FELL, 9, 32, "overload", warning=True)]
    assert ingress.limit.view(ingress.now).fallen
    ingress.rounds(20, 0.200)  # 4 -> 24: not yet back
    assert len(ingress.events) == 1
    ingress.rounds(5, 0.200)  # back to 29 >= 0.9 * 32
    [recovered] = ingress.events[1:]
    assert (recovered.change, recovered.limit, recovered.level) == (Change.RECOVERED, 29, 32)
    assert recovered.reason == "growth" and not recovered.warning
    assert not ingress.limit.view(ingress.now).fallen


def test_a_small_limit_halving_is_no_sharp_fall() -> None:
    ingress = steady(initial=6)
    ingress.round(signal=Signal.OVERLOADED)  # 6 -> 3: half, but only 3 POSTs
    assert ingress.events == []
