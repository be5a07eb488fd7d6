"""Metrics (DESIGN §8.2): names and labels, the backlog SQL function, and a real scrape of a
running relay over a real socket."""

from __future__ import annotations

import itertools
import re
from typing import Any

import httpx
import psycopg
import pytest
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from relay.admission.limit import Limit, Sample, Signal
from relay.admission.permits import Admission, AdmissionView, Priority
from relay.admission.retry_budget import BudgetView
from relay.delivery.lane import LaneStats, LaneView
from relay.edges.store import AckResult
from relay.runner import Relay
from relay.serving import metrics
from relay.serving.health import refresh_interval
from relay.serving.metrics import Metrics, status_class, type_labels
from relay.serving.progress import ListenerView
from relay.tools.sink import Sink
from tests.support import bulk_backlog, count, q, scans, settings, wait_for
from tests.test_relay import enqueue_runs

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def get(port: int, path: str) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.get(f"http://127.0.0.1:{port}{path}", timeout=10)


async def scrape(port: int) -> Samples:
    resp = await get(port, "/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    return parse(resp.text)


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lb), v in samples.items() if n == name and want <= set(lb))


def relay_port(r: Relay) -> int:
    assert r.endpoints is not None
    return r.endpoints.port


# -- pure -----------------------------------------------------------------------------------


def test_status_classes() -> None:
    assert [status_class(s) for s in (200, 204, 301, 409, 422, 503)] == [
        "2xx",
        "2xx",
        "3xx",
        "4xx",
        "4xx",
        "5xx",
    ]
    assert status_class(None) == "error"
    assert status_class(42) == "error"


def test_event_type_labels_are_capped_and_stable() -> None:
    by_type = {f"t{i:03}": 1 for i in range(100)}
    labels = type_labels(by_type, limit=10)
    assert len(labels) == 11 and labels["other"] == 90
    assert sorted(k for k in labels if k != "other") == [f"t{i:03}" for i in range(10)]
    assert type_labels({"a": 2}) == {"a": 2}


def test_every_metric_has_the_prefix_and_a_help_text() -> None:
    m = Metrics()
    body, content_type = m.exposition()
    assert content_type.startswith("text/plain")
    families = list(text_string_to_metric_families(body.decode()))
    assert families
    for family in families:
        # Ours, and prometheus-client's standard process/platform/gc collectors (issue 15).
        assert family.name.startswith(("ledger_relay_", "process_", "python_")), family.name
        assert family.documentation
    names = {f.name for f in families}
    # Counters end in _total, durations in _seconds (Prometheus naming rules).
    assert {
        "ledger_relay_delivered_events",
        "ledger_relay_leases_lost",
        "ledger_relay_runs_blocked",
        "ledger_relay_ingress_requests",
        "ledger_relay_listen_reconnects",
        "ledger_relay_delivery_lag_seconds",
        "ledger_relay_ingress_request_duration_seconds",
        "ledger_relay_backlog_events",
        "ledger_relay_oldest_pending_age_seconds",
        "ledger_relay_blocked_runs",
    } <= names
    samples = parse(body.decode())
    assert ("ledger_relay_leases_lost_total", ()) not in samples  # no lanes yet: no series
    assert ("ledger_relay_listen_reconnects_total", ()) in samples


def test_the_backlog_by_key_has_a_bounded_label_set() -> None:
    """Issue 50 item 4: one series per key of backlog_by_key's rows (the top keys, the rest as
    `(other)`, the default key as `(default)`); a key that left the top loses its series."""
    m = Metrics()
    m.set_backlog_keys([("tenant-a", 7), ("", 3), (None, 2)])
    samples = parse(m.exposition()[0].decode())
    series = {k: v for k, v in samples.items() if k[0] == "ledger_relay_backlog_key_runs"}
    assert series == {
        ("ledger_relay_backlog_key_runs", (("key", "tenant-a"),)): 7,
        ("ledger_relay_backlog_key_runs", (("key", "(default)"),)): 3,
        ("ledger_relay_backlog_key_runs", (("key", "(other)"),)): 2,
    }
    m.set_backlog_keys([("tenant-b", 1)])
    samples = parse(m.exposition()[0].decode())
    series = {k: v for k, v in samples.items() if k[0] == "ledger_relay_backlog_key_runs"}
    assert series == {("ledger_relay_backlog_key_runs", (("key", "tenant-b"),)): 1}


def test_every_metric_of_the_table_is_exported_with_its_type_help_and_labels() -> None:
    """The metric definitions are data (relay/serving/metrics.py): each one is in a scrape as
    written there, and no family of ours is in the scrape that the table does not hold."""
    kinds: dict[type, str] = {Counter: "counter", Gauge: "gauge", Histogram: "histogram"}
    kinds |= {CounterMetricFamily: "counter", GaugeMetricFamily: "gauge"}
    table: dict[metrics.Instrument[Any] | metrics.Family, tuple[str, ...]] = {
        v: v.labels for v in vars(metrics).values() if isinstance(v, metrics.Instrument)
    }
    table |= {metrics.DELIVERED: ("lane", "type"), metrics.MISCONFIGURED: ()}
    table |= {metrics.CLAIMED_BY_CLASS: ("lane", "class")}
    table |= {v: ("lane",) for v in metrics.PER_LANE}
    table |= {v: () for v in metrics.OF_LISTENER}
    table |= {metrics.POST_LIMIT: (), metrics.POST_LIMIT_CEILING: (), metrics.POST_MIN_RTT: ()}
    table |= {metrics.POSTS_IN_FLIGHT: ("class",), metrics.POSTS_WAITING: ("class",)}
    table |= {metrics.RETRY_BUDGET_TOKENS: ()}
    stats = LaneStats(by_type={"step": 1}, by_class={"due": 1})
    lanes = [LaneView("ordinary", stats, 0, 0, 0.0, False)]
    m = Metrics(
        views=lambda: lanes,
        admission=lambda: admission_view(min_rtt=0.04),
        retry_budget=lambda: BudgetView(balance=10.0, retrying=0),
    )
    m.requests.labels("ordinary", "2xx").inc()
    for gauge in (m.backlog_events, m.backlog_runs, m.oldest_pending):
        gauge.labels("due", "ordinary").set(1)
    m.backlog_key_runs.labels("tenant").set(1)
    families = {
        f.name: f
        for f in text_string_to_metric_families(m.exposition()[0].decode())
        if f.name.startswith("ledger_relay_") and not f.name.endswith("_created")
    }
    assert sorted(families) == sorted(metrics.PREFIX + v.name for v in table)
    for v, labels in table.items():
        family = families[metrics.PREFIX + v.name]
        assert (family.type, family.documentation) == (kinds[v.kind], v.help), v.name
        assert {k for s in family.samples for k in s.labels} - {"le"} == set(labels), v.name
        buckets = {float(s.labels["le"]) for s in family.samples if "le" in s.labels}
        want = set(v.buckets) | {float("inf")} if isinstance(v, metrics.Instrument) else set()
        assert buckets == (want if v.kind is Histogram else set()), v.name


def test_the_collector_reads_the_views_it_was_given_and_the_observers_count() -> None:
    stats = LaneStats(
        claims=2, claimed_runs=3, ack_groups=6, lease_lost=1, failed=2, retries=4,
        by_type={"step": 5}, by_class={"targeted": 1, "finished": 7, "due": 8},
    )  # fmt: skip
    lanes = [LaneView("ordinary", stats, inflight=2, turns=9, turned_at=1.0, misconfigured=False)]
    listener = ListenerView(up=True, reconnects=3, received=7)
    m = Metrics(views=lambda: lanes, listener_view=lambda: listener)
    request, ack = m.request_observer("critical"), m.ack_observer("critical")
    request(200, 0.01)
    request(503, 0.02)
    request(None, 5.0)  # no answer
    ack(AckResult("r", "acked", acked=2, last_seq=2, lag_seconds=0.3, error=None))
    ack(AckResult("r", "stale", acked=0, last_seq=None, lag_seconds=None, error=None))
    samples = parse(m.exposition()[0].decode())
    assert total(samples, "ledger_relay_delivered_events_total", lane="ordinary", type="step") == 5
    assert total(samples, "ledger_relay_claimed_runs_total", lane="ordinary") == 3
    assert total(samples, "ledger_relay_claims_total", lane="ordinary") == 2
    assert total(samples, "ledger_relay_claimed_runs_by_class_total", lane="ordinary") == 16
    assert (
        total(
            samples,
            "ledger_relay_claimed_runs_by_class_total",
            lane="ordinary",
            **{"class": "finished"},
        )
        == 7
    )
    assert total(samples, "ledger_relay_ack_groups_total", lane="ordinary") == 6
    assert total(samples, "ledger_relay_leases_lost_total", lane="ordinary") == 1
    assert total(samples, "ledger_relay_runs_blocked_total", lane="ordinary") == 2
    assert total(samples, "ledger_relay_retries_scheduled_total", lane="ordinary") == 4
    assert total(samples, "ledger_relay_inflight_runs", lane="ordinary") == 2
    assert total(samples, "ledger_relay_listen_up") == 1
    assert (
        total(samples, "ledger_relay_listen_reconnects_total") == 2
    )  # the first connect is no re-
    assert total(samples, "ledger_relay_notifications_received_total") == 7
    for status_class_, n in (("2xx", 1), ("5xx", 1), ("error", 1)):
        got = total(samples, "ledger_relay_ingress_requests_total", status_class=status_class_)
        assert got == n, status_class_
    duration = "ledger_relay_ingress_request_duration_seconds"
    assert total(samples, duration + "_count", lane="critical") == 3
    assert total(samples, duration + "_sum", lane="critical") == pytest.approx(5.03)
    assert total(samples, "ledger_relay_delivery_lag_seconds_count", lane="critical") == 1
    assert total(samples, "ledger_relay_delivery_lag_seconds_sum", lane="critical") == 0.3
    lanes.clear()  # read at each scrape, never kept
    samples = parse(m.exposition()[0].decode())
    assert ("ledger_relay_leases_lost_total", (("lane", "ordinary"),)) not in samples


def admission_view(*, min_rtt: float | None) -> AdmissionView:
    """A real admission's view at ceiling 36 and its initial limit, 4: 1 critical and 3
    ordinary POSTs in flight, 1 ordinary waiting; with `min_rtt`, one answer seen."""
    admission = Admission(Limit(36), max_reserve=4)
    critical = admission.try_acquire(Priority.CRITICAL, 0.0)
    for _ in range(3):
        assert admission.try_acquire(Priority.ORDINARY, 0.0) is not None
    assert critical is not None and admission.try_acquire(Priority.ORDINARY, 0.0) is None
    admission.wait(Priority.ORDINARY)
    if min_rtt is not None:
        admission.answered(critical, Sample(min_rtt, Signal.ANSWERED), min_rtt)
    return admission.view(1.0)


def test_the_post_turn_is_read_from_the_admission_and_budget_views() -> None:
    lanes = [LaneView("critical", LaneStats(deferred=3), 0, 0, 0.0, False)]
    view = admission_view(min_rtt=0.04)
    m = Metrics(
        views=lambda: lanes,
        admission=lambda: view,
        retry_budget=lambda: BudgetView(balance=9.5, retrying=1),
        fixed_limit=99,  # not read: the adaptive limit is there
    )
    samples = parse(m.exposition()[0].decode())
    assert total(samples, "ledger_relay_post_limit") == 4
    assert total(samples, "ledger_relay_post_limit_ceiling") == 36
    assert total(samples, "ledger_relay_posts_in_flight", **{"class": "critical"}) == 1
    assert total(samples, "ledger_relay_posts_in_flight", **{"class": "ordinary"}) == 3
    assert total(samples, "ledger_relay_posts_waiting", **{"class": "critical"}) == 0
    assert total(samples, "ledger_relay_posts_waiting", **{"class": "ordinary"}) == 1
    assert total(samples, "ledger_relay_post_min_rtt_seconds") == pytest.approx(0.04)
    assert total(samples, "ledger_relay_retry_budget_tokens") == 9.5
    assert total(samples, "ledger_relay_retries_deferred_total", lane="critical") == 3
    # Before any answer the minimum round trip is absent, not 0 or NaN.
    view = admission_view(min_rtt=None)
    samples = parse(m.exposition()[0].decode())
    assert not [k for k in samples if k[0] == "ledger_relay_post_min_rtt_seconds"]


def test_under_the_fixed_limit_the_fixed_figure_is_the_limit_and_no_permits_are_exported() -> None:
    m = Metrics(admission=lambda: None, fixed_limit=36)
    samples = parse(m.exposition()[0].decode())
    assert total(samples, "ledger_relay_post_limit") == 36
    assert total(samples, "ledger_relay_post_limit_ceiling") == 36
    absent = ("posts_in_flight", "posts_waiting", "post_min_rtt_seconds", "retry_budget_tokens")
    assert not [k for k in samples if k[0] in {metrics.PREFIX + name for name in absent}]


# -- the backlog function ---------------------------------------------------------------------


def backlog_rows(conn: psycopg.Connection[Any], schema: str) -> dict[str, tuple[int, int, float]]:
    rows = conn.execute(q(schema, "select * from {s}.backlog()")).fetchall()
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


def test_backlog_function_counts_pending_work_per_lane(
    schema: str, conn: psycopg.Connection[Any]
) -> None:
    empty = backlog_rows(conn, schema)
    assert empty == {"blocked": (0, 0, 0.0), "critical": (0, 0, 0.0), "ordinary": (0, 0, 0.0)}

    bulk_backlog(conn, schema, 4, 5, prefix="o")
    enqueue_runs(conn, schema, 2, 3, prefix="t")  # each ends with a terminal event: critical
    # Block o4 behind a failed head (what fail_event leaves behind).
    conn.execute(
        q(schema, "insert into {s}.event_failures (run_id, seq, attempts) values ('o4', 1, 1)")
    )
    conn.execute(q(schema, "update {s}.runs set blocked_seq = 1 where run_id = 'o4'"))
    got = backlog_rows(conn, schema)
    assert got["critical"][:2] == (2, 6)
    assert got["ordinary"][:2] == (3, 15)
    assert got["blocked"][:2] == (1, 1)
    assert all(age > 0 for _, _, age in got.values())


def test_backlog_function_reads_the_active_runs_not_the_history(
    schema: str, conn: psycopg.Connection[Any]
) -> None:
    """Two probes of the outbox's primary key per active run (its last seq, and the event after
    its cursor) and nothing of the delivered history: no sequential scan of the outbox, nothing
    of run_seqs. (~75 ms at 20k active runs on this machine; issue 16's one-pass design over
    events_pending needed a per-event state that schema version 7 no longer writes.)"""
    bulk_backlog(conn, schema, 5000, 10, prefix="h")  # a delivered history: idle runs
    conn.execute(q(schema, "update {s}.runs set delivered_seq = 10, idle = true"))
    bulk_backlog(conn, schema, 300, 12, prefix="o")
    conn.execute(  # 10 delivered, 2 pending
        q(schema, "update {s}.runs set delivered_seq = 10 where run_id like 'o%%'")
    )
    conn.execute(q(schema, "analyze {s}.runs"))
    got, delta = scans(conn, schema, lambda: backlog_rows(conn, schema))
    assert got["ordinary"][:2] == (300, 600)
    assert delta["outbox"][0] == 0, delta  # no sequential scan of the events
    read = delta["outbox_pkey"][1]
    assert read <= 2 * 300, delta  # the head and the last event of each run, not its history
    assert not any(n for name, (n, _) in delta.items() if name.startswith("run_seqs")), delta


# -- a running relay --------------------------------------------------------------------------

pytestmark_anyio = pytest.mark.anyio


@pytestmark_anyio
async def test_scrape_of_a_running_relay(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    s, url = sink
    s.faults.fail(503, times=1)  # one transient answer, retried
    runs = enqueue_runs(conn, schema, 5, 3, prefix="m")  # run_created, step, step (terminal)
    cfg = settings(pg_url, schema, url, metrics_addr="127.0.0.1:0")
    async with Relay(cfg).running() as r:
        await wait_for(lambda: count(conn, schema, "state <> 'delivered'") == 0, what="acks")
        port = relay_port(r)
        samples = await scrape(port)
        acks = sum(lane.stats.acks for lane in r.lanes.values())
        posts = sum(lane.stats.posts for lane in r.lanes.values())
        claim_runs = cfg.claim_runs

    assert total(samples, "ledger_relay_delivered_events_total") == 15
    assert total(samples, "ledger_relay_delivered_events_total", type="run_created") == 5
    assert total(samples, "ledger_relay_delivered_events_total", type="step") == 10
    assert total(samples, "ledger_relay_delivery_lag_seconds_count") == acks
    assert total(samples, "ledger_relay_delivery_lag_seconds_sum") > 0
    assert total(samples, "ledger_relay_ingress_requests_total", status_class="5xx") == 1
    assert total(samples, "ledger_relay_ingress_requests_total", status_class="2xx") == posts - 1
    assert total(samples, "ledger_relay_ingress_request_duration_seconds_count") == posts
    assert total(samples, "ledger_relay_listen_up") == 1
    assert total(samples, "ledger_relay_listen_reconnects_total") == 0
    assert total(samples, "ledger_relay_leases_lost_total") == 0
    # Runs per claim and per ack group, as an operator reads them off the counters: every run
    # was taken by some claim statement (a claim that found nothing counts too), and acked in
    # some group.
    claims = total(samples, "ledger_relay_claims_total")
    assert 1 <= claims and total(samples, "ledger_relay_claimed_runs_total") <= claims * claim_runs
    groups = total(samples, "ledger_relay_ack_groups_total")
    assert 1 <= groups <= total(samples, "ledger_relay_delivery_lag_seconds_count") == acks
    # Ids never become labels: no run id or event id in any label value.
    ids = set(runs) | {f"{run}-{i}" for run in runs for i in range(3)}
    values = {v for (_, labels) in samples for _, v in labels}
    assert not values & ids, values & ids
    ours = [
        (name, labels)
        for (name, labels) in samples
        if name.startswith("ledger_relay_") and name != "ledger_relay_build_info"
    ]
    # No `database` label in the one-database form: its dashboards and alerts read as before
    # (a fleet's relays carry one, docs/sharding.md).
    assert {k for (_, labels) in ours for k, _ in labels} <= {
        "lane",
        "type",
        "status_class",
        "class",
        "le",
        "key",  # fairness keys, the top ones only (issue 50 item 4)
    }


@pytestmark_anyio
@pytest.mark.parametrize("post_limit", ["adaptive", "fixed"])
async def test_a_running_relay_exports_its_post_limit(
    pg_url: str,
    schema: str,
    conn: psycopg.Connection[Any],
    sink: tuple[Sink, str],
    post_limit: str,
) -> None:
    """The benchmark and the dashboards scrape `post_limit` whatever the setting."""
    _, url = sink
    enqueue_runs(conn, schema, 5, 3, prefix="p")
    cfg = settings(
        pg_url, schema, url, metrics_addr="127.0.0.1:0", post_limit=post_limit,
        concurrency=8, critical_concurrency=3,
    )  # fmt: skip
    async with Relay(cfg).running() as r:
        await wait_for(lambda: count(conn, schema, "state <> 'delivered'") == 0, what="acks")
        samples = await scrape(relay_port(r))
    ceiling = 8 + 3
    assert total(samples, "ledger_relay_post_limit_ceiling") == ceiling
    assert total(samples, "ledger_relay_retries_deferred_total") == 0
    for lane in ("critical", "ordinary"):
        assert ("ledger_relay_retries_deferred_total", (("lane", lane),)) in samples
    if post_limit == "fixed":
        assert total(samples, "ledger_relay_post_limit") == ceiling
        assert not [k for k in samples if k[0] == "ledger_relay_posts_in_flight"]
        assert total(samples, "ledger_relay_retry_budget_tokens") > 0
        return
    assert 2 <= total(samples, "ledger_relay_post_limit") <= ceiling
    for cls in ("critical", "ordinary"):  # every POST answered: no permit held or awaited
        assert samples[("ledger_relay_posts_in_flight", (("class", cls),))] == 0
        assert samples[("ledger_relay_posts_waiting", (("class", cls),))] == 0
    assert 0 < total(samples, "ledger_relay_post_min_rtt_seconds") < 60
    assert total(samples, "ledger_relay_retry_budget_tokens") > 0


@pytestmark_anyio
async def test_backlog_gauges_and_misconfigured_ingress(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    s, url = sink
    s.faults.set_default(401)  # endpoint misconfigured: the lane backs off, nothing fails
    enqueue_runs(conn, schema, 2, 2, prefix="g", terminal=False)
    cfg = settings(pg_url, schema, url, metrics_addr="127.0.0.1:0", max_backoff="0.5s")
    async with Relay(cfg).running() as r:
        port = relay_port(r)
        await wait_for(lambda: not r.health.ingress_ok, what="ingress reported misconfigured")
        ready = await get(port, "/readyz")
        assert ready.status_code == 503
        assert ready.json()["checks"]["ingress"] is False
        assert r.endpoints is not None
        await r.endpoints.probe()  # the background refresh, now rather than in a few seconds
        samples = await scrape(port)
        assert total(samples, "ledger_relay_backlog_events", lane="ordinary") == 4
        assert total(samples, "ledger_relay_backlog_runs", lane="ordinary") == 2
        assert total(samples, "ledger_relay_backlog_events", lane="critical") == 0
        assert total(samples, "ledger_relay_oldest_pending_age_seconds", lane="ordinary") > 0
        assert total(samples, "ledger_relay_ingress_requests_total", status_class="4xx") >= 1
        assert total(samples, "ledger_relay_ready") == 0
        assert count(conn, schema, "state = 'failed'") == 0

        s.faults.set_default(None)  # fixed: delivery resumes, readiness comes back
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 4, what="delivery")
        await wait_for(lambda: r.health.ingress_ok, what="ingress recovered")
        await r.endpoints.probe()
        ready = await get(port, "/readyz")
        assert ready.status_code == 200, ready.text
        samples = await scrape(port)
        assert total(samples, "ledger_relay_backlog_events") == 0
        assert total(samples, "ledger_relay_oldest_pending_age_seconds", lane="ordinary") == 0
        assert total(samples, "ledger_relay_ready") == 1
        assert total(samples, "ledger_relay_backlog_refresh_timestamp_seconds") > 0


@pytestmark_anyio
async def test_the_outbox_parts_age_is_exported_beside_the_retention(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    """Retention makes the outbox's next part current every retention / 2 (docs/storage.md); a
    rotation held back (producer transactions open past its wait) shows as the current part's
    age, exported with the backlog gauges beside the configured retention, which the
    LedgerRelayRetentionBehind alert compares it with. A rotation starts the age again."""
    _, url = sink
    conn.execute(
        q(schema, "update {s}.outbox_parts set opened_at = now() - interval '3 days' where current")
    )
    cfg = settings(pg_url, schema, url, metrics_addr="127.0.0.1:0", retention="1d")
    async with Relay(cfg, prune_interval=3600).running() as r:  # this test prunes, not the relay
        port = relay_port(r)
        assert r.endpoints is not None
        await r.endpoints.probe()
        samples = await scrape(port)
        assert total(samples, "ledger_relay_retention_seconds") == 86400
        assert total(samples, "ledger_relay_outbox_part_age_seconds") >= 3 * 86400
        conn.execute(q(schema, "select {s}.prune('1 day', 100)"))  # overdue: the parts rotate
        await r.endpoints.probe()
        samples = await scrape(port)
        assert 0 < total(samples, "ledger_relay_outbox_part_age_seconds") < 3600


@pytestmark_anyio
async def test_a_costly_backlog_refresh_spaces_out_the_next_ones(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    """`backlog()` reads every pending event: after a refresh that took 0.1 s the next waits
    20 times that (2 s), not the 1 s period, so the gauges never load the database much."""
    _, url = sink
    conn.execute(q(schema, "create table {s}.refreshes (at timestamptz not null)"))
    conn.execute(
        q(
            schema,
            "create or replace function {s}.backlog() returns table (lane text, runs bigint,"
            " events bigint, oldest_age_seconds double precision) language sql as $$"
            " insert into {s}.refreshes values (clock_timestamp()); select pg_sleep(0.1);"
            " select 'ordinary'::text, 0::bigint, 0::bigint, 0::float8 $$",
        )
    )

    def refreshes() -> list[Any]:
        return [r[0] for r in conn.execute(q(schema, "select at from {s}.refreshes order by at"))]

    cfg = settings(pg_url, schema, url, metrics_addr="127.0.0.1:0", poll_interval="0.2s")
    assert refresh_interval(cfg) == 1.0
    async with Relay(cfg).running():
        await wait_for(lambda: len(refreshes()) >= 4, what="four refreshes")
    at = refreshes()
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(at)]
    # 20 x 0.1 s = 2 s between the probes' starts; each insert above comes a variable moment
    # after its probe starts, so allow for that. The period alone gives ~1.1 s.
    assert min(gaps) >= 1.6, gaps


def test_label_names_match_prometheus_rules() -> None:
    body, _ = Metrics().exposition()
    for line in body.decode().splitlines():
        if line.startswith("#") or not line:
            continue
        assert re.match(r"^(ledger_relay|process|python)_[a-z_]+(\{.*\})? ", line), line


def test_a_fleets_scrape_labels_each_database_and_parses_as_openmetrics_too() -> None:
    """Issue 51 item 4: FleetMetrics merges the databases' families, one per name, each sample
    with its `database`; the strict OpenMetrics parser takes it (histograms included)."""
    from prometheus_client.openmetrics.parser import (
        text_string_to_metric_families as openmetrics_families,
    )

    from relay.serving.metrics import FleetMetrics

    a, b = Metrics(replica=False), Metrics(replica=False)
    a.request_observer("ordinary")(200, 0.01)
    b.request_observer("critical")(None, 0.2)
    a.set_backlog([("blocked", 2, 3, 60.0)])
    fleet = FleetMetrics(lambda: {"a": True, "b": False}, relays=lambda: {"a": a, "b": b})
    body, content_type = fleet.exposition("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    families = {f.name: f for f in openmetrics_families(body.decode())}
    requests = families["ledger_relay_ingress_requests"].samples
    assert {(s.labels["database"], s.labels["status_class"]) for s in requests} == {
        ("a", "2xx"),
        ("b", "error"),
    }
    lag = families["ledger_relay_delivery_lag_seconds"].samples
    assert {s.labels["database"] for s in lag} == {"a", "b"}
    # What is the replica's, once: no database label, and no per-database copy of it.
    assert all("database" not in s.labels for s in families["ledger_relay_build_info"].samples)
    assert [s.labels for s in families["ledger_relay_ready"].samples] == [{}]
    # Each database's gauges (its relay's probe refreshes them) carry its name too; b's probe
    # has not refreshed them yet: none (tests/test_fleet_ops.py).
    blocked = families["ledger_relay_blocked_runs"].samples
    assert {s.labels["database"]: s.value for s in blocked} == {"a": 2}
    samples = parse(fleet.exposition()[0].decode())
    assert total(samples, "ledger_relay_database_up", database="b") == 0
