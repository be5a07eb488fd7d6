"""The hot paths' clock (relay/core/clock.py) against the deadlines the loop keeps, on each loop
the relay may run on (issue 52 item 2). On uvloop a timer keeps whole milliseconds of libuv's
clock, and a sleep to a deadline of `clock.now()` often ends before it: what the relay does when
it wakes for one is what must hold."""

import asyncio

import anyio
import anyio.lowlevel
import pytest

from relay.core import clock, loop
from relay.edges.ingress import Deadlines

pytestmark = [pytest.mark.anyio, pytest.mark.both_loops]


async def test_the_test_runs_on_the_loop_it_names(anyio_backend: object) -> None:
    assert loop.running() == ("asyncio" if anyio_backend == "asyncio" else "uvloop")


async def test_a_request_is_cut_only_once_the_hot_paths_clock_reached_its_deadline() -> None:
    """The POSTs' one timer (relay/edges/ingress.py): requests whose deadlines fall between
    the loop's milliseconds, each cut no sooner than its deadline by `clock.now()`. Red on uvloop
    if the timer's firing is taken for the deadline (its timers fire up to a millisecond early
    on this clock)."""
    deadlines = Deadlines()
    early: list[float] = []

    async def request(after: float) -> None:
        scope = anyio.CancelScope()
        deadline = clock.now() + after
        deadlines.add(scope, deadline)
        with scope:
            await anyio.sleep_forever()
        if clock.now() < deadline:
            early.append(deadline - clock.now())

    for _ in range(20):
        async with anyio.create_task_group() as tg:
            for i in range(15):
                tg.start_soon(request, 0.0013 + i * 0.00037)
    assert early == [], f"{len(early)} of 300 cut before their deadline on {loop.running()}"


async def test_the_hot_paths_clock_is_never_behind_the_loops() -> None:
    """A window stamped and read on `clock.now()` ends no later than on the loop's clock: the
    loop's `time()` read first is never ahead of it (uvloop's is libuv's, in whole ms)."""
    running = asyncio.get_running_loop()
    for _ in range(2000):
        theirs = running.time()
        ours = clock.now()
        assert theirs <= ours


async def test_the_hot_paths_clock_tells_apart_instants_half_a_millisecond_apart() -> None:
    """A round trip to a fast ingress takes well under a millisecond, and the adaptive limit
    judges it against the recent minimum: red if `clock.now` were uvloop's own `time()`, which
    steps by whole milliseconds."""
    steps = []
    for _ in range(50):
        first = clock.now()
        while (then := clock.now()) == first:
            pass
        steps.append(then - first)
        await anyio.lowlevel.checkpoint()
    assert min(steps) < 0.0005, f"the clock steps by {min(steps)} s on {loop.running()}"
