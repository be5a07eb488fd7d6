"""The HTML of the status page and the run page (pure). Every value goes through `esc`
(html.escape, quotes included) whether it is an id, an excerpt or a figure; markup comes only
from the literals here. The refreshing script and the styles are assets.py's constants."""

from __future__ import annotations

from html import escape
from typing import Any
from urllib.parse import quote

from relay.core.classes import backlog_class
from relay.serving.ui.assets import CSS, SCRIPT
from relay.serving.ui.series import LANES
from relay.serving.ui.view import (
    CHART_H,
    CHART_W,
    DATABASE_HEAD,
    Cell,
    commands,
    is_run_href,
    run_figures,
    run_href,
    run_rows,
)

BLOCKED_HEAD = (
    "run", "failed event", "seq", "HTTP status", "body excerpt", "attempts", "failed at", "held",
)  # fmt: skip
FLEET_HEAD = (
    "replica", "liveness", "runs held", "next lease expiry", "renewals (reported)",
    "delivered (reported)", "ingress (reported)", "POST limit (reported)", "last report",
)  # fmt: skip
RUN_HEAD = (
    "seq", "event id", "type", "state", "attempts", "HTTP status", "last error",
    "lease owner", "lease expires",
)  # fmt: skip


def esc(value: object) -> str:
    return escape(str(value), quote=True)


def _fig(figures: dict[str, str], key: str, cls: str = "") -> str:
    c = f' class="{cls}"' if cls else ""
    return f'<span data-k="{esc(key)}"{c}>{esc(figures.get(key, "-"))}</span>'


def _cell(value: Cell) -> str:
    if isinstance(value, list) and len(value) == 2 and is_run_href(value[1]):
        return f'<td><a href="{esc(value[1])}">{esc(value[0])}</a></td>'
    if isinstance(value, list):
        return f"<td>{esc(value[0] if value else '')}</td>"
    return f"<td>{esc(value)}</td>"


def _card(figures: dict[str, str], key: str, label: str, alarm: bool) -> str:
    """A figure with its label; an `alarm` card turns red while its figure is not 0, or for
    a figure in ALARMS while it is not one of the calm values listed there (the script keeps
    that up to date)."""
    if not alarm:
        return f'<div class="card"><b>{_fig(figures, key)}</b>{esc(label)}</div>'
    calm = ALARMS.get(key, ("0",))
    bad = " bad" if figures.get(key) not in calm else ""
    attrs = f' data-calm="{esc("|".join(calm))}"' if key in ALARMS else ""
    return (
        f'<div class="card{bad}" data-alarm="{esc(key)}"{attrs}>'
        f"<b>{_fig(figures, key)}</b>{esc(label)}</div>"
    )


def _table(head: tuple[str, ...], rows: list[list[Cell]], body_id: str, empty: str) -> str:
    th = "".join(f"<th>{esc(h)}</th>" for h in head)
    trs = "".join("<tr>" + "".join(_cell(c) for c in r) + "</tr>" for r in rows)
    hidden = " hidden" if rows else ""
    return (
        f'<table><thead><tr>{th}</tr></thead><tbody id="{body_id}">{trs}</tbody></table>'
        f'<p id="{body_id}-empty" class="empty"{hidden}>{esc(empty)}</p>'
    )


def _doc(title: str, body: str, attrs: str = "", head: str = "") -> bytes:
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">{head}'
        f'<meta name="referrer" content="no-referrer"><title>{esc(title)}</title>'
        f"<style>{CSS}</style></head><body{attrs}>{body}<script>{SCRIPT}</script></body></html>\n"
    ).encode()


# The cards at the top of the status page: (figure key, label, alarm when not zero).
CARDS = (
    ("blocked.runs", "blocked runs", True),
    ("blocked.events", "failed events", True),
    ("blocked.held", "events held behind them", False),
    ("blocked.oldest", "oldest failure", False),
    ("expired_leases", "expired leases", False),
    ("table_bytes", "outbox tables", False),
    ("part_age", "current outbox part open", False),
)

# This replica's POST turn (issue 42): the limit is red while it has fallen sharply.
LIMIT_CARDS = (
    ("limit.limit", "POSTs in flight allowed / ceiling", False),
    ("limit.state", "limit state", True),
    ("limit.inflight", "POSTs in flight", False),
    ("limit.waiting", "POSTs waiting for the limit", False),
    ("limit.min_rtt", "minimum round trip", False),
    ("limit.tokens", "retry tokens", False),
)
# This replica's runs claimed by class (issue 50 item 4).
CLAIM_CARDS = (
    ("claimed.targeted", "targeted terminals", False),
    ("claimed.finished", "finished runs", False),
    ("claimed.due", "due runs", False),
)
# An alarm card's calm figures where they are not "0" ("-": no figure yet).
ALARMS = {"limit.state": ("steady", "fixed", "-")}


def _rows(f: dict[str, str], names: tuple[str, ...], keys: tuple[str, ...]) -> str:
    return "".join(
        f"<tr><td>{esc(name)}</td>"
        + "".join(f'<td class="n">{_fig(f, f"{name}.{k}")}</td>' for k in keys)
        + "</tr>"
        for name in names
    )


# The backlog's rows by the class of runs they count, not by lane: a finished run found by
# discovery is prioritised work that takes an ordinary slot, not the critical lane's control
# traffic (docs/design.md, "Scheduling: which run goes next"), as in `relay status` and the
# metrics' `class` label (issue 50 item 4).
BACKLOG_NAMES = tuple(backlog_class(lane) for lane in LANES)
KEYS_HEAD = ("fairness key", "runs")


def _chart_svg(chart: dict[str, Any]) -> str:
    return (
        f'<svg id="chart" width="{CHART_W}" height="{CHART_H}" viewBox="0 0 {CHART_W} {CHART_H}"'
        ' role="img" aria-label="delivery rate per lane, last 15 minutes">'
        + "".join(
            f'<polyline id="line-{lane}" class="{lane}" points="{esc(chart[lane])}"/>'
            for lane in LANES
        )
        + f'<text class="axis" x="4" y="{CHART_H - 4}">15 min ago</text>'
        + f'<text class="axis" x="{CHART_W - 4}" y="{CHART_H - 4}" text-anchor="end">now</text>'
        + "</svg>"
    )


def _pager(offset: int, shown: int, page_size: int, database: str | None) -> str:
    """Links to the newer and older pages of blocked runs, those that exist (of `database`'s
    page, in a fleet)."""
    of = "" if database is None else f"&amp;database={esc(quote(database, safe=''))}"
    links = []
    if offset > 0:
        links.append(f'<a href="/?offset={max(0, offset - page_size)}{of}">newer failures</a>')
    if shown >= page_size:
        links.append(f'<a href="/?offset={offset + page_size}{of}">older failures</a>')
    return " · ".join(links)


def _of_fleet(database: str | None) -> str:
    """A fleet's page of one database says which, and leads to the page of every database."""
    if database is None:
        return ""
    return (
        f'<p class="meta">database <b id="database">{esc(database)}</b> of this fleet · '
        '<a href="/">every database, up or down</a></p>'
    )


def _backlog(f: dict[str, str]) -> str:
    """The backlog table: runs, pending events and the oldest pending, by the runs they count."""
    rows = _rows(f, BACKLOG_NAMES, ("runs", "events", "oldest"))
    return (
        '<h2>Backlog</h2><p class="meta">Runs, pending events, oldest pending, the blocked'
        " totals and the runs by fairness key are the backlog refresh's (one pass over the"
        f" pending events, spaced by its own cost), as of {_fig(f, 'backlog_age')}; other"
        " counts that grow with the backlog stop at a cap (shown with a +). Finished runs have"
        " their terminal event pending (what an outage leaves behind: prioritised work, found"
        " by discovery, not the critical lane's), due runs have not (they are due now or after"
        " their backoff).</p>"
        '<table><thead><tr><th>runs</th><th class="n">count</th>'
        '<th class="n">pending events</th><th class="n">oldest pending</th>'
        f'</tr></thead><tbody id="backlog">{rows}</tbody></table>'
    )


def _keys(rows: list[list[Cell]]) -> str:
    """The backlog by fairness key: the runs of the 10 keys with the most, as the backlog
    refresh counted them."""
    return (
        "<h2>Backlog by fairness key (the 10 with the most)</h2>"
        + _table(KEYS_HEAD, rows, "key-rows", "No run with pending events names a key.")
        + '<p class="meta">Runs with pending events that are not blocked, by the fairness key'
        " their producer named: the rest of the keys as (other), runs that name none as"
        " (default).</p>"
    )


def status_page(view: dict[str, Any], refresh_seconds: float, page_size: int) -> bytes:
    f = view["figures"]
    lanes = _rows(f, LANES, ("rate", "lag_p50", "lag_p99"))
    chart = view["chart"]
    svg = _chart_svg(chart)
    offset = int(view.get("blocked_offset") or 0)
    database = view.get("database")
    pager = _pager(offset, len(view["blocked"]), page_size, database)
    cards = "".join(_card(f, key, label, alarm) for key, label, alarm in CARDS)
    limit_cards = "".join(_card(f, key, label, alarm) for key, label, alarm in LIMIT_CARDS)
    claim_cards = "".join(_card(f, key, label, alarm) for key, label, alarm in CLAIM_CARDS)
    body = (
        "<h1>ledger-relay</h1>"
        + _of_fleet(database)
        + f'<p class="meta">served by {_fig(f, "replica_id")} · database time {_fig(f, "db_now")}'
        ' · <span id="updated">as rendered</span> · read-only</p>'
        f'<div class="cards">{cards}</div>'
        + _backlog(f)
        + _keys(view["keys"])
        + '<h2>Lanes</h2><p class="meta">The critical lane delivers the terminals it is'
        " signalled as they commit; the ordinary lane all the rest, finished runs in three of"
        " every four claims while due ones wait too.</p><table><thead><tr><th>lane</th>"
        '<th class="n">delivery rate</th><th class="n">lag p50</th><th class="n">lag p99</th>'
        f'</tr></thead><tbody id="lanes">{lanes}</tbody></table>'
        "<h2>Runs claimed by class (this replica, since it started)</h2>"
        f'<div class="cards" id="claims">{claim_cards}</div>'
        '<p class="meta">Targeted terminals are signalled as they commit (the critical lane\'s'
        " only work, claimed at once); finished runs have a pending terminal and are found by"
        " discovery; due runs are the rest. Live from the replica serving this page; every"
        " replica's, per lane, in claimed_runs_by_class_total.</p>"
        "<h2>Ingress limit (this replica)</h2>"
        f'<div class="cards" id="ingress-limit">{limit_cards}</div>'
        '<p class="meta">POSTs to the ingress this replica may have in flight under its'
        " adaptive limit (post_limit), both lanes together, critical ones in brackets; the"
        " limit falls when the ingress queues or answers overloaded, and is red while it has"
        " fallen sharply and not recovered. Live from the replica serving this page, not from"
        " the reports.</p>"
        '<h2>Delivery rate, last 15 minutes (events/s, whole fleet)</h2><p class="legend">'
        '<span class="critical">━ critical</span><span class="ordinary">━ ordinary</span>'
        f'<span>max <span id="chart-max">{esc(chart["max"])}</span></span></p>{svg}'
        f"<h2>Blocked runs (from #{offset + 1}, oldest failure first)</h2>"
        + _table(BLOCKED_HEAD, view["blocked"], "blocked-rows", "No blocked runs.")
        + f'<p class="pager">{pager}</p>'
        "<h2>Replicas</h2>"
        + _table(FLEET_HEAD, view["fleet"], "fleet-rows", "No replica has reported yet.")
        + '<p class="meta">Lag: commit to ack, the worst replica\'s percentile over its last'
        " 15 minutes. Liveness, runs held and lease expiry are the database's. Renewals,"
        " delivered, ingress and lag are what each replica reports of itself from its health"
        " loop: checked for shape, and only from the session that holds the replica's liveness"
        " lock, but its own word (a role that can hold a lock can invent a replica); a report"
        " that fails the checks shows as rejected, with no figures.</p>"
    )
    attrs = f' data-refresh="{esc(refresh_seconds)}" data-offset="{offset}" data-updates="0"'
    if database is None:
        return _doc("ledger-relay status", body, attrs)
    attrs += f' data-database="{esc(database)}"'  # the script's /api/status names it
    return _doc(f"{database} · ledger-relay status", body, attrs)


def run_page(doc: dict[str, Any], limit: int, database: str | None = None) -> bytes:
    run, events = doc["run"], doc["events"]
    f = run_figures(run)
    cmds = "\n".join(commands(run, events))
    more = ""
    if len(events) >= limit:
        after = int(events[-1]["seq"]) + 1
        href = run_href(run["run_id"], database)
        href += f"{'?' if database is None else '&'}from_seq={after}"
        more = f'<p>{limit} events shown. <a id="more" href="{esc(href)}">The next ones</a></p>'

    back = "/" if database is None else f"/?database={quote(database, safe='')}"
    body = (
        f'<p><a href="{esc(back)}">← status</a></p>'
        f'<h1>Run <span id="run-id">{esc(f["run_id"])}</span></h1>'
        f'<p id="run-state">{esc(f["state"])}</p>'
        f'<p class="meta">epoch {esc(f["epoch"])} · lease owner {esc(f["lease_owner"])}'
        f" until {esc(f['lease_expires_at'])} · next attempt {esc(f['next_attempt_at'])}"
        f" · {esc(f['counts'])}</p>"
        "<h2>Events (seq order)</h2>"
        + _table(RUN_HEAD, run_rows(run, events), "run-events", "No events (pruned).")
        + more
        + "<h2>Commands</h2><p>To act on this run from a shell with database access:</p>"
        f'<pre id="commands">{esc(cmds)}</pre>'
    )
    return _doc(f"run {f['run_id'][:80]} · ledger-relay", body)


def message_page(status: int, text: str) -> bytes:
    return _doc(f"{status} · ledger-relay", f'<p><a href="/">← status</a></p><p>{esc(text)}</p>')


# -- a fleet's list of databases (relay/serving/ui/fleet.py) -------------------------------------


def _reloading(refresh_seconds: float) -> str:
    """The list reloads itself whole (it costs no statement): no script needed."""
    return f'<meta http-equiv="refresh" content="{esc(max(1, round(refresh_seconds)))}">'


def _down_banner(down: list[str], total: int) -> str:
    if not down:
        return f'<p class="allup" id="down">All {total} databases are up.</p>'
    return (
        f'<p class="banner" id="down">{len(down)} of {total} databases DOWN: '
        f"{esc(', '.join(down))}</p>"
    )


def _database_tr(row: dict[str, Any]) -> str:
    down = row["status"] == "DOWN"
    cells = (
        f'<td><a href="{esc(row["href"])}">{esc(row["name"])}</a></td>'
        f"<td>{esc(row['status'])}</td><td>{esc(row['since'])}</td><td>{esc(row['why'])}</td>"
        + "".join(f'<td class="n">{esc(x)}</td>' for x in row["figures"])
    )
    attrs = f' id="database-{esc(row["name"])}"' + (' class="down"' if down else "")
    return f"<tr{attrs}>{cells}</tr>"


def fleet_page(view: dict[str, Any], refresh_seconds: float) -> bytes:
    """Every database of a fleet: a banner naming the down ones, a row each (a down one in
    red, with why and since when), each leading to its own page."""
    rows = view["databases"]
    th = "".join(f"<th>{esc(h)}</th>" for h in DATABASE_HEAD)
    body = (
        "<h1>ledger-relay: a fleet over several databases</h1>"
        f'<p class="meta">served by {esc(view["replica_id"])} · this replica\'s view of each'
        " database · read-only</p>"
        + _down_banner(view["down"], len(rows))
        + f'<table><thead><tr>{th}</tr></thead><tbody id="databases">'
        + "".join(_database_tr(r) for r in rows)
        + "</tbody></table>"
        '<p class="meta">Up: served, its LISTEN connection up (ledger_relay_database_up 1). DOWN:'
        " set aside (unreachable, refused, at a schema version this release cannot serve, or"
        " its relay failed: tried again with backoff) or its server lost while served, since"
        " the first failure (a database set aside stays DOWN while its next relay starts);"
        " starting: probed, its first relay starting. The backlog is its relay's"
        " last refresh of the backlog gauges. Each database's page has its lanes, blocked runs"
        " and replicas.</p>"
    )
    return _doc("ledger-relay fleet", body, head=_reloading(refresh_seconds))


def database_down_page(view: dict[str, Any], refresh_seconds: float) -> bytes:
    """The page of a database that is down (or starting): why, and since when."""
    [row] = view["databases"]
    word = "is DOWN" if row["status"] == "DOWN" else f"is {row['status']}"
    why = f" {esc(row['why'])}" if row["why"] else ""
    body = (
        '<p><a href="/">← every database</a></p>'
        f"<h1>ledger-relay: database {esc(row['name'])}</h1>"
        f'<p class="banner" id="down">Database {esc(row["name"])} {esc(word)} since'
        f" {esc(row['since'])}.{why}</p>"
        '<p class="meta">Its page (backlog, lanes, blocked runs, replicas) is back once it is'
        " served again; this page reloads itself until then.</p>"
    )
    return _doc(f"{row['name']} down · ledger-relay", body, head=_reloading(refresh_seconds))
