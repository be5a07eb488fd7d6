"""When the adaptive limit's fall is worth a line, and at which level, and when it is over (issue
49 item 5; relay/admission/limit.py, docs/admission.md "Events"), on the fake clock of
tests/test_admission_limit.py: a fall for overload (429, 503, 504, a timeout) is a warning; one
for queueing alone is the limit doing its job at a busy ingress, info, and a warning only once it
has held the limit down SUSTAINED seconds; a fall that holds back nothing is no fall; the fallen
state ends when the pressure is gone: the limit grew back, a window used less than half of it,
or the replica has been idle IDLE_SPAN. And the shell logs each event at the level it says
(relay/delivery/post_turn.py)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from relay.admission.limit import IDLE_SPAN, SUSTAINED, Change, Limit, LimitEvent, Sample, Signal
from relay.admission.permits import Admission, Priority
from relay.delivery.post_turn import Permits
from tests.support import relay_logs
from tests.test_admission_limit import RTT, Ingress, steady

QUEUEING = 2 * RTT  # a median twice the minimum: queueing, the limit halves


def burst() -> Ingress:
    """A limit at its ceiling of 36 that a burst's queueing halved, as issue 49 saw it
    ("limit 18 from 36, reason queueing"): every POST it allowed was out."""
    ingress = steady(ceiling=36, initial=36)
    assert ingress.round(QUEUEING) == 18
    return ingress


def test_a_fall_for_queueing_is_info_and_one_for_overload_a_warning() -> None:
    ingress = burst()
    assert ingress.events == [LimitEvent(Change.FELL, 18, 36, "queueing", warning=False)]
    assert ingress.limit.view(ingress.now).fallen
    ingress = steady(ceiling=36, initial=36)
    ingress.round(signal=Signal.OVERLOADED)
    assert ingress.events == [LimitEvent(Change.FELL, 18, 36, "overload", warning=True)]


def test_a_fall_that_holds_back_nothing_is_no_fall() -> None:
    """Issue 49's steady 30 runs/s: "limit 4 from 8, inflight 1". One POST out at a time, a
    window of slow answers halves the limit, which still leaves room for four."""
    ingress = steady(ceiling=36, initial=8)
    for _ in range(8):  # a window of 8 answers, one POST out at a time
        ingress.round(QUEUEING, used=1)
    assert ingress.limit.allowed == 4
    assert ingress.events == []
    assert not ingress.limit.view(ingress.now).fallen


def test_queueing_that_holds_the_limit_down_is_a_warning_once() -> None:
    """An ingress of 10 workers under an endless backlog: the limit saws between about 10 and
    17, never back near 36. A warning SUSTAINED seconds after the fall, and only one."""
    ingress = burst()
    while ingress.now < 100.0 + 3 * SUSTAINED:
        ingress.round(RTT * max(1.0, ingress.limit.allowed / 10))
    fell, held = ingress.events
    assert fell == LimitEvent(Change.FELL, 18, 36, "queueing", warning=False)
    assert held.change is Change.FELL and held.reason == "queueing" and held.warning
    assert SUSTAINED <= held.fallen_for < SUSTAINED + 1.0
    assert held.level == 36 and held.limit < 18
    assert ingress.limit.view(ingress.now).fallen


def test_overload_while_fallen_for_queueing_is_a_warning_once() -> None:
    ingress = burst()
    ingress.round(signal=Signal.OVERLOADED)  # 18 -> 9
    ingress.round(signal=Signal.OVERLOADED)  # 9 -> 4: the same fall, warned already
    assert [(e.reason, e.warning, e.limit) for e in ingress.events] == [
        ("queueing", False, 18),
        ("overload", True, 9),
    ]


def test_a_fall_ends_when_the_burst_is_over() -> None:
    """The burst drained: the replica has a few POSTs out, less than half of what the limit
    allows, so the limit holds back nothing and does not grow either: not fallen."""
    ingress = burst()
    ingress.rounds(4, used=4)  # 16 answers: the window of 18 is still open
    assert len(ingress.events) == 1
    ingress.round(used=4)
    [recovered] = ingress.events[1:]
    assert recovered == LimitEvent(
        Change.RECOVERED, 18, 36, "unused", fallen_for=recovered.fallen_for
    )
    assert recovered.fallen_for == pytest.approx(5 * RTT)
    assert not ingress.limit.view(ingress.now).fallen
    ingress.rounds(10, used=4)
    assert len(ingress.events) == 2


def test_an_idle_replica_is_not_left_fallen() -> None:
    """Issue 49: an idle healthy replica stayed "limit 5/36 (fallen)". Idle: no POST in flight
    and no answer for IDLE_SPAN."""
    ingress = burst()
    limit, fell_at = ingress.limit, ingress.now
    assert limit.settle(fell_at + IDLE_SPAN - 0.1, inflight=0) is None  # not idle long enough
    assert limit.settle(fell_at + IDLE_SPAN, inflight=1) is None  # a POST still out: a hung one
    assert limit.view(fell_at + IDLE_SPAN).fallen
    event = limit.settle(fell_at + IDLE_SPAN, inflight=0)
    assert event == LimitEvent(
        Change.RECOVERED, 18, 36, "idle", fallen_for=pytest.approx(IDLE_SPAN)
    )
    assert not limit.view(fell_at + IDLE_SPAN).fallen
    assert limit.settle(fell_at + 2 * IDLE_SPAN, inflight=0) is None  # said once
    steady_limit = steady(ceiling=36, initial=36).limit
    assert steady_limit.settle(1e6, inflight=0) is None  # never fallen: nothing to say


def test_after_an_idle_recovery_a_new_fall_is_reported_again() -> None:
    ingress = burst()
    ingress.now += IDLE_SPAN
    event = ingress.limit.settle(ingress.now, inflight=0)
    assert event is not None
    ingress.events.append(event)
    ingress.rounds(30)  # grows back by one a window, 18 -> 36 (min_rtt aged out: re-learnt)
    ingress.round(signal=Signal.OVERLOADED)
    assert [(e.change, e.reason) for e in ingress.events] == [
        (Change.FELL, "queueing"),
        (Change.RECOVERED, "idle"),
        (Change.FELL, "overload"),
    ]


# -- the shell logs each event at its level --------------------------------------------------------


class _Levels(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, int, dict[str, Any]]] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields = dict(getattr(record, "fields", {}) or {})
        self.records.append((record.getMessage(), record.levelno, fields))


def answer_all(permits: Permits, signal: Signal, rtt: float) -> None:
    """Every POST the limit allows taken, then answered with `signal` after `rtt`."""
    taken = []
    while (permit := permits.try_take(Priority.CRITICAL)) is not None:
        taken.append(permit)
    for permit in taken:
        permits.answered(permit, Sample(rtt, signal))
    for permit in taken:
        permits.release(permit)


@pytest.mark.parametrize(
    ("signal", "level", "reason"),
    [(Signal.ANSWERED, logging.INFO, "queueing"), (Signal.OVERLOADED, logging.WARNING, "overload")],
)
def test_limit_fell_is_logged_at_the_level_the_event_says(
    signal: Signal, level: int, reason: str
) -> None:
    permits = Permits(Admission(Limit(36, initial=36, slow_start=False), max_reserve=4))
    handler = _Levels()
    with relay_logs(handler):
        answer_all(permits, Signal.ANSWERED, 0.001)  # learns the minimum
        answer_all(permits, signal, 0.050)
    [(name, got, fields)] = [r for r in handler.records if r[0].startswith("limit_")]
    assert (name, got, fields["reason"]) == ("limit_fell", level, reason)
    assert fields["from_limit"] == 36 and fields["limit"] == 18 and fields["fallen_s"] == 0.0
