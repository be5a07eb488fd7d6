"""The lane's one POST slot queue (issue 27 item 3): single claims and multi-run groups wait in
the same queue and take a freed slot the same way, critical ones first. No database, no
network: the lane is built over stand-ins it never calls here."""

from __future__ import annotations

from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from anyio.abc import TaskGroup

from relay.delivery.deliveries import Wiring
from relay.delivery.lane import Lane
from relay.delivery.post_turn import Slot
from relay.edges.store import Held
from relay.settings import load
from tests.support import one_event_claim, wait_for

pytestmark = [pytest.mark.anyio, pytest.mark.both_loops]  # issue 52: asyncio and uvloop


def held(run_id: str, *, critical: bool = False, targeted: bool = False) -> Held:
    return Held(one_event_claim(run_id, critical=critical, targeted=targeted))


def lane(concurrency: int = 1) -> Lane:
    cfg = load(
        {
            "database_url": "postgresql://relay@127.0.0.1:1/relay",
            "ingress_url": "http://127.0.0.1:1/runs/{run_id}/events",
            "poll_interval": "5",
        },
        environ={},
    )
    store: Any = object()  # never called: only the slot queue runs here
    ingress: Any = object()
    return Lane("ordinary", cfg, store, Wiring(ingress), concurrency)


async def until(check: Any) -> None:
    await wait_for(check, timeout=5, interval=0.001)


def queue(ln: Lane) -> list[tuple[tuple[Hashable, ...], bool]]:
    """The lane's slot queue as (run ids, critical) per waiter, in the order they queued."""
    return [(w.keys, w.critical) for w in ln.post_turn.slots.queued]


class Takers:
    """Claims of a lane taking its POST slot, each in a task: `took` is the order they got it."""

    def __init__(self, ln: Lane, tasks: TaskGroup) -> None:
        self.ln, self.tasks = ln, tasks
        self.took: list[str] = []

    async def queue(self, name: str, holds: list[Held]) -> None:
        """Start a taker and return once it waits in the slot queue."""
        waiting = len(self.ln.post_turn.slots.queued)
        self.tasks.start_soon(self._take, name, holds)
        await until(lambda: len(self.ln.post_turn.slots.queued) == waiting + 1)

    async def _take(self, name: str, holds: list[Held]) -> None:
        assert (await self.ln.post_turn.take(holds)).slot is Slot.POSTING
        self.took.append(name)

    async def release(self, times: int) -> None:
        """Free the slot `times` times, as a delivery does when its POST is done, each time
        until the next waiter has it."""
        for _ in range(times):
            had = len(self.took)
            self.ln.post_turn.slots.release()
            await until(lambda n=had + 1: len(self.took) == n)


@asynccontextmanager
async def slot_taken() -> AsyncIterator[tuple[Lane, Takers]]:
    """A lane whose one POST slot run "first" holds, and takers that queue for it."""
    ln = lane()
    try:
        assert (await ln.post_turn.take([held("first")])).slot is Slot.POSTING
        async with anyio.create_task_group() as tasks:
            yield ln, Takers(ln, tasks)
    finally:
        ln.complete.close()


async def test_a_freed_slot_goes_to_the_critical_claim_before_an_earlier_group() -> None:
    """A group queued first waits behind a targeted terminal's claim queued after it (before
    the queue was one, a group took the raw semaphore and a freed slot went to it first)."""
    async with slot_taken() as (ln, takers):
        await takers.queue("group", [held("g1"), held("g2")])
        await takers.queue("critical", [held("c", targeted=True)])
        assert queue(ln) == [(("g1", "g2"), False), (("c",), True)]  # the group queued first
        await takers.release(2)
        assert takers.took == ["critical", "group"]
        assert {"first", "g1", "g2", "c"} <= ln.post_turn.posting_runs


async def test_a_finished_run_found_by_discovery_waits_its_turn_in_queue_order() -> None:
    """A run whose prefix ends in a terminal, found by discovery (critical, not targeted), is
    prioritised work, not control traffic (issue 50): it does not jump the queue."""
    async with slot_taken() as (ln, takers):
        await takers.queue("group", [held("g1"), held("g2")])
        await takers.queue("finished", [held("f", critical=True)])
        assert queue(ln) == [(("g1", "g2"), False), (("f",), False)]
        await takers.release(2)
        assert takers.took == ["group", "finished"]


async def test_a_promoted_run_makes_its_queued_group_critical() -> None:
    """A terminal event committed for a run queued in a group turns the group critical: it
    goes before single ordinary claims queued earlier."""
    group = [held("g1"), held("g2")]
    async with slot_taken() as (ln, takers):
        await takers.queue("single", [held("s")])
        await takers.queue("group", group)
        assert queue(ln) == [(("s",), False), (("g1", "g2"), False)]
        ln.inflight.update({h.claim.run_id: h for h in group})
        ln.promote("g2")  # wakes the group's waiter: it queues again, as critical
        assert group[1].claim.critical
        await until(lambda: len(ln.post_turn.slots.queued) == 2)
        assert queue(ln) == [(("s",), False), (("g1", "g2"), True)]
        await takers.release(2)
        assert takers.took == ["group", "single"]
