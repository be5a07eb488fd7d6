"""Who may POST under the adaptive limit (relay/admission/permits.py, issue 42): the critical
reserve the ordinary lane cannot take, critical waiters first, each lane first come first served, a
permit released once. Pure: the waiting is the admission's decision, no event loop."""

from __future__ import annotations

import pytest

from relay.admission.limit import Limit, Sample, Signal
from relay.admission.permits import Admission, Permit, Priority

CRITICAL, ORDINARY = Priority.CRITICAL, Priority.ORDINARY
NOW = 50.0
OK = Sample(0.040, Signal.ANSWERED)


def admission(allowed: int, max_reserve: int | None = None) -> Admission:
    """An admission whose limit allows `allowed` POSTs (its ceiling)."""
    return Admission(Limit(allowed, initial=allowed), max_reserve=max_reserve)


def take_all(adm: Admission, priority: Priority) -> list[Permit]:
    permits = []
    while (permit := adm.try_acquire(priority, NOW)) is not None:
        permits.append(permit)
    return permits


@pytest.mark.parametrize(
    ("allowed", "reserve"), [(2, 1), (3, 1), (4, 1), (5, 2), (8, 2), (16, 4), (32, 8)]
)
def test_the_reserve_is_a_quarter_of_the_limit_at_least_one(allowed: int, reserve: int) -> None:
    assert admission(allowed).reserve == reserve


def test_the_reserve_is_at_most_the_critical_lanes_own_concurrency() -> None:
    assert admission(36, max_reserve=4).reserve == 4
    assert admission(4, max_reserve=4).reserve == 1


def test_a_saturated_ordinary_lane_leaves_the_reserve_to_terminals() -> None:
    adm = admission(16)
    ordinary = take_all(adm, ORDINARY)
    assert len(ordinary) == 16 - 4
    critical = take_all(adm, CRITICAL)
    assert len(critical) == 4
    assert adm.inflight == 16
    view = adm.view(NOW)
    assert view.inflight == {CRITICAL: 4, ORDINARY: 12}


def test_the_critical_lane_may_use_the_whole_limit() -> None:
    adm = admission(8)
    assert len(take_all(adm, CRITICAL)) == 8
    assert adm.try_acquire(ORDINARY, NOW) is None


def test_a_freed_permit_goes_to_a_critical_waiter_before_ordinary_ones() -> None:
    adm = admission(4)
    held = take_all(adm, CRITICAL)
    first_ordinary = adm.wait(ORDINARY)
    second_ordinary = adm.wait(ORDINARY)
    critical = adm.wait(CRITICAL)
    assert adm.view(NOW).waiting == {CRITICAL: 1, ORDINARY: 2}
    adm.release(held[0], OK, NOW)
    granted = adm.grants(NOW)
    assert [ticket for ticket, _ in granted] == [critical]
    assert granted[0][1].priority is CRITICAL
    adm.release(held[1], OK, NOW)
    adm.release(held[2], OK, NOW)
    assert [ticket for ticket, _ in adm.grants(NOW)] == [first_ordinary, second_ordinary]


def test_a_newcomer_does_not_pass_a_waiter_that_goes_before_it() -> None:
    adm = admission(4)
    held = take_all(adm, CRITICAL)
    waiter = adm.wait(CRITICAL)
    adm.release(held[0], OK, NOW)
    assert adm.try_acquire(CRITICAL, NOW) is None  # the waiter's turn
    assert adm.try_acquire(ORDINARY, NOW) is None  # a critical waiter goes first
    assert [ticket for ticket, _ in adm.grants(NOW)] == [waiter]


def test_an_ordinary_waiter_does_not_hold_back_a_critical_newcomer() -> None:
    adm = admission(4)
    ordinary = take_all(adm, ORDINARY)
    assert len(ordinary) == 3
    adm.wait(ORDINARY)
    assert adm.try_acquire(CRITICAL, NOW) is not None


def test_an_ordinary_waiter_is_not_granted_the_reserve() -> None:
    adm = admission(4)
    ordinary = take_all(adm, ORDINARY)
    waiter = adm.wait(ORDINARY)
    assert adm.grants(NOW) == []  # a permit is free, but it is the reserve
    adm.release(ordinary[0], OK, NOW)
    assert [ticket for ticket, _ in adm.grants(NOW)] == [waiter]


def test_a_cancelled_waiter_leaves_the_queue() -> None:
    adm = admission(2)
    held = take_all(adm, CRITICAL)
    gone = adm.wait(CRITICAL)
    stays = adm.wait(CRITICAL)
    adm.cancel(gone)
    adm.cancel(gone)  # harmless
    adm.release(held[0], None, NOW)
    assert [ticket for ticket, _ in adm.grants(NOW)] == [stays]


def test_a_permit_is_released_once() -> None:
    adm = admission(4)
    permit = adm.try_acquire(ORDINARY, NOW)
    assert permit is not None
    adm.release(permit, OK, NOW)
    with pytest.raises(RuntimeError):
        adm.release(permit, OK, NOW)


def test_a_release_feeds_the_answer_to_the_limit() -> None:
    """An overload answer halves the limit: the POSTs already in flight stay, new ones wait
    until fewer than the new limit are in flight."""
    adm = admission(8)
    permits = take_all(adm, CRITICAL)
    adm.release(permits[0], Sample(0.040, Signal.OVERLOADED), NOW + 0.040)
    assert adm.limit.allowed == 4
    assert adm.try_acquire(CRITICAL, NOW + 0.041) is None  # 7 in flight, 4 allowed
    for permit in permits[1:5]:
        adm.release(permit, None, NOW + 0.05)  # never sent: the limit is not told
    assert adm.limit.allowed == 4
    assert adm.try_acquire(CRITICAL, NOW + 0.06) is not None  # 3 in flight


def test_the_reserve_stays_critical_when_the_limit_falls_under_ordinary_posts() -> None:
    """Ordinary POSTs sent under a limit of 16 fill all of the 8 it fell to: a terminal still
    gets a permit from the reserve (2 of 8), the ordinary lane none until it is back under."""
    adm = admission(16)
    ordinary = take_all(adm, ORDINARY)
    assert len(ordinary) == 12
    adm.release(ordinary.pop(), Sample(0.040, Signal.OVERLOADED), NOW + 0.040)
    assert adm.limit.allowed == 8 and adm.reserve == 2
    assert len(take_all(adm, CRITICAL)) == 2  # 11 + 2 in flight: over 8 by the reserve
    assert adm.try_acquire(ORDINARY, NOW + 0.041) is None
    for permit in ordinary[:6]:
        adm.release(permit, None, NOW + 0.05)
    assert adm.try_acquire(ORDINARY, NOW + 0.05) is not None  # 5 + 2 in flight, 6 ordinary


def test_permits_count_what_was_in_flight_when_they_were_granted() -> None:
    adm = admission(4)
    assert [p.inflight for p in take_all(adm, ORDINARY)] == [1, 2, 3]


def test_an_admission_needs_room_for_both_lanes() -> None:
    with pytest.raises(ValueError):
        Admission(Limit(8, min_limit=1))
    with pytest.raises(ValueError):
        Admission(Limit(8), critical_share=1.0)
