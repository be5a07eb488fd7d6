"""The fault suite's checker itself: each violation it exists to find makes a row invalid."""

from __future__ import annotations

from collections import Counter
from typing import Any

from tests.faults.checker import Facts, check


def facts(**overrides: Any) -> Facts:
    base: dict[str, Any] = dict(
        scenario="unit",
        sent={"a-0", "a-1", "b-0"},
        attempted={"a-0", "a-1", "b-0"},
        received={"a-0": 1, "a-1": 2, "b-0": 1},
        first_order={"a": [1, 2], "b": [1]},
        stale_epochs=0,
        outbox=[
            ("a-0", "a", 1, "delivered"),
            ("a-1", "a", 2, "delivered"),
            ("b-0", "b", 1, "delivered"),
        ],
        blocked={},
        poison=set(),
        wakes_expected={"run-created:a", "run-created:b"},
        wakes_emitted={"run-created:a", "run-created:b"},
        emit_attempts=Counter({"run-created:a": 1, "run-created:b": 1}),
        wake_payload_mismatches=0,
        lease_lost=Counter({"ack_fenced": 1}),
        drain_seconds=0.5,
        faults=1,
    )
    base.update(overrides)
    return Facts(**base)


def test_a_clean_run_is_valid_and_counts_duplicates() -> None:
    row = check(facts())
    assert row.valid, row.problems
    assert (row.sent, row.delivered, row.duplicated, row.max_duplicates) == (3, 3, 1, 1)
    assert row.stale_acks_rejected == 1


def test_each_violation_invalidates_the_row() -> None:
    lost = facts(received={"a-0": 1, "a-1": 1})
    assert check(lost).lost == 1 and not check(lost).valid
    unexpected = facts(received={"a-0": 1, "a-1": 1, "b-0": 1, "zz": 1})
    assert check(unexpected).unexpected == 1 and not check(unexpected).valid
    disorder = facts(first_order={"a": [2, 1], "b": [1]})
    assert check(disorder).out_of_order == 1 and not check(disorder).valid
    unacked_ack = facts(received={"a-0": 1, "b-0": 1}, sent={"a-0", "b-0"})
    row = check(unacked_ack)
    assert row.acked_without_delivery == 1 and not row.valid
    missing = facts(wakes_emitted={"run-created:a"})
    assert check(missing).wakes_missing == 1 and not check(missing).valid
    twice = facts(emit_attempts=Counter({"run-created:a": 2, "run-created:b": 1}))
    assert check(twice).wakes_extra == 1 and not check(twice).valid
    mismatch = facts(wake_payload_mismatches=1)
    assert not check(mismatch).valid


def test_only_the_poisoned_runs_may_block() -> None:
    outbox = [("a-0", "a", 1, "failed"), ("a-1", "a", 2, "pending"), ("b-0", "b", 1, "delivered")]
    only_b: dict[str, Any] = dict(
        received={"b-0": 1},
        first_order={"b": [1]},
        wakes_expected={"run-created:b"},
        wakes_emitted={"run-created:b"},
        emit_attempts=Counter({"run-created:b": 1}),
    )
    ok = facts(outbox=outbox, blocked={"a": 1}, poison={"a-0"}, **only_b)
    row = check(ok)
    assert row.valid, row.problems
    assert (row.blocked_runs, row.poison_injected, row.lost) == (1, 1, 0)
    # A failed event nobody poisoned is a loss, and its blocked run a problem.
    stray = facts(outbox=outbox, blocked={"a": 1}, poison=set(), **only_b)
    assert not check(stray).valid
