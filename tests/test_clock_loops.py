"""The hot paths' clock (relay/core/clock.py) against the deadlines the loop keeps, on each loop
the relay may run on (issue 52 item 2)."""

import anyio
import pytest

from relay.core import clock, loop

pytestmark = pytest.mark.parametrize(
    "anyio_backend",
    [
        pytest.param("asyncio", id="asyncio"),
        pytest.param(
            ("asyncio", {"use_uvloop": True}),
            id="uvloop",
            # Open (issue 52 item 2): on uvloop a sleep to a deadline of clock.now() wakes
            # before it, with clock.now as time.monotonic and also as the loop's own time().
            marks=pytest.mark.xfail(strict=True, reason="uvloop wakes before the deadline"),
        ),
    ],
)


@pytest.mark.anyio
async def test_a_deadline_of_the_hot_paths_clock_has_passed_when_the_loop_wakes_for_it() -> None:
    early = []
    for _ in range(200):
        deadline = clock.now() + 0.002
        await anyio.sleep(deadline - clock.now())
        if clock.now() < deadline:
            early.append(deadline - clock.now())
    assert early == [], f"woke before the deadline on {loop.running()}: {len(early)} of 200"
