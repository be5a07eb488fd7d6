"""What a lane may hold (relay/delivery/holdings.py): under the fixed limit its concurrency and a
claim beyond; under the adaptive limit what its share of the limit can POST now and one round more
(issue 42), following the limit as it moves. No database: Holdings is pure bookkeeping."""

from __future__ import annotations

from relay.delivery.holdings import Holdings
from relay.edges.store import Claim
from relay.settings import Settings
from tests.support import offline_settings, one_event_claim


def cfg(**extra: str) -> Settings:
    return offline_settings(**{"claim_runs": "64", **extra})


def claim(run_id: str) -> Claim:
    return one_event_claim(run_id)


def test_the_fixed_limit_holds_its_concurrency_and_a_claim_beyond() -> None:
    holdings = Holdings(cfg(), 32)
    assert holdings.capacity == 32 + 64


def test_the_adaptive_limit_holds_its_share_and_one_round_more() -> None:
    share = 3
    holdings = Holdings(cfg(), 32, lambda: share)
    assert holdings.capacity == 6
    share = 16  # the limit grew: the lane may hold more
    assert holdings.capacity == 32
    share = 32  # at the lane's ceiling: as under the fixed limit
    assert holdings.capacity == 32 + 64
    share = 2  # it fell: no new claim while the lane holds more than that
    for i in range(4):
        holdings.hold(claim(f"r{i}"))
    assert holdings.room() == 0
    assert not holdings.may_claim()


def test_under_the_adaptive_limit_an_idle_post_may_claim() -> None:
    holdings = Holdings(cfg(), 32, lambda: 4)
    holdings.hold(claim("r0"))
    assert holdings.room() == 7 and holdings.may_claim()  # one of 4 POSTs in use


def test_with_a_batch_url_a_round_of_posts_is_counted_in_claims() -> None:
    settings = cfg(ingress_batch_url="http://127.0.0.1:1/batch")
    assert Holdings(settings, 32, lambda: 3).capacity == (3 + 1) * 64


def test_the_claim_gate_never_holds_a_targeted_terminal_while_the_lane_has_room() -> None:
    """Issue 50: discovery waits for half a claim of room, a targeted terminal does not; only
    the lane's capacity and byte budget bound it (a flood of them)."""
    holdings = Holdings(cfg(), 4)  # the critical lane's default: 4 + 64 runs
    for i in range(holdings.capacity - 1):
        holdings.hold(claim(f"r{i}"))
    assert not holdings.may_claim()  # room for one run: no discovery claim
    assert holdings.may_target()  # but a targeted terminal is claimed at once
    holdings.hold(claim("last"))
    assert not holdings.may_target()  # full: the next waits for one to settle
