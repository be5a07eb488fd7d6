"""`/metrics`, `/healthz` and `/readyz` on `metrics_addr` (DESIGN §8.2).

- `/healthz` answers whether the relay's loops are turning: every lane went round its loop
  within `stall_limit`. It never depends on the database (a database outage must not make an
  orchestrator restart every replica at once; the lanes keep turning, failing and backing off,
  while it is down). Kubernetes' liveness probe and the systemd watchdog use this.
- `/readyz` answers whether this replica can do its job now: the relay started and is not
  stopping, the database answered the last probe, the LISTEN connection is up, the schema
  version matches the code, and the ingress is not answering "misconfigured" (401/403/404/...).
  The body says which check failed.
- `/metrics` is the Prometheus exposition of relay/serving/metrics.py.

Of the relay itself the endpoints read only the `RelayView` the runner hands them
(relay/serving/progress.py), and of the metrics only what relay/serving/metrics.py exposes.

A background task probes the database every `refresh_interval` (reads the schema version and
refreshes the backlog gauges with the `backlog()` SQL function; `DatabaseProbe`): scrapes and
probes never query the database themselves. Each database's relay of a fleet, which serves no
endpoints of its own, runs the same probe and report alone (`serve_status`) for the fleet's
/metrics and status page.
The endpoints re-evaluate readiness after every probe, and a scrape re-evaluates it too, so
`ledger_relay_ready` says what `/readyz` would say whether or not anyone asks `/readyz` (under
systemd nobody does: the gauge once read 0 on every healthy replica and the shipped alert paged
for all of them, issue 41).

The server is the lightest that is correct: an anyio TCP listener with h11 (already under
httpx), one request per connection, no keep-alive, bounded in time and in connections, with an
error boundary around every request and around accept() (relay/serving/server.py): nothing a client
of `metrics_addr` does can end the process.

The same address serves the read-only status page (relay/serving/ui/: `/`, `/runs/...`, `/api/...`),
behind `ui_token` when one is set; the probe loop also writes this replica's report for it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any, LiteralString

import anyio
import orjson
import psycopg
from anyio.abc import SocketAttribute, SocketStream, TaskGroup, TaskStatus
from anyio.streams.stapled import MultiListener
from psycopg import sql

from relay import logs
from relay.maintenance.migrate import read_version, version_problem
from relay.serving.progress import RelayView, loops_alive, stall_limit
from relay.serving.server import Respond, serve_listeners
from relay.serving.ui.data import Backlog, Data
from relay.serving.ui.pool import PagePool
from relay.serving.ui.web import Request, Response, StatusPage, serves_without_token
from relay.settings import Settings

if TYPE_CHECKING:
    from relay.edges.store import Store
    from relay.serving.metrics import Metrics

# The readiness probe has its own short deadline and period, apart from the backlog refresh:
# /readyz turns not-ready within about two seconds of losing the database (and back as soon).
READY_PROBE_INTERVAL = 1.0
READY_PROBE_DEADLINE = 1.0
# The longest the replica report waits for the LISTEN connection (its check_interval,
# relay/edges/listener.py), on top of the statement deadline.
LISTEN_WAIT = 5.0
# What a function or grant older than this relay raises: the figure it reads is left out.
OLDER_THAN_THIS_RELAY = (psycopg.errors.UndefinedFunction, psycopg.errors.InsufficientPrivilege)


# -- pure decisions ---------------------------------------------------------------------------


def refresh_interval(s: Settings) -> float:
    """Probe and backlog refresh period: five poll intervals, between 1 s and 15 s."""
    return min(15.0, max(1.0, 5 * s.poll_interval))


# The backlog refresh reads every pending event (`backlog()`): at least this many times its own
# duration passes before the next one, so it never takes more than ~1/20 of a database core.
REFRESH_COST_FACTOR = 20.0


def refresh_gap(interval: float, took: float) -> float:
    """Time from one backlog refresh to the next: the period, or longer after a costly one."""
    return max(interval, REFRESH_COST_FACTOR * took)


def readiness(
    *,
    started: bool,
    database: bool,
    schema_problem: str | None,
    listen_up: bool,
    ingress_ok: bool,
) -> tuple[bool, dict[str, Any]]:
    checks: dict[str, Any] = {
        "started": started,
        "database": database,
        "schema": schema_problem or True,
        "listen": listen_up,
        "ingress": ingress_ok,
    }
    ok = started and database and schema_problem is None and listen_up and ingress_ok
    return ok, checks


def page_refresh(s: Settings) -> float:
    """How often the status page refreshes itself: half the probe's period, 1 s to 5 s."""
    return min(5.0, max(1.0, refresh_interval(s) / 2))


def split_addr(addr: str) -> tuple[str | None, int]:
    """'HOST:PORT' (HOST may be empty for every interface, or a [v6] address)."""
    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    return (host or None), int(port)


# -- the database probe -----------------------------------------------------------------------


class DatabaseProbe:
    """The database's probe and the gauges it refreshes: every READY_PROBE_INTERVAL it reads the
    schema version (reachability, for /readyz, and `database_probe_failures`); every
    `refresh_interval`, or later after a costly refresh (`refresh_gap`), the backlog gauges and
    the outbox's part age. On a connection of the relay's store pool, never one of its own: the
    endpoints of a relay alone run it, and so does each database's relay of a fleet, alone, for
    the fleet's /metrics (issue 51 item 4; no status page there, no replica report)."""

    def __init__(self, settings: Settings, store: Store, metrics: Metrics) -> None:
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self.database = False
        self.schema_problem: str | None = "not checked yet"
        self.probes = 0
        self.refresh_took = 0.0  # the last backlog refresh's duration (refresh_gap)
        self.backlog: Backlog | None = None  # the backlog gauges' last refresh, for the page
        # The *_unavailable warnings already said: outbox_part_age() or backlog_by_key() older
        # than this relay (missing, or not granted), each said once
        self._warned_unavailable: set[str] = set()

    @property
    def usable(self) -> bool:
        """The database answered the last probe, at the schema version this relay serves."""
        return self.database and self.schema_problem is None

    async def run(self, after: Callable[[bool], None] = lambda refreshed: None) -> None:
        """Probe until cancelled; `after(refreshed)` once each probe is done (whether it was
        due to refresh the gauges too)."""
        interval = refresh_interval(self.settings)
        refreshed = anyio.current_time()
        while True:
            await anyio.sleep(min(READY_PROBE_INTERVAL, interval))
            now = anyio.current_time()
            due = now - refreshed >= refresh_gap(interval, self.refresh_took)
            await self.probe(refresh=due)
            after(due)
            if due:
                refreshed = now

    async def probe(self, *, refresh: bool = True) -> None:
        """Read the schema version within READY_PROBE_DEADLINE and record reachability; then,
        when `refresh`, refresh the backlog gauges (bounded by the statement deadline)."""
        was = self.database
        try:
            async with AsyncExitStack() as stack:
                with anyio.fail_after(READY_PROBE_DEADLINE):
                    conn = await stack.enter_async_context(self.store.pool.connection())
                    version = await read_version(conn, self.store.schema)
                self.database = True
                self.schema_problem = version_problem(version, self.store.schema)
                if refresh and self.schema_problem is None:
                    with anyio.fail_after(self.store.deadline):
                        await self._refresh_backlog(conn)
                        await self._refresh_part_age(conn)
        except (psycopg.Error, OSError, TimeoutError) as exc:
            self.database = False
            self.metrics.probe_failures.inc()
            if was or self.probes == 0:
                logs.warning("database_unreachable", error=logs.error_text(exc))
        else:
            if not was and self.probes > 0:
                logs.info("database_reachable")
        self.probes += 1

    async def _bounded(
        self,
        conn: psycopg.AsyncConnection[Any],
        query: LiteralString,
        params: tuple[Any, ...] | None = None,
    ) -> list[tuple[Any, ...]]:
        """The rows of `query` ({} the relay's schema), in a transaction of its own under the
        statement deadline."""
        async with conn.transaction():
            await conn.execute(
                "select set_config('statement_timeout', %s, true)",
                (f"{int(self.store.statement_timeout * 1000)}ms",),
            )
            cur = await conn.execute(
                sql.SQL(query).format(sql.Identifier(self.store.schema)), params
            )
            return await cur.fetchall()

    async def _refresh_backlog(self, conn: psycopg.AsyncConnection[Any]) -> None:
        started = anyio.current_time()
        try:
            rows = await self._bounded(
                conn, "select lane, runs, events, oldest_age_seconds from {}.backlog()"
            )
        except psycopg.errors.UndefinedFunction:
            # The functions were shipped after this database's last `relay migrate`.
            logs.warning("backlog_unavailable", hint="run `relay migrate`")
            return
        finally:  # a refresh that timed out cost the database as much: it spaces the next too
            self.refresh_took = anyio.current_time() - started
        figures = tuple((str(r[0]), int(r[1]), int(r[2]), float(r[3])) for r in rows)
        self.metrics.set_backlog(figures)
        at = anyio.current_time()
        self.backlog = Backlog(figures, at)  # the status page's totals too
        self.metrics.backlog_refreshed.set_to_current_time()
        keys = await self._refresh_backlog_keys(conn)
        self.backlog = Backlog(figures, at, keys)  # and its table by fairness key

    async def _refresh_backlog_keys(
        self, conn: psycopg.AsyncConnection[Any]
    ) -> tuple[tuple[str | None, int], ...]:
        """The backlog by fairness key, the keys with the most only (issue 50 item 4); none
        while the database's functions are older than this relay."""
        started = anyio.current_time()
        try:
            rows = await self._bounded(
                conn, "select key, runs from {}.backlog_by_key(%s)", (self.metrics.backlog_keys,)
            )
        except OLDER_THAN_THIS_RELAY as exc:
            self._warn_unavailable_once("backlog_by_key_unavailable", exc)
            return ()
        finally:  # its cost spaces the next refresh with the backlog's
            self.refresh_took += anyio.current_time() - started
        keys = tuple((r[0], int(r[1])) for r in rows)
        self.metrics.set_backlog_keys(keys)
        return keys

    async def _refresh_part_age(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """The age of the outbox's current part: retention falling behind shows there."""
        try:
            async with conn.transaction():
                cur = await conn.execute(
                    sql.SQL("select {}.outbox_part_age()").format(sql.Identifier(self.store.schema))
                )
                row = await cur.fetchone()
        except OLDER_THAN_THIS_RELAY as exc:
            self._warn_unavailable_once("part_age_unavailable", exc)
            return
        if row is not None and row[0] is not None:
            self.metrics.set_part_age(float(row[0]))

    def _warn_unavailable_once(self, event: str, exc: psycopg.Error) -> None:
        """Functions or grants older than this relay: a warning naming the figure left out,
        once, then quiet."""
        if event in self._warned_unavailable:
            return
        self._warned_unavailable.add(event)
        logs.warning(
            event,
            error=logs.error_text(exc),
            hint="run `relay migrate` (with the roles, if the relay has its own)",
        )


# -- the endpoints ----------------------------------------------------------------------------


class DatabaseStatus:
    """One database's side of the status page: its probe and gauges (`DatabaseProbe`), the
    page's own connection to it, its `StatusPage`, and this replica's report into it after
    each refresh of the gauges. The endpoints of a relay alone hold one; each database's relay
    of a fleet runs one alone (`serve_status`), whose page the fleet's serves (issue 51)."""

    def __init__(
        self,
        settings: Settings,
        view: RelayView,
        store: Store,
        metrics: Metrics,
        database: str | None = None,
    ) -> None:
        self.view = view
        self.store = store
        self.metrics = metrics
        self.gauges = DatabaseProbe(settings, store, metrics)  # reachability, schema, backlog
        # The status page reads on a connection of its own, never the delivery pools (issue 32)
        self.page_pool = PagePool(settings.database_url.reveal())
        self._reporting = False
        self.page = StatusPage(
            Data(self.page_pool.query, settings.schema, view.on_liveness_session),
            replica_id=settings.replica_id,
            token=settings.ui_token,
            refresh_seconds=page_refresh(settings),
            backlog=lambda: self.gauges.backlog,
            admission=view.admission,
            retry_budget=view.retry_budget,
            fixed_limit=settings.post_ceiling,
            open_without_token=serves_without_token(split_addr(settings.metrics_addr or ":0")[0]),
            lanes=view.lanes,
            database=database,
        )

    async def run(self, after: Callable[[], object] = lambda: None) -> None:
        """Probe until cancelled (`DatabaseProbe.run`); `after()` once each probe is done, then
        this replica's report when the probe refreshed the gauges of a usable database."""
        try:
            async with anyio.create_task_group() as reports:

                def probed(refreshed: bool) -> None:
                    after()
                    if refreshed and self.gauges.usable and not self._reporting:
                        self._reporting = True
                        reports.start_soon(self._report)

                await self.gauges.run(probed)
        finally:  # the page's connection ends with the probe
            with anyio.CancelScope(shield=True):
                await self.page_pool.close()

    async def _report(self) -> None:
        """This replica's report, beside the probes rather than in their way: it waits for the
        LISTEN connection (between two of its waits for notifications) before it is sent."""
        try:
            with anyio.move_on_after(self.store.deadline + LISTEN_WAIT):
                await self.page.report(self.view.lanes(), self.metrics.recent_lag)
        finally:
            self._reporting = False


class Endpoints:
    def __init__(self, settings: Settings, view: RelayView, store: Store, metrics: Metrics) -> None:
        self.settings = settings
        self.view = view
        self.metrics = metrics
        self.since = anyio.current_time()
        self.status = DatabaseStatus(settings, view, store, metrics)
        self.gauges = self.status.gauges
        self.page = self.status.page
        self.port = 0

    # liveness and readiness

    def alive(self) -> bool:
        if self.view.stop_requested():
            return True  # draining, bounded by shutdown_timeout
        turned = [lane.turned_at for lane in self.view.lanes()]
        return loops_alive(turned, self.since, anyio.current_time(), stall_limit(self.settings))

    def ready(self) -> tuple[bool, dict[str, Any]]:
        listener = self.view.listener()
        ok, checks = readiness(
            started=self.view.started() and not self.view.stop_requested(),
            database=self.gauges.database,
            schema_problem=self.gauges.schema_problem,
            listen_up=listener is not None and listener.up,
            ingress_ok=self.view.ingress_ok(),
        )
        self.metrics.ready.set(1.0 if ok else 0.0)
        return ok, checks

    # the database probe, and the replica's report after each refresh (DatabaseStatus)

    async def probe(self, *, refresh: bool = True) -> None:
        await self.gauges.probe(refresh=refresh)

    async def probe_loop(self) -> None:
        await self.status.run(after=self.ready)  # the gauge, whether or not anyone asks /readyz

    # HTTP

    def route(self, method: str, path: str, accept: str) -> tuple[int, str, bytes]:
        if method not in ("GET", "HEAD"):
            return 405, "text/plain; charset=utf-8", b"method not allowed\n"
        if path == "/metrics":
            self.ready()  # the gauge as of this scrape, not of the last probe
            try:
                body, content_type = self.metrics.exposition(accept)
            except (TypeError, ValueError):  # prometheus_client on an Accept it cannot parse
                return 406, "text/plain; charset=utf-8", b"unacceptable Accept header\n"
            return 200, content_type, body
        if path == "/healthz":
            if self.alive():
                return 200, "text/plain; charset=utf-8", b"ok\n"
            return 503, "text/plain; charset=utf-8", b"stalled\n"
        if path == "/readyz":
            ok, checks = self.ready()
            body = orjson.dumps({"ready": ok, "checks": checks}) + b"\n"
            return (200 if ok else 503), "application/json", body
        return 404, "text/plain; charset=utf-8", b"not found\n"

    async def dispatch(self, request: Request) -> Response:
        """The status page's paths to the page; the probes' and the scrape's to `route`."""
        if self.page.handles(request.path):
            return await self.page.handle(request)
        accept = request.headers.get("accept", "")
        return Response(*self.route(request.method, request.path, accept))


def waiting_route(method: str, path: str, _accept: str) -> tuple[int, str, bytes]:
    """The endpoints while `relay run` waits for its database at start (relay/startup.py):
    alive (the wait is the loop turning; a liveness or startup probe must not restart it),
    not ready, no metrics yet."""
    if method not in ("GET", "HEAD"):
        return 405, "text/plain; charset=utf-8", b"method not allowed\n"
    if path == "/healthz":
        return 200, "text/plain; charset=utf-8", b"ok (waiting for the database)\n"
    if path == "/readyz":
        checks = {"started": False, "database": False}
        return 503, "application/json", orjson.dumps({"ready": False, "checks": checks}) + b"\n"
    if path == "/metrics":
        return 503, "text/plain; charset=utf-8", b"waiting for the database\n"
    return 404, "text/plain; charset=utf-8", b"not found\n"


def fleet_route(
    method: str,
    path: str,
    databases: Mapping[str, str],
    stopping: bool,
    scrape: Callable[[], tuple[bytes, str]],
) -> tuple[int, str, bytes]:
    """The endpoints of a fleet over several databases (relay/fleet.py, issue 51), for now: alive
    while the process runs, ready while it serves and until a stop is asked for, whatever each
    database does (one database down must not take the replica out of service, nor restart it:
    Sequin #2154's lesson); `databases` (name -> state) is in the /readyz answer; /metrics is
    `scrape()`'s (`ledger_relay_database_up`). The status page's paths are the fleet's page's
    (relay/serving/ui/fleet.py), asked before this."""
    if method not in ("GET", "HEAD"):
        return 405, "text/plain; charset=utf-8", b"method not allowed\n"
    if path == "/healthz":
        return 200, "text/plain; charset=utf-8", b"ok\n"
    if path == "/readyz":
        body = orjson.dumps({"ready": not stopping, "databases": dict(databases)}) + b"\n"
        return (503 if stopping else 200), "application/json", body
    if path == "/metrics":
        body, content_type = scrape()
        return 200, content_type, body
    return 404, "text/plain; charset=utf-8", b"not found\n"


class MetricsPort:
    """`metrics_addr`, bound once at start and answered for the whole run: by `waiting_route`
    while the relay waits for its database and starts, then by the endpoints (`serve`). A
    scrape or a probe in between is answered, never refused: the address was briefly closed
    between the start-up answers and the endpoints until 2026-12 (a probe saw "connection
    refused" under load)."""

    def __init__(self, listener: MultiListener[SocketStream], addr: str) -> None:
        self.listener = listener
        self.addr = addr
        self.port: int = listener.listeners[0].extra(SocketAttribute.local_port)
        self.respond: Respond = _waiting

    @classmethod
    async def bind(cls, addr: str) -> MetricsPort:
        host, port = split_addr(addr)
        try:
            listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
        except OSError as exc:
            raise ConnectionError(f"cannot listen on metrics_addr {addr}: {exc.strerror}") from None
        return cls(listener, addr)

    @classmethod
    @asynccontextmanager
    async def serving(cls, addr: str) -> AsyncIterator[MetricsPort]:
        """Bound to `addr` and served for the duration of the block (a busy address raises at
        once)."""
        port = await cls.bind(addr)
        async with anyio.create_task_group() as tg:
            tg.start_soon(port.run)
            try:
                yield port
            finally:
                tg.cancel_scope.cancel()

    async def run(self) -> None:
        """Serve until cancelled, each request by whoever answers at that moment."""
        async with self.listener:
            await serve_listeners(self.listener.listeners, self._dispatch)

    async def _dispatch(self, request: Request) -> Response:
        return await self.respond(request)


async def serve(
    settings: Settings,
    view: RelayView,
    store: Store,
    metrics: Metrics,
    port: MetricsPort,
    *,
    task_status: TaskStatus[Endpoints] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """The endpoints on `port` until cancelled: readiness and liveness from `view`, the
    exposition of `metrics` (whose observers the runner wired into the lanes)."""
    endpoints = Endpoints(settings, view, store, metrics)
    endpoints.port = port.port
    host, _ = split_addr(port.addr)
    logs.info("endpoints_listening", addr=f"{host or ''}:{endpoints.port}")
    await endpoints.probe()
    port.respond = endpoints.dispatch
    task_status.started(endpoints)
    await endpoints.probe_loop()


async def serve_status(
    settings: Settings,
    view: RelayView,
    store: Store,
    metrics: Metrics,
    database: str | None,
    *,
    task_status: TaskStatus[DatabaseStatus] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """One database's relay in a fleet, which serves no endpoints of its own: its gauges, its
    report and its status page (`DatabaseStatus`), the probe and the refresh on a relay alone's
    schedule, the first before it is started (as `serve`), until cancelled. The fleet's
    /metrics reads the gauges with its `database` label, its page serves the page."""
    status = DatabaseStatus(settings, view, store, metrics, database)
    await status.gauges.probe()
    task_status.started(status)
    await status.run()


async def start_serving(
    tg: TaskGroup,
    settings: Settings,
    view: RelayView,
    store: Store,
    metrics: Metrics | None,
    port: MetricsPort | None,
    database: str | None,
) -> tuple[Endpoints | None, DatabaseStatus | None]:
    """What a relay serves of itself, started in `tg` and served until it is cancelled: with
    its metrics served on `port`, the endpoints (`serve`); with its metrics kept but no port of
    its own (one database's relay of a fleet), its status (`serve_status`); neither without
    metrics. Returned once each serves, as the runner's `endpoints` and `status`."""
    if metrics is not None and port is not None:
        return await tg.start(serve, settings, view, store, metrics, port), None
    elif metrics is not None:  # one database's of a fleet: for its /metrics and page
        return None, await tg.start(serve_status, settings, view, store, metrics, database)
    return None, None


async def _waiting(request: Request) -> Response:
    accept = request.headers.get("accept", "")
    return Response(*waiting_route(request.method, request.path, accept))
