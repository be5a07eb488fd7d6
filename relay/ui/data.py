"""The status page's database side and the pure shaping of what it reads.

Per refresh of the page the data layer sends one statement (`ui_status()`), and per run page
one (`ui_run()`); each goes through `Store.query`, so it runs in its own transaction with the
relay's statement and lock timeouts and under the store's application deadline. `queries`
counts them (the docs state the number, tests/test_ui.py measures it). The replica report
(`report_replica()`) is the third, sent by the health probe loop every refresh interval whether
or not anyone looks at the page; its answer feeds the rate series.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import orjson
from psycopg import sql

from relay.ui.series import LANES, RateSeries

if TYPE_CHECKING:
    from relay.lane import LaneView

Query = Callable[[sql.Composed, Sequence[Any]], Awaitable[list[tuple[Any, ...]]]]

BLOCKED_PAGE = 50  # blocked runs per page
RUN_EVENTS_PAGE = 200  # events per run page
REPORT_TTL = 120.0  # seconds after which a replica's report shows as stale
RECOVERING_FOR = 60.0  # seconds an ingress counts as "recovering" after it was misconfigured


class Data:
    def __init__(self, query: Query, schema: str) -> None:
        self._query = query
        self.queries = 0  # statements sent for pages (tests and docs: queries per refresh)
        self.reports = 0  # report statements sent (the probe loop's, one per refresh interval)
        s = sql.Identifier(schema)
        self._status = sql.SQL("select {}.ui_status(%s, %s, %s)::text").format(s)
        self._run = sql.SQL("select {}.ui_run(%s, %s, %s)::text").format(s)
        self._report = sql.SQL("select {}.report_replica(%s, %s::jsonb, %s)::text").format(s)

    async def _one(self, query: sql.Composed, params: Sequence[Any]) -> Any:
        if query is self._report:
            self.reports += 1
        else:
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
        counts: dict[str, dict[str, int]] = await self._one(
            self._report, (owner, orjson.dumps(report).decode(), REPORT_TTL)
        )
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
    lanes: Iterable[LaneView], ingress: str, lag: Mapping[str, Mapping[str, float | None]]
) -> dict[str, Any]:
    """This replica's report: per lane its cumulative counters, in flight, and lag p50/p99 of
    the last 15 minutes; its ingress health. Counters only: no ids, no payloads."""
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
        }
    return {"lanes": out, "ingress": ingress}


def _worst(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def shape_status(
    doc: dict[str, Any], series: RateSeries, now: float, replica_id: str
) -> dict[str, Any]:
    """`ui_status()`'s document plus what the page adds: the rate series (this process), per
    lane the worst replica's lag p50/p99 (percentiles of different replicas cannot be merged;
    the worst is an upper bound), and one row per replica merging liveness, leases and report."""
    reports: dict[str, Any] = doc.get("reports") or {}
    fresh = [r["report"] for r in reports.values() if not r.get("stale") and r.get("report")]
    lag = {}
    for lane in LANES:
        lanes = [rep.get("lanes", {}).get(lane, {}) for rep in fresh]
        lag[lane] = {
            "p50": _worst(x.get("lag_p50") for x in lanes),
            "p99": _worst(x.get("lag_p99") for x in lanes),
        }
    leases = {x["owner"]: x for x in doc.get("leases") or []}
    alive = {x["owner"]: x for x in doc.get("replicas") or []}
    rows = []
    for owner in sorted(set(leases) | set(alive) | set(reports)):
        rep = reports.get(owner) or {}
        body = rep.get("report") or {}
        lanes_rep = body.get("lanes") or {}
        rows.append(
            {
                "owner": owner,
                "this": owner == replica_id,
                "alive": (alive.get(owner) or {}).get("alive"),
                "runs_held": (leases.get(owner) or {}).get("runs", 0),
                "next_expiry": (leases.get(owner) or {}).get("next_expiry"),
                "renewals": sum(int(v.get("renewals") or 0) for v in lanes_rep.values()),
                "delivered": sum(int(v.get("delivered") or 0) for v in lanes_rep.values()),
                "ingress": body.get("ingress") if rep and not rep.get("stale") else None,
                "seen_age_seconds": rep.get("age_seconds"),
                "stale": bool(rep.get("stale")) if rep else None,
            }
        )
    rate = series.latest()
    return {
        **doc,
        "replica_id": replica_id,
        "rates": {lane: rate.get(lane, 0.0) for lane in LANES},
        "series": series.series(now),
        "lag": lag,
        "fleet": rows,
    }
