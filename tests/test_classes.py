"""The ordinary lane's share between finished runs (b) and any due run (c) (issue 50,
relay/core/classes.py): pure, on a simulated backlog and a fake clock."""

from __future__ import annotations

from relay.core.classes import (
    BACKLOG_CLASSES,
    DUE_WEIGHT,
    FINISHED_WEIGHT,
    Discovered,
    Shares,
    backlog_class,
)
from relay.serving.ui.data import CLASSES as CLAIM_CLASSES

CLAIM = 8  # runs a claim asks for


def drain(shares: Shares, backlog: dict[Discovered, int], claims: int, now: float = 0.0) -> dict:
    """Run `claims` claims as the lane does (a short finished claim filled from any due run)
    against `backlog` runs of each class; the runs each class got."""
    got = {Discovered.FINISHED: 0, Discovered.DUE: 0}
    for _ in range(claims):
        first = shares.first(now)
        take = min(CLAIM, backlog[first])
        backlog[first] -= take
        got[first] += take
        shares.claimed(first, take, CLAIM, now)
        if first is Discovered.FINISHED and take < CLAIM:
            rest = min(CLAIM - take, backlog[Discovered.DUE])
            backlog[Discovered.DUE] -= rest
            got[Discovered.DUE] += rest
            shares.claimed(Discovered.DUE, rest, CLAIM - take, now)
    return got


def test_with_both_at_work_finished_runs_get_their_weight_and_due_runs_the_rest() -> None:
    got = drain(Shares(recheck=1.0), {Discovered.FINISHED: 10**6, Discovered.DUE: 10**6}, 400)
    total = sum(got.values())
    share = got[Discovered.FINISHED] / total
    assert abs(share - FINISHED_WEIGHT / (FINISHED_WEIGHT + DUE_WEIGHT)) < 0.02, got
    assert got[Discovered.DUE] > 0, "due runs starved beside finished ones"


def test_finished_runs_go_first_when_both_start_level() -> None:
    assert Shares(recheck=1.0).first(0.0) is Discovered.FINISHED


def test_no_credit_is_banked_while_finished_runs_have_none_due() -> None:
    shares = Shares(recheck=1.0)
    # A long stretch with no finished run: only due runs are claimed.
    got = drain(shares, {Discovered.FINISHED: 0, Discovered.DUE: 10**6}, 200, now=0.0)
    assert got[Discovered.FINISHED] == 0
    # Finished runs arrive after the recheck: they get their share, not every claim until the
    # due runs' 200 claims are made up.
    later = drain(shares, {Discovered.FINISHED: 10**6, Discovered.DUE: 10**6}, 40, now=5.0)
    assert (
        later[Discovered.DUE]
        >= 40 * CLAIM * DUE_WEIGHT / (FINISHED_WEIGHT + DUE_WEIGHT) - 2 * CLAIM
    ), later


def test_after_an_empty_answer_finished_runs_are_not_asked_first_until_the_recheck() -> None:
    shares = Shares(recheck=1.0)
    shares.claimed(Discovered.FINISHED, 0, CLAIM, now=10.0)
    assert shares.first(10.5) is Discovered.DUE
    assert shares.first(11.0) is Discovered.FINISHED


def test_due_runs_are_not_starved_by_an_endless_stream_of_finished_runs() -> None:
    shares = Shares(recheck=1.0)
    seen_due_within = 0
    gap = 0
    for _ in range(1000):
        first = shares.first(0.0)
        shares.claimed(first, CLAIM, CLAIM, 0.0)  # both classes always have a full claim
        gap = 0 if first is Discovered.DUE else gap + 1
        seen_due_within = max(seen_due_within, gap)
    assert seen_due_within <= FINISHED_WEIGHT // DUE_WEIGHT + 1, seen_due_within


def test_the_backlogs_classes_are_the_claim_counters() -> None:
    """Issue 50 item 4: the backlog's rows are named by the classes the claim counters count
    (`claimed_runs_by_class_total{class}`, the page's cards), so a class's backlog and its
    claims read side by side; an unknown row of `backlog()` keeps its own name."""
    assert BACKLOG_CLASSES == {"critical": "finished", "ordinary": "due"}
    assert set(BACKLOG_CLASSES.values()) <= set(CLAIM_CLASSES)
    assert backlog_class("blocked") == "blocked"
