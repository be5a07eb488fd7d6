"""The POST slot queue on its own (relay/delivery/slots.py, issue 27): critical waiters first, FIFO
within a class, a freed slot handed to the next waiter rather than contended for again, no slot
leaked by a cancelled waiter, a slot freed once. No lane, no database: each step waits until every
task is blocked, so the order seen is the queue's, not the scheduler's."""

from __future__ import annotations

from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager

import anyio
import pytest
from anyio.abc import TaskGroup

from relay.delivery.slots import Slots

pytestmark = [pytest.mark.anyio, pytest.mark.both_loops]  # issue 52: asyncio and uvloop


class Takers:
    """Tasks that each take a slot; `took` is the order they got one, `woken` those that were
    woken without one, `cancelled` those whose wait was cancelled."""

    def __init__(self, slots: Slots, tasks: TaskGroup) -> None:
        self.slots = slots
        self.tasks = tasks
        self.took: list[str] = []
        self.woken: list[str] = []
        self.cancelled: list[str] = []
        self.scopes: dict[str, anyio.CancelScope] = {}

    async def queue(self, name: str, *, critical: bool = False, keys: tuple[str, ...] = ()) -> None:
        """Start a taker and return once it waits in the queue (or has its slot)."""
        self.tasks.start_soon(self._take, name, critical, keys or (name,))
        await anyio.wait_all_tasks_blocked()

    async def _take(self, name: str, critical: bool, keys: tuple[Hashable, ...]) -> None:
        with anyio.CancelScope() as scope:
            self.scopes[name] = scope
            got = await self.slots.take(critical, keys)
            (self.took if got else self.woken).append(name)
            return
        self.cancelled.append(name)

    async def release(self) -> None:
        """What a delivery does when its POST is done; returns once the next taker has run."""
        self.slots.release()
        await anyio.wait_all_tasks_blocked()


@asynccontextmanager
async def one_slot_taken() -> AsyncIterator[Takers]:
    """Takers of a single slot that is already taken: each one queues."""
    slots = Slots(1)
    assert slots.take_nowait()
    async with anyio.create_task_group() as tasks:
        yield Takers(slots, tasks)


async def test_takes_free_slots_at_once_and_queues_once_none_is_left() -> None:
    slots = Slots(2)
    assert slots.take_nowait() and await slots.take(critical=False)
    assert slots.value == 0 and not slots.take_nowait()
    async with anyio.create_task_group() as tasks:
        takers = Takers(slots, tasks)
        await takers.queue("a")
        assert takers.took == [] and len(slots.queued) == 1
        await takers.release()
        assert takers.took == ["a"] and slots.queued == () and slots.value == 0
    slots.release()
    slots.release()
    assert slots.value == 2


async def test_a_freed_slot_goes_to_critical_waiters_first_then_in_queue_order() -> None:
    async with one_slot_taken() as takers:
        slots = takers.slots
        await takers.queue("ordinary-1")
        await takers.queue("critical-1", critical=True)
        await takers.queue("ordinary-2")
        await takers.queue("critical-2", critical=True)
        for _ in range(4):
            await takers.release()
    assert takers.took == ["critical-1", "critical-2", "ordinary-1", "ordinary-2"]
    assert slots.value == 0  # the last one still holds its slot


async def test_a_freed_slot_is_handed_over_not_contended_for_again() -> None:
    """Between the release and the waiter's turn, a newcomer finds no free slot: the waiter
    that queued first gets it, and the newcomer queues behind whoever still waits."""
    async with one_slot_taken() as takers:
        slots = takers.slots
        await takers.queue("first")
        await takers.queue("second")
        slots.release()  # the waiter has not run yet
        assert slots.value == 0 and not slots.take_nowait()
        await anyio.wait_all_tasks_blocked()
        assert takers.took == ["first"]
        await takers.queue("newcomer")
        await takers.release()
        assert takers.took == ["first", "second"]
        await takers.release()
    assert takers.took == ["first", "second", "newcomer"]


async def test_a_waiter_cancelled_in_the_queue_leaves_it() -> None:
    async with one_slot_taken() as takers:
        slots = takers.slots
        await takers.queue("gone")
        takers.scopes["gone"].cancel()
        await anyio.wait_all_tasks_blocked()
        assert takers.cancelled == ["gone"] and slots.queued == ()
    slots.release()  # to nobody: the slot is free again, not handed to the cancelled waiter
    assert slots.value == 1 and slots.take_nowait()


async def test_a_waiter_cancelled_after_the_hand_over_passes_its_slot_on() -> None:
    """Cancelled, then handed the slot before it ran: it passes the slot to the next waiter
    (or frees it): cancellation never leaks one."""
    async with one_slot_taken() as takers:
        slots = takers.slots
        await takers.queue("cancelled")
        await takers.queue("next")
        takers.scopes["cancelled"].cancel()
        await takers.release()  # handed to "cancelled", which has not run yet
        assert takers.cancelled == ["cancelled"] and takers.took == ["next"]
        assert slots.value == 0
        await takers.queue("last")
        takers.scopes["last"].cancel()
        await takers.release()
        assert takers.cancelled == ["cancelled", "last"]
    assert slots.value == 1  # nobody was left to pass it to


async def test_a_caller_deadline_takes_the_waiter_out_of_the_queue() -> None:
    slots = Slots(1)
    assert slots.take_nowait()
    got = None
    with anyio.move_on_after(0.01):
        got = await slots.take(critical=True)
    assert got is None and slots.queued == ()
    slots.release()
    assert slots.value == 1


async def test_a_woken_waiter_leaves_without_a_slot() -> None:
    """`wake` (a promotion: the lane's waiter queues again in its new class) and `wake_all`
    (the lane stops) leave the slots where they are."""
    async with one_slot_taken() as takers:
        slots = takers.slots
        await takers.queue("group", keys=("g1", "g2"))
        await takers.queue("other")
        await takers.queue("third")
        slots.wake("g2")
        slots.wake("nobody")
        await anyio.wait_all_tasks_blocked()
        assert takers.woken == ["group"] and len(slots.queued) == 2
        slots.wake("g1")  # its waiter has left: nothing
        await takers.release()
        assert takers.took == ["other"]
        slots.wake_all()
        await anyio.wait_all_tasks_blocked()
        assert takers.woken == ["group", "third"] and slots.queued == ()
    assert slots.value == 0  # "other" still holds the slot


async def test_a_slot_is_freed_once() -> None:
    """`release_once()` frees its slot the first time only (a delivery frees early, when only
    the acks are left, and again at its end); a bare release beyond the slots taken is a bug."""
    slots = Slots(2)
    assert slots.take_nowait() and slots.take_nowait()
    free = slots.release_once()
    free()
    free()
    assert slots.value == 1
    slots.release()
    with pytest.raises(RuntimeError, match="more often than taken"):
        slots.release()
    assert slots.value == 2


def test_at_least_one_slot() -> None:
    with pytest.raises(ValueError, match="at least one slot"):
        Slots(0)
