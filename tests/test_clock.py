"""The hot paths' clock (relay/core/clock.py) is asyncio's loop's: a trust window, a round trip
or a permit stamped by one and read by the other means the same instant there."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from relay.core import clock

pytestmark = pytest.mark.anyio


async def test_the_hot_paths_clock_is_the_event_loops() -> None:
    """On asyncio's own loop the two are one clock. uvloop's is libuv's, in whole milliseconds:
    how the relay keeps right on it is tests/test_clock_loops.py's."""
    for _ in range(50):
        before = anyio.current_time()
        ours = clock.now()
        after = anyio.current_time()
        assert before <= ours <= after
        await anyio.lowlevel.checkpoint()
