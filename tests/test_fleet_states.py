"""A fleet's databases while they are down (issue 51, docs/sharding.md "Each database on its
own"): how soon one set aside is tried again once it is fixed, over a fake clock, and what its
state and `since` say from the moment it was lost until it is served again."""

from __future__ import annotations

from itertools import pairwise

from relay.fleet import FIRST_RETRY, retry_delay
from relay.pools import RECONNECT_WINDOW

# -- the set-aside retry's schedule, over a fake clock -----------------------------------------

OUTAGES = [k * 0.25 for k in range(4 * 900)]  # every quarter second of a 15-minute outage
WORST, LUCKIEST = 0.999_999, 0.0  # `rand` at the top and the bottom of its range


def probes(outage: float, rand: float) -> list[float]:
    """When a database set aside at 0 (its first failed probe) is probed, up to its first probe
    at or after `outage` (fixed then: `relay migrate` run, its server back), every delay drawn
    with `rand`; a probe that is refused returns at once."""
    now, attempt, times = 0.0, 0, [0.0]
    while now < outage:
        attempt += 1
        now += retry_delay(attempt, rand)
        times.append(now)
    return times


def test_a_database_set_aside_is_tried_again_within_the_pools_window_however_long_it_was_down() -> (
    None
):
    """Fixed at any moment of a 15-minute outage, it is probed again within RECONNECT_WINDOW
    (10 s), as soon as a served database's lost server is tried (relay/pools.py), not after
    the 30 s the set-aside retry once waited at its cap."""
    waits = [probes(outage, WORST)[-1] - outage for outage in OUTAGES]
    assert max(waits) <= RECONNECT_WINDOW, max(waits)
    # A blip is tried again at once: the first delays are FIRST_RETRY's and its doubles.
    assert retry_delay(1, WORST) <= FIRST_RETRY
    assert probes(1.0, WORST)[-1] < 2.0


def test_a_database_that_stays_down_costs_at_most_two_probes_a_window() -> None:
    """What the shorter wait costs: each probe is a connection (and a debug line). However
    the jitter falls, the probes of a long outage, once at the cap, are at least half the
    window apart, never a tight loop against a server that is down."""
    for rand in (LUCKIEST, 0.5, WORST):
        times = probes(OUTAGES[-1], rand)
        gaps = [b - a for a, b in pairwise(times)]
        assert min(gaps[8:]) >= RECONNECT_WINDOW / 2, (rand, gaps[:12])
        assert len(times) <= 8 + OUTAGES[-1] / (RECONNECT_WINDOW / 2), (rand, len(times))
