"""Prometheus metrics (DESIGN §8.2), all named `ledger_relay_*`, served on `metrics_addr`.

Three sources, none of which puts an id in a label:
- counters the lanes and the listener already keep, read at scrape time from the snapshots
  (`LaneView`, `ListenerView`) that callables given at construction return, so the delivery
  path does no extra work for them;
- observations that need a value per decision, through observers the runner hands to each lane
  at construction: the commit-to-ack lag of each acknowledged batch (`ack_observer`, from the
  ack's own result, database clock) and each ingress request's status class and duration
  (`request_observer`, called by the lane's IngressClient wherever a POST is sent);
- gauges of the database's backlog, refreshed by a background task (`health.DatabaseProbe`) from
  the `backlog()` SQL function, never inside a scrape;
- the POST turn's adaptive limit, its permits per lane and the retry budget (issue 42), read at
  scrape time from the `AdmissionView` and `BudgetView` that callables given at construction
  return, as the lanes' counters are.

Each Relay has its own registry, so several relays in one process (tests, embedding apps)
never collide in the global one.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from relay import __version__
from relay.core.classes import backlog_class
from relay.edges.ingress import RequestObserver
from relay.edges.store import AckResult
from relay.serving import build
from relay.serving.progress import ListenerView
from relay.serving.ui.series import LagWindow

if TYPE_CHECKING:
    from relay.admission.permits import AdmissionView
    from relay.admission.retry_budget import BudgetView
    from relay.delivery.lane import LaneView

LaneViews = Callable[[], Iterable["LaneView"]]
InstrumentT = TypeVar("InstrumentT", Counter, Gauge, Histogram)
ViewT = TypeVar("ViewT")  # what a scraped metric is read from: a lane's view, the listener's

PREFIX = "ledger_relay_"
LANES = ("critical", "ordinary")
# Event types are a producer's vocabulary (a handful of names), so they are a label; a producer
# that put ids in event_type would blow up the series count, so past this many distinct types
# per lane the rest are counted as "other" (the logs still carry the real type).
MAX_TYPES = 64
LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
HTTP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


def status_class(status: int | None) -> str:
    """'2xx' .. '5xx' for an HTTP answer, 'error' for no answer (timeout, connection error)."""
    if status is None or not 100 <= status <= 599:
        return "error"
    return f"{status // 100}xx"


def type_labels(by_type: Mapping[str, int], limit: int = MAX_TYPES) -> dict[str, int]:
    """Counts per event type with at most `limit` distinct labels; the rest fold into 'other'.
    Which types keep their own label is stable (sorted names), so a series never changes
    meaning between scrapes once the limit is reached."""
    names = sorted(by_type)
    out = {name: by_type[name] for name in names[:limit]}
    rest = sum(by_type[name] for name in names[limit:])
    if rest:
        out["other"] = out.get("other", 0) + rest
    return out


@dataclass(frozen=True, slots=True)
class Instrument(Generic[InstrumentT]):
    """A metric the relay updates itself, as it is exported: kind, name (after the prefix), help
    text, label names and, for a histogram, its buckets."""

    kind: type[InstrumentT]
    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    def make(self, registry: CollectorRegistry | None) -> InstrumentT:
        extra: dict[str, Any] = {"buckets": self.buckets} if self.buckets else {}
        return self.kind(PREFIX + self.name, self.help, self.labels, registry=registry, **extra)


@dataclass(frozen=True, slots=True)
class Family:
    """A metric built afresh at each scrape, as it is exported: kind, name (after the prefix)
    and help text."""

    kind: type[CounterMetricFamily | GaugeMetricFamily]
    name: str
    help: str

    def make(self, labels: Sequence[str] = ()) -> CounterMetricFamily | GaugeMetricFamily:
        return self.kind(PREFIX + self.name, self.help, labels=labels)


@dataclass(frozen=True, slots=True)
class Scraped(Family, Generic[ViewT]):
    """A family with one value per view it is read from: a lane's (labelled by lane), or the
    listener's."""

    value: Callable[[ViewT], float]


# -- what is exported: the instruments the relay updates, then what a scrape reads --------------

LAG = Instrument(
    Histogram,
    "delivery_lag_seconds",
    "Commit-to-ack lag of the oldest event of each acknowledged batch (database clock).",
    ("lane",),
    LAG_BUCKETS,
)
REQUESTS = Instrument(
    Counter,
    "ingress_requests",
    "POSTs to the ingress by HTTP status class ('error': no answer).",
    ("lane", "status_class"),
)
REQUEST_SECONDS = Instrument(
    Histogram,
    "ingress_request_duration_seconds",
    "Duration of POSTs to the ingress, answered or not.",
    ("lane",),
    HTTP_BUCKETS,
)
# The backlog by class (issue 50 item 4): `finished` runs (a terminal event pending) and `due` runs
# (the rest), as the claim counters name them. `lane` is the class's name before issue 50, when
# finished runs went to the critical lane (`critical` = finished, `ordinary` = due): kept on the
# same series for one release so that rules and dashboards reading it keep working, deprecated
# (docs/operations.md §7), removed in the next.
BACKLOG_LABELS = ("class", "lane")
BACKLOG_EVENTS = Instrument(
    Gauge,
    "backlog_events",
    "Pending events of runs that are not blocked, by class: finished (a terminal event"
    " pending), due (the rest); whole database. `lane` is deprecated (critical = finished).",
    BACKLOG_LABELS,
)
BACKLOG_RUNS = Instrument(
    Gauge,
    "backlog_runs",
    "Runs with pending events that are not blocked, by class: finished (a terminal event"
    " pending), due (the rest); whole database. `lane` is deprecated (critical = finished).",
    BACKLOG_LABELS,
)
BACKLOG_KEY_RUNS = Instrument(
    Gauge,
    "backlog_key_runs",
    "Runs with pending events that are not blocked, by fairness key: the keys with the most"
    ' only (BACKLOG_KEYS), the rest as key="(other)", the default key as "(default)".',
    ("key",),
)
# How many fairness keys have a series of their own in backlog_key_runs: a bounded label set
# however many keys there are (docs/operations.md, "Fairness keys").
BACKLOG_KEYS = 10
OLDEST_PENDING = Instrument(
    Gauge,
    "oldest_pending_age_seconds",
    "Age of the oldest pending event of an unblocked run, by class: finished (a terminal event"
    " pending), due (the rest); database clock. `lane` is deprecated (critical = finished).",
    BACKLOG_LABELS,
)
BLOCKED_RUNS = Instrument(
    Gauge,
    "blocked_runs",
    "Runs blocked behind a failed event, waiting for an operator (whole database).",
)
FAILED_EVENTS = Instrument(
    Gauge,
    "failed_events",
    "Failed events waiting for an operator to retry or skip them (whole database).",
)
OLDEST_FAILED = Instrument(
    Gauge,
    "oldest_failed_age_seconds",
    "Age of the oldest failed event (database clock); 0 when none.",
)
BACKLOG_REFRESHED = Instrument(
    Gauge,
    "backlog_refresh_timestamp_seconds",
    "Unix time of the last successful refresh of the backlog gauges.",
)
OUTBOX_PART_AGE = Instrument(
    Gauge,
    "outbox_part_age_seconds",
    "How long the outbox's current part has taken new events (database clock): retention"
    " rotates the parts every retention / 2, so past the retention rotations are held back.",
)
RETENTION = Instrument(
    Gauge,
    "retention_seconds",
    "The configured retention of delivered events (RELAY_RETENTION).",
)
READY = Instrument(Gauge, "ready", "1 while /readyz answers 200.")
PROBE_FAILURES = Instrument(
    Counter,
    "database_probe_failures",
    "Background database probes (behind /readyz) that failed or ran out of time.",
)
# What runs where: the version and the commit as labels of a constant 1 (join them onto any
# series): a rollout shows as two versions, or two commits of one (relay/serving/build.py).
BUILD_INFO = Instrument(
    Gauge,
    "build_info",
    "The relay's version, the commit it was built from ('unknown' if not known) and Python's"
    " version, as labels; always 1.",
    ("version", "commit", "python"),
)

DELIVERED = Family(
    CounterMetricFamily,
    "delivered_events",
    "Events acknowledged after the ingress accepted them, by lane and event type.",
)
PER_LANE: tuple[Scraped[LaneView], ...] = (
    Scraped(
        CounterMetricFamily,
        "leases_lost",
        "Batches abandoned because their lease was lost (renewal failed or the ack was "
        "fenced); each one is delivered again by the new owner.",
        lambda lane: lane.stats.lease_lost,
    ),
    Scraped(
        CounterMetricFamily,
        "runs_blocked",
        "Runs this process blocked: an event was rejected as poison or its engine wake failed.",
        lambda lane: lane.stats.failed,
    ),
    Scraped(
        CounterMetricFamily,
        "retries_scheduled",
        "Batches handed back with a backoff after a transient ingress failure.",
        lambda lane: lane.stats.retries,
    ),
    Scraped(
        CounterMetricFamily,
        "retries_deferred",
        "Retries the retry budget held back: each waits in the outbox for a later claim.",
        lambda lane: lane.stats.deferred,
    ),
    Scraped(
        CounterMetricFamily,
        "claimed_runs",
        "Run prefixes claimed under a lease.",
        lambda lane: lane.stats.claimed_runs,
    ),
    Scraped(
        CounterMetricFamily,
        "claims",
        "Claim statements run; claimed_runs / claims is the runs per claim (at most "
        "claim_runs; fewer when the lane's byte budget or its room is the bound).",
        lambda lane: lane.stats.claims,
    ),
    Scraped(
        CounterMetricFamily,
        "ack_groups",
        "Ack statements committed, each acknowledging a group of runs in one transaction; "
        "delivery_lag_seconds_count / ack_groups is the runs per group.",
        lambda lane: lane.stats.ack_groups,
    ),
    Scraped(
        CounterMetricFamily,
        "leases_reclaimed",
        "Runs claimed before their lease expired because its owner was dead (its liveness "
        "lock was free).",
        lambda lane: lane.stats.reclaimed,
    ),
    Scraped(
        GaugeMetricFamily,
        "inflight_runs",
        "Claims held by this process right now.",
        lambda lane: lane.inflight,
    ),
)
OF_LISTENER: tuple[Scraped[ListenerView], ...] = (
    Scraped(
        CounterMetricFamily,
        "listen_reconnects",
        "Times the LISTEN connection was re-established after it was lost.",
        # `reconnects` counts every successful connect, the first one included.
        lambda listener: max(0, listener.reconnects - 1),
    ),
    Scraped(
        GaugeMetricFamily,
        "listen_up",
        "1 while the LISTEN connection is established.",
        lambda listener: 1.0 if listener.up else 0.0,
    ),
    Scraped(
        CounterMetricFamily,
        "notifications_received",
        "Notifications received on the LISTEN connection.",
        lambda listener: listener.received,
    ),
)
MISCONFIGURED = Family(
    GaugeMetricFamily,
    "ingress_misconfigured",
    "1 while the ingress answers 'misconfigured' (401/403/404/410/3xx) and lanes pause.",
)

# The POST turn (issue 42, docs/admission.md). Under `post_limit = fixed` there is no limit to
# read, but dashboards and the benchmark plot `post_limit` whatever the setting, so the fixed
# figure (both lanes' slots) is exported as the limit and its ceiling. The permits' gauges are
# absent then: a lane's own in-flight count (`inflight_runs`) is claims, not POSTs, and passing
# it off as POSTs would make the two settings' figures look comparable when they are not.
POST_LIMIT = Family(
    GaugeMetricFamily,
    "post_limit",
    "POSTs in flight to the ingress the adaptive limit allows now, both lanes together "
    "(post_limit = fixed: concurrency + critical_concurrency).",
)
POST_LIMIT_CEILING = Family(
    GaugeMetricFamily,
    "post_limit_ceiling",
    "The most the adaptive limit may allow: concurrency + critical_concurrency.",
)
POSTS_IN_FLIGHT = Family(
    GaugeMetricFamily,
    "posts_in_flight",
    "POSTs holding a permit of the adaptive limit, by lane class (absent with post_limit = fixed).",
)
POSTS_WAITING = Family(
    GaugeMetricFamily,
    "posts_waiting",
    "POSTs queued for a permit of the adaptive limit, by lane class (absent with post_limit = "
    "fixed).",
)
# Absent rather than NaN before the first answer: NaN poisons sums and comparisons, while an
# absent series is what `absent()` and `or` are for.
POST_MIN_RTT = Family(
    GaugeMetricFamily,
    "post_min_rtt_seconds",
    "The recent minimum round trip of a POST, against which the limit judges queueing (absent "
    "before the first answer and with post_limit = fixed).",
)
CLAIMED_BY_CLASS = Family(
    CounterMetricFamily,
    "claimed_runs_by_class",
    "Run prefixes claimed, by lane and class (issue 50): targeted (a terminal committed while "
    "the relay runs), finished (a pending terminal found by discovery), due (the rest).",
)
RETRY_BUDGET_TOKENS = Family(
    GaugeMetricFamily,
    "retry_budget_tokens",
    "Retry tokens left (a retry takes one); retries past them wait in the outbox.",
)


class _StatsCollector(Collector):
    """Counters the relay keeps anyway, read at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        lanes = list(self.metrics.views())
        delivered = DELIVERED.make(["lane", "type"])
        for lane in lanes:
            for event_type, n in type_labels(lane.stats.by_type).items():
                delivered.add_metric([lane.name, event_type], n)
        yield delivered
        by_class = CLAIMED_BY_CLASS.make(["lane", "class"])
        for lane in lanes:
            for name, n in lane.stats.by_class.items():
                by_class.add_metric([lane.name, name], n)
        yield by_class
        for scraped in PER_LANE:
            family = scraped.make(["lane"])
            for lane in lanes:
                family.add_metric([lane.name], scraped.value(lane))
            yield family
        listener = self.metrics.listener_view()
        for scraped_listener in OF_LISTENER:
            family = scraped_listener.make()
            family.add_metric([], 0 if listener is None else scraped_listener.value(listener))
            yield family
        misconfigured = MISCONFIGURED.make()
        misconfigured.add_metric([], 0.0 if self.metrics.ingress_ok() else 1.0)
        yield misconfigured


class _PostTurnCollector(Collector):
    """The POST turn's limit, permits and retry budget, read at scrape time: the replica's,
    whatever the number of databases it serves."""

    def __init__(self, metrics: Metrics | FleetMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        admission = self.metrics.admission()
        limit, ceiling = POST_LIMIT.make(), POST_LIMIT_CEILING.make()
        inflight, waiting = POSTS_IN_FLIGHT.make(["class"]), POSTS_WAITING.make(["class"])
        min_rtt = POST_MIN_RTT.make()
        if admission is not None:
            limit.add_metric([], admission.limit.allowed)
            ceiling.add_metric([], admission.limit.ceiling)
            for priority, n in admission.inflight.items():
                inflight.add_metric([priority.value], n)
            for priority, n in admission.waiting.items():
                waiting.add_metric([priority.value], n)
            if admission.limit.min_rtt is not None:
                min_rtt.add_metric([], admission.limit.min_rtt)
        elif self.metrics.fixed_limit is not None:
            limit.add_metric([], self.metrics.fixed_limit)
            ceiling.add_metric([], self.metrics.fixed_limit)
        yield from (limit, ceiling, inflight, waiting, min_rtt)
        tokens = RETRY_BUDGET_TOKENS.make()
        budget = self.metrics.retry_budget()
        if budget is not None:
            tokens.add_metric([], budget.balance)
        yield tokens


class _ProbedGauges(Collector):
    """The database's unlabelled gauges (blocked runs, failed events, the outbox's part age),
    without a sample until a refresh of the database's probe set them: a gauge's 0 before anyone
    looked would read "nothing blocked, a part just begun" (a fleet's /metrics serves each
    database's relay from its start, before its first probe). The labelled ones (by lane, by
    key) have no series until then anyway. `backlog_refresh_timestamp_seconds` keeps its 0,
    which says "never refreshed" (the DatabaseProbeFailing alert reads it so)."""

    def __init__(self, *gauges: Gauge) -> None:
        self.gauges = gauges
        self._probed: set[Gauge] = set()

    def set(self, gauge: Gauge, value: float) -> None:
        """One of `gauges` set by a refresh: exported from now on."""
        gauge.set(value)
        self._probed.add(gauge)

    def collect(self) -> Iterator[Metric]:
        for gauge in self.gauges:
            for family in gauge.collect():
                if gauge not in self._probed:
                    family.samples.clear()  # its HELP and TYPE still say what it is
                yield family


class Metrics:
    def __init__(
        self,
        *,
        views: LaneViews = lambda: (),
        listener_view: Callable[[], ListenerView | None] = lambda: None,
        ingress_ok: Callable[[], bool] = lambda: True,
        admission: Callable[[], AdmissionView | None] = lambda: None,
        retry_budget: Callable[[], BudgetView | None] = lambda: None,
        fixed_limit: int | None = None,
        retention: float | None = None,
        replica: bool = True,
    ) -> None:
        """`views` and `listener_view` return snapshots of the lanes and of the LISTEN
        connection, `admission` and `retry_budget` of the POST turn (None: the fixed limit, or
        no budget), read at each scrape; `fixed_limit` is the POSTs in flight the fixed limit
        allows, exported when `admission` gives None; `retention` (seconds) is exported as
        configured. `replica=False`: one database's metrics in a fleet, without what is the
        replica's (the process, the build, the POST turn), which the fleet exports once
        (`FleetMetrics`)."""
        self.registry = CollectorRegistry()
        self.views = views
        self.listener_view = listener_view
        self.ingress_ok = ingress_ok
        self.admission = admission
        self.retry_budget = retry_budget
        self.fixed_limit = fixed_limit
        r = self.registry
        self.lag = LAG.make(r)
        self.requests = REQUESTS.make(r)
        self.request_seconds = REQUEST_SECONDS.make(r)
        self.backlog_events = BACKLOG_EVENTS.make(r)
        self.backlog_runs = BACKLOG_RUNS.make(r)
        self.backlog_key_runs = BACKLOG_KEY_RUNS.make(r)
        self.backlog_keys = BACKLOG_KEYS  # keys with a series of their own
        self.oldest_pending = OLDEST_PENDING.make(r)
        self.blocked_runs = BLOCKED_RUNS.make(None)
        self.failed_events = FAILED_EVENTS.make(None)
        self.oldest_failed = OLDEST_FAILED.make(None)
        self.backlog_refreshed = BACKLOG_REFRESHED.make(r)
        self.outbox_part_age = OUTBOX_PART_AGE.make(None)
        self._probed = _ProbedGauges(
            self.blocked_runs, self.failed_events, self.oldest_failed, self.outbox_part_age
        )
        r.register(self._probed)
        self.retention = RETENTION.make(r)
        if retention is not None:
            self.retention.set(retention)
        self.ready = READY.make(r)
        self.probe_failures = PROBE_FAILURES.make(r)
        if replica:
            replica_wide(r)
            r.register(_PostTurnCollector(self))
        for lane in LANES:
            self.lag.labels(lane)
            self.request_seconds.labels(lane)
        r.register(_StatsCollector(self))
        # The last 15 minutes of lags per lane, for the status page's p50/p99 (relay/serving/ui/).
        self.recent_lag = {lane: LagWindow() for lane in LANES}

    # -- observers (handed to each lane at construction) --------------------------------------

    def ack_observer(self, lane: str) -> Callable[[AckResult], None]:
        """For `Wiring(observe_ack=...)` (a lane's deliveries): the commit-to-ack lag of each
        acknowledged batch."""
        histogram = self.lag.labels(lane)
        recent = self.recent_lag.setdefault(lane, LagWindow())

        def observe(result: AckResult) -> None:
            if result.acked and result.lag_seconds is not None:
                histogram.observe(max(0.0, result.lag_seconds))
                recent.add(time.monotonic(), max(0.0, result.lag_seconds))

        return observe

    def request_observer(self, lane: str) -> RequestObserver:
        """For `IngressClient(on_request=...)`: every POST, single-run and multi-run, by status
        class (None: no answer) and its duration."""
        seconds = self.request_seconds.labels(lane)
        by_class: dict[str, Counter] = {}  # status class -> its labelled counter, looked up once

        def observe(status: int | None, elapsed: float) -> None:
            cls = status_class(status)
            counter = by_class.get(cls)
            if counter is None:
                counter = by_class[cls] = self.requests.labels(lane, cls)
            counter.inc()
            seconds.observe(elapsed)

        return observe

    # -- gauges and the exposition -----------------------------------------------------------

    def set_backlog(self, rows: Iterable[tuple[str, int, int, float]]) -> None:
        """Rows of `backlog()`: (row, runs, events, oldest_age_seconds), each row of pending
        work labelled with the class it counts and, deprecated, its name (`BACKLOG_LABELS`)."""
        for row, runs, events, oldest in rows:
            if row == "blocked":
                self._probed.set(self.blocked_runs, runs)
                self._probed.set(self.failed_events, events)
                self._probed.set(self.oldest_failed, oldest)
            else:
                labels = (backlog_class(row), row)
                self.backlog_runs.labels(*labels).set(runs)
                self.backlog_events.labels(*labels).set(events)
                self.oldest_pending.labels(*labels).set(oldest)

    def set_part_age(self, seconds: float) -> None:
        """`outbox_part_age()`: how long the outbox's current part has taken new events."""
        self._probed.set(self.outbox_part_age, seconds)

    def set_backlog_keys(self, rows: Iterable[tuple[str | None, int]]) -> None:
        """Rows of `backlog_by_key()`: (key, runs), None for the rest. Keys that left the top
        lose their series."""
        self.backlog_key_runs.clear()
        for key, runs in rows:
            label = "(other)" if key is None else "(default)" if key == "" else key
            self.backlog_key_runs.labels(label).set(runs)

    def exposition(self, accept: str = "") -> tuple[bytes, str]:
        """The scrape body and its content type (OpenMetrics when the scraper asks for it)."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


def replica_wide(registry: CollectorRegistry) -> None:
    """What is the process's, once per replica: the build and the standard process_* /
    python_* collectors."""
    BUILD_INFO.make(registry).labels(__version__, build.commit(), platform.python_version()).set(1)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)


class _DatabasesCollector(Collector):
    """`ledger_relay_database_up{database}`, read at scrape time from `up()` (name -> up)."""

    def __init__(self, up: Callable[[], Mapping[str, bool]]) -> None:
        self.up = up

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "ledger_relay_database_up",
            "1 while this outbox database of a fleet is served with its LISTEN connection up; "
            "0 while it is set aside, starting, or its server does not answer",
            labels=["database"],
        )
        for name, up in self.up().items():
            family.add_metric([name], 1.0 if up else 0.0)
        yield family


# What a fleet exports of each database's relay, with a `database` label: the delivery's own
# figures (its lanes, its listener, its ingress's answers), and its database's gauges, which
# each relay of a fleet refreshes on a relay alone's schedule (relay/serving/health.py,
# `refresh_gauges`). Readiness is the replica's (`FleetMetrics`).
PER_DATABASE = frozenset(
    PREFIX + name
    for name in (
        LAG.name,
        REQUESTS.name,
        REQUEST_SECONDS.name,
        DELIVERED.name,
        CLAIMED_BY_CLASS.name,
        MISCONFIGURED.name,
        BACKLOG_EVENTS.name,
        BACKLOG_RUNS.name,
        BACKLOG_KEY_RUNS.name,
        OLDEST_PENDING.name,
        BLOCKED_RUNS.name,
        FAILED_EVENTS.name,
        OLDEST_FAILED.name,
        BACKLOG_REFRESHED.name,
        OUTBOX_PART_AGE.name,
        PROBE_FAILURES.name,
        *(scraped.name for scraped in PER_LANE),
        *(scraped.name for scraped in OF_LISTENER),
    )
)


def labelled(database: str, families: Iterable[Metric], into: dict[str, Metric]) -> None:
    """`families` (one database's) with `database` on each sample, merged into `into` by name:
    one family per name across the databases, as the exposition requires."""
    for family in families:
        if family.name not in PER_DATABASE:
            continue
        merged = into.get(family.name)
        if merged is None:
            merged = into[family.name] = Metric(
                family.name, family.documentation, family.type, family.unit
            )
        for sample in family.samples:
            merged.samples.append(sample._replace(labels={**sample.labels, "database": database}))


class _PerDatabaseCollector(Collector):
    """Each served database's relay metrics (`PER_DATABASE`), labelled with its name, read at
    scrape time from `relays()` (name -> that relay's Metrics)."""

    def __init__(self, relays: Callable[[], Mapping[str, Metrics]]) -> None:
        self.relays = relays

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for database, metrics in self.relays().items():
            labelled(database, metrics.registry.collect(), merged)
        yield from merged.values()


class FleetMetrics:
    """The metrics of a fleet over several databases (relay/fleet.py, issue 51): what is the
    replica's once (the process, the build, the shared POST turn and retry budget, the
    retention, `ready`), one `ledger_relay_database_up` per database, and each served
    database's delivery metrics with a `database` label (`PER_DATABASE`). A database's series
    are there while its relay runs: set aside, it has none but its `database_up` 0, and its
    counters start again from 0 when its relay does (a counter reset, which `rate()` takes)."""

    def __init__(
        self,
        up: Callable[[], Mapping[str, bool]],
        *,
        relays: Callable[[], Mapping[str, Metrics]] = lambda: {},
        ready: Callable[[], bool] = lambda: True,
        admission: Callable[[], AdmissionView | None] = lambda: None,
        retry_budget: Callable[[], BudgetView | None] = lambda: None,
        fixed_limit: int | None = None,
        retention: float | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.admission = admission
        self.retry_budget = retry_budget
        self.fixed_limit = fixed_limit
        self.ready = ready
        r = self.registry
        replica_wide(r)
        self._ready = READY.make(r)
        if retention is not None:
            RETENTION.make(r).set(retention)
        r.register(_PostTurnCollector(self))
        r.register(_DatabasesCollector(up))
        r.register(_PerDatabaseCollector(relays))

    def exposition(self, accept: str = "") -> tuple[bytes, str]:
        """The scrape body and its content type (OpenMetrics when the scraper asks for it)."""
        self._ready.set(1.0 if self.ready() else 0.0)  # what /readyz answers now
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type
