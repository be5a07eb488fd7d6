"""The status page (issue 17) over plain HTTP: its pure parts (series, escaping, quoting, the
token), then a real relay with traffic and a poisoned run behind a hostile id: the JSON matches
`relay status --json`, the blocked run and its run page show, every value is escaped, unknown
runs are 404, each refresh costs one statement, and ui_token guards the page but not the
probes. The browser tests are tests/test_ui_browser.py."""

from __future__ import annotations

import html as html_lib
import json
import os
import subprocess
import sys
from typing import Any
from urllib.parse import quote

import httpx
import psycopg
import pytest

from relay.admission.permits import AdmissionView
from relay.delivery.lane import LaneStats, LaneView
from relay.ops.format import clean
from relay.runner import Relay
from relay.serving.ui import data as ui_data
from relay.serving.ui.page import run_page, status_page
from relay.serving.ui.series import LagWindow, RateSeries, percentile
from relay.serving.ui.view import commands, run_href, sh, status_view
from relay.serving.ui.web import Request, authorized, cookie_secret, cookie_value, session_cookie
from relay.settings import Secret
from relay.tools.sink import Sink
from tests.support import TOKENS, admission_view, count, q, settings, wait_for

HOSTILE = "<img src=x onerror=window.pwned=1>\"'&<script>alert(1)</script> ünï ‮"
EXCERPT = "<script>window.pwned=2</script> bad \"field\" 'x' é"
TOKEN = "s3cret-ui-token-0123456789"

pytestmark = pytest.mark.anyio

# -- pure ---------------------------------------------------------------------------------------


def test_rate_series_sums_increases_and_ignores_restarts() -> None:
    s = RateSeries(window=100.0)
    s.add(0.0, {"a": {"critical": 0, "ordinary": 10}})
    s.add(10.0, {"a": {"critical": 5, "ordinary": 30}, "b": {"critical": 100, "ordinary": 0}})
    assert s.latest() == {"critical": 0.5, "ordinary": 2.0}  # b is new: its baseline only
    s.add(20.0, {"a": {"critical": 1, "ordinary": 40}, "b": {"critical": 110, "ordinary": 0}})
    assert s.latest() == {"critical": 1.0, "ordinary": 1.0}  # a went down (restart): nothing
    s.add(200.0, {"a": {"critical": 1, "ordinary": 40}})
    series = s.series(200.0)
    assert [ago for ago, _ in series["ordinary"]] == [0.0]  # older points left the window


def test_lag_window_quantiles() -> None:
    assert percentile([], 0.5) is None
    w = LagWindow(window=1000.0)
    for i in range(1, 101):
        w.add(float(i), i / 100)
    got = w.quantiles(100.0)
    assert got["p50"] == 0.5 and got["p99"] == 0.99
    assert w.quantiles(2000.0)["p50"] is None  # all older than the window


def test_ingress_state() -> None:
    assert ui_data.ingress_state(True, 5.0, 5.0) == "misconfigured"
    assert ui_data.ingress_state(False, 5.0, 30.0) == "recovering"
    assert ui_data.ingress_state(False, 5.0, 500.0) == "ok"
    assert ui_data.ingress_state(False, None, 5.0) == "ok"


def test_report_has_counters_only() -> None:
    stats = LaneStats(delivered=7, claimed_runs=3)
    lanes = [LaneView("ordinary", stats, 1, 2, 0.0, misconfigured=False, renewals=4)]
    report = ui_data.build_report(lanes, "ok", {"ordinary": {"p50": 0.01, "p99": 0.2}})
    assert report == {
        "lanes": {
            "ordinary": {
                "delivered": 7, "claimed": 3, "renewals": 4, "retries": 0, "blocked": 0,
                "leases_lost": 0, "inflight": 1, "lag_p50": 0.01, "lag_p99": 0.2,
                "claimed_targeted": 0, "claimed_finished": 0, "claimed_due": 0,
            }
        },
        "ingress": "ok",
    }  # fmt: skip


def req(headers: dict[str, str], target: str = "/") -> Request:
    return Request("GET", target, headers)


def test_token_by_header_or_cookie_compared_whole() -> None:
    token = Secret(TOKEN)
    assert authorized(None, req({}))
    assert not authorized(token, req({}))
    assert authorized(token, req({"authorization": f"Bearer {TOKEN}"}))
    assert authorized(token, req({"authorization": f"bearer {TOKEN}"}))
    assert not authorized(token, req({"authorization": f"Bearer {TOKEN[:-1]}"}))
    assert not authorized(token, req({"authorization": f"Basic {TOKEN}"}))
    session = cookie_secret(TOKEN)
    assert authorized(token, req({"cookie": f"a=b; relay_ui_session={session}"}))
    assert not authorized(token, req({"cookie": f"relay_ui_session={session}x"}))
    assert cookie_value("x=1;  relay_ui_token=abc ", "relay_ui_token") == "abc"
    assert cookie_value("relay_ui_tokenx=abc", "relay_ui_token") is None


def test_the_cookie_carries_a_derived_value_not_the_token() -> None:
    """Cookies ignore ports: every service on the relay's host sees the page's cookie, so it
    holds an HMAC of the token, which opens this page and nothing else (issue 41)."""
    token = Secret(TOKEN)
    header = session_cookie(TOKEN)
    name, _, rest = header.partition("=")
    value, *attributes = [part.strip() for part in rest.split(";")]
    assert name == "relay_ui_session"
    assert value == cookie_secret(TOKEN) and TOKEN not in header
    assert value != cookie_secret(TOKEN + "x")  # bound to the token
    assert {"HttpOnly", "SameSite=Strict", "Path=/"} <= set(attributes)
    # The derived value is no token: neither as a Bearer token nor as `?token=`.
    assert not authorized(token, req({"authorization": f"Bearer {value}"}))
    # The token-valued cookie of before opens nothing, under its old name or the new one.
    assert not authorized(token, req({"cookie": f"relay_ui_token={TOKEN}"}))
    assert not authorized(token, req({"cookie": f"relay_ui_session={TOKEN}"}))


@pytest.mark.parametrize("word", [HOSTILE, "e; rm -rf / $(x) `y` \\'", "a\nb\x1b[31m", "😀 ok"])
def test_commands_are_shell_quoted(word: str) -> None:
    cmds = commands({"run_id": word, "blocked_seq": 1}, [{"state": "failed", "event_id": word}])
    assert cmds[0] == f"relay retry {sh(word)}"
    assert (
        "\n" not in "".join(cmds) and "\u202e" not in "".join(cmds) and "\x1b" not in "".join(cmds)
    )
    # What bash makes of the shown word is the id itself.
    got = subprocess.run(
        ["bash", "-c", f"printf %s {sh(word)}"], capture_output=True, check=True
    ).stdout.decode()
    assert got == word


def test_run_links_are_quoted() -> None:
    assert run_href("a/b?c#d<e>") == "/runs/a%2Fb%3Fc%23d%3Ce%3E"


def hostile_status(run_id: str) -> dict[str, Any]:
    doc = {
        "db_now": "2026-01-01T00:00:00+00:00",
        "lanes": [{"lane": "ordinary", "runs": 1, "events": 2, "oldest_pending_age_seconds": 3.0}],
        "blocked": {"runs": 1, "events": 1, "held_events": 2, "oldest_failure_age_seconds": 1.0},
        "blocked_runs": [
            {
                "run_id": run_id, "seq": 1, "event_id": run_id + "-e", "last_status": 422,
                "last_error": EXCERPT, "attempts": 1, "held_events": 2,
                "failed_at": "2026-01-01T00:00:00+00:00",
            }
        ],
        "leases": [{"owner": HOSTILE, "runs": 1, "next_expiry": None}],
        "replicas": [], "reports": {}, "tables": {"events": 1}, "blocked_offset": 0,
    }  # fmt: skip
    data = ui_data.shape_status(doc, RateSeries(), 0.0, HOSTILE)
    return data


@pytest.mark.parametrize(
    "run_id", [HOSTILE, "x" * 10_000 + HOSTILE, "\"'><svg/onload=alert(1)>", "😀 \u0000 \u202e"]
)
def test_pages_escape_every_value(run_id: str) -> None:
    data = hostile_status(run_id)
    html = status_page(status_view(data), 3.0, 50).decode()
    run = {"run_id": run_id, "blocked_seq": 1, "blocked_event_id": run_id, "epoch": 1}
    run_html = run_page(
        {"run": run, "events": [{"seq": 1, "event_id": run_id, "state": "failed",
                                 "last_error": EXCERPT}]},
        200,
    ).decode()  # fmt: skip
    for page in (html, run_html):
        # The only elements are the page's own: no data-made tag anywhere before its script.
        head, _, _ = page.rpartition("<script>")
        assert "<script" not in head and "<img" not in head and "<svg/" not in head
    assert "&lt;script&gt;window.pwned=2&lt;/script&gt;" in html  # the excerpt, as text
    if run_id.endswith(HOSTILE):
        assert "&lt;img src=x onerror=window.pwned=1&gt;" in run_html  # the id, as text
    assert quote(run_id[:50], safe="") in html  # the link, quoted


def section(html: str, tbody: str) -> str:
    """The rows of the page's table body `tbody`."""
    start = html.index(f'<tbody id="{tbody}">')
    return html[start : html.index("</tbody>", start)]


@pytest.mark.parametrize("key", [HOSTILE, "\"'><svg/onload=alert(1)>", "😀 \u0000 \u202e"])
def test_the_backlog_by_key_shows_producers_keys_as_text(key: str) -> None:
    """Issue 50 item 4: the page's table by fairness key, from the backlog refresh: a key is a
    producer's text, escaped and cleaned (control and bidi characters as escapes), never a link;
    the rest of the keys `(other)`, the default key `(default)`, as in `relay status`."""
    rows = (("ordinary", 6, 6, 1.0),)
    keys = ((key, 3), ("", 2), (None, 1))
    totals = ui_data.backlog_figures(ui_data.Backlog(rows, 0.0, keys), 0, 1.0)
    assert totals["keys"] == [
        {"key": key, "runs": 3}, {"key": "", "runs": 2}, {"key": None, "runs": 1},
    ]  # fmt: skip
    data = hostile_status("r") | totals
    view = status_view(data)
    assert view["keys"] == [[clean(key, 120), "3"], ["(default)", "2"], ["(other)", "1"]]
    html = status_page(view, 3.0, 50).decode()
    shown = section(html, "key-rows")
    head, _, _ = html.rpartition("<script>")
    assert "<script" not in head and "<img" not in head and "<svg/" not in head
    assert f"<td>{html_lib.escape(clean(key, 120))}</td>" in shown, shown
    assert "\u202e" not in shown and "\u0000" not in shown  # shown as escapes, not as such
    assert "<a " not in shown
    # Every run the default key's (or functions older than schema version 10): no rows
    for without in ((("", 5),), ()):
        totals = ui_data.backlog_figures(ui_data.Backlog(rows, 0.0, without), 0, 1.0)
        view = status_view(hostile_status("r") | totals)
        assert view["keys"] == []
        assert 'id="key-rows-empty" class="empty">' in status_page(view, 3.0, 50).decode()


def test_the_backlog_rows_are_finished_and_due_runs_not_lanes() -> None:
    """Issue 50: the backlog's runs whose terminal is pending are finished runs, prioritised
    work found by discovery, not the critical lane's control traffic: the page names the rows
    by the class of runs they count (item 4: finished, due), as `relay status` and the metrics'
    `class` label do, and keeps 'critical' for the lane's own rate and lag. The JSON's `lanes`
    carry the class beside `backlog()`'s names, as `relay status --json`."""
    rows = (("critical", 2, 20, 5.0), ("ordinary", 3, 4, 1.0))
    data = hostile_status("r") | ui_data.backlog_figures(ui_data.Backlog(rows, 0.0), 0, 1.0)
    assert [(x["class"], x["lane"]) for x in data["lanes"]] == [
        ("finished", "critical"),
        ("due", "ordinary"),
    ]
    view = status_view(data)
    f = view["figures"]
    assert (f["finished.runs"], f["finished.events"], f["due.runs"]) == ("2", "20", "3")
    html = status_page(view, 3.0, 50).decode()
    backlog = section(html, "backlog")
    assert "<td>finished</td>" in backlog and "<td>due</td>" in backlog
    assert "critical" not in backlog and "ordinary" not in backlog, backlog
    lanes = section(html, "lanes")
    assert "<td>critical</td>" in lanes and 'data-k="critical.rate"' in lanes
    assert "runs" not in lanes and "events" not in lanes, lanes  # no backlog figure there


def test_the_claims_by_class_are_this_replicas_lanes_summed() -> None:
    """Issue 50 item 4: the page's runs claimed by class, both lanes together, as
    claimed_runs_by_class_total counts them per lane; '-' without the figures."""
    lanes = [
        LaneView(name, LaneStats(by_class=counts), 0, 0, 0.0, misconfigured=False)
        for name, counts in (
            ("critical", {"targeted": 4, "finished": 0, "due": 0}),
            ("ordinary", {"targeted": 1, "finished": 30, "due": 10}),
        )
    ]
    claimed = ui_data.claimed_by_class(lanes)
    assert claimed == {"targeted": 5, "finished": 30, "due": 10}
    view = status_view(hostile_status("r") | {"claimed_by_class": claimed})
    f = view["figures"]
    assert (f["claimed.targeted"], f["claimed.finished"], f["claimed.due"]) == ("5", "30", "10")
    html = status_page(view, 3.0, 50).decode()
    assert '<span data-k="claimed.finished">30</span></b>finished runs' in html
    assert status_view(hostile_status("r"))["figures"]["claimed.due"] == "-"


def test_run_page_links_to_its_next_events() -> None:
    run = {"run_id": "a/b", "blocked_seq": None, "epoch": None}
    events = [{"seq": i, "event_id": f"e{i}", "state": "delivered"} for i in range(1, 4)]
    assert 'href="/runs/a%2Fb?from_seq=4"' in run_page({"run": run, "events": events}, 3).decode()
    assert "from_seq" not in run_page({"run": run, "events": events}, 4).decode()


# -- a real relay -------------------------------------------------------------------------------


def enqueue(conn: psycopg.Connection[Any], schema: str, run_id: str, n: int, tag: str) -> None:
    with conn.transaction():
        for i in range(n):
            conn.execute(
                q(schema, "select {s}.enqueue(%s, %s, %s, %s::jsonb)"),
                (run_id, f"{run_id}-{tag}{i}", "step", json.dumps({"i": i})),
            )


def limit_card(admission: AdmissionView | None) -> tuple[tuple[str, ...], str]:
    """The ingress limit card's figures, and the page's HTML, for this replica's POST turn."""
    data = hostile_status("r") | {"ingress_limit": ui_data.limit_figures(admission, TOKENS, 36)}
    view = status_view(data)
    keys = ("limit", "state", "inflight", "waiting", "min_rtt", "tokens")
    shown = tuple(view["figures"]["limit." + k] for k in keys)
    return shown, status_page(view, 3.0, 50).decode()


def test_the_ingress_limit_card_shows_the_post_turn_and_turns_red_when_the_limit_fell() -> None:
    shown, html = limit_card(admission_view(fallen=True))
    assert shown == ("7 / 36", "fallen", "6 (critical 1)", "12 (critical 0)", "41 ms", "9.5")
    assert 'class="card bad" data-alarm="limit.state"' in html
    shown, html = limit_card(admission_view(fallen=False))
    assert shown[1] == "steady"
    assert 'class="card" data-alarm="limit.state"' in html
    shown, html = limit_card(None)  # post_limit = fixed: the fixed figure, no permits
    assert shown == ("36 (fixed)", "fixed", "-", "-", "-", "9.5")
    assert 'class="card" data-alarm="limit.state"' in html
    # No figures at all (a document without the card's part): dashes, and no alarm.
    figures = status_view(hostile_status("r"))["figures"]
    assert figures["limit.state"] == "-" and figures["limit.limit"] == "-"


def status_cli(pg_url: str, schema: str) -> Any:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update(RELAY_DATABASE_URL=pg_url, RELAY_SCHEMA=schema)
    got = subprocess.run(
        [sys.executable, "-m", "relay.cli", "status", "--json"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert got.returncode == 0, got.stderr
    return json.loads(got.stdout)


def counts_of(doc: Any) -> Any:
    """`doc` without its ages (they grow between two reads)."""
    if isinstance(doc, list):
        return [counts_of(x) for x in doc]
    if isinstance(doc, dict):
        return {k: counts_of(v) for k, v in doc.items() if not k.endswith("age_seconds")}
    return doc


async def report_now(r: Relay) -> None:
    """The probe loop's report, now rather than in a few seconds."""
    assert r.endpoints is not None
    e = r.endpoints
    await e.page.report(r.view.lanes(), e.metrics.recent_lag)


async def test_status_page_of_a_running_relay(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    s, url = sink
    s.faults.fail(422, times=1000, run_id=HOSTILE, body=EXCERPT.encode())
    enqueue(conn, schema, HOSTILE, 3, "h")
    for i in range(4):
        enqueue(conn, schema, f"ok{i}", 3, "a")
    # two runs of named fairness keys, one a hostile text, due in an hour: pending throughout
    for run_id, key in (("keyed-1", HOSTILE), ("keyed-2", "tenant-b")):
        conn.execute(
            q(schema, "select {s}.enqueue(%s, %s, 'step', %s::jsonb, p_fairness_key => %s)"),
            (run_id, run_id + "-e", "{}", key),
        )
    conn.execute(
        q(
            schema,
            "update {s}.runs set next_attempt_at = now() + interval '1 hour'"
            " where run_id like 'keyed-%%'",
        )
    )
    # the current part of the outbox has taken events for two hours (retention: a day)
    conn.execute(
        q(
            schema,
            "update {s}.outbox_parts set opened_at = now() - interval '2 hours' where current",
        )
    )
    cfg = settings(pg_url, schema, url, metrics_addr="127.0.0.1:0")
    async with Relay(cfg).running() as r:
        assert r.endpoints is not None
        port = r.endpoints.port
        base = f"http://127.0.0.1:{port}"
        await wait_for(
            lambda: (
                count(conn, schema, "state = 'pending'") == 2 + 2
                and count(conn, schema, "state = 'failed'") == 1
            ),
            what="the good runs delivered and the hostile one blocked",
        )
        await report_now(r)
        await r.endpoints.probe(refresh=True)  # the lanes' totals are the backlog refresh's
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            data = (await client.get("/api/status")).json()
            cli = status_cli(pg_url, schema)
            for key in ("lanes", "keys", "blocked", "expired_leases"):
                assert counts_of(data[key]) == counts_of(cli[key]), key
            # this replica's runs claimed by class, as its lanes count them (issue 50 item 4)
            claimed = data["claimed_by_class"]
            assert claimed == ui_data.claimed_by_class(r.view.lanes()), claimed
            assert claimed["due"] >= 5, claimed  # the four good runs and the hostile one
            assert data["view"]["figures"]["claimed.due"] == f"{claimed['due']:,}"
            # the backlog by fairness key (issue 50 item 4); the blocked run counts in none
            assert sorted(data["keys"], key=lambda k: k["key"]) == [
                {"key": HOSTILE, "runs": 1}, {"key": "tenant-b", "runs": 1},
            ]  # fmt: skip
            assert set(data["tables"]) == set(cli["tables"])
            # The last minute's runs are status()'s only: at any backlog the page shows the
            # fleet's delivery rate instead (the figure reads every active run).
            assert cli["runs_delivered_last_minute"] == 4
            assert "runs_delivered_last_minute" not in data
            assert data["backlog_age_seconds"] is not None
            assert 2 * 3600 <= data["outbox_part_age_seconds"] < 3 * 3600
            assert data["view"]["figures"]["part_age"].startswith("2h 0")
            assert counts_of(data["blocked_runs"]) == counts_of(cli["blocked_runs"])
            assert [b["run_id"] for b in data["blocked_runs"]] == [HOSTILE]
            [blocked] = data["blocked_runs"]
            assert blocked["last_status"] == 422 and EXCERPT in blocked["last_error"]
            me = [f for f in data["fleet"] if f["this"]]
            assert me and me[0]["ingress"] == "ok" and me[0]["delivered"] == 12
            assert me[0]["alive"] is True

            # At most one statement per refresh (viewers share it: test_status_page_security),
            # one per run page.
            data_layer = r.endpoints.page.data
            before = data_layer.queries
            assert (await client.get("/?offset=1")).status_code == 200
            assert data_layer.queries == before + 1
            page = await client.get("/")
            assert page.status_code == 200
            assert page.headers["content-type"].startswith("text/html")
            assert "script-src 'sha256-" in page.headers["content-security-policy"]
            html = page.text
            assert "<img src=x" not in html and "&lt;img src=x onerror" in html
            assert "&lt;script&gt;window.pwned=2" in html
            assert f'href="/runs/{quote(HOSTILE, safe="")}"' in html
            assert "422" in html
            assert "current outbox part open" in html
            keys = section(html, "key-rows")
            assert f"<td>{html_lib.escape(clean(HOSTILE, 120))}</td>" in keys, keys
            assert "<td>tenant-b</td>" in keys

            before = data_layer.queries
            run = await client.get(f"/runs/{quote(HOSTILE, safe='')}")
            assert data_layer.queries == before + 1
            assert run.status_code == 200
            assert "<img src=x" not in run.text
            assert f"relay retry {sh(HOSTILE + '-h0')}" in html_lib.unescape(run.text)
            doc = (await client.get(f"/api/runs/{quote(HOSTILE, safe='')}")).json()
            assert [e["seq"] for e in doc["events"]] == [1, 2, 3]
            assert [e["state"] for e in doc["events"]] == ["failed", "pending", "pending"]
            assert "payload" not in doc["events"][0]

            missing = await client.get("/runs/no-such-run")
            assert missing.status_code == 404
            assert (await client.get("/api/runs/no-such-run")).status_code == 404
            huge = await client.get("/runs/" + quote("<x>" * 3400, safe=""))
            assert huge.status_code == 404  # a 10 kB id (30 kB in the URL) is just not found
            assert (await client.post("/api/status")).status_code == 405
            assert (await client.get("/api/status?offset=1")).json()["blocked_runs"] == []


async def test_ui_token_guards_the_page_not_the_probes(
    pg_url: str, schema: str, sink: tuple[Sink, str]
) -> None:
    _, url = sink
    cfg = settings(pg_url, schema, url, metrics_addr="127.0.0.1:0", ui_token=TOKEN)
    assert TOKEN not in repr(cfg)
    async with Relay(cfg).running() as r:
        assert r.endpoints is not None
        base = f"http://127.0.0.1:{r.endpoints.port}"
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            for path in ("/", "/api/status", "/runs/x", "/api/runs/x"):
                got = await client.get(path)
                assert got.status_code == 401, path
                assert TOKEN not in got.text
            assert (await client.get("/?token=wrong-token")).status_code == 401
            for path in ("/healthz", "/metrics"):
                assert (await client.get(path)).status_code == 200, path
            bearer = {"authorization": f"Bearer {TOKEN}"}
            assert (await client.get("/api/status", headers=bearer)).status_code == 200
            login = await client.get(f"/?token={TOKEN}&offset=0")
            assert login.status_code == 303
            assert login.headers["location"] == "/?offset=0"
            cookie = login.headers["set-cookie"]
            assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
            assert TOKEN not in cookie
            # The client keeps the cookie the login set, and it opens the page.
            assert (await client.get("/")).status_code == 200
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            client.cookies.set("relay_ui_session", cookie_secret(TOKEN))
            assert (await client.get("/")).status_code == 200
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            client.cookies.set("relay_ui_token", TOKEN)  # the token itself, as set until 2026-12
            assert (await client.get("/")).status_code == 401


# -- the SQL behind it --------------------------------------------------------------------------


def test_report_replica_updates_only_an_existing_row(
    pg_url: str, conn: psycopg.Connection[Any], schema: str
) -> None:
    def report(owner: str, doc: Any, ttl: float = 60.0, on: Any = conn) -> Any:
        row = on.execute(
            q(schema, "select {s}.report_replica(%s, %s::jsonb, %s)"),
            (owner, json.dumps(doc), ttl),
        ).fetchone()
        assert row is not None
        return row[0]

    def hold(on: Any, owner: str) -> None:
        on.execute(q(schema, "select {s}.hold_liveness(%s)"), (owner,))

    lanes = {"lanes": {"ordinary": {"delivered": 5}, "critical": {"delivered": 2}}}
    # No liveness row, no report: a report must never make an owner look like a dead replica.
    # The key of schema version 8 and older names a row's holder only where a row records it
    # (issue 48 item 6: anyone can take that key), so holding it is not enough to report.
    conn.execute(q(schema, "select pg_advisory_lock({s}.liveness_key('ghost'))"))
    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="liveness lock"):
        report("ghost", lanes)
    assert count_rows(conn, schema) == 0
    with psycopg.connect(pg_url, autocommit=True) as other:
        hold(conn, "a")
        hold(other, "b")  # each replica reports on the session that holds its own lock
        assert report("a", lanes) == {"a": {"critical": 2, "ordinary": 5}}
        assert report("b", {"lanes": {}}, on=other) == {
            "a": {"critical": 2, "ordinary": 5},
            "b": {"critical": 0, "ordinary": 0},
        }
        conn.execute(q(schema, "update {s}.replicas set reported_at = now() - interval '1 hour'"))
        assert report("b", {}, 60.0, on=other) == {"b": {"critical": 0, "ordinary": 0}}  # a stale
    for bad in ([1], "x", {"big": "y" * 9000}):
        with pytest.raises(psycopg.errors.InvalidParameterValue):
            report("a", bad)
    status = conn.execute(q(schema, "select {s}.ui_status(50, 0, 60)")).fetchone()
    assert status is not None
    reports = status[0]["reports"]
    assert reports["a"]["stale"] is True and reports["b"]["stale"] is False


def count_rows(conn: psycopg.Connection[Any], schema: str) -> int:
    row = conn.execute(q(schema, "select count(*) from {s}.replicas")).fetchone()
    assert row is not None
    return int(row[0])


def fail_head(conn: psycopg.Connection[Any], schema: str, run_id: str) -> None:
    """What a relay does for a poison answer to the run's first event: claim it, fail it."""
    claimed = conn.execute(
        q(schema, "select lease_token from {s}.claim('r', 1, 10, '1 min', 'ordinary', %s)"),
        (run_id,),
    ).fetchall()
    assert claimed, run_id
    failed = conn.execute(
        q(schema, "select {s}.fail_event(%s, %s, 1, 422, 'bad payload')"),
        (run_id, claimed[0][0]),
    ).fetchone()
    assert failed == (True,)


def test_ui_status_pages_blocked_runs(conn: psycopg.Connection[Any], schema: str) -> None:
    for i in range(5):
        run = f"p{i}"
        enqueue(conn, schema, run, 2, "x")
        fail_head(conn, schema, run)  # one after the other: p0 is the oldest failure

    def page(limit: int, offset: int) -> list[str]:
        row = conn.execute(
            q(schema, "select {s}.ui_status(%s, %s, 60)"), (limit, offset)
        ).fetchone()
        assert row is not None
        assert row[0]["held_events"] == 5  # the totals are the whole database's
        assert all(b["held_events"] == 1 for b in row[0]["blocked_runs"])
        return [b["run_id"] for b in row[0]["blocked_runs"]]

    assert page(2, 0) == ["p0", "p1"]
    assert page(2, 2) == ["p2", "p3"]
    assert page(2, 4) == ["p4"]
    assert page(2, 99) == []
    assert page(-1, -5) == []


async def test_each_replica_reports_its_ingress_health(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    s, url = sink
    s.faults.set_default(401)  # misconfigured: the lane pauses
    enqueue(conn, schema, "m1", 1, "x")
    cfg = settings(pg_url, schema, url, metrics_addr="127.0.0.1:0", max_backoff="0.5s")
    async with Relay(cfg).running() as r:
        assert r.endpoints is not None
        base = f"http://127.0.0.1:{r.endpoints.port}"

        async def ingress() -> str:
            await report_now(r)
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                fleet = (await client.get("/api/status")).json()["fleet"]
            [me] = [f for f in fleet if f["this"]]
            return str(me["ingress"])

        await wait_for(lambda: not r.health.ingress_ok, what="misconfigured")
        assert await ingress() == "misconfigured"
        s.faults.set_default(None)
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 1, what="recovered")
        assert await ingress() == "recovering"


@pytest.mark.parametrize("post_limit", ["adaptive", "fixed"])
async def test_the_ingress_limit_card_of_a_running_relay(
    pg_url: str,
    schema: str,
    conn: psycopg.Connection[Any],
    sink: tuple[Sink, str],
    post_limit: str,
) -> None:
    _, url = sink
    for i in range(3):
        enqueue(conn, schema, f"l{i}", 2, "a")
    cfg = settings(
        pg_url, schema, url, metrics_addr="127.0.0.1:0", post_limit=post_limit,
        concurrency=8, critical_concurrency=3,
    )  # fmt: skip
    async with Relay(cfg).running() as r:
        assert r.endpoints is not None
        await wait_for(lambda: count(conn, schema, "state = 'pending'") == 0, what="delivered")
        base = f"http://127.0.0.1:{r.endpoints.port}"
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            data = (await client.get("/api/status")).json()
            html = (await client.get("/")).text
    card, f = data["ingress_limit"], data["view"]["figures"]
    assert card["ceiling"] == 8 + 3 and card["fallen"] is False
    assert "Ingress limit (this replica)" in html and 'data-k="limit.state"' in html
    assert card["retry_tokens"] > 0
    if post_limit == "fixed":
        assert (card["mode"], card["limit"], f["limit.state"]) == ("fixed", 11, "fixed")
        assert card["inflight"] is None
        return
    assert card["mode"] == "adaptive" and 2 <= card["limit"] <= 11
    assert f["limit.state"] == "steady" and f["limit.limit"] == f"{card['limit']} / 11"
    assert card["inflight"] == {"critical": 0, "ordinary": 0}  # every POST answered
    assert card["waiting"] == {"critical": 0, "ordinary": 0}
    assert card["min_rtt_seconds"] > 0
