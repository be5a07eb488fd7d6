"""What the page shows, as text (pure): the figures and table rows of the status page and the
run page, built from the data layer's documents. The HTML (page.py) and the script that
refreshes it (assets.py) both show exactly these strings, so the formatting lives here once.

A cell is a string, or `[text, href]` for a link; an href is always built here from a quoted
id (`/runs/<quoted>`), never taken from the data, and page.py and the script make a link of a
pair only when its href is such a path (`is_run_href`): nothing a replica reports, or any other
value that reached a cell, becomes a link (issue 32, item 5).
"""

from __future__ import annotations

import shlex
from typing import Any
from urllib.parse import quote

from relay.core.classes import backlog_class
from relay.ops.format import clean, fmt_age, fmt_bytes, fmt_time, key_label
from relay.serving.ui.data import CLASSES
from relay.serving.ui.series import LANES

Cell = str | list[str]
EXCERPT = 200  # characters of an ingress body shown in the blocked-runs table
CHART_W, CHART_H = 600, 120


def run_href(run_id: str, database: str | None = None) -> str:
    """A run page's path; a fleet's names the database that holds the run."""
    href = "/runs/" + quote(run_id, safe="")
    return href if database is None else f"{href}?database={quote(database, safe='')}"


def is_run_href(href: object) -> bool:
    """A path `run_href` builds: the only href a cell may carry."""
    return isinstance(href, str) and href.startswith("/runs/")


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:,}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}/s"


def _capped(value: Any, cap: Any) -> str:
    """A count the database stopped at `cap` + 1 (ui_count_cap) shows as "cap+"."""
    if isinstance(value, int) and isinstance(cap, int) and value > cap:
        return f"{cap:,}+"
    return _num(value)


def _backlog_age(age: float | None) -> str:
    return "not measured yet" if age is None else fmt_age(age) + " ago"


def _lag(value: float | None) -> str:
    return fmt_age(value) if value is not None else "-"


def _by_class(counts: dict[str, int] | None) -> str:
    """POSTs of both lane classes, the critical ones in brackets: '6 (critical 1)'."""
    if counts is None:
        return "-"
    return f"{sum(counts.values()):,} (critical {counts.get('critical', 0):,})"


def _limit_card(limit: dict[str, Any] | None) -> dict[str, str]:
    """The ingress limit card's figures (data.limit_figures' shape; '-' without one). The state
    says "fallen" while the limit has fallen sharply and not recovered: the card's alarm."""
    if not limit:
        return dict.fromkeys(LIMIT_FIGURES, "-")
    fixed = limit.get("mode") == "fixed"
    tokens = limit.get("retry_tokens")
    return {
        "limit.limit": f"{_num(limit.get('limit'))}"
        + (" (fixed)" if fixed else f" / {_num(limit.get('ceiling'))}"),
        "limit.state": "fixed" if fixed else ("fallen" if limit.get("fallen") else "steady"),
        "limit.inflight": _by_class(limit.get("inflight")),
        "limit.waiting": _by_class(limit.get("waiting")),
        "limit.min_rtt": fmt_age(limit.get("min_rtt_seconds")),
        "limit.tokens": "-" if tokens is None else f"{tokens:,.1f}",
    }


LIMIT_FIGURES = (
    "limit.limit", "limit.state", "limit.inflight", "limit.waiting", "limit.min_rtt",
    "limit.tokens",
)  # fmt: skip


def figures(data: dict[str, Any]) -> dict[str, str]:
    """Every single figure on the status page, by the key of its element. The backlog's are
    by the class of runs they count (`finished.runs`, `due.events`, ...: `backlog_class`), the
    delivery rate and lag by the lane that delivered (`critical.rate`, ...)."""
    lanes = {x["lane"]: x for x in data.get("lanes") or []}
    out: dict[str, str] = {}
    for lane in LANES:
        row, name = lanes.get(lane, {}), backlog_class(lane)
        out[f"{name}.runs"] = _num(row.get("runs", 0))
        out[f"{name}.events"] = _num(row.get("events", 0))
        out[f"{name}.oldest"] = fmt_age(row.get("oldest_pending_age_seconds", 0))
        out[f"{lane}.rate"] = _rate(data.get("rates", {}).get(lane))
        lag = data.get("lag", {}).get(lane, {})
        out[f"{lane}.lag_p50"] = _lag(lag.get("p50"))
        out[f"{lane}.lag_p99"] = _lag(lag.get("p99"))
    blocked = data.get("blocked") or {}
    cap = data.get("count_cap")
    out["blocked.runs"] = _num(blocked.get("runs", 0))
    out["blocked.events"] = _num(blocked.get("events", 0))
    out["blocked.held"] = _capped(blocked.get("held_events", 0), cap)
    out["blocked.oldest"] = fmt_age(blocked.get("oldest_failure_age_seconds", 0))
    out["backlog_age"] = _backlog_age(data.get("backlog_age_seconds"))
    out["expired_leases"] = _capped(data.get("expired_leases", 0), cap)
    out["db_now"] = fmt_time(data.get("db_now"))
    tables = data.get("tables") or {}
    out["table_bytes"] = fmt_bytes(sum(int(v) for v in tables.values()))
    out["part_age"] = fmt_age(data.get("outbox_part_age_seconds"))
    out["replica_id"] = clean(data.get("replica_id", ""), 200)
    out |= _limit_card(data.get("ingress_limit"))
    claimed = data.get("claimed_by_class") or {}
    for name in CLASSES:
        out[f"claimed.{name}"] = _num(claimed.get(name)) if claimed else "-"
    return out


def blocked_rows(data: dict[str, Any]) -> list[list[Cell]]:
    rows: list[list[Cell]] = []
    cap = data.get("count_cap")
    database = data.get("database")
    for b in data.get("blocked_runs") or []:
        rows.append(
            [
                [clean(b["run_id"], 120), run_href(b["run_id"], database)],
                clean(b["event_id"], 120),
                _num(b["seq"]),
                _num(b.get("last_status")),
                clean(b.get("last_error") or "", EXCERPT),
                _num(b.get("attempts")),
                fmt_time(b.get("failed_at"), short=True),
                _capped(b.get("held_events"), cap),
            ]
        )
    return rows


def key_rows(data: dict[str, Any]) -> list[list[Cell]]:
    """The backlog by fairness key (issue 50 item 4), as `relay status` shows it: the keys with
    the most runs, the rest as `(other)`, runs without a key as `(default)`; no rows until a
    producer names a key. A key is a producer's text: a cell of text, never a link."""
    keys = data.get("keys") or []
    if all(k.get("key") == "" for k in keys):
        return []
    return [[key_label(k.get("key"), 120), _num(k.get("runs"))] for k in keys]


def _report_text(row: dict[str, Any]) -> str:
    """The report's ingress state, or why its report is not shown: text, never a link (a
    report is what another process says of itself)."""
    if row.get("report_problem"):
        return "report rejected: " + clean(str(row["report_problem"]), EXCERPT)
    return clean(str(row.get("ingress") or "-"), 40)


def fleet_rows(data: dict[str, Any]) -> list[list[Cell]]:
    rows: list[list[Cell]] = []
    for r in data.get("fleet") or []:
        alive = {True: "alive", False: "dead", None: "-"}[r.get("alive")]
        seen = "-" if r.get("seen_age_seconds") is None else fmt_age(r["seen_age_seconds"]) + " ago"
        if r.get("stale"):
            seen += " (stale)"
        rows.append(
            [
                clean(r["owner"], 120) + (" (this page)" if r.get("this") else ""),
                alive,
                _num(r.get("runs_held")),
                fmt_time(r.get("next_expiry"), short=True),
                _num(r.get("renewals")),
                _num(r.get("delivered")),
                _report_text(r),
                clean(str(r.get("post_limit") or "-"), 40),
                seen,
            ]
        )
    return rows


def chart(data: dict[str, Any]) -> dict[str, str]:
    """SVG polyline points per lane over the 15-minute window, and the y-axis maximum."""
    series = data.get("series") or {}
    window = 15 * 60.0
    top = max([1.0] + [r for lane in LANES for _, r in series.get(lane, [])])
    out = {"max": _rate(top)}
    for lane in LANES:
        pts = [
            f"{CHART_W * (1 - min(ago, window) / window):.1f},{CHART_H * (1 - r / top):.1f}"
            for ago, r in series.get(lane, [])
        ]
        out[lane] = " ".join(pts)
    return out


def status_view(data: dict[str, Any]) -> dict[str, Any]:
    """All the page shows, for page.py and for the script (`view` in /api/status)."""
    offset = int(data.get("blocked_offset") or 0)
    return {
        "figures": figures(data),
        "blocked": blocked_rows(data),
        "keys": key_rows(data),
        "fleet": fleet_rows(data),
        "chart": chart(data),
        "blocked_offset": offset,
    } | ({"database": data["database"]} if "database" in data else {})  # a fleet's only


# -- the run page -------------------------------------------------------------------------------


def sh(word: str) -> str:
    """`word` quoted for a POSIX shell; a word with control or bidi characters (which would
    hide or reorder what the operator reads) in bash's $'...' form with those as \\u escapes,
    so what is shown is what is pasted."""
    if clean(word) == word:
        return shlex.quote(word)
    out = []
    for ch in word:
        if ch in "\\'":
            out.append("\\" + ch)
        elif clean(ch) != ch:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
        else:
            out.append(ch)
    return "$'" + "".join(out) + "'"


def commands(run: dict[str, Any], events: list[dict[str, Any]]) -> list[str]:
    """The exact `relay retry` / `relay skip` commands for the run's failed events, shell-quoted
    (ids are producers' text: quoting is what makes them safe to paste)."""
    out = []
    for e in events:
        if e.get("state") == "failed":
            out.append(f"relay retry {sh(e['event_id'])}")
            out.append(f"relay skip {sh(e['event_id'])} --reason 'REASON'")
    if run.get("blocked_seq") is not None:
        out.append(f"relay retry --run {sh(run['run_id'])}")
    out.append(f"relay inspect {sh(run['run_id'])}")
    return out


def run_rows(run: dict[str, Any], events: list[dict[str, Any]]) -> list[list[Cell]]:
    """One row per event, in seq order; the run's lease shown on its pending events (the prefix
    a lease covers)."""
    live = bool(run.get("lease_live"))
    rows: list[list[Cell]] = []
    for e in events:
        leased = live and e.get("state") == "pending"
        rows.append(
            [
                _num(e["seq"]),
                clean(e["event_id"], 200),
                clean(e.get("event_type") or "", 120),
                e["state"] + (" (terminal)" if e.get("terminal") else ""),
                _num(e.get("attempts")),
                _num(e.get("last_status")),
                clean(e.get("last_error") or "", 500),
                clean(run.get("lease_owner") or "", 120) if leased else "-",
                fmt_time(run.get("lease_expires_at"), short=True) if leased else "-",
            ]
        )
    return rows


def run_figures(run: dict[str, Any]) -> dict[str, str]:
    from relay.ops.format import run_state

    return {
        "run_id": clean(run["run_id"]),
        "state": run_state(run),
        "epoch": _num(run.get("epoch")),
        "lease_owner": clean(run.get("lease_owner") or "-", 200),
        "lease_expires_at": fmt_time(run.get("lease_expires_at")),
        "next_attempt_at": fmt_time(run.get("next_attempt_at")),
        "counts": (
            f"{_num(run.get('events_total'))} events: {_num(run.get('pending'))} pending, "
            f"{_num(run.get('delivered'))} delivered, {_num(run.get('failed'))} failed, "
            f"{_num(run.get('skipped'))} skipped"
        ),
    }


# -- a fleet's list of databases (relay/serving/ui/fleet.py) -------------------------------------

DATABASE_HEAD = (
    "database", "status", "since", "why", "finished runs", "open runs", "pending events",
    "oldest pending", "blocked runs", "backlog as of",
)  # fmt: skip


def _status_word(entry: dict[str, Any]) -> str:
    """`up`; `DOWN` for a database set aside or whose server does not answer; `starting`."""
    if entry.get("up"):
        return "up"
    return "starting" if entry.get("state") == "starting" else "DOWN"


def database_row(entry: dict[str, Any]) -> dict[str, Any]:
    """One database of the list as text: its name and page, its status, since when, why it is
    down, and its backlog's figures ('-' while down or before its first refresh)."""
    lanes = {x["lane"]: x for x in entry.get("lanes") or []}
    # backlog()'s `critical` row counts the finished runs, its `ordinary` row the open ones
    finished, opened = lanes.get("critical", {}), lanes.get("ordinary", {})
    events = [finished.get("events"), opened.get("events")]
    oldest = [finished.get("oldest_pending_age_seconds"), opened.get("oldest_pending_age_seconds")]
    known = [x for x in oldest if x is not None]
    since = entry.get("since")
    age = entry.get("for_seconds")
    name = str(entry.get("database", ""))
    return {
        "name": clean(name, 40),
        "href": "/?database=" + quote(name, safe=""),
        "status": _status_word(entry),
        "since": "-" if since is None else f"{fmt_time(since, short=True)} ({fmt_age(age)} ago)",
        "why": clean(entry.get("error") or "", 500),
        "figures": [
            _num(finished.get("runs")),
            _num(opened.get("runs")),
            _num(None if None in events else sum(e for e in events if e is not None)),
            fmt_age(max(known)) if known else "-",
            _num((entry.get("blocked") or {}).get("runs")),
            _backlog_age(entry.get("backlog_age_seconds")) if entry.get("up") else "-",
        ],
    }


def database_view(data: dict[str, Any]) -> dict[str, Any]:
    """All a fleet's list shows: a row per database, and the names of those down."""
    rows = [database_row(e) for e in data.get("databases") or []]
    return {
        "databases": rows,
        "down": [r["name"] for r in rows if r["status"] == "DOWN"],
        "replica_id": clean(data.get("replica_id", ""), 200),
    }
