"""The event loop's lateness probe (relay/delivery/post_turn.py `LoopLag`, issue 52 item 3): dense
while POSTs go and answers read it, sparse when none has for a while, and dense again from the
next POST's permit (or an answer's read), still seeing a blocked loop."""

from __future__ import annotations

import time

import anyio
import pytest

from relay.admission.limit import Limit, LimitEvent, Sample, Signal
from relay.admission.permits import Admission, Priority
from relay.delivery.post_turn import (
    LAG_IDLE_TICK,
    LAG_SPAN,
    LAG_TICK,
    LoopLag,
    Permits,
    probe_tick,
)
from tests.support import wait_for

pytestmark = pytest.mark.anyio

# uvloop's loop clock counts whole milliseconds (relay/core/clock.py): a 50 ms block after a
# 10 ms sleep began reads as 39.99... ms overslept there, not 40.
CLOCK_STEP = 0.001


def test_the_probe_is_dense_while_answers_read_it_and_sparse_after_a_quiet_span() -> None:
    assert probe_tick(0.0) == LAG_TICK
    assert probe_tick(LAG_SPAN * 0.99) == LAG_TICK
    assert probe_tick(LAG_SPAN) == LAG_IDLE_TICK
    assert probe_tick(3600.0) == LAG_IDLE_TICK
    assert LAG_IDLE_TICK >= 50 * LAG_TICK  # an idle relay: 2 wakes a second, not 100


@pytest.mark.both_loops
async def test_an_answers_read_wakes_a_sparse_probe_which_then_sees_a_blocked_loop() -> None:
    """Unread for LAG_SPAN, the probe sleeps LAG_IDLE_TICK; the next read wakes it at once (not
    at the end of that sleep) to sleep LAG_TICK again, so a planted 50 ms block of the loop
    right after is seen as at least that much lateness."""
    lag = LoopLag()
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(lag.run)
        # Dense from the start, sparse once unread for LAG_SPAN.
        await wait_for(lambda: lag.tick == LAG_IDLE_TICK, what="the unread probe to go sparse")
        lag.value()  # an answer came
        await anyio.wait_all_tasks_blocked()  # the probe ran, if it was woken
        assert lag.tick == LAG_TICK, "the read did not wake the sparse probe"
        time.sleep(0.05)  # noqa: ASYNC251 (the planted block: the loop runs nothing meanwhile)
        await anyio.sleep(LAG_TICK * 3)
        seen = lag.value()
        tasks.cancel_scope.cancel()
    assert seen >= 0.05 - LAG_TICK - CLOCK_STEP


@pytest.mark.both_loops
async def test_a_posts_permit_wakes_a_sparse_probe_so_its_answer_sees_the_loop_blocked() -> None:
    """After a quiet spell the probe sleeps LAG_IDLE_TICK; the first POST wakes it as it takes
    its permit, before it is sent (not at its answer's read), so a 50 ms block of the loop while
    that POST is on the wire is in the lateness its answer hands the limit."""
    seen: list[float] = []

    class Spy(Limit):
        def observe(self, sample: Sample, *, inflight: int, now: float) -> LimitEvent | None:
            seen.append(sample.lag)
            return super().observe(sample, inflight=inflight, now=now)

    lag = LoopLag()
    permits = Permits(Admission(Spy(4, initial=4)), lag)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(lag.run)
        await wait_for(lambda: lag.tick == LAG_IDLE_TICK, what="the quiet probe to go sparse")
        permit = permits.try_take(Priority.ORDINARY)  # the first POST after the quiet spell
        assert permit is not None
        await anyio.wait_all_tasks_blocked()  # the probe ran, if it was woken
        assert lag.tick == LAG_TICK, "the POST's permit did not wake the sparse probe"
        time.sleep(0.05)  # noqa: ASYNC251 (the planted block, the POST on the wire)
        await anyio.sleep(LAG_TICK * 3)  # the rest of its round trip
        permits.answered(permit, Sample(0.06, Signal.ANSWERED))
        permits.release(permit)
        tasks.cancel_scope.cancel()
    assert seen and seen[0] >= 0.05 - LAG_TICK - CLOCK_STEP, seen
