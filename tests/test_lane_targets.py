"""The critical lane's targeted drains (relay/delivery/targets.py; issue 50, docs/design.md
"Scheduling"): a targeted run is claimed by id at once, the claim gate never holds it, and a run
it could not claim is drained again once another replica delivers it. No database: the store is
a stand-in that records each claim and answers from a script."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from relay.delivery.deliveries import Wiring
from relay.delivery.holdings import Holdings
from relay.delivery.lane import Lane
from relay.delivery.stats import FetchStats
from relay.delivery.targets import Targets
from relay.edges.store import Claim
from relay.settings import Settings, load
from tests.support import one_event_claim, wait_for

pytestmark = [pytest.mark.anyio, pytest.mark.both_loops]  # issue 52: asyncio and uvloop


def cfg() -> Settings:
    return load(
        {
            "database_url": "postgresql://relay@127.0.0.1:1/relay",
            "ingress_url": "http://127.0.0.1:1/runs/{run_id}/events",
            "claim_runs": "64",
            "poll_interval": "3600",  # a claim within the test comes from a wake, never the poll
        },
        environ={},
    )


class Store:
    """Claims by id, each answered with nothing (the run leased elsewhere or backing off)."""

    owner = "replica-a"

    def __init__(self) -> None:
        self.claims: list[tuple[str, int, str | None]] = []

    async def claim(self, lane: str, n_runs: int, run_id: str | None = None) -> list[Claim]:
        self.claims.append((lane, n_runs, run_id))
        return []


def targets(holdings: Holdings | None = None) -> tuple[Targets, Store, FetchStats]:
    store, fetched = Store(), FetchStats()
    store_: Any = store
    return Targets("critical", store_, holdings or Holdings(cfg(), 4), fetched), store, fetched


async def test_a_run_it_could_not_claim_is_drained_again_once_delivered_elsewhere() -> None:
    t, store, fetched = targets()
    t.add("r1")
    t.add("r1")  # targeted already: once
    assert t.ready()
    assert await t.claim() == []
    assert store.claims == [("critical", 1, "r1")] and fetched.claims == 1
    assert not t.pending and t.wanted == {"r1"}  # leased elsewhere: wanted
    assert not t.delivered_elsewhere("r2")  # never wanted here
    assert t.delivered_elsewhere("r1")  # drained again, and no longer wanted
    assert not t.delivered_elsewhere("r1")


async def test_a_run_the_lane_claimed_meanwhile_or_holds_is_not_wanted() -> None:
    holdings = Holdings(cfg(), 4)
    t, _, _ = targets(holdings)
    t.add("r1")
    await t.claim()
    t.claimed("r1")  # a later claim took it: no drain when another replica delivers
    assert not t.delivered_elsewhere("r1")
    holdings.hold(one_event_claim("held"))
    t.add("held")  # the lane holds it: nothing to target
    assert not t.pending
    t.runs.append("held")  # targeted before the lane took it: an empty claim of a held run
    assert await t.claim() == []
    assert t.wanted == set()


async def test_the_claim_gate_never_holds_a_targeted_run() -> None:
    holdings = Holdings(cfg(), 4)
    t, _, _ = targets(holdings)
    for i in range(holdings.capacity - 1):
        holdings.hold(one_event_claim(f"r{i}"))
    t.add("terminal")
    assert not holdings.may_claim() and t.ready()  # room for one run: discovery waits, not it
    holdings.hold(one_event_claim("last"))
    assert t.pending and not t.ready()  # full: the next as one settles


async def test_a_drain_wakes_the_critical_lanes_loop_and_a_delivery_elsewhere_drains_again() -> (
    None
):
    """The loop waits `poll_interval` (an hour) between passes: each claim here comes from a
    drain's wake."""
    store = Store()
    store_: Any = store
    ingress: Any = object()
    lane = Lane("critical", cfg(), store_, Wiring(ingress), 4)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(lane.run)
        await wait_for(lambda: lane.turns >= 1, what="the lane's first turn")
        lane.drain("r1")
        await wait_for(lambda: len(store.claims) == 1, what="the targeted claim", timeout=10)
        await wait_for(lambda: lane.targets.wanted == {"r1"}, what="r1 wanted")
        lane.delivered_elsewhere("r1")
        await wait_for(
            lambda: len(store.claims) == 2, what="the claim after a delivery", timeout=10
        )
        assert store.claims == [("critical", 1, "r1")] * 2
        lane.delivered_elsewhere("r2")  # never wanted: no claim
        lane.stop()
    assert len(store.claims) == 2
