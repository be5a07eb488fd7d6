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
    owes_back = False  # no lease held unknowingly (relay/edges/store.py give_back)

    def __init__(self) -> None:
        self.claims: list[tuple[str, int, str | None]] = []
        self.owed: list[Claim] = []  # hand-backs that failed: this stand-in cannot release

    def owe(self, claim: Claim) -> None:
        self.owed.append(claim)

    async def claim(self, lane: str, n_runs: int, run_id: str | None = None) -> list[Claim]:
        self.claims.append((lane, n_runs, run_id))
        return []


def targets(holdings: Holdings | None = None) -> tuple[Targets, Store, FetchStats]:
    store, fetched = Store(), FetchStats()
    store_: Any = store
    holdings = holdings or Holdings(cfg(), 4)
    return Targets("critical", store_, holdings, fetched, wanted_for=30.0), store, fetched


def wanted(t: Targets) -> set[str]:
    return t.wanted.names(anyio.current_time())


async def test_a_run_it_could_not_claim_is_drained_again_once_delivered_elsewhere() -> None:
    t, store, fetched = targets()
    t.add("r1")
    t.add("r1")  # targeted already: once
    assert t.ready()
    assert await t.claim() == []
    assert store.claims == [("critical", 1, "r1")] and fetched.claims == 1
    assert not t.pending and wanted(t) == {"r1"}  # leased elsewhere: wanted
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
    assert wanted(t) == set()


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
        await wait_for(lambda: wanted(lane.targets) == {"r1"}, what="r1 wanted")
        lane.delivered_elsewhere("r1")
        await wait_for(
            lambda: len(store.claims) == 2, what="the claim after a delivery", timeout=10
        )
        assert store.claims == [("critical", 1, "r1")] * 2
        lane.delivered_elsewhere("r2")  # never wanted: no claim
        lane.stop()
    assert len(store.claims) == 2


class SlowStore(Store):
    """The ordinary lane's discovery claim is on the wire until `answer` is set, then returns
    run r1's claim (found by discovery: not targeted)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = anyio.Event()
        self.answer = anyio.Event()
        self.answered = False

    async def claim(self, lane: str, n_runs: int, run_id: str | None = None) -> list[Claim]:
        self.claims.append((lane, n_runs, run_id))
        if lane == "critical" or self.answered:
            return []
        self.asked.set()
        await self.answer.wait()
        self.answered = True
        return [one_event_claim("r1", critical=True)]


async def test_a_terminal_notified_while_its_runs_ordinary_claim_is_on_the_wire_goes_first() -> (
    None
):
    """The race of issue 50: the terminal's notification comes while the ordinary lane's claim
    of that run is on the wire, so `promote` finds nothing held, and the critical lane's claim
    by id finds the run leased. The claim must arrive as a targeted terminal: here the lane's
    one slot is taken, so a targeted single claim is handed to the critical lane at once, where
    an untargeted one would queue behind the slot."""
    store = SlowStore()
    store_: Any = store
    ingress: Any = object()
    lane = Lane("ordinary", cfg(), store_, Wiring(ingress), 1)
    handed: list[Claim] = []

    def handoff(claim: Claim) -> bool:
        handed.append(claim)
        return True

    lane.post_turn.handoff = handoff
    assert lane.post_turn.slots.take_nowait()  # the one slot is busy: a claim would queue
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(lane.run)
        with anyio.fail_after(10):
            await store.asked.wait()  # discovery's claim is on the wire
        lane.promote("r1")  # the runner's _on_terminal: nothing held yet
        store.answer.set()
        await wait_for(lambda: len(handed) == 1, what="r1 handed to the critical lane", timeout=10)
        assert handed[0].run_id == "r1" and handed[0].targeted and handed[0].widen  # a step event
        assert lane.stats.by_class["targeted"] == 1
        lane.stop()
        lane.post_turn.slots.release()
    assert not lane.inflight


async def test_a_run_foretold_and_never_claimed_is_forgotten_after_a_lease() -> None:
    """The ordinary lane is told of every terminal; the critical lane claims most of them, so
    the names it keeps for a claim on the way are kept for a lease's time, no longer."""
    store_: Any = Store()
    ingress: Any = object()
    lane = Lane("ordinary", cfg(), store_, Wiring(ingress), 1)
    async with lane.deliveries.running():
        lane.promote("r1")
        now = anyio.current_time()
        assert lane.foretold.names(now) == {"r1"}
        lane.foretold.forget(now + cfg().lease_ttl)
        assert len(lane.foretold) == 0
        assert lane.targets.wanted.ttl == cfg().lease_ttl  # the critical lane's wanted runs too
        lane.stop()


async def test_a_run_the_lane_adopts_is_no_longer_wanted() -> None:
    """A claim adopted from the ordinary lane (a targeted terminal it could not start) is the
    critical lane's: no second claim of it by id when its delivery is announced."""
    store = Store()
    store_: Any = store
    ingress: Any = object()
    lane = Lane("critical", cfg(), store_, Wiring(ingress), 1)
    lane.targets.add("r1")
    assert await lane.targets.claim() == []  # leased by this replica's ordinary lane
    assert wanted(lane.targets) == {"r1"}
    assert lane.post_turn.slots.take_nowait()  # its delivery queues: no POST in this test
    async with lane.deliveries.running():
        assert lane.adopt(one_event_claim("r1").promoted())
        assert wanted(lane.targets) == set()
        lane.delivered_elsewhere("r1")
        assert not lane.targets.pending  # not drained again
        lane.stop()
        lane.post_turn.slots.release()
