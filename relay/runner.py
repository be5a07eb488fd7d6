"""The orchestrator: wires store, listener, lanes and retention into one anyio task group.

Usable as a library (`async with Relay(settings).running(): ...` or `await relay.run()` inside
the application's own task group, with its own httpx transport) and by `relay run`.
"""

from __future__ import annotations

import gc
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from anyio.abc import TaskStatus
from psycopg import sql

from relay import logs
from relay.admission.limit import Limit
from relay.admission.permits import Admission, AdmissionView
from relay.admission.retry_budget import BudgetView, RetryBudget
from relay.core import clock, loop
from relay.delivery.deliveries import Wiring
from relay.delivery.lane import Lane, LaneView
from relay.delivery.post_turn import LoopLag, Permits
from relay.edges.http_client import Sender, open_sender, require_extras
from relay.edges.ingress import IngressClient
from relay.edges.listener import Listener
from relay.edges.store import AckResult, Store
from relay.edges.tracing import NO_TRACING, Tracer, flush_timeout
from relay.maintenance.migrate import SchemaError, read_version, version_problem
from relay.maintenance.retention import Retention
from relay.pools import Pools
from relay.serving import health, sdnotify
from relay.serving.metrics import Metrics
from relay.serving.progress import ListenerView, RelayView
from relay.settings import Settings, redact_url

# Young collections every 10,000 net allocations of tracked objects instead of 700: one claim of
# 64 runs loads hundreds of rows, each ran a collection of its own (docs/performance.md).
GC_THRESHOLDS = (10_000, 20, 20)


def tune_gc() -> None:
    """For a long-lived `relay run`, once everything is imported and built: the objects of
    start-up are frozen out of every collection (the full ones walked them all, ~50k), and
    young collections are rarer. Paired, four reps: ~13% less CPU per one-event run."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def post_permits(settings: Settings, lag: LoopLag | None = None) -> Permits | None:
    """The replica's permits for POSTs under the adaptive limit (docs/admission.md), shared by
    both lanes; None with `post_limit = fixed`, where each lane's slots alone bound its POSTs.
    The ceiling is both lanes' concurrency and the critical reserve at most the critical lane's,
    so at an ingress that keeps up each lane keeps all of its own, as with the fixed limit."""
    if settings.post_limit == "fixed":
        return None
    limit = Limit(settings.post_ceiling)
    return Permits(Admission(limit, max_reserve=settings.critical_concurrency), lag)


@dataclass(frozen=True)
class Shared:
    """What a replica's relays share, one of each, however many databases it serves
    (relay/fleet.py, issue 51): the adaptive limit's permits (None with `post_limit = fixed`), the
    retry budget, and the event loop's lateness the limit tolerates. Whoever builds them runs the
    lateness probe and the limit's idle rule: a relay given them runs neither."""

    loop_lag: LoopLag
    permits: Permits | None
    budget: RetryBudget


def shared_for(settings: Settings) -> Shared:
    """One replica's permits, budget and lateness probe, for `settings`."""
    loop_lag = LoopLag()  # the relay's own lateness, which the limit tolerates
    return Shared(loop_lag, post_permits(settings, loop_lag), RetryBudget())


@dataclass
class Health:
    ready: bool = False
    ingress_ok: bool = True


class Relay:
    def __init__(
        self,
        settings: Settings,
        *,
        client: httpx.AsyncClient | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        prune_interval: float = 60.0,
        tracer: Tracer = NO_TRACING,
        shared: Shared | None = None,
        database: str | None = None,
        keep_metrics: bool = False,
        pool_sizes: tuple[int, int] | None = None,
    ) -> None:
        self.settings = settings
        self.tracer = tracer  # spans of every delivery (relay/edges/tracing.py), when configured
        # Alone in its process (the one-database form, or an application's library use), a
        # relay owns what it shares with no other: it serves metrics_addr, tells systemd, runs
        # the limit's background tasks and flushes the tracer at the end. One of a fleet
        # (`shared` given, relay/fleet.py) leaves all of that to the fleet.
        self.alone = shared is None
        # The database's name in a fleet: on each of its log lines and POSTs (issue 51).
        self.database = database
        # Its metrics, kept for the fleet's /metrics (`keep_metrics`) or served on its own
        # metrics_addr; None until it runs, and without either.
        self.keep_metrics = keep_metrics
        self.metrics: Metrics | None = None
        # The application's own HTTP client (or transport, e.g. an in-process ASGI app): both
        # lanes POST through it, and it stays the application's to close
        # (relay/edges/http_client.py).
        self.app_http = client if client is not None else transport
        if self.app_http is None:  # an extra the relay's own client needs: said now, not later
            require_extras(settings, os.environ)
        self.prune_interval = prune_interval
        # The database pools and the stores over them; `pool_sizes`: a fleet's connection budget.
        self._pools = Pools(settings, pool_sizes)
        # What each POST may go under: the adaptive limit's permits and the retry budget, one
        # of each per replica, shared by both lanes (relay/delivery/post_turn.py,
        # relay/admission/retry_budget.py), and by every database's lanes in a fleet.
        shared = shared or shared_for(settings)
        self.loop_lag = shared.loop_lag
        self.permits = shared.permits
        self.budget = shared.budget
        self.health = Health()
        self.lanes: dict[str, Lane] = {}
        self.listener: Listener | None = None
        self._stop = anyio.Event()
        self._started = anyio.Event()
        self.endpoints: health.Endpoints | None = None  # /metrics etc., when metrics_addr is set
        # One database's of a fleet: its gauges, its report and its status page, for the
        # fleet's /metrics and page; None until it runs, and without them.
        self.status: health.DatabaseStatus | None = None
        # What health, sdnotify and metrics read of this relay (they get no other handle on it).
        self.view = relay_view(self)

    # -- public ------------------------------------------------------------------------------

    def stop(self) -> None:
        """Graceful shutdown: stop claiming, finish or release in-flight work, return."""
        if not self._stop.is_set():
            with self._bound():
                logs.info("shutdown_requested", replica=self.settings.replica_id)
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    async def wait_stop_requested(self) -> None:
        await self._stop.wait()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Relay]:
        """Run in the background for the duration of the block; stops gracefully on exit."""
        async with anyio.create_task_group() as tg:
            await tg.start(self.run)
            try:
                yield self
            finally:
                self.stop()

    async def run(self, *, task_status: TaskStatus[Relay] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            # Bound before anything else and answered until the run ends (health.MetricsPort).
            addr = self.settings.metrics_addr
            with self._bound():
                async with health.MetricsPort.serving(addr) if addr else nullcontext() as port:
                    await self._run(port, task_status)
        finally:
            # However the run ends (a stop, an error, a cancellation), the spans it recorded are
            # exported: what the batch processor still holds, for at most a share of the grace
            # period (relay/edges/tracing.py flush_timeout), whatever the collector does.
            if self.tracer.enabled and self.alone:
                bound = flush_timeout(self.settings.shutdown_timeout)
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(self.tracer.shutdown, bound)

    async def _run(self, port: health.MetricsPort | None, task_status: TaskStatus[Relay]) -> None:
        s = self.settings
        pools = await self._pools.open(self._stop)
        if pools is None:
            logs.info("shutdown", replica=s.replica_id)
            return
        ordinary_pool, critical_pool = pools
        try:
            ordinary_store = self._pools.store(ordinary_pool)
            async with ordinary_pool.connection() as conn:
                with anyio.fail_after(ordinary_store.deadline):
                    problem = version_problem(await read_version(conn, s.schema), s.schema)
            if problem:
                raise SchemaError(problem)
            # Metrics only when they are served; their observers are wired into the lanes. One
            # database's of a fleet leave out what is the replica's (the fleet exports it once).
            metrics = None
            if port is not None or self.keep_metrics:
                metrics = self.metrics = Metrics(
                    views=self.view.lanes,
                    listener_view=self.view.listener,
                    ingress_ok=self.view.ingress_ok,
                    admission=self.view.admission,
                    retry_budget=self.view.retry_budget,
                    fixed_limit=s.post_ceiling,
                    retention=s.retention,
                    replica=self.alone,
                )
            async with (
                open_sender(s, s.concurrency, self.app_http) as ordinary_http,
                open_sender(s, s.critical_concurrency, self.app_http) as critical_http,
            ):
                critical = self._lane(
                    "critical",
                    self._pools.store(critical_pool),
                    critical_http,
                    s.critical_concurrency,
                    metrics,
                )
                ordinary = self._lane(
                    "ordinary", ordinary_store, ordinary_http, s.concurrency, metrics
                )
                ordinary.post_turn.handoff = critical.adopt
                self.lanes = {"critical": critical, "ordinary": ordinary}
                listen_url = s.listen_database_url or s.database_url
                self.listener = Listener(
                    listen_url.reveal(),
                    s.terminal_channel,
                    on_terminal=self._on_terminal,
                    on_delivered=critical.delivered_elsewhere,
                    on_wake=self._wake_all,
                    on_connected=self._wake_all,
                    liveness=(s.schema, s.replica_id),
                )
                await self._serve(ordinary_store, metrics, port, task_status)
        finally:
            for pool in pools:
                await pool.close()
            logs.info("shutdown", replica=s.replica_id)

    # -- internals ---------------------------------------------------------------------------

    async def _serve(
        self,
        store: Store,
        metrics: Metrics | None,
        port: health.MetricsPort | None,
        task_status: TaskStatus[Relay],
    ) -> None:
        assert self.listener is not None
        s = self.settings
        async with anyio.create_task_group() as background:
            background.start_soon(self.listener.run)
            # No claim before the liveness lock is held (issue 18), or another replica could
            # take this one's first claims for a dead owner's. Bounded: a LISTEN connection that
            # cannot connect leaves the relay polling (DESIGN §4.1), liveness taken later.
            with anyio.move_on_after(s.statement_timeout) as waited:
                await self.listener.first_session.wait()
            if waited.cancelled_caught:
                logs.warning("started_without_liveness", waited=s.statement_timeout)
            if s.retention > 0:
                background.start_soon(Retention(store, s.retention, self.prune_interval).run)
            if self.permits is not None and self.alone:
                background.start_soon(self.loop_lag.run)
                background.start_soon(self.permits.settle_when_idle)
            # Operations (relay/serving/health.py, relay/serving/sdnotify.py), each only when
            # configured.
            self.endpoints, self.status = await health.start_serving(
                background, s, self.view, store, metrics, port, self.database
            )
            notifier = sdnotify.from_environ() if self.alone else None
            if notifier is not None:
                background.start_soon(sdnotify.supervise, s, self.view, notifier)
            async with anyio.create_task_group() as lanes:
                for lane in self.lanes.values():
                    lanes.start_soon(lane.run)
                self.health.ready = True
                logs.info(
                    "started",
                    replica=self.settings.replica_id,
                    schema=self.settings.schema,
                    ingress=redact_url(self.settings.ingress_url),
                    concurrency=self.settings.concurrency,
                    critical_concurrency=self.settings.critical_concurrency,
                    post_limit=self.settings.post_limit,
                    batch_size=self.settings.batch_size,
                    event_loop=loop.running(),
                )
                self._started.set()
                task_status.started(self)
                await self._stop.wait()
                self.health.ready = False
                for lane in self.lanes.values():
                    lane.stop()
            # Lanes are done (in-flight work finished or released): the replica stopped cleanly,
            # which the LISTEN session says before it closes (issue 41); then the rest stops.
            await self.listener.stop()
            background.cancel_scope.cancel()

    def _lane(
        self, name: str, store: Store, http: Sender, concurrency: int, metrics: Metrics | None
    ) -> Lane:
        """One lane with its own HTTP client, observed by `metrics` when they are served."""
        s = self.settings
        on_request = metrics.request_observer(name) if metrics else None
        wiring = Wiring(
            IngressClient(s, http, on_request=on_request, database=self.database),
            tracer=self.tracer,
            budget=self.budget,
            on_ready_change=self._ingress_ready,
            observe_ack=metrics.ack_observer(name) if metrics else _ignore_ack,
        )
        return Lane(
            name, s, store, wiring, concurrency, permits=self.permits, database=self.database
        )

    def _bound(self) -> AbstractContextManager[None]:
        """The database's name on every log line of this relay, in a fleet."""
        return logs.bound(database=self.database) if self.database else nullcontext()

    def _on_terminal(self, run_id: str) -> None:
        self.lanes["ordinary"].promote(run_id)  # if the ordinary lane holds it, hand it over
        self.lanes["critical"].drain(run_id)

    def _wake_all(self) -> None:
        for lane in self.lanes.values():
            lane.wake.set()

    def _ingress_ready(self, ok: bool) -> None:
        self.health.ingress_ok = ok


def relay_view(relay: Relay) -> RelayView:
    """What health, sdnotify, metrics and the status page read of `relay`
    (relay/serving/progress.py): the callables over its state, built in one place. Each one
    looks at the relay when an observer asks, not when it is built: the lanes and the listener
    only exist once the relay runs, and a view asked for before then sees none (no lanes, no
    listener)."""

    def lanes() -> list[LaneView]:
        return [lane.view() for lane in relay.lanes.values()]

    def listener() -> ListenerView | None:
        built = relay.listener
        return built.view() if built is not None else None

    def admission() -> AdmissionView | None:
        return relay.permits.view() if relay.permits is not None else None

    def retry_budget() -> BudgetView:
        return relay.budget.view(clock.now())

    async def on_liveness_session(
        query: sql.Composed, params: Sequence[Any]
    ) -> list[tuple[Any, ...]]:
        if relay.listener is None:
            raise ConnectionError("the LISTEN connection is not built yet")
        return await relay.listener.on_liveness_session(query, params)

    return RelayView(
        started=lambda: relay.health.ready,
        stop_requested=lambda: relay.stop_requested,
        wait_stop_requested=relay.wait_stop_requested,
        lanes=lanes,
        listener=listener,
        ingress_ok=lambda: relay.health.ingress_ok,
        on_liveness_session=on_liveness_session,
        admission=admission,
        retry_budget=retry_budget,
    )


def _ignore_ack(result: AckResult) -> None:
    """No metrics: nothing observes acknowledgements."""
