"""Each replica's adaptive POST limit in `relay status` (issue 42, item 4): a replica reports it
in its report's `limit` (relay/serving/ui/data.py `report_limit`), the database checks its shape
(`report_limit_problem`, schema/functions_ui.sql) and `status()` returns it per replica from a
valid report of the last two minutes (`replica_limit`, schema/functions_ops.sql), which
`relay status` prints under the replicas."""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any

import anyio
import psycopg
import pytest

from relay.admission.retry_budget import BudgetView
from relay.delivery.lane import LaneStats, LaneView
from relay.ops.render import NO_LIMIT, limit_text, render_status
from relay.runner import Relay
from relay.serving.ui.data import REPORT_TTL, build_report, shape_status
from relay.serving.ui.page import FLEET_HEAD
from relay.serving.ui.series import RateSeries
from relay.serving.ui.view import status_view
from tests.support import TOKENS, Rig, admission_view, q, relay_logs, wait_for
from tests.test_ops import cli, cli_env, cli_json
from tests.test_ops_render import status_data
from tests.test_relay import enqueue_runs

Conn = psycopg.Connection[Any]


def own_report(budget: BudgetView | None = TOKENS, **kw: Any) -> dict[str, Any]:
    """What a relay under the adaptive limit reports of itself (build_report)."""
    lanes = [LaneView("critical", LaneStats(delivered=3), 1, 2, 0.0, False, renewals=1)]
    return build_report(lanes, "ok", {}, admission_view(**kw), budget)


def hold(on: Conn, schema: str, owner: str) -> None:
    assert on.execute(q(schema, "select {s}.hold_liveness(%s)"), (owner,)).fetchone() == (True,)


def report(on: Conn, schema: str, owner: str, doc: Any) -> Any:
    row = on.execute(
        q(schema, "select {s}.report_replica(%s, %s::jsonb, 60)"), (owner, json.dumps(doc))
    ).fetchone()
    assert row is not None
    return row[0]


def status_limits(on: Conn, schema: str) -> dict[str, Any]:
    row = on.execute(q(schema, "select {s}.status(0)")).fetchone()
    assert row is not None
    return {x["owner"]: x["limit"] for x in row[0]["replicas"]}


# -- the report's shape, checked by the database --------------------------------------------------


def test_the_report_carries_the_limit_and_the_database_takes_it(conn: Conn, schema: str) -> None:
    doc = own_report()
    assert doc["limit"] == {
        "limit": 7, "ceiling": 36, "reserve": 2, "in_flight_critical": 1,
        "in_flight_ordinary": 5, "waiting_critical": 0, "waiting_ordinary": 12,
        "min_rtt_ms": 41, "fallen": True, "retry_tokens": 9.5,
    }  # fmt: skip
    hold(conn, schema, "r1")
    report(conn, schema, "r1", doc)
    # before any answer there is no round trip; the tokens may be spent below zero
    report(conn, schema, "r1", own_report(BudgetView(-3.25, 4), min_rtt=None))
    report(conn, schema, "r1", own_report(None))  # no budget: no tokens to show
    # a relay of a release before issue 42 reports no limit, and still reports
    report(conn, schema, "r1", {k: v for k, v in doc.items() if k != "limit"})
    report(conn, schema, "r1", {"limit": {}})


BAD_LIMITS = [
    ({"limit": -1}, "limit.limit must be a non-negative integer (got -1)"),
    ({"ceiling": 1.5}, "limit.ceiling must be a non-negative integer (got 1.5)"),
    ({"reserve": "2"}, "limit.reserve must be a non-negative integer (got string)"),
    ({"in_flight_critical": True}, "limit.in_flight_critical must be a non-negative integer"),
    ({"in_flight_ordinary": None}, "limit.in_flight_ordinary must be a non-negative integer"),
    ({"waiting_critical": -2}, "limit.waiting_critical must be a non-negative integer"),
    ({"waiting_ordinary": 1e30}, "limit.waiting_ordinary must be a non-negative integer"),
    ({"min_rtt_ms": -1}, "limit.min_rtt_ms must be a non-negative integer or null (got -1)"),
    ({"min_rtt_ms": 0.5}, "limit.min_rtt_ms must be a non-negative integer or null"),
    ({"fallen": 1}, "limit.fallen must be true or false (got 1)"),
    ({"fallen": None}, "limit.fallen must be true or false (got null)"),
    ({"retry_tokens": "9.5"}, "limit.retry_tokens must be a number or null (got string)"),
    ({"href": "https://evil.example"}, "limit.href is not a known field"),
]


@pytest.mark.parametrize(("field", "problem"), BAD_LIMITS)
def test_a_bad_figure_of_the_limit_is_refused_by_name(
    conn: Conn, schema: str, field: dict[str, Any], problem: str
) -> None:
    doc = own_report()
    doc["limit"].update(field)
    hold(conn, schema, "r1")
    with pytest.raises(psycopg.errors.InvalidParameterValue) as err:
        report(conn, schema, "r1", doc)
    assert problem in str(err.value)


@pytest.mark.parametrize("limit", [[], None, 7, "7/36"])
def test_a_limit_that_is_not_an_object_is_refused(conn: Conn, schema: str, limit: Any) -> None:
    hold(conn, schema, "r1")
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="limit must be an object"):
        report(conn, schema, "r1", {**own_report(), "limit": limit})


# -- status(): the limit of a valid, fresh report -------------------------------------------------


def test_status_gives_each_replica_the_limit_of_its_valid_fresh_report(
    pg_url: str, conn: Conn, schema: str
) -> None:
    with contextlib.ExitStack() as stack:
        for owner in ("fresh", "stale", "fixed", "forged"):  # a LISTEN session each
            session = stack.enter_context(psycopg.connect(pg_url, autocommit=True))
            hold(session, schema, owner)
            report(session, schema, owner, own_report() if owner != "fixed" else {"lanes": {}})
        conn.execute(
            q(schema, "update {s}.replicas set reported_at = reported_at"
                      " - make_interval(secs => %s) where owner = 'stale'"),
            (REPORT_TTL + 1,),
        )  # fmt: skip
        forged = {**own_report(), "limit": {"limit": "many"}}  # a row written past the checks
        conn.execute(
            q(schema, "update {s}.replicas set report = %s::jsonb where owner = 'forged'"),
            (json.dumps(forged),),
        )
        assert status_limits(conn, schema) == {
            "fresh": own_report()["limit"], "stale": None, "fixed": None, "forged": None,
        }  # fmt: skip


def test_the_report_ttl_is_the_pages(conn: Conn, schema: str) -> None:
    row = conn.execute(q(schema, "select {s}.report_ttl_seconds()")).fetchone()
    assert row == (REPORT_TTL,)


# -- relay status ---------------------------------------------------------------------------------


def test_the_line_under_each_replica() -> None:
    assert limit_text(own_report()["limit"]) == (
        "limit 7/36 (fallen), in flight 6 (critical 1), waiting 12, min rtt 41 ms, retry tokens 9.5"
    )
    quiet = own_report(BudgetView(-3.25, 4), min_rtt=None, fallen=False)["limit"]
    quiet["waiting_critical"] = 2
    assert limit_text(quiet) == (
        "limit 7/36, in flight 6 (critical 1), waiting 14 (critical 2), min rtt -,"
        " retry tokens -3.25"
    )
    assert limit_text({}) == "limit ?/?, in flight ? (critical ?), waiting ?, min rtt -"
    replicas = [
        {"owner": "a", "alive": True, "seen_at": None, "limit": own_report()["limit"]},
        {"owner": "b", "alive": True, "seen_at": None, "limit": None},
    ]
    got = render_status(status_data(replicas=replicas), 200).splitlines()
    at = got.index("POST limit, as each replica reported it in the last 2 minutes:")
    assert got[at + 1] == "  a: " + limit_text(own_report()["limit"])
    assert got[at + 2] == "  b: " + NO_LIMIT
    for r in replicas:
        r["limit"] = None  # no replica reports one (all fixed, or all of a release before)
    assert "POST limit" not in render_status(status_data(replicas=replicas), 200)


async def deliver_some(rig: Rig, relay: Relay) -> None:
    enqueue_runs(rig.conn, rig.schema, 3, 2, prefix=f"r{rig.count()}-")
    await wait_for(lambda: rig.count("state <> 'delivered'") == 0, what="every event delivered")


@pytest.mark.anyio
async def test_a_running_relay_reports_its_limit_and_relay_status_prints_it(rig: Rig) -> None:
    cfg = rig.settings(metrics_addr="127.0.0.1:0")
    env = cli_env(rig.pg_url, rig.schema)
    async with Relay(cfg).running() as r:
        assert r.endpoints is not None
        await deliver_some(rig, r)
        await r.endpoints.page.report(r.view.lanes(), r.endpoints.metrics.recent_lag)
        assert not r.endpoints.page._report_failing
        status = await anyio.to_thread.run_sync(lambda: cli_json(env, "status"))
        text = await anyio.to_thread.run_sync(lambda: cli(env, "status"))
    [me] = [x for x in status["replicas"] if x["owner"] == cfg.replica_id]
    limit = me["limit"]
    assert limit is not None and limit["ceiling"] == cfg.post_ceiling, me
    assert isinstance(limit["min_rtt_ms"], int)  # it has had answers
    assert text.returncode == 0, text.stderr
    assert f"  {cfg.replica_id}: {limit_text(limit)}" in text.stdout, text.stdout


@pytest.mark.anyio
async def test_a_relay_under_the_fixed_limit_reports_none(rig: Rig) -> None:
    cfg = rig.settings(metrics_addr="127.0.0.1:0", post_limit="fixed")
    env = cli_env(rig.pg_url, rig.schema)
    async with Relay(cfg).running() as r:
        assert r.endpoints is not None
        await deliver_some(rig, r)
        await r.endpoints.page.report(r.view.lanes(), r.endpoints.metrics.recent_lag)
        assert not r.endpoints.page._report_failing
        row = rig.conn.execute(
            rig.q("select report from {s}.replicas where owner = %s"), (cfg.replica_id,)
        ).fetchone()
        status = await anyio.to_thread.run_sync(lambda: cli_json(env, "status"))
        text = await anyio.to_thread.run_sync(lambda: cli(env, "status"))
    assert row is not None and "limit" not in row[0] and row[0]["lanes"]
    assert [x["limit"] for x in status["replicas"] if x["owner"] == cfg.replica_id] == [None]
    assert text.returncode == 0 and "POST limit" not in text.stdout, text.stdout


@pytest.mark.anyio
async def test_functions_older_than_the_relay_refuse_its_report_harmlessly(rig: Rig) -> None:
    """A relay of this release against functions before it (`relay migrate` not run yet): its
    report is refused, logged once, and the relay goes on delivering on the same LISTEN
    session, which keeps its liveness lock (docs/operations.md, upgrades)."""
    older = """
        create or replace function {s}.report_limit_problem(p_limit jsonb) returns text
        language sql immutable as $$ select 'limit is not a known key (older functions)' $$"""
    rig.conn.execute(rig.q(older))
    cfg = rig.settings(metrics_addr="127.0.0.1:0")
    handler = _Records()
    async with Relay(cfg).running() as r:
        assert r.endpoints is not None
        page = r.endpoints.page
        with relay_logs(handler):
            await page.report(r.view.lanes(), r.endpoints.metrics.recent_lag)
            await page.report(r.view.lanes(), r.endpoints.metrics.recent_lag)
        assert page._report_failing
        assert [m for m in handler.messages if "replica_report_failed" in m] != []
        assert len([m for m in handler.messages if "replica_report_failed" in m]) == 1
        listener = r.view.listener()
        assert listener is not None and listener.up
        await deliver_some(rig, r)  # still delivering
        alive = rig.conn.execute(
            rig.q(
                "select not pg_try_advisory_xact_lock_shared("
                "{s}.liveness_key_of(owner, incarnation)) from {s}.replicas where owner = %s"
            ),
            (cfg.replica_id,),
        ).fetchone()
        assert alive == (True,)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# -- the status page's fleet table ----------------------------------------------------------------


def test_the_fleet_table_shows_each_replicas_reported_limit() -> None:
    replicas = [
        {"owner": "a", "alive": True, "limit": own_report()["limit"]},
        {"owner": "b", "alive": True, "limit": None},
        {"owner": "c", "alive": True, "limit": {"limit": "x", "ceiling": 3}},  # never raises
    ]
    data = shape_status({"replicas": replicas}, RateSeries(), 0.0, "a")
    assert [r["post_limit"] for r in data["fleet"]] == ["7/36 (fallen)", None, None]
    view = status_view(data)
    head = FLEET_HEAD.index("POST limit (reported)")
    assert [row[head] for row in view["fleet"]] == ["7/36 (fallen)", "-", "-"]
