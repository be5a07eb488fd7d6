"""The status page's database side and the pure shaping of what it reads.

Per refresh of the page the data layer sends one statement (`ui_status()`), and per run page
one (`ui_run()`); `queries` counts them (the docs state the number, tests/test_ui.py measures
it). The replica report (`report_replica()`) is the third, sent by the health probe loop every
refresh interval whether or not anyone looks at the page, on the LISTEN connection's session
(the database refuses a report from any session but the one holding the owner's liveness lock);
its answer feeds the rate series.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from psycopg import sql

from relay.admission.permits import Priority
from relay.core.classes import backlog_class
from relay.serving.ui.series import LANES, RateSeries

if TYPE_CHECKING:
    from relay.admission.permits import AdmissionView
    from relay.admission.retry_budget import BudgetView
    from relay.delivery.lane import LaneView

Query = Callable[[sql.Composed, Sequence[Any]], Awaitable[list[tuple[Any, ...]]]]

BLOCKED_PAGE = 50  # blocked runs per page
RUN_EVENTS_PAGE = 200  # events per run page
REPORT_TTL = 120.0  # seconds after which a replica's report shows as stale
RECOVERING_FOR = 60.0  # seconds an ingress counts as "recovering" after it was misconfigured
INGRESS_STATES = ("ok", "recovering", "misconfigured")  # what a report's `ingress` may say
CLASSES = ("targeted", "finished", "due")  # a claim's class (issue 50; docs/design.md)


@dataclass(frozen=True, slots=True)
class Backlog:
    """The backlog gauges' last refresh (relay/serving/health.py): `backlog()`'s rows, when
    (monotonic seconds), and `backlog_by_key()`'s rows (key, runs: the keys with the most, None
    for the rest, '' the default key; empty when the database's functions are older than
    schema version 10's)."""

    rows: tuple[tuple[str, int, int, float], ...]
    at: float
    keys: tuple[tuple[str | None, int], ...] = ()


class Data:
    """`query` runs the page's statements; `on_liveness_session` the report, on the session
    that holds this replica's liveness lock (the only one the database takes it from)."""

    def __init__(self, query: Query, schema: str, on_liveness_session: Query | None) -> None:
        self._query = query
        self._on_liveness_session = on_liveness_session
        self.queries = 0  # statements sent for pages (tests and docs: queries per refresh)
        self.reports = 0  # report statements sent (the probe loop's, one per refresh interval)
        s = sql.Identifier(schema)
        self._status = sql.SQL("select {}.ui_status(%s, %s, %s)::text").format(s)
        self._run = sql.SQL("select {}.ui_run(%s, %s, %s)::text").format(s)
        self._report = sql.SQL("select {}.report_replica(%s, %s::jsonb, %s)::text").format(s)

    async def _one(self, query: sql.Composed, params: Sequence[Any]) -> Any:
        self.queries += 1
        rows = await self._query(query, params)
        return orjson.loads(rows[0][0])

    async def status(self, offset: int = 0, limit: int = BLOCKED_PAGE) -> dict[str, Any]:
        result: dict[str, Any] = await self._one(self._status, (limit, offset, REPORT_TTL))
        return result

    async def run(self, run_id: str, from_seq: int = 1, limit: int = RUN_EVENTS_PAGE) -> Any:
        """The run's document; raises psycopg.errors.NoDataFound for an unknown run."""
        return await self._one(self._run, (run_id, from_seq, limit))

    async def report(self, owner: str, report: Mapping[str, Any]) -> dict[str, dict[str, int]]:
        if self._on_liveness_session is None:
            raise ConnectionError("no LISTEN connection to report on")
        self.reports += 1
        params = (owner, orjson.dumps(report).decode(), REPORT_TTL)
        rows = await self._on_liveness_session(self._report, params)
        counts: dict[str, dict[str, int]] = orjson.loads(rows[0][0])
        return counts


# -- pure ---------------------------------------------------------------------------------------


def ingress_state(misconfigured: bool, last_misconfigured: float | None, now: float) -> str:
    """'misconfigured' while a lane is paused on a misconfigured answer, 'recovering' for
    RECOVERING_FOR seconds after, else 'ok'."""
    if misconfigured:
        return "misconfigured"
    if last_misconfigured is not None and now - last_misconfigured < RECOVERING_FOR:
        return "recovering"
    return "ok"


def build_report(
    lanes: Iterable[LaneView],
    ingress: str,
    lag: Mapping[str, Mapping[str, float | None]],
    admission: AdmissionView | None = None,
    budget: BudgetView | None = None,
) -> dict[str, Any]:
    """This replica's report: per lane its cumulative counters, in flight, and lag p50/p99 of
    the last 15 minutes; its ingress health; under the adaptive limit (`admission` not None)
    its POST turn (`report_limit`). Per lane also its runs claimed by class (`claimed_targeted`,
    `claimed_finished`, `claimed_due`; issue 50). Counters only: no ids, no payloads."""
    out: dict[str, Any] = {}
    for lane in lanes:
        q = lag.get(lane.name, {})
        out[lane.name] = {
            "delivered": lane.stats.delivered,
            "claimed": lane.stats.claimed_runs,
            "renewals": lane.renewals,
            "retries": lane.stats.retries,
            "blocked": lane.stats.failed,
            "leases_lost": lane.stats.lease_lost,
            "inflight": lane.inflight,
            "lag_p50": q.get("p50"),
            "lag_p99": q.get("p99"),
            # runs claimed by class (issue 50 item 4): relay status shows each replica's
            **{f"claimed_{c}": lane.stats.by_class.get(c, 0) for c in CLASSES},
        }
    report: dict[str, Any] = {"lanes": out, "ingress": ingress}
    if admission is not None:
        report["limit"] = report_limit(admission, budget)
    return report


def report_limit(admission: AdmissionView, budget: BudgetView | None) -> dict[str, Any]:
    """The report's `limit` (issue 42), as `relay status` prints it for every replica: the POSTs
    the adaptive limit allows, its ceiling and the critical reserve, POSTs in flight and waiting
    per lane class, the minimum round trip in whole milliseconds (None before any answer),
    whether it fell sharply, and the retry tokens (below zero when failed retries outlive the
    deposits that paid for them; None without a budget). Its shape is checked in the database
    (report_limit_problem, schema/functions_ui.sql)."""
    limit = admission.limit
    min_rtt = None if limit.min_rtt is None else round(limit.min_rtt * 1000)
    return {
        "limit": limit.allowed,
        "ceiling": limit.ceiling,
        "reserve": admission.reserve,
        "in_flight_critical": admission.inflight.get(Priority.CRITICAL, 0),
        "in_flight_ordinary": admission.inflight.get(Priority.ORDINARY, 0),
        "waiting_critical": admission.waiting.get(Priority.CRITICAL, 0),
        "waiting_ordinary": admission.waiting.get(Priority.ORDINARY, 0),
        "min_rtt_ms": min_rtt,
        "fallen": limit.fallen,
        "retry_tokens": None if budget is None else round(budget.balance, 2),
    }


def limit_figures(
    admission: AdmissionView | None, budget: BudgetView | None, fixed_limit: int
) -> dict[str, Any]:
    """This replica's POST turn (issue 42) as the page shows it: the limit and its ceiling,
    whether it fell sharply and has not recovered, POSTs in flight and waiting per lane class,
    the minimum round trip (None before any answer) and the retry tokens. With `admission`
    None (post_limit = fixed) the limit is the fixed figure and there are no permits to count.
    Read live from this process at each refresh; every replica's (as of its last report) is in
    its report's `limit` (`report_limit`), which the page's fleet table and `relay status`
    show."""
    tokens = None if budget is None else budget.balance
    if admission is None:
        return {
            "mode": "fixed", "limit": fixed_limit, "ceiling": fixed_limit, "fallen": False,
            "inflight": None, "waiting": None, "min_rtt_seconds": None, "retry_tokens": tokens,
        }  # fmt: skip
    limit = admission.limit
    return {
        "mode": "adaptive",
        "limit": limit.allowed,
        "ceiling": limit.ceiling,
        "fallen": limit.fallen,
        "inflight": {p.value: n for p, n in admission.inflight.items()},
        "waiting": {p.value: n for p, n in admission.waiting.items()},
        "min_rtt_seconds": limit.min_rtt,
        "retry_tokens": tokens,
    }


def claimed_by_class(lanes: Iterable[LaneView]) -> dict[str, int]:
    """This replica's runs claimed by class since it started, both lanes together (issue 50
    item 4): `targeted` terminals (signalled as they commit), `finished` runs (a pending
    terminal found by discovery), `due` (the rest); what `claimed_runs_by_class_total` counts
    per lane."""
    out = dict.fromkeys(CLASSES, 0)
    for lane in lanes:
        for name, n in lane.stats.by_class.items():
            out[name] = out.get(name, 0) + n
    return out


def backlog_figures(backlog: Backlog | None, held_events: Any, now: float) -> dict[str, Any]:
    """`lanes`, `keys` and `blocked` shaped as `relay status --json` shapes them (each row of
    `lanes` with its class), from the backlog gauges' last refresh instead of a pass over the
    pending events per page view: exact as of `backlog_age_seconds` ago (None, and every
    figure None, before the first refresh; `keys` empty then)."""
    rows = {r[0]: r for r in backlog.rows} if backlog is not None else {}

    def of(lane: str) -> tuple[int | None, int | None, float | None]:
        row = rows.get(lane)
        if row is None:
            return (0, 0, 0.0) if backlog is not None else (None, None, None)
        return row[1], row[2], row[3]

    lanes = []
    for lane in LANES:  # backlog()'s names for its rows, each with the class it counts
        runs, events, oldest = of(lane)
        lanes.append(
            {"class": backlog_class(lane), "lane": lane, "runs": runs, "events": events,
             "oldest_pending_age_seconds": oldest}
        )  # fmt: skip
    runs, events, oldest = of("blocked")
    blocked = {
        "runs": runs,
        "events": events,
        "oldest_failure_age_seconds": oldest,
        "held_events": held_events,
    }
    keys = [{"key": k, "runs": n} for k, n in backlog.keys] if backlog is not None else []
    age = None if backlog is None else max(0.0, now - backlog.at)
    return {"lanes": lanes, "keys": keys, "blocked": blocked, "backlog_age_seconds": age}


def _worst(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


# A report is another process's claim about itself: the database checks its shape when it is
# written (`report_problem`), and these read it as if it had not, so a row from before that
# check (or written by hand) is shown as text and never breaks the page.


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _count(value: Any) -> int:
    """A counter of a report: a non-negative integer, else 0."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return value if ok else 0


def _seconds(value: Any) -> float | None:
    """A lag of a report: non-negative finite seconds, else unknown."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok and 0 <= value < math.inf else None


def _fresh_lanes(reports: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The `lanes` part of every fresh report."""
    out = []
    for entry in reports.values():
        entry = _obj(entry)
        if not entry.get("stale"):
            out.append(_obj(_obj(entry.get("report")).get("lanes")))
    return out


def _lag(reports: Mapping[str, Any]) -> dict[str, dict[str, float | None]]:
    """Per lane the worst fresh report's lag p50/p99."""
    fresh = _fresh_lanes(reports)
    lag = {}
    for lane in LANES:
        lanes = [_obj(rep.get(lane)) for rep in fresh]
        lag[lane] = {q: _worst(_seconds(x.get(f"lag_{q}")) for x in lanes) for q in ("p50", "p99")}
    return lag


def _post_limit(limit: Any) -> str | None:
    """A replica's POST limit as the fleet table shows it, `7/36` or `7/36 (fallen)`, from the
    `limit` status_figures() gives each replica (its valid report of the last two minutes):
    None without one (post_limit = fixed, a relay before issue 42, no fresh report)."""
    limit = _obj(limit)
    if not limit:
        return None
    allowed, ceiling = limit.get("limit"), limit.get("ceiling")
    if not (isinstance(allowed, int) and isinstance(ceiling, int)):
        return None
    return f"{allowed}/{ceiling}" + (" (fallen)" if limit.get("fallen") is True else "")


def _fleet_row(
    owner: str, lease: dict[str, Any], replica: dict[str, Any], entry: Any
) -> dict[str, Any]:
    rep = _obj(entry)
    body = _obj(rep.get("report"))
    lanes = [_obj(v) for v in _obj(body.get("lanes")).values()]
    ingress = body.get("ingress")
    problem = rep.get("problem")
    return {
        "owner": owner,
        "alive": replica.get("alive"),
        "runs_held": lease.get("runs", 0),
        "next_expiry": lease.get("next_expiry"),
        # None (shown "-") without a valid report: no figure is made up for a rejected one
        "renewals": sum(_count(v.get("renewals")) for v in lanes) if body else None,
        "delivered": sum(_count(v.get("delivered")) for v in lanes) if body else None,
        "ingress": ingress if ingress in INGRESS_STATES and not rep.get("stale") else None,
        "post_limit": _post_limit(replica.get("limit")),
        "report_problem": str(problem) if problem is not None else None,
        "seen_age_seconds": _seconds(rep.get("age_seconds")),
        "stale": bool(rep.get("stale")) if rep else None,
    }


def shape_status(
    doc: dict[str, Any], series: RateSeries, now: float, replica_id: str
) -> dict[str, Any]:
    """`ui_status()`'s document plus what the page adds: the rate series (this process), per
    lane the worst replica's lag p50/p99 (percentiles of different replicas cannot be merged;
    the worst is an upper bound), and one row per replica merging liveness, leases and report.
    Never raises on what a report holds."""
    reports = _obj(doc.get("reports"))
    leases = {x["owner"]: x for x in doc.get("leases") or []}
    replicas = {x["owner"]: x for x in doc.get("replicas") or []}
    rows = []
    for owner in sorted(set(leases) | set(replicas) | set(reports)):
        replica = _obj(replicas.get(owner))
        row = _fleet_row(owner, leases.get(owner) or {}, replica, reports.get(owner))
        rows.append({**row, "this": owner == replica_id})
    rate = series.latest()
    return {
        **doc,
        "replica_id": replica_id,
        "rates": {lane: rate.get(lane, 0.0) for lane in LANES},
        "series": series.series(now),
        "lag": _lag(reports),
        "fleet": rows,
    }
