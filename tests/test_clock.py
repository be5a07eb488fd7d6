"""The hot paths' clock (relay/core/clock.py) is the event loop's: a trust window, a round trip or a
permit stamped by one and read by the other must mean the same instant."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from relay.core import clock

pytestmark = pytest.mark.anyio


async def test_the_hot_paths_clock_is_the_event_loops() -> None:
    """Red if the relay's loop ever keeps a clock of its own (uvloop's is libuv's, cached per
    loop turn in milliseconds): then relay.core.clock must read the loop's."""
    for _ in range(50):
        before = anyio.current_time()
        ours = clock.now()
        after = anyio.current_time()
        assert before <= ours <= after
        await anyio.lowlevel.checkpoint()
