"""The claim over many keys in `relay bench`'s fairness scenario (issue 50): the claim's reads
are counted by relation from the server's counters of its transaction, and the `keys` case runs
alone (`--fairness-cases keys`, as for 1M events over 1,000 keys). No figure is asserted but
counts: reads and buffers, never a time."""

from __future__ import annotations

import argparse
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from rich.console import Console

from relay.tools.bench import fairness
from relay.tools.bench.kit import BenchSink, Env


def test_a_tables_rows_read_are_its_scanned_rows_and_those_fetched_through_its_indexes() -> None:
    x = fairness.Explained(
        1.0,
        2.0,
        10,
        {
            "runs": {"table": "runs", "scans": 2, "tuples": 30, "fetched": 4},
            "runs_due_by_key": {"table": "runs", "scans": 7, "tuples": 90, "fetched": 12},
            "runs_pkey": {"table": "runs", "scans": 3, "tuples": 3, "fetched": 3},
            "outbox_pkey": {"table": "outbox", "scans": 64, "tuples": 320, "fetched": 320},
        },
    )
    # an index's own entries are not rows of the table; the rows it led to are
    assert x.rows_of("runs") == 30 + 4 + 12 + 3
    assert x.rows_of("outbox") == 320
    assert x.rows_of("fairness_keys") == 0


def test_the_cases_are_named_from_a_list() -> None:
    assert fairness._cases("keys") == ("keys",)
    assert fairness._cases("quiet, keys") == ("quiet", "keys")
    for wrong in ("", "keys,plenty"):
        with pytest.raises(argparse.ArgumentTypeError):
            fairness._cases(wrong)
    p = argparse.ArgumentParser()
    fairness._arguments(p)
    assert p.parse_args([]).fairness_cases == fairness.CASES  # the default run: every case


@pytest.mark.anyio
async def test_the_keys_case_alone_counts_each_claims_reads(
    pg_url: str, schema: str, tmp_path: Path
) -> None:
    p = argparse.ArgumentParser()
    fairness._arguments(p)
    small = "--fairness-cases keys --fairness-keys 30 --fairness-key-runs 4 --fairness-claims 2"
    a = p.parse_args(small.split())
    async with AsyncExitStack() as stack:
        env = Env(pg_url, schema, BenchSink(), "http://127.0.0.1:9/", Console(), tmp_path, stack)
        result = await fairness.fairness(env, a)
    m = result.metrics
    assert m["fairness_keys_events"] == 30 * 4 * 5
    assert not any(k.startswith(("fairness_quiet", "fairness_share")) for k in m)  # keys only
    claims = [k for k in fairness.KEYS if k.startswith("fairness_keys_") and "_p" in k]
    assert claims and all(k in m for k in claims), sorted(set(claims) - set(m))
    for state, _, _ in fairness.STATES:
        for lane in ("ordinary", "critical"):
            at = f"fairness_keys_{state}{lane}"
            assert m[f"{at}_buffers"] > 0, at
            assert m[f"{at}_keys_read"] > 0, at  # the walk over the keys' rows
            reads = result.data["keys"][f"{state}{lane}"]
            assert reads["runs"]["table"] == "runs", reads
    # Every key due: the ordinary claim takes 64 of the 120 runs, each read at least once.
    assert m["fairness_keys_ordinary_runs_read"] >= 64
    # "99 keys in 100 with no due work": none of keys k1..k30 is a multiple of 100, so no run is
    # due and the claim reads fewer runs than when every key was due.
    assert m["fairness_keys_sparse_ordinary_runs_read"] < m["fairness_keys_ordinary_runs_read"]
    assert len(result.rows) == 2 * len(fairness.STATES)
