"""Each replica's runs claimed by class in `relay status` (issue 50 item 4): a replica reports
them per lane (`claimed_targeted`, `claimed_finished`, `claimed_due`: relay/serving/ui/data.py
`build_report`), the database checks them as counts (`report_lane_problem`) and `status()`
sums them per replica from a valid report of the last two minutes (`replica_claims`), which
`relay status` prints under the replicas."""

from __future__ import annotations

import contextlib
from typing import Any

import psycopg
import pytest

from relay.delivery.lane import LaneStats, LaneView
from relay.ops.render import render_status
from relay.serving.ui.data import build_report
from tests.support import q
from tests.test_limit_report import hold, report
from tests.test_ops_render import status_data

Conn = psycopg.Connection[Any]


def own_report() -> dict[str, Any]:
    """What a relay reports of itself: both lanes, each with its claims by class."""
    lanes = [
        LaneView(name, LaneStats(by_class=counts), 0, 0, 0.0, misconfigured=False)
        for name, counts in (
            ("critical", {"targeted": 4, "finished": 0, "due": 0}),
            ("ordinary", {"targeted": 1, "finished": 30, "due": 10}),
        )
    ]
    return build_report(lanes, "ok", {})


def status_claims(on: Conn, schema: str) -> dict[str, Any]:
    row = on.execute(q(schema, "select {s}.status(0)")).fetchone()
    assert row is not None
    return {x["owner"]: x["claimed_by_class"] for x in row[0]["replicas"]}


def test_status_sums_each_replicas_reported_claims_by_class(
    pg_url: str, conn: Conn, schema: str
) -> None:
    doc = own_report()
    assert doc["lanes"]["ordinary"]["claimed_finished"] == 30
    assert doc["lanes"]["critical"]["claimed_targeted"] == 4
    # a relay of a release before reports none: its report is still taken, and shows none
    old = {"lanes": {"ordinary": {"delivered": 1}}, "ingress": "ok"}
    with contextlib.ExitStack() as stack:
        for owner, sent in (("r1", doc), ("r2", old)):  # a LISTEN session each
            session = stack.enter_context(psycopg.connect(pg_url, autocommit=True))
            hold(session, schema, owner)
            report(session, schema, owner, sent)
        assert status_claims(conn, schema) == {
            "r1": {"targeted": 5, "finished": 30, "due": 10},
            "r2": None,
        }


@pytest.mark.parametrize("value", [-1, 1.5, "3", None, True])
def test_a_bad_claim_count_is_refused_by_name(conn: Conn, schema: str, value: Any) -> None:
    doc = own_report()
    doc["lanes"]["ordinary"]["claimed_due"] = value
    hold(conn, schema, "r1")
    with pytest.raises(psycopg.errors.InvalidParameterValue) as err:
        report(conn, schema, "r1", doc)
    assert "lanes.ordinary.claimed_due must be a non-negative integer" in str(err.value)


def test_the_lines_under_the_replicas() -> None:
    replicas = [
        {"owner": "host-a:1", "alive": True, "seen_at": None, "claimed_by_class":
            {"targeted": 5, "finished": 3000, "due": 10}},
        {"owner": "host-b:1", "alive": True, "seen_at": None, "claimed_by_class": None},
    ]  # fmt: skip
    got = render_status(status_data(replicas=replicas), 200)
    assert "Runs claimed by class since start, as each replica reported it:" in got, got
    assert "  host-a:1: targeted 5, finished 3,000, due 10" in got, got
    assert "  host-b:1: none reported" in got, got
    for x in replicas:
        x["claimed_by_class"] = None
    assert "claimed by class" not in render_status(status_data(replicas=replicas), 200)
