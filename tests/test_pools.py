"""A relay's pools after their server went away (issue 51, docs/sharding.md "A server lost"): each
series of reconnection attempts lasts `RECONNECT_WINDOW` and the next starts at once, so a
server back is tried within about half the window however long it was down; never a pool that
gave up. The schedule over a fake clock (psycopg_pool's own `AttemptWithBackoff`, which takes
`now`), and a real pool behind a TCP proxy that keeps trying, with nothing asking it for a
connection, past several windows of its server gone."""

from __future__ import annotations

from urllib.parse import urlsplit

import anyio
import pytest
from psycopg_pool.base import AttemptWithBackoff

from relay.pools import RECONNECT_WINDOW, Pools
from tests.faults.proxy import FaultProxy, via
from tests.support import settings, wait_for
from tests.test_fleet import closed_port

# -- the schedule, over a fake clock ------------------------------------------------------------


def first_try_after(outage: float, window: float, *, rearmed: bool = True) -> float | None:
    """When a pool whose connection broke at 0 first tries to connect at or after `outage` (its
    server back then): psycopg_pool's series of attempts (`AttemptWithBackoff`, its delays from
    the clock passed in), each given up after `window`, and then the next at once when
    `rearmed` (relay.pools.rearm), else none (None)."""
    now = 0.0
    attempt = AttemptWithBackoff(timeout=window)
    while now < outage:  # this attempt fails
        if attempt.time_to_give_up(now):
            if not rearmed:
                return None
            attempt = AttemptWithBackoff(timeout=window)
            continue  # the next series' first attempt, at once
        attempt.update_delay(now)
        now += attempt.delay
    return now


OUTAGES = [k * 0.25 for k in range(4 * 900)]  # every quarter second of a 15-minute outage


def test_a_server_back_is_tried_within_half_the_window_however_long_it_was_down() -> None:
    waits = []
    for outage in OUTAGES:
        tried = first_try_after(outage, RECONNECT_WINDOW)
        assert tried is not None
        waits.append(tried - outage)
    # 1 s, 2 s and 4 s apart (the first delay ±10 %), the last clipped to the window's end.
    assert max(waits) <= 0.45 * RECONNECT_WINDOW, max(waits)


def test_psycopg_pools_default_window_left_a_server_back_untried_for_minutes() -> None:
    """Why the relay sets the window: at psycopg_pool's default (`reconnect_timeout`, 5 minutes)
    the delay doubles through the whole outage, and after it nothing is tried at all until a
    client asks the pool for a connection."""
    waits = [
        tried - outage
        for outage in OUTAGES
        if (tried := first_try_after(outage, 300.0, rearmed=False)) is not None
    ]
    assert max(waits) > 60, max(waits)
    assert first_try_after(301.0, 300.0, rearmed=False) is None
    # An outage of 15 to 17 s: the next attempt 10 s after it or more (10.9 s measured).
    after = [(15 + k * 0.01, first_try_after(15 + k * 0.01, 300.0)) for k in range(200)]
    assert max(tried - outage for outage, tried in after if tried is not None) > 10


# -- a real pool ---------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_pool_keeps_trying_past_its_window_and_reconnects_with_nobody_asking(
    pg_url: str, schema: str
) -> None:
    """The pools' server gone (the proxy in front of it now leads to a closed port and cut
    every connection) past several windows of 0.3 s, and back: each pool made a connection
    again by itself. Without the next series at once, a pool stops trying after its first
    window until something asks it for a connection."""
    host, port = urlsplit(pg_url).hostname, urlsplit(pg_url).port
    assert host is not None and port is not None
    async with anyio.create_task_group() as tg:
        proxy = FaultProxy(host, port, "db")
        await proxy.start(tg)
        s = settings(via(pg_url, proxy.port), schema, "http://127.0.0.1:1")
        opened = await Pools(s, reconnect_window=0.3).open(anyio.Event())
        assert opened is not None
        try:
            proxy.target = (host, closed_port())
            proxy.reset()
            for pool in opened:
                await pool.check()  # finds its connection broken: the first series starts
            for pool in opened:
                # Two attempts a window at most (0 and its end): past four windows.
                await wait_for(
                    lambda pool=pool: pool.get_stats().get("connections_errors", 0) >= 8,
                    what=f"{pool.name} trying on",
                )
                assert pool.get_stats()["pool_available"] == 0
            proxy.target = (host, port)
            for pool in opened:
                await wait_for(
                    lambda pool=pool: pool.get_stats()["pool_available"] >= 1,
                    what=f"{pool.name} connected again",
                )
        finally:
            for pool in opened:
                await pool.close()
            tg.cancel_scope.cancel()
