"""The POST turn's wiring (relay/delivery/post_turn.py, issue 42): `Permits`, the anyio shell around
the pure admission, and `PostTurn`, a lane's slot then the replica's permit. No database, no
network: each step waits until every task is blocked, so the order seen is the queue's, not the
scheduler's."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager

import anyio
import pytest
from anyio.abc import TaskGroup

from relay.admission.limit import Limit, LimitEvent, Sample, Signal
from relay.admission.permits import Admission, Permit, Priority
from relay.delivery.post_turn import LAG_TICK, LoopLag, Permits, PostTurn, Slot, Turn
from relay.edges.store import Held
from relay.runner import post_permits
from relay.settings import load
from tests.support import one_event_claim

pytestmark = [pytest.mark.anyio, pytest.mark.both_loops]  # issue 52: asyncio and uvloop


def held(run_id: str, *, critical: bool = False, targeted: bool = False) -> Held:
    return Held(one_event_claim(run_id, critical=critical, targeted=targeted))


def permits(limit: int = 2) -> Permits:
    """Permits under a limit of `limit` (the reserve: one, at 2 to 4)."""
    return Permits(Admission(Limit(limit, initial=limit)))


def inflight(p: Permits) -> dict[Priority, int]:
    return p.view().inflight


def waiting(p: Permits) -> dict[Priority, int]:
    return p.view().waiting


class PermitTakers:
    """Tasks that each ask `Permits` for one: `took` the order they got it, `woken` those woken
    without one, `cancelled` those whose wait was cancelled; `permits` what each holds."""

    def __init__(self, p: Permits, tasks: TaskGroup) -> None:
        self.p, self.tasks = p, tasks
        self.took: list[str] = []
        self.woken: list[str] = []
        self.cancelled: list[str] = []
        self.held: dict[str, Permit] = {}
        self.scopes: dict[str, anyio.CancelScope] = {}

    async def queue(self, name: str, priority: Priority, keys: tuple[Hashable, ...] = ()) -> None:
        self.tasks.start_soon(self._take, name, priority, keys or (name,))
        await anyio.wait_all_tasks_blocked()

    async def _take(self, name: str, priority: Priority, keys: tuple[Hashable, ...]) -> None:
        with anyio.CancelScope() as scope:
            self.scopes[name] = scope
            permit = await self.p.take(priority, keys)
            if permit is None:
                self.woken.append(name)
            else:
                self.took.append(name)
                self.held[name] = permit
            return
        self.cancelled.append(name)

    async def release(self, name: str) -> None:
        self.p.release(self.held.pop(name))
        await anyio.wait_all_tasks_blocked()


@asynccontextmanager
async def full(limit: int = 2) -> AsyncIterator[tuple[PermitTakers, Permit, Permit]]:
    """Permits whose limit is all taken: an ordinary permit and the critical reserve."""
    p = permits(limit)
    ordinary = await p.take(Priority.ORDINARY)
    critical = await p.take(Priority.CRITICAL)
    assert ordinary is not None and critical is not None
    async with anyio.create_task_group() as tasks:
        yield PermitTakers(p, tasks), ordinary, critical


# -- Permits ------------------------------------------------------------------------------------


async def test_a_freed_permit_goes_to_the_critical_waiter_before_an_earlier_ordinary_one() -> None:
    async with full() as (takers, ordinary, critical):
        await takers.queue("ordinary", Priority.ORDINARY)
        await takers.queue("critical", Priority.CRITICAL)
        assert waiting(takers.p) == {Priority.CRITICAL: 1, Priority.ORDINARY: 1}
        takers.p.release(ordinary)  # the ordinary share's permit: the critical waiter has it
        await anyio.wait_all_tasks_blocked()
        assert takers.took == ["critical"]
        takers.p.release(critical)
        await anyio.wait_all_tasks_blocked()
        assert takers.took == ["critical", "ordinary"]
        for name in ("critical", "ordinary"):
            await takers.release(name)
    assert inflight(takers.p) == {Priority.CRITICAL: 0, Priority.ORDINARY: 0}


async def test_a_waiter_cancelled_after_its_grant_passes_the_permit_on() -> None:
    async with full() as (takers, ordinary, critical):
        await takers.queue("first", Priority.ORDINARY)
        await takers.queue("second", Priority.ORDINARY)
        takers.scopes["first"].cancel()  # cancelled, still queued until it runs...
        takers.p.release(ordinary)  # ...and granted the permit before it does
        await anyio.wait_all_tasks_blocked()
        assert takers.cancelled == ["first"]
        assert takers.took == ["second"]  # the permit was passed on, not leaked
        await takers.release("second")
        takers.p.release(critical)
    assert inflight(takers.p) == {Priority.CRITICAL: 0, Priority.ORDINARY: 0}
    assert waiting(takers.p) == {Priority.CRITICAL: 0, Priority.ORDINARY: 0}


async def test_a_waiter_cancelled_before_its_grant_leaves_no_ticket() -> None:
    async with full() as (takers, ordinary, critical):
        await takers.queue("gone", Priority.ORDINARY)
        await takers.queue("gone-critical", Priority.CRITICAL)
        takers.scopes["gone"].cancel()
        takers.scopes["gone-critical"].cancel()
        await anyio.wait_all_tasks_blocked()
        assert waiting(takers.p) == {Priority.CRITICAL: 0, Priority.ORDINARY: 0}
        takers.p.release(ordinary)  # granted to nobody: kept free
        takers.p.release(critical)
        await anyio.wait_all_tasks_blocked()
        assert sorted(takers.cancelled) == ["gone", "gone-critical"]
        assert takers.took == []
    assert inflight(takers.p) == {Priority.CRITICAL: 0, Priority.ORDINARY: 0}
    assert await takers.p.take(Priority.ORDINARY) is not None  # the permit is there to take


async def test_wake_sends_a_waiter_back_without_a_permit_to_queue_again() -> None:
    async with full() as (takers, ordinary, critical):
        await takers.queue("a", Priority.ORDINARY, ("run-a",))
        await takers.queue("b", Priority.ORDINARY, ("run-b",))
        takers.p.wake("run-b")
        await anyio.wait_all_tasks_blocked()
        assert takers.woken == ["b"]
        assert waiting(takers.p) == {Priority.CRITICAL: 0, Priority.ORDINARY: 1}
        await takers.queue("b-again", Priority.CRITICAL, ("run-b",))  # as a promotion does
        takers.p.release(ordinary)
        await anyio.wait_all_tasks_blocked()
        assert takers.took == ["b-again"]
        takers.p.release(critical)
        await anyio.wait_all_tasks_blocked()
        assert takers.took == ["b-again", "a"]
        for name in ("a", "b-again"):
            await takers.release(name)
    assert inflight(takers.p) == {Priority.CRITICAL: 0, Priority.ORDINARY: 0}


# -- PostTurn: a lane's slot, then the replica's permit ------------------------------------------


class TurnTakers:
    """Claims (or groups) of a lane taking their turn, each in a task: `took` the order they
    got one, `turns` what each holds, `ended` the slot state of those that got none."""

    def __init__(self, turn: PostTurn, tasks: TaskGroup) -> None:
        self.post_turn, self.tasks = turn, tasks
        self.took: list[str] = []
        self.turns: dict[str, Turn] = {}
        self.ended: dict[str, Slot] = {}
        self.cancelled: list[str] = []
        self.scopes: dict[str, anyio.CancelScope] = {}

    async def queue(self, name: str, holds: list[Held]) -> None:
        self.tasks.start_soon(self._take, name, holds)
        await anyio.wait_all_tasks_blocked()

    async def _take(self, name: str, holds: list[Held]) -> None:
        with anyio.CancelScope() as scope:
            self.scopes[name] = scope
            turn = await self.post_turn.take(holds)
            if turn.slot is Slot.POSTING:
                self.took.append(name)
                self.turns[name] = turn
            else:
                self.ended[name] = turn.slot
            return
        self.cancelled.append(name)

    async def free(self, name: str) -> None:
        self.turns.pop(name).free()
        await anyio.wait_all_tasks_blocked()


@asynccontextmanager
async def lane_turns(
    p: Permits, concurrency: int = 4, lane: str = "ordinary"
) -> AsyncIterator[TurnTakers]:
    turn = PostTurn(lane, concurrency, poll_interval=5.0, permits=p)
    async with anyio.create_task_group() as tasks:
        yield TurnTakers(turn, tasks)


async def test_a_promoted_group_waiting_for_a_permit_goes_before_earlier_ordinary_waiters() -> None:
    """It holds its slot; the promotion wakes its permit waiter, which queues again as
    CRITICAL and takes the next freed permit before the ordinary claim queued earlier."""
    p = permits(2)
    reserve = await p.take(Priority.CRITICAL)  # the critical lane holds the reserve
    assert reserve is not None
    group = [held("g1"), held("g2")]
    async with lane_turns(p) as takers:
        await takers.queue("first", [held("f")])
        assert takers.took == ["first"]  # the ordinary share: one permit
        await takers.queue("single", [held("s")])
        await takers.queue("group", group)
        assert waiting(p) == {Priority.CRITICAL: 0, Priority.ORDINARY: 2}
        group[1].claim = group[1].claim.promoted()  # as Lane.promote does
        takers.post_turn.promote("g2")
        await anyio.wait_all_tasks_blocked()
        assert waiting(p) == {Priority.CRITICAL: 1, Priority.ORDINARY: 1}
        await takers.free("first")
        assert takers.took == ["first", "group"]
        await takers.free("group")
        assert takers.took == ["first", "group", "single"]
        await takers.free("single")
    p.release(reserve)
    assert inflight(p) == {Priority.CRITICAL: 0, Priority.ORDINARY: 0}
    assert takers.post_turn.slots.value == takers.post_turn.slots.total


async def test_stop_wakes_the_permit_waiters_and_their_slots_go_back() -> None:
    async with full() as (permit_takers, ordinary, critical):
        p = permit_takers.p
        async with lane_turns(p, concurrency=3) as takers:
            for name in ("a", "b", "c"):
                await takers.queue(name, [held(name)])
            assert takers.post_turn.slots.value == 0  # each holds its slot, waiting for a permit
            assert waiting(p)[Priority.ORDINARY] == 3
            takers.post_turn.stop()
            await anyio.wait_all_tasks_blocked()
            assert takers.ended == dict.fromkeys(("a", "b", "c"), Slot.STOPPING)
            assert takers.post_turn.slots.value == 3
            assert waiting(p) == {Priority.CRITICAL: 0, Priority.ORDINARY: 0}
        p.release(ordinary)
        p.release(critical)
    assert inflight(p) == {Priority.CRITICAL: 0, Priority.ORDINARY: 0}


async def test_a_turn_cancelled_while_waiting_for_a_permit_gives_its_slot_back() -> None:
    async with full() as (permit_takers, ordinary, critical):
        p = permit_takers.p
        async with lane_turns(p, concurrency=2) as takers:
            await takers.queue("gone", [held("gone")])
            await takers.queue("stays", [held("stays")])
            assert takers.post_turn.slots.value == 0
            takers.scopes["gone"].cancel()
            await anyio.wait_all_tasks_blocked()
            assert takers.cancelled == ["gone"]
            assert takers.post_turn.slots.value == 1
            assert waiting(p)[Priority.ORDINARY] == 1
            p.release(ordinary)  # to the one still waiting, not to the cancelled one
            await anyio.wait_all_tasks_blocked()
            assert takers.took == ["stays"]
            await takers.free("stays")
        p.release(critical)
    assert inflight(p) == {Priority.CRITICAL: 0, Priority.ORDINARY: 0}
    assert takers.post_turn.slots.value == 2


async def test_the_ordinary_lane_cannot_take_the_reserve_a_critical_post_gets_at_once() -> None:
    """The runner's permits (post_permits): with a limit of N the ordinary lane has at most
    N - reserve POSTs in flight, however many slots it has, and a critical POST takes the
    reserve without waiting for any of them."""
    cfg = load(
        {
            "database_url": "postgresql://relay@127.0.0.1:1/relay",
            "ingress_url": "http://127.0.0.1:1/runs/{run_id}/events",
            "concurrency": "8",
            "critical_concurrency": "2",
        },
        environ={},
    )
    p = post_permits(cfg)
    assert p is not None
    allowed, reserve = p.view().limit.allowed, p.view().reserve
    assert reserve >= 1
    async with (
        lane_turns(p, concurrency=9) as ordinary,  # a slot left for the finished run's turn
        lane_turns(p, concurrency=2, lane="critical") as critical,
    ):
        for i in range(8):
            await ordinary.queue(f"o{i}", [held(f"o{i}")])
        assert len(ordinary.took) == allowed - reserve
        assert inflight(p)[Priority.ORDINARY] == allowed - reserve
        assert waiting(p)[Priority.ORDINARY] == 8 - (allowed - reserve)
        # A finished run the ordinary lane found (its prefix ends in a terminal) is not control
        # traffic (issue 50): it waits for the ordinary share like the rest, not the reserve.
        await ordinary.queue("finished", [held("f", critical=True)])
        assert "finished" not in ordinary.took
        assert inflight(p)[Priority.CRITICAL] == 0
        await critical.queue("terminal", [held("t", targeted=True)])
        assert critical.took == ["terminal"]  # at once: no ordinary POST had to end first
        await critical.free("terminal")
        while ordinary.turns:  # each freed permit lets one more ordinary POST go, no more
            await ordinary.free(next(iter(ordinary.turns)))
            assert inflight(p)[Priority.ORDINARY] <= allowed - reserve
        assert len(ordinary.took) == 9
    assert inflight(p) == {Priority.CRITICAL: 0, Priority.ORDINARY: 0}


async def test_the_loop_lag_probe_sees_a_blocked_event_loop() -> None:
    """LoopLag notes how late its timer fired: a planted 50 ms block of the loop is seen as at
    least that much lateness (a lower bound, whatever else the machine does)."""
    lag = LoopLag()
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(lag.run)
        await anyio.sleep(LAG_TICK * 3)
        time.sleep(0.05)  # noqa: ASYNC251 (the planted block: the loop runs nothing meanwhile)
        await anyio.sleep(LAG_TICK * 3)
        seen = lag.value()
        tasks.cancel_scope.cancel()
    assert seen >= 0.05 - LAG_TICK


async def test_permits_hand_the_loop_lag_to_the_limit_with_each_answer() -> None:
    """A late loop widens what the limit tolerates: the same slow window is a cut without it."""
    seen: list[float] = []

    class Spy(Limit):
        def observe(self, sample: Sample, *, inflight: int, now: float) -> LimitEvent | None:
            seen.append(sample.lag)
            return super().observe(sample, inflight=inflight, now=now)

    class Late(LoopLag):
        def value(self) -> float:
            return 0.025

    p = Permits(Admission(Spy(4, initial=4)), lag=Late())
    permit = await p.take(Priority.ORDINARY)
    assert permit is not None
    p.answered(permit, Sample(0.010, Signal.ANSWERED))
    p.release(permit)
    assert seen == [0.025]


async def test_a_promotion_in_one_database_does_not_wake_another_databases_waiter() -> None:
    """A fleet's databases share the replica's permits (issue 51) and may hold the same run id:
    a promotion of run r in database a wakes a's waiter for r (which goes first), and b's
    waiter for its own r keeps its place in the queue (woken, it would queue again behind later
    waiters, and a's would not go first)."""
    p = permits(2)
    reserve = await p.take(Priority.CRITICAL)  # the critical lane holds the reserve
    assert reserve is not None
    turns = {db: PostTurn("ordinary", 4, poll_interval=5.0, permits=p, database=db) for db in "ab"}
    async with anyio.create_task_group() as tasks:
        a, b = TurnTakers(turns["a"], tasks), TurnTakers(turns["b"], tasks)
        await a.queue("a-first", [held("f")])  # the ordinary share: one permit
        a_r = [held("r")]
        await a.queue("a-r", a_r)  # a's run r
        await b.queue("b-r", [held("r")])  # b's run r, queued after it
        await a.queue("a-later", [held("x")])
        assert waiting(p) == {Priority.CRITICAL: 0, Priority.ORDINARY: 3}
        a_r[0].claim = a_r[0].claim.promoted()
        turns["a"].promote("r")  # a terminal committed for a's run r
        await anyio.wait_all_tasks_blocked()
        assert waiting(p) == {Priority.CRITICAL: 1, Priority.ORDINARY: 2}
        await a.free("a-first")
        assert a.took == ["a-first", "a-r"]
        await a.free("a-r")
        assert b.took == ["b-r"]  # b's r kept its place before a-later
        await b.free("b-r")
        assert a.took == ["a-first", "a-r", "a-later"]
        await a.free("a-later")
    p.release(reserve)
    assert inflight(p) == {Priority.CRITICAL: 0, Priority.ORDINARY: 0}
