"""Security pass 3 on the status page (issue 32, items 3-5): a replica report is data, not
trust (only the session holding the owner's liveness lock may write one, its shape is checked,
and a hostile row already stored renders as text); nothing of a report becomes a link; and the
page cannot hurt delivery (its own connection and timeout, one query for many viewers, cheap
figures, loopback only without a token)."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import psycopg
import pytest
from psycopg import sql

from relay.delivery.lane import LaneStats, LaneView
from relay.runner import Relay
from relay.serving.ui.assets import SCRIPT
from relay.serving.ui.coalesce import Coalesced
from relay.serving.ui.data import Backlog, backlog_figures, build_report, shape_status
from relay.serving.ui.page import status_page
from relay.serving.ui.pool import PagePool
from relay.serving.ui.series import RateSeries
from relay.serving.ui.view import run_href, status_view
from relay.serving.ui.web import serves_without_token
from relay.tools.sink import Sink
from tests.support import Rig, bulk_backlog, q, scans, settings, wait_for

pytestmark = pytest.mark.anyio

EVIL = "https://evil.example/sso"
FORGED = {"lanes": {"critical": {"renewals": "x"}}}


def own_report() -> dict[str, Any]:
    """What a relay reports of itself (build_report), both lanes filled in."""
    lanes = [
        LaneView(lane, LaneStats(delivered=7, claimed_runs=3), 1, 2, 0.0, False, renewals=4)
        for lane in ("critical", "ordinary")
    ]
    lag = {"critical": {"p50": 0.01, "p99": 0.2}, "ordinary": {"p50": None, "p99": None}}
    return build_report(lanes, "recovering", lag)


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def report(on: psycopg.Connection[Any], schema: str, owner: str, doc: Any) -> Any:
    text = doc if isinstance(doc, str) else json.dumps(doc)
    row = on.execute(
        q(schema, "select {s}.report_replica(%s, %s::jsonb, 60)"), (owner, text)
    ).fetchone()
    assert row is not None
    return row[0]


def hold(on: psycopg.Connection[Any], schema: str, owner: str) -> None:
    row = on.execute(q(schema, "select {s}.hold_liveness(%s)"), (owner,)).fetchone()
    assert row == (True,)


# -- item 4: only the lock holder reports ---------------------------------------------------------


def test_a_report_needs_the_owners_liveness_lock(
    pg_url: str, conn: psycopg.Connection[Any], schema: str
) -> None:
    hold(conn, schema, "victim")  # as the victim's LISTEN connection does
    assert report(conn, schema, "victim", own_report())["victim"] == {
        "critical": 7,
        "ordinary": 7,
    }
    with psycopg.connect(pg_url, autocommit=True) as forger:
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="liveness lock"):
            report(forger, schema, "victim", {"lanes": {"critical": {"delivered": 10**9}}})
        # What the role can still do: make up a replica of its own (a new owner's lock, then
        # a report). That writes its own row only; the page says whose word the figures are.
        hold(forger, schema, "invented")
        assert "invented" in report(forger, schema, "invented", own_report())
    row = conn.execute(
        q(schema, "select report #>> '{{lanes,critical,delivered}}' from {s}.replicas"
                  " where owner = 'victim'")
    ).fetchall()  # fmt: skip
    assert row == [("7",)]


# -- item 4: the shape of a report ----------------------------------------------------------------

BAD_REPORTS = [
    (FORGED, "lanes.critical.renewals must be a non-negative integer (got string)"),
    ({"lanes": {"critical": {"delivered": -1}}}, "lanes.critical.delivered must be a non-neg"),
    ({"lanes": {"ordinary": {"claimed": 1.5}}}, "lanes.ordinary.claimed must be a non-negative"),
    ({"lanes": {"ordinary": {"retries": 1e30}}}, "lanes.ordinary.retries must be a non-negative"),
    ({"lanes": {"critical": {"lag_p99": "slow"}}}, "lanes.critical.lag_p99 must be a non-neg"),
    ({"lanes": {"critical": {"lag_p50": -2}}}, "lanes.critical.lag_p50 must be a non-negative"),
    ({"lanes": {"critical": {"delivered": True}}}, "lanes.critical.delivered must be a non-neg"),
    ({"lanes": {"bulk": {}}}, "lanes.bulk is not a lane"),
    ({"lanes": {"critical": []}}, "lanes.critical must be an object"),
    ({"lanes": {"critical": {"href": 1}}}, "lanes.critical.href is not a known field"),
    ({"lanes": []}, "lanes must be an object"),
    ({"ingress": [EVIL, "x"]}, "ingress must be one of ok, recovering, misconfigured"),
    ({"ingress": "<b>pwned</b>"}, "ingress must be one of"),
    ({"fleet": 1}, 'only "lanes", "ingress" and "limit" are known keys'),
    ('{"lanes": {"critical": {"delivered": ' + deep(1100) + "}}}", "(got array)"),
    ('{"x": ' + deep(1100) + "}", 'only "lanes", "ingress" and "limit"'),
    ({"ingress": "x" * 9000}, "the report is over 8 kB"),
    ([1], "the report must be a JSON object"),
]


@pytest.mark.parametrize(("doc", "problem"), BAD_REPORTS)
def test_a_malformed_report_is_refused_with_what_is_wrong(
    conn: psycopg.Connection[Any], schema: str, doc: Any, problem: str
) -> None:
    hold(conn, schema, "r1")
    with pytest.raises(psycopg.errors.InvalidParameterValue) as err:
        report(conn, schema, "r1", doc)
    assert problem in str(err.value)


def test_the_relays_own_report_passes(conn: psycopg.Connection[Any], schema: str) -> None:
    hold(conn, schema, "r1")
    assert report(conn, schema, "r1", own_report()) == {"r1": {"critical": 7, "ordinary": 7}}
    assert report(conn, schema, "r1", {}) == {"r1": {"critical": 0, "ordinary": 0}}


# -- item 4 and 5: hostile rows already stored ----------------------------------------------------

HOSTILE_ROWS = {
    "forged": json.dumps(FORGED),
    "link": json.dumps({"ingress": [EVIL, "sign in again"], "lanes": {}}),
    "deep": '{"lanes": ' + deep(1100) + "}",
    "text": json.dumps("just a string"),
    "huge": json.dumps({"lanes": {"critical": {"delivered": 10**30}}}),
}


def store_hostile_rows(conn: psycopg.Connection[Any], schema: str) -> None:
    """Rows as a relay role could write them before the checks (written here as the owner)."""
    for owner, text in HOSTILE_ROWS.items():
        conn.execute(
            q(schema, "insert into {s}.replicas (owner, reported_at, report)"
                      " values (%s, clock_timestamp(), %s::jsonb)"),
            (owner, text),
        )  # fmt: skip


def page_of(doc: dict[str, Any]) -> tuple[dict[str, Any], str]:
    data = shape_status(doc, RateSeries(), 0.0, "me")
    view = status_view(data)
    return view, status_page(view, 3.0, 50).decode()


def test_stored_hostile_reports_render_as_text(conn: psycopg.Connection[Any], schema: str) -> None:
    store_hostile_rows(conn, schema)
    row = conn.execute(q(schema, "select {s}.ui_status(50, 0, 60)::text")).fetchone()
    assert row is not None
    doc = json.loads(row[0])  # orjson's depth limit too: the deep report never leaves the DB
    view, html = page_of(doc)
    fleet = {r[0]: r for r in view["fleet"]}
    assert set(fleet) == set(HOSTILE_ROWS)
    for owner, cells in fleet.items():
        assert all(isinstance(c, str) for c in cells), owner
        assert cells[6].startswith("report rejected: "), owner
        assert cells[4] == cells[5] == "-", owner  # no figure of a rejected report
    assert "lanes.critical.renewals must be a non-negative integer" in fleet["forged"][6]
    assert EVIL not in html and "evil.example" not in json.dumps(view)


def test_shape_status_never_raises_on_what_a_report_holds() -> None:
    """What ui_status returned before the checks: whatever the row held, under `report`."""
    garbage: list[Any] = [
        FORGED,
        {"lanes": {"critical": {"renewals": None, "delivered": "12", "lag_p99": "x"}}},
        {"lanes": {"critical": [1, 2]}, "ingress": [EVIL, "x"]},
        {"lanes": [], "ingress": {"href": EVIL}},
        {"lanes": {"critical": {"delivered": float("nan"), "lag_p50": -1, "renewals": True}}},
        "text",
        [EVIL],
        None,
        7,
    ]
    reports: dict[str, Any] = {
        f"o{i}": {"report": g, "stale": False} for i, g in enumerate(garbage)
    }
    reports["odd"] = [1, 2]
    reports["older"] = {"report": FORGED, "stale": "yes", "age_seconds": "x"}
    view, html = page_of({"reports": reports, "leases": [], "replicas": []})
    assert len(view["fleet"]) == len(reports)
    assert EVIL not in html and "evil.example" not in json.dumps(view)
    for cells in view["fleet"]:
        assert all(isinstance(c, str) for c in cells)
    assert shape_status({"reports": "x"}, RateSeries(), 0.0, "me")["fleet"] == []


# -- a running relay ------------------------------------------------------------------------------


async def test_a_running_relay_reports_and_a_forger_cannot(rig: Rig) -> None:
    conn, schema = rig.conn, rig.schema
    cfg = rig.settings(metrics_addr="127.0.0.1:0")
    async with Relay(cfg).running() as r:
        assert r.endpoints is not None
        store_hostile_rows(conn, schema)  # after start: its hold_liveness forgets dead rows
        e = r.endpoints
        await e.page.report(r.view.lanes(), e.metrics.recent_lag)  # on the LISTEN session
        assert not e.page._report_failing
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):
            report(conn, schema, cfg.replica_id, FORGED)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{e.port}", timeout=30) as c:
            for path in ("/", "/api/status"):
                got = await c.get(path)
                assert got.status_code == 200, path
                assert EVIL not in got.text
            fleet = {f["owner"]: f for f in (await c.get("/api/status")).json()["fleet"]}
        assert fleet[cfg.replica_id]["ingress"] == "ok" and fleet[cfg.replica_id]["alive"]
        assert fleet["forged"]["report_problem"] and fleet["forged"]["delivered"] is None


# -- item 3: the page cannot hurt delivery --------------------------------------------------------


async def test_viewers_at_once_share_one_fetch() -> None:
    now = [0.0]
    gate = anyio.Event()
    calls: list[int] = []

    async def fetch(key: int) -> dict[str, int]:
        calls.append(key)
        await gate.wait()
        return {"answer": len(calls)}

    shared: Coalesced[int, dict[str, int]] = Coalesced(fetch, 1.5, clock=lambda: now[0])
    got: list[dict[str, int]] = []

    async def viewer() -> None:
        got.append(await shared.get(0))

    async with anyio.create_task_group() as tg:
        for _ in range(12):
            tg.start_soon(viewer)
        await wait_for(lambda: shared.waiting(0) == 11, what="eleven waiting for the first")
        gate.set()
    assert calls == [0] and got == [{"answer": 1}] * 12
    now[0] = 1.0
    assert await shared.get(0) == {"answer": 1}  # kept for the ttl
    assert await shared.get(1) == {"answer": 2} and calls == [0, 1]  # per key
    now[0] = 1.6
    assert await shared.get(0) == {"answer": 3}  # then fetched again
    assert shared.fetches == 3


async def test_a_failed_fetch_is_shared_and_not_kept() -> None:
    gate = anyio.Event()
    calls = 0

    async def fetch(key: int) -> int:
        nonlocal calls
        calls += 1
        await gate.wait()
        if calls == 1:
            raise psycopg.errors.QueryCanceled("statement timeout")
        return calls

    shared: Coalesced[int, int] = Coalesced(fetch, 1.5)
    errors: list[Exception] = []

    async def viewer() -> None:
        try:
            await shared.get(0)
        except psycopg.Error as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(viewer)
        await wait_for(lambda: shared.waiting(0) == 4, what="four waiting for the first")
        gate.set()
    assert calls == 1 and len(errors) == 5
    assert await shared.get(0) == 2  # the next request tries again


async def test_a_cancelled_fetch_hands_over_to_a_waiter() -> None:
    started = anyio.Event()

    async def fetch(key: int) -> str:
        if not started.is_set():
            started.set()
            await anyio.sleep_forever()
        return "second"

    shared: Coalesced[int, str] = Coalesced(fetch, 1.5)
    got: list[str] = []
    scopes: list[anyio.CancelScope] = []

    async def leader() -> None:
        with anyio.CancelScope() as scope:  # its client goes away
            scopes.append(scope)
            await shared.get(0)

    async def waiter() -> None:
        got.append(await shared.get(0))

    async with anyio.create_task_group() as tg:
        tg.start_soon(leader)
        await started.wait()
        tg.start_soon(waiter)
        await wait_for(lambda: shared.waiting(0) == 1, what="the waiter")
        scopes[0].cancel()
    assert got == ["second"]


def page_backends(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(
        "select count(*) from pg_stat_activity"
        " where application_name = 'ledger-relay-status-page' and pid <> pg_backend_pid()"
    ).fetchone()
    assert row is not None
    return int(row[0])


async def test_twelve_viewers_cost_one_query_on_the_pages_own_connection(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    _, url = sink
    cfg = settings(pg_url, schema, url, metrics_addr="127.0.0.1:0")
    await wait_for(lambda: page_backends(conn) == 0, what="no other page connection")
    async with Relay(cfg).running() as r:
        assert r.endpoints is not None
        e = r.endpoints
        before, rendered = e.page.data.queries, e.page.bodies.fetches
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{e.port}", timeout=30) as c:
            async with anyio.create_task_group() as tg:
                for i in range(12):
                    tg.start_soon(c.get, "/api/status" if i % 2 else "/")
        assert e.page.data.queries - before <= 1  # shared (coalesce.py), whatever N is
        assert e.page.bodies.fetches - rendered <= 2  # one page and one JSON body, not twelve
        assert page_backends(conn) == 1  # its own connection, not the delivery pools'
    await wait_for(lambda: page_backends(conn) == 0, what="the page's connection closed")


async def test_the_pages_connection_is_bounded_and_read_only(
    pg_url: str, schema: str, conn: psycopg.Connection[Any]
) -> None:
    # A backend lingers a moment after its client closed (earlier tests' pages).
    await wait_for(lambda: page_backends(conn) == 0, what="no other page connection")
    pool = PagePool(pg_url, statement_timeout=0.2)
    try:
        with pytest.raises(psycopg.errors.QueryCanceled):
            await pool.query(sql.SQL("select pg_sleep(5)"), ())
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            await pool.query(q(schema, "delete from {s}.replicas"), ())
        rows = await pool.query(q(schema, "select {s}.ui_status(50, 0, 60)::text"), ())
        assert json.loads(rows[0][0])["blocked_runs"] == []
        assert page_backends(conn) == 1  # the same connection throughout
        # The bounds live in each transaction, none on the session: through a transaction-mode
        # pooler the next client of that server connection may be a claim.
        async with pool._pool.connection() as session:
            cur = await session.execute(
                "select current_setting('default_transaction_read_only'),"
                " current_setting('statement_timeout')"
            )
            assert await cur.fetchone() == ("off", "0")
    finally:
        await pool.close()
    await wait_for(lambda: page_backends(conn) == 0, what="the page's connection closed")


def test_ui_status_reads_no_pass_over_the_pending_events(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    pending = bulk_backlog(conn, schema, 500, 100)

    def read(call: str) -> int:
        _, delta = scans(conn, schema, lambda: conn.execute(q(schema, call)).fetchall())
        return sum(tuples for _, tuples in delta.values())

    # status() computes the lanes' totals (backlog()): since schema version 7 a few probes per
    # active run (its cursor and last seq), no longer a pass over the pending events (it read
    # all 50,000 in version 6); the page leaves even those to the backlog gauges.
    assert read("select {s}.status(50)") < pending / 10
    assert read("select {s}.ui_status(50, 0, 60)") < 100


def test_the_lanes_totals_come_from_the_backlog_refresh_and_say_so() -> None:
    doc = {"blocked_runs": [], "count_cap": 100_000, "held_events": 100_001}
    view, html = page_of({**doc, **backlog_figures(None, 100_001, 10.0)})
    assert view["figures"]["due.events"] == "-"
    assert view["figures"]["backlog_age"] == "not measured yet"
    assert view["figures"]["blocked.held"] == "100,000+"
    rows = (("ordinary", 3, 2_000_000, 40.0), ("blocked", 1, 1, 5.0))
    totals = backlog_figures(Backlog(rows, 4.0), 7, 10.0)
    assert totals["backlog_age_seconds"] == 6.0
    view, html = page_of({**doc, **totals})
    assert view["figures"]["due.events"] == "2,000,000"
    assert view["figures"]["finished.events"] == "0"
    assert view["figures"]["backlog_age"] == "6.0 s ago"
    assert "backlog refresh" in html and "6.0 s ago" in html


@pytest.mark.parametrize(
    ("host", "open_"),
    [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True),
     (None, False), ("0.0.0.0", False), ("::", False), ("10.0.0.5", False),
     ("relay.internal", False)],
)  # fmt: skip
def test_without_a_token_the_page_is_served_only_on_loopback(host: str | None, open_: bool) -> None:
    assert serves_without_token(host) is open_


async def test_on_every_interface_without_a_token_the_page_is_off_not_the_probes(
    pg_url: str, schema: str, sink: tuple[Sink, str]
) -> None:
    _, url = sink
    cfg = settings(pg_url, schema, url, metrics_addr="0.0.0.0:0")
    async with Relay(cfg).running() as r:
        assert r.endpoints is not None
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{r.endpoints.port}", timeout=30
        ) as c:
            for path in ("/", "/api/status", "/runs/x", "/api/runs/x"):
                got = await c.get(path)
                assert got.status_code == 403 and "ui_token" in got.text, path
            for path in ("/healthz", "/metrics"):
                assert (await c.get(path)).status_code == 200, path
            assert (await c.get("/readyz")).status_code in (200, 503)
        assert r.endpoints.page.data.queries == 0


# -- item 5: nothing of a report becomes a link, nor a trusted figure ----------------------------


def test_only_a_run_page_becomes_a_link() -> None:
    view, _ = page_of({"blocked_runs": [], "reports": {}})
    view["fleet"] = [[["sign in again", EVIL], "x"]]  # a pair that reached a cell anyway
    view["blocked"] = [[["run", "javascript:window.pwned=1"]]]
    html = status_page(view, 3.0, 50).decode()
    assert EVIL not in html and "javascript:" not in html
    assert "<td>sign in again</td>" in html and "<td>run</td>" in html
    assert (
        'href="/runs/a%2Fb"'
        in status_page({**view, "blocked": [[["a/b", run_href("a/b")]]]}, 3.0, 50).decode()
    )
    assert 'String(value[1]).indexOf("/runs/") === 0' in SCRIPT  # the script's rule too


def test_a_reports_figures_are_shown_as_its_own_word() -> None:
    reports = {"invented": {"report": {"lanes": {"ordinary": {"delivered": 10**9}}}}}
    view, html = page_of({"reports": reports, "replicas": [{"owner": "invented", "alive": True}]})
    [row] = view["fleet"]
    assert row[5] == "1,000,000,000"
    assert "<th>delivered (reported)</th>" in html and "its own word" in html
