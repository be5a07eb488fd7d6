"""The event loop's lateness probe (relay/delivery/post_turn.py `LoopLag`, issue 52 item 3): dense
while answers read it, sparse when none has for a while, and dense again at the next answer's
read, still seeing a blocked loop."""

from __future__ import annotations

import time

import anyio
import pytest

from relay.delivery.post_turn import LAG_IDLE_TICK, LAG_SPAN, LAG_TICK, LoopLag, probe_tick
from tests.support import wait_for

pytestmark = pytest.mark.anyio


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
    assert seen >= 0.05 - LAG_TICK
