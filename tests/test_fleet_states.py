"""A fleet's databases while they are down (issue 51, docs/sharding.md "Each database on its
own"): how soon one set aside is tried again once it is fixed, over a fake clock, and what its
state and `since` say from the moment it was lost until it is served again."""

from __future__ import annotations

import time
from itertools import pairwise
from typing import Any
from urllib.parse import urlsplit

import anyio
import pytest
from anyio.abc import TaskStatus

from relay import fleet as relay_fleet
from relay.fleet import FIRST_RETRY, Fleet, retry_delay
from relay.pools import RECONNECT_WINDOW
from relay.runner import Relay
from relay.serving.ui.fleet import database_entry
from relay.serving.ui.view import database_row
from tests.faults.proxy import FaultProxy, via
from tests.support import wait_for
from tests.test_fleet import (
    closed_port,
    fleet,
    shards,  # noqa: F401 - the fixture
)

# -- the set-aside retry's schedule, over a fake clock -----------------------------------------

OUTAGES = [k * 0.25 for k in range(4 * 900)]  # every quarter second of a 15-minute outage
WORST, LUCKIEST = 0.999_999, 0.0  # `rand` at the top and the bottom of its range


def probes(outage: float, rand: float) -> list[float]:
    """When a database set aside at 0 (its first failed probe) is probed, up to its first probe
    at or after `outage` (fixed then: `relay migrate` run, its server back), every delay drawn
    with `rand`; a probe that is refused returns at once."""
    now, attempt, times = 0.0, 0, [0.0]
    while now < outage:
        attempt += 1
        now += retry_delay(attempt, rand)
        times.append(now)
    return times


def test_a_database_set_aside_is_tried_again_within_the_pools_window_however_long_it_was_down() -> (
    None
):
    """Fixed at any moment of a 15-minute outage, it is probed again within RECONNECT_WINDOW
    (10 s), as soon as a served database's lost server is tried (relay/pools.py), not after
    the 30 s the set-aside retry once waited at its cap."""
    waits = [probes(outage, WORST)[-1] - outage for outage in OUTAGES]
    assert max(waits) <= RECONNECT_WINDOW, max(waits)
    # A blip is tried again at once: the first delays are FIRST_RETRY's and its doubles.
    assert retry_delay(1, WORST) <= FIRST_RETRY
    assert probes(1.0, WORST)[-1] < 2.0


def test_a_database_that_stays_down_costs_at_most_two_probes_a_window() -> None:
    """What the shorter wait costs: each probe is a connection (and a debug line). However
    the jitter falls, the probes of a long outage, once at the cap, are at least half the
    window apart, never a tight loop against a server that is down."""
    for rand in (LUCKIEST, 0.5, WORST):
        times = probes(OUTAGES[-1], rand)
        gaps = [b - a for a, b in pairwise(times)]
        assert min(gaps[8:]) >= RECONNECT_WINDOW / 2, (rand, gaps[:12])
        assert len(times) <= 8 + OUTAGES[-1] / (RECONNECT_WINDOW / 2), (rand, len(times))


# -- what the page says while a database is down ------------------------------------------------


def shown(f: Fleet, name: str) -> dict[str, Any]:
    """`name` as the fleet's list shows it: its object of /api/status, its row's status word
    (`up`, `DOWN`, `starting`), and `since` as the wall-clock seconds it is shown from."""
    db = next(d for d in f.page.databases() if d.name == name)
    entry = database_entry(db, time.time(), anyio.current_time())
    return {**entry, "status": database_row(entry)["status"], "since": db.since}


@pytest.mark.anyio
async def test_a_database_set_aside_is_shown_down_with_its_reason_while_its_next_relay_starts(
    shards: dict[str, str],  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """s1's first relay fails; its probe then passes, and its next relay's start is held (here
    until the test lets it go, as a start waits for its pools or its liveness lock). All that
    while s1 is DOWN, set aside, with the failure and since it failed, not `starting` with no
    reason since the probe; once that relay serves, it is up."""
    let_go = anyio.Event()
    built: list[str] = []

    class HeldAfterFailing(Relay):
        async def run(self, *, task_status: TaskStatus[Relay] = anyio.TASK_STATUS_IGNORED) -> None:
            built.append(str(self.database))
            if self.database == "s1" and built.count("s1") == 1:
                raise RuntimeError("the first relay of s1 fails")
            if self.database == "s1":
                await let_go.wait()
            await super().run(task_status=task_status)

    monkeypatch.setattr(relay_fleet, "Relay", HeldAfterFailing)
    nowhere = f"http://127.0.0.1:{closed_port()}"
    async with anyio.create_task_group() as tg:
        f = fleet(shards, nowhere, max_retry=0.1)
        await tg.start(f.run)
        await wait_for(lambda: shown(f, "s1")["status"] == "DOWN", what="s1 set aside")
        failed = shown(f, "s1")
        await wait_for(lambda: built.count("s1") == 2, what="s1's next relay starting")
        starting = shown(f, "s1")
        let_go.set()
        await wait_for(lambda: shown(f, "s1")["up"], what="s1 served")
        served = shown(f, "s1")
        f.stop()
    assert failed["error"] == "failed: RuntimeError: the first relay of s1 fails", failed
    assert starting["status"] == "DOWN" and starting["state"] == "set_aside", starting
    assert starting["error"] == failed["error"] and starting["since"] == failed["since"], starting
    assert served["status"] == "up" and served["since"] > failed["since"], served


@pytest.mark.anyio
async def test_a_relay_that_rode_out_a_lost_server_then_failed_is_down_since_the_loss(
    shards: dict[str, str],  # noqa: F811 - the fixture
    pg_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """s1's server lost once served (its proxy cuts every connection and refuses new ones):
    DOWN, `lost: ...`, since its LISTEN connection's first failure. Its relay then fails (here
    on cue) and s1 is set aside: still DOWN since that first failure, the same outage, not
    since the set-aside; once its server is back it is served and up again."""
    host, port = urlsplit(pg_url).hostname, urlsplit(pg_url).port
    assert host is not None and port is not None
    fail = anyio.Event()

    class FailsOnCue(Relay):
        async def run(self, *, task_status: TaskStatus[Relay] = anyio.TASK_STATUS_IGNORED) -> None:
            if self.database != "s1" or fail.is_set():
                await super().run(task_status=task_status)
                return
            async with anyio.create_task_group() as tg:
                await tg.start(super().run)
                task_status.started(self)
                await fail.wait()
                raise RuntimeError("s1's relay fails")

    monkeypatch.setattr(relay_fleet, "Relay", FailsOnCue)
    nowhere = f"http://127.0.0.1:{closed_port()}"
    async with anyio.create_task_group() as proxies:
        proxy = FaultProxy(host, port, "s1")
        await proxy.start(proxies)
        urls = {"s0": shards["s0"], "s1": via(shards["s1"], proxy.port)}
        async with anyio.create_task_group() as tg:
            f = fleet(urls, nowhere, max_retry=0.2)
            await tg.start(f.run)
            await wait_for(lambda: shown(f, "s1")["up"], what="s1 up")
            proxy.target = (host, closed_port())  # its server is gone
            proxy.reset()
            await wait_for(
                lambda: (shown(f, "s1")["error"] or "").startswith("lost: "), what="s1 lost"
            )
            lost = shown(f, "s1")
            fail.set()
            await wait_for(lambda: shown(f, "s1")["state"] == "set_aside", what="s1 set aside")
            set_aside = shown(f, "s1")
            proxy.target = (host, port)  # back
            await wait_for(lambda: shown(f, "s1")["up"], what="s1 up again")
            f.stop()
        proxies.cancel_scope.cancel()
    assert lost["status"] == "DOWN" and lost["state"] == "serving", lost
    assert set_aside["status"] == "DOWN", set_aside
    assert set_aside["error"] == "failed: RuntimeError: s1's relay fails", set_aside
    assert set_aside["since"] == lost["since"], (set_aside, lost)
