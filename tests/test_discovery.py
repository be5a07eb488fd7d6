"""The ordinary lane's discovery (relay/delivery/discovery.py, issue 50): how many runs a pass
asks for, a short claim of finished runs filled from any due run in the same pass, and the
spacing after a pass that found nothing. No database: the store is a stand-in that hands out runs
from two backlogs and records each claim, with the event loop's time it came."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from relay.delivery.discovery import MIN_EMPTY_PASS_SPACING, Discovery
from relay.delivery.holdings import Holdings
from relay.delivery.stats import FetchStats
from relay.edges.store import Claim
from relay.settings import Settings
from tests.support import offline_settings, one_event_claim

pytestmark = [pytest.mark.anyio, pytest.mark.both_loops]  # issue 52: asyncio and uvloop


class Backlogs:
    """The store's `claim` over two backlogs: 'critical' picks finished runs, 'ordinary' any due
    run (schema/functions.sql `claim`)."""

    def __init__(self, finished: int, due: int) -> None:
        self.runs = {
            "critical": [one_event_claim(f"f{i}", critical=True) for i in range(finished)],
            "ordinary": [one_event_claim(f"d{i}") for i in range(due)],
        }
        self.asked: list[tuple[str, int]] = []
        self.asked_at: list[float] = []

    async def claim(self, lane: str, n_runs: int, run_id: str | None = None) -> list[Claim]:
        assert run_id is None, "discovery never targets a run"
        self.asked.append((lane, n_runs))
        self.asked_at.append(anyio.current_time())
        took, self.runs[lane] = self.runs[lane][:n_runs], self.runs[lane][n_runs:]
        return took


def settings(**more: str) -> Settings:
    return offline_settings(**{"claim_runs": "8", **more})


def discovery(cfg: Settings, store: Backlogs, concurrency: int = 4) -> Discovery:
    store_: Any = store
    return Discovery(cfg, store_, Holdings(cfg, concurrency), FetchStats())


async def test_a_short_claim_of_finished_runs_is_filled_from_any_due_run_in_the_same_pass() -> None:
    store = Backlogs(finished=3, due=100)
    d = discovery(settings(), store)
    found = await d.claims(now=0.0)
    assert store.asked == [("critical", 8), ("ordinary", 5)]
    assert [c.run_id for c in found.claims] == ["f0", "f1", "f2", "d0", "d1", "d2", "d3", "d4"]
    assert found.full  # as many as it asked for: the next pass starts at once
    assert (d.fetched.passes, d.fetched.claims) == (1, 2)


async def test_a_pass_that_finds_less_than_it_asked_for_is_not_full() -> None:
    store = Backlogs(finished=0, due=2)
    found = await discovery(settings(), store).claims(now=0.0)
    assert [c.run_id for c in found.claims] == ["d0", "d1"]
    assert not found.full


async def test_a_pass_asks_for_no_more_than_the_lanes_room_and_byte_budget() -> None:
    store = Backlogs(finished=100, due=100)
    d = discovery(settings(), store, concurrency=4)  # holds 4 + claim_runs: room for 12
    for i in range(10):
        d.holdings.hold(one_event_claim(f"held{i}"))
    await d.claims(now=0.0)
    assert store.asked == [("critical", 2)]  # the room left

    store = Backlogs(finished=100, due=100)
    tight = settings(max_batch_bytes="1KiB", max_lane_bytes="3KiB")  # each run counts 1 KiB
    await discovery(tight, store).claims(now=0.0)
    assert store.asked == [("critical", 3)]  # the byte budget, below claim_runs and the room


async def test_the_pass_after_one_that_found_nothing_waits_for_the_spacing() -> None:
    """A burst of wakes after an empty pass costs a handful of passes, not one each: the next
    claim goes out no sooner than the spacing after the empty one (a lower bound on the loop's
    clock, which the wait guarantees; nothing here bounds how late it may go)."""
    store = Backlogs(finished=0, due=0)
    d = discovery(settings(), store)
    assert not (await d.claims(now=anyio.current_time())).full
    empty_pass_ended, calls = store.asked_at[-1], len(store.asked)
    await d.claims(now=anyio.current_time())  # woken at once, as by the next wake of a burst
    # The sum, as the code reckons it (`spaced_until`), not the difference: the loop's clock
    # reads ~70,000 s after a day's uptime, where 69614.503 - 69614.493 is 0.00999999 in floats
    # (uvloop's whole milliseconds land on it exactly; CI read it so once).
    assert store.asked_at[calls] >= empty_pass_ended + MIN_EMPTY_PASS_SPACING
