"""A fleet's status page and its relays' reports (issue 51 item 4), against real PostgreSQL
databases of the embedded cluster and real HTTP: each database's relay writes this replica's
report into its own database (what `relay status --database NAME` and that database's page
show); the fleet's page lists every database configured, a down one unmistakably (its reason
and since when), leads to each database's own page, and answers a down one's with why; the page
is guarded by `ui_token` as a relay alone's is. The one-database form's page names no
database."""

from __future__ import annotations

import json
import subprocess
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import httpx
import psycopg
import pytest

from relay.serving.ui.page import run_page, status_page
from relay.serving.ui.view import run_href, status_view
from tests.faults.proxy import FaultProxy, via
from tests.support import wait_for
from tests.test_cli import RELAY
from tests.test_fleet import (
    SCHEMA,
    closed_port,
    delivered,
    enqueue_runs,
    fleet,
    ingress,
    shards,  # noqa: F401 - the fixture
)
from tests.test_fleet_cli import env_of

pytestmark = pytest.mark.anyio

TOKEN = "fleet-page-token-0123456789"
DOWN_S1 = '<p class="banner" id="down">1 of 2 databases DOWN: s1</p>'


def reported(url: str, owner: str) -> dict[str, Any] | None:
    """The report `owner` last wrote into the database at `url`, if any."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            f"select report from {SCHEMA}.replicas where owner = %s", (owner,)
        ).fetchone()
    return None if row is None else row[0]


def delivered_in(report: dict[str, Any] | None) -> int:
    lanes = (report or {}).get("lanes") or {}
    return sum(int(lane.get("delivered", 0)) for lane in lanes.values())


async def test_each_database_of_a_fleet_holds_this_replicas_report_and_its_status_shows_it(
    shards: dict[str, str],  # noqa: F811 - the fixture
) -> None:
    """Each database's relay writes this replica's report into its own database, as a relay
    alone does, on the session holding its liveness lock there (the database takes it from no
    other): each database's report counts that database's deliveries, `relay status
    --database NAME` shows the replica's report, and that database's page lists the replica."""
    urls = {name: shards[name] for name in ("s0", "s1")}
    runs = {"s0": 2, "s1": 4}
    ids = {name: enqueue_runs(url, name, runs=runs[name]) for name, url in urls.items()}
    metrics = f"127.0.0.1:{closed_port()}"
    async with ingress() as (sink, url), anyio.create_task_group() as tg:
        f = fleet(urls, url, {"RELAY_METRICS_ADDR": metrics})
        owner = f.settings.replica_id
        await tg.start(f.run)
        await wait_for(lambda: delivered(sink, set().union(*ids.values())), what="delivery")
        for name, db in urls.items():
            await wait_for(
                lambda db=db, name=name: delivered_in(reported(db, owner)) == len(ids[name]),
                what=f"{name}'s report counting its own deliveries",
            )
        async with httpx.AsyncClient(base_url=f"http://{metrics}") as http:
            pages = {name: await http.get(f"/api/status?database={name}") for name in urls}
        status = await anyio.to_thread.run_sync(
            lambda: subprocess.run(
                [*RELAY, "status", "--database", "s1", "--json"],
                env=env_of(urls),
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        )
        f.stop()
    for name, answer in pages.items():
        assert answer.status_code == 200, answer.text
        data = answer.json()
        assert data["database"] == name
        [row] = [r for r in data["fleet"] if r["owner"] == owner]
        assert row["this"] and row["alive"] and row["delivered"] == len(ids[name]), row
        assert row["report_problem"] is None and row["stale"] is False
    assert status.returncode == 0, status.stderr
    [replica] = [r for r in json.loads(status.stdout)["s1"]["replicas"] if r["owner"] == owner]
    assert replica["claimed_by_class"] is not None, replica  # from a fresh, valid report
    assert sum(replica["claimed_by_class"].values()) == runs["s1"], replica


async def test_a_fleets_page_shows_every_database_a_down_one_unmistakably(
    shards: dict[str, str],  # noqa: F811 - the fixture
) -> None:
    """The list: every database configured, each up or down; the down one (nothing listens at
    its port) in a red row and named in a banner, with its reason and since when; the others'
    backlog as their relays counted it (the ingress never answers: 2 runs of 3 events pending in
    s0, 5 in s1). Each database's page is its own, its JSON naming it; a down one's page says
    it is down and why; an unknown name is 404."""
    dead = urlunsplit(urlsplit(shards["s2"])._replace(netloc=f"127.0.0.1:{closed_port()}"))
    urls = {"s0": shards["s0"], "s1": shards["s1"], "gone": dead}
    enqueue_runs(urls["s0"], "s0", runs=2)
    enqueue_runs(urls["s1"], "s1", runs=5)
    metrics = f"127.0.0.1:{closed_port()}"
    nowhere = f"http://127.0.0.1:{closed_port()}"
    async with anyio.create_task_group() as tg:
        f = fleet(urls, nowhere, {"RELAY_METRICS_ADDR": metrics})
        await tg.start(f.run)
        want = {"s0": "serving", "s1": "serving", "gone": "set_aside"}
        await wait_for(lambda: f.states() == want, what="s0, s1 served and gone set aside")
        async with httpx.AsyncClient(base_url=f"http://{metrics}") as http:

            async def backlog_counted() -> bool:
                listed = (await http.get("/api/status")).json()["databases"]
                return all(d["backlog_age_seconds"] is not None for d in listed if d["up"])

            await wait_for(backlog_counted, what="both backlogs counted")
            html = await http.get("/")
            listed = await http.get("/api/status")
            own = {name: await http.get(f"/api/status?database={name}") for name in ("s0", "s1")}
            s0_page = await http.get("/?database=s0")
            run = await http.get("/runs/s0-r0?database=s0")
            elsewhere = await http.get("/api/runs/s0-r0?database=s1")
            down_page = await http.get("/?database=gone")
            down_json = await http.get("/api/status?database=gone")
            unknown = await http.get("/?database=nope")
            unnamed_run = await http.get("/runs/s0-r0")
        f.stop()

    assert listed.status_code == 200
    data = listed.json()
    by_name = {d["database"]: d for d in data["databases"]}
    assert list(by_name) == ["s0", "s1", "gone"]  # every database configured, in its order
    assert data["down"] == ["gone"]
    gone = by_name["gone"]
    assert gone["up"] is False and gone["state"] == "set_aside"
    assert gone["error"].startswith("unreachable: "), gone
    assert gone["since"] is not None and gone["for_seconds"] >= 0
    for name, events in (("s0", 6), ("s1", 15)):
        up = by_name[name]
        assert up["up"] is True and up["error"] is None
        assert sum(lane["events"] for lane in up["lanes"]) == events, up

    assert html.status_code == 200
    text = html.text
    assert '<p class="banner" id="down">1 of 3 databases DOWN: gone</p>' in text
    assert '<tr id="database-gone" class="down">' in text
    row = text.split('<tr id="database-gone" class="down">')[1].split("</tr>")[0]
    assert "<td>DOWN</td>" in row and "unreachable: " in row and " ago)" in row
    for name in ("s0", "s1"):
        up_row = text.split(f'<tr id="database-{name}">')[1].split("</tr>")[0]
        assert f'<a href="/?database={name}">{name}</a>' in up_row and "<td>up</td>" in up_row

    for name, events in (("s0", 6), ("s1", 15)):
        answer = own[name]
        assert answer.status_code == 200
        page = answer.json()
        assert page["database"] == name and page["view"]["database"] == name
        assert sum(lane["events"] for lane in page["lanes"]) == events
    assert s0_page.status_code == 200
    assert 'data-database="s0"' in s0_page.text and 'id="blocked-rows"' in s0_page.text
    assert run.status_code == 200 and "s0-r0-e0" in run.text
    assert 'href="/?database=s0"' in run.text  # back to its database's page
    assert elsewhere.status_code == 404  # s1 holds no such run

    assert down_page.status_code == 200
    assert "Database gone is DOWN since" in down_page.text and "unreachable: " in down_page.text
    assert down_json.status_code == 503
    assert down_json.json()["up"] is False and down_json.json()["database"] == "gone"
    assert unknown.status_code == 404
    assert unnamed_run.status_code == 404 and b"?database=NAME" in unnamed_run.content


async def test_a_database_whose_server_is_lost_while_served_shows_down_until_it_is_back(
    shards: dict[str, str],  # noqa: F811 - the fixture
    pg_url: str,
) -> None:
    """s1's server lost once served (every connection through its proxy cut, new ones refused):
    the list shows it DOWN, with an error and since when, whether its relay rides the loss out
    or is set aside; once its server answers again it is up and the banner is gone."""
    host, port = urlsplit(pg_url).hostname, urlsplit(pg_url).port
    assert host is not None and port is not None
    metrics = f"127.0.0.1:{closed_port()}"
    nowhere = f"http://127.0.0.1:{closed_port()}"
    async with anyio.create_task_group() as proxies:
        proxy = FaultProxy(host, port, "s1")
        await proxy.start(proxies)
        urls = {"s0": shards["s0"], "s1": via(shards["s1"], proxy.port)}
        f = fleet(urls, nowhere, {"RELAY_METRICS_ADDR": metrics}, max_retry=0.5)
        async with (
            anyio.create_task_group() as tg,
            httpx.AsyncClient(base_url=f"http://{metrics}") as http,
        ):
            await tg.start(f.run)

            async def listed() -> dict[str, dict[str, Any]]:
                answer = await http.get("/api/status")
                return {d["database"]: d for d in answer.json()["databases"]}

            async def up(name: str, want: bool) -> bool:
                return (await listed())[name]["up"] is want

            await wait_for(lambda: up("s1", True), what="s1 up")
            proxy.target = (host, closed_port())  # its server is gone
            proxy.reset()

            seen: list[str] = []

            async def shown_down() -> bool:
                seen.append((await http.get("/")).text)
                return DOWN_S1 in seen[-1]

            await wait_for(shown_down, what="s1 shown DOWN")
            proxy.target = (host, port)  # back
            await wait_for(lambda: up("s1", True), what="s1 up again")
            healed = (await http.get("/")).text
            f.stop()
        proxies.cancel_scope.cancel()
    row = seen[-1].split('<tr id="database-s1" class="down">')[1].split("</tr>")[0]
    assert "<td>DOWN</td>" in row and " ago)" in row, row  # since when
    assert any(why in row for why in ("lost: ", "unreachable: ", "failed: ")), row
    assert '<p class="allup" id="down">All 2 databases are up.</p>' in healed


async def test_a_fleets_page_is_guarded_by_ui_token_as_a_relay_alones(
    shards: dict[str, str],  # noqa: F811 - the fixture
) -> None:
    """With `ui_token` set, the list and every database's page need it (Bearer, or the cookie
    a `?token=` login sets, which keeps `?database=`); the probes stay open."""
    urls = {"s0": shards["s0"]}
    metrics = f"127.0.0.1:{closed_port()}"
    nowhere = f"http://127.0.0.1:{closed_port()}"
    async with anyio.create_task_group() as tg:
        f = fleet(urls, nowhere, {"RELAY_METRICS_ADDR": metrics, "RELAY_UI_TOKEN": TOKEN})
        await tg.start(f.run)
        await wait_for(lambda: f.states() == {"s0": "serving"}, what="s0 served")
        async with httpx.AsyncClient(base_url=f"http://{metrics}") as http:
            bare = [await http.get(p) for p in ("/", "/api/status", "/?database=s0")]
            ready = await http.get("/readyz")
            bearer = {"authorization": f"Bearer {TOKEN}"}
            opened = [await http.get(p, headers=bearer) for p in ("/", "/api/status?database=s0")]
            login = await http.get(f"/?database=s0&token={TOKEN}")
        f.stop()
    assert [r.status_code for r in bare] == [401, 401, 401]
    assert ready.status_code == 200
    assert [r.status_code for r in opened] == [200, 200]
    assert login.status_code == 303 and login.headers["location"] == "/?database=s0"
    assert TOKEN not in login.headers["set-cookie"]


def test_the_one_database_page_names_no_database() -> None:
    """The one-database form's page and links are as before the fleet's page: no database in
    the view, the body, the run links or the pager; a fleet's name it."""
    data: dict[str, Any] = {
        "blocked_runs": [{"run_id": "r/1", "event_id": "e", "seq": 1}],
        "blocked_offset": 50,
    }
    view = status_view(data)
    assert "database" not in view
    alone = status_page(view, 3.0, 50).decode().split("<script>")[0]  # the markup
    assert "data-database" not in alone and "of this fleet" not in alone
    assert 'href="/runs/r%2F1"' in alone and 'href="/?offset=0"' in alone
    assert run_href("r/1") == "/runs/r%2F1"

    fleets = status_page(status_view({**data, "database": "s0"}), 3.0, 50).decode()
    assert "database s0 of this fleet" in fleets.replace('<b id="database">', "").replace(
        "</b>", ""
    )
    assert 'data-database="s0"' in fleets
    assert 'href="/runs/r%2F1?database=s0"' in fleets
    assert 'href="/?offset=0&amp;database=s0"' in fleets
    run = {"run_id": "r/1"}
    events = [{"seq": 1, "event_id": "e", "state": "pending"}]
    assert 'href="/"' in run_page({"run": run, "events": events}, 200).decode()
    assert 'href="/?database=s0"' in run_page({"run": run, "events": events}, 200, "s0").decode()
