"""The status page of a fleet over several databases (issue 51 item 4; docs/sharding.md).

    GET /                          every database of the fleet, up or down (a down one's
                                   error and since when), and its backlog
    GET /api/status                the same, as JSON (`databases`)
    GET /?database=NAME            that database's page, as a relay alone serves its own
    GET /api/status?database=NAME  its data, with `database`
    GET /runs/<run_id>?database=NAME, /api/runs/<run_id>?database=NAME   its run pages

The list costs no statement: each database's state is the fleet's, its backlog its relay's last
refresh of the backlog gauges. A database's page is its relay's own `StatusPage` (web.py), on
its own connection to that database, so the page of one database costs what a relay alone's
does, and the list stays cheap however many databases there are. A database that is down has
no page: `?database=NAME` answers with the reason it is down and since when (the JSON with 503).
The fleet passes `databases`, a view of its members read at each request (relay/fleet.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import anyio

from relay.serving.ui import page
from relay.serving.ui.data import Backlog, backlog_figures
from relay.serving.ui.view import database_view
from relay.serving.ui.web import (
    TEXT,
    Request,
    Response,
    StatusPage,
    gate,
    html_response,
    json_response,
)
from relay.settings import Secret


@dataclass(frozen=True, slots=True)
class DatabaseState:
    """One database of the fleet as its page shows it. `state` is the fleet's (`serving`,
    `starting`, `set_aside`); `up` whether it is served with its LISTEN connection up
    (`ledger_relay_database_up`); `error` why it is not (without a password), `since` since
    when (wall-clock seconds) it is in its state, or down; `page` its page while its relay
    runs and `backlog` its relay's last refresh of the backlog gauges."""

    name: str
    state: str
    up: bool
    error: str | None = None
    since: float | None = None
    page: StatusPage | None = None
    backlog: Backlog | None = None


def _iso(wall: float | None) -> str | None:
    return None if wall is None else datetime.fromtimestamp(wall, UTC).isoformat()


def database_entry(db: DatabaseState, wall: float, now: float) -> dict[str, Any]:
    """One database in the JSON of the list (`wall`: the time, `now`: the monotonic clock the
    backlog's refresh is timed on): up or down, its state, why and since when, and its backlog
    as `relay status --json` shapes it (every figure None before its first refresh, and while
    it is down)."""
    totals = backlog_figures(db.backlog if db.up else None, None, now)
    blocked = {k: v for k, v in totals["blocked"].items() if k != "held_events"}
    return {
        "database": db.name,
        "up": db.up,
        "state": db.state,
        "error": None if db.up else db.error,
        "since": _iso(db.since),
        "for_seconds": None if db.since is None else max(0.0, wall - db.since),
        "lanes": totals["lanes"],
        "blocked": blocked,
        "backlog_age_seconds": totals["backlog_age_seconds"],
    }


def fleet_status(
    databases: Sequence[DatabaseState], replica_id: str, wall: float, now: float
) -> dict[str, Any]:
    """What `/api/status` answers in a fleet without `?database=`: every database, the names
    of those that are down, and the view the page shows."""
    entries = [database_entry(db, wall, now) for db in databases]
    data: dict[str, Any] = {
        "replica_id": replica_id,
        "databases": entries,
        "down": [e["database"] for e in entries if not e["up"]],
    }
    data["view"] = database_view(data)
    return data


class FleetPage:
    """The status page of a fleet: the list of its databases, and each database's own page.
    Who may see it is decided as for a relay alone (web.py `gate`), once, before either."""

    def __init__(
        self,
        databases: Callable[[], Sequence[DatabaseState]],
        *,
        replica_id: str,
        token: Secret | None,
        open_without_token: bool,
        refresh_seconds: float,
    ) -> None:
        self.databases = databases
        self.replica_id = replica_id
        self.token = token
        self.open_without_token = open_without_token
        self.refresh_seconds = refresh_seconds

    handles = staticmethod(StatusPage.handles)

    async def handle(self, request: Request) -> Response:
        refused = gate(self.token, self.open_without_token, request)
        if refused is not None:
            return refused
        name = request.query.get("database")
        if name is None:
            return self._list(request.path)
        db = next((d for d in self.databases() if d.name == name), None)
        if db is None:
            return Response(404, TEXT, b"no such database in this fleet\n")
        if db.up and db.page is not None:
            return await db.page.answer(request)
        entry = database_entry(db, time.time(), anyio.current_time())
        if request.path.startswith("/api/"):
            return json_response(entry, 503)
        view = database_view({"databases": [entry]})
        return html_response(200, page.database_down_page(view, self.refresh_seconds))

    def _list(self, path: str) -> Response:
        data = fleet_status(self.databases(), self.replica_id, time.time(), anyio.current_time())
        if path == "/":
            return html_response(200, page.fleet_page(data["view"], self.refresh_seconds))
        if path == "/api/status":
            return json_response(data)
        return Response(404, TEXT, b"a fleet's run pages name their database: add ?database=NAME\n")
