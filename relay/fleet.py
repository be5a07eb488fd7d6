"""One fleet over many outbox databases (issue 51 item 2): a relay per database, one process.

`relay run` with the list form of the database (relay/databases.py) runs a `Fleet`: one
`Relay` (relay/runner.py) per database, each with its own pools, LISTEN connection, liveness
lock, lanes and retention, all in one task group. What is the replica's and not a database's is
built once here and handed to each relay (`Shared`): the adaptive limit's permits, the retry
budget, the event loop's lateness the limit tolerates, and the tracer; the fleet runs their
background tasks, answers `metrics_addr` (its probes, its metrics, and its status page over every
database: relay/serving/ui/fleet.py) and flushes the tracer at the end.

A database is on its own: before its relay is built, one connection reads its schema version
(`probe`). A database that does not answer, refuses, is at a schema version this release cannot
serve, or whose relay fails later, is set aside with one log line (`database_set_aside`) and
tried again with capped, jittered backoff: never fatal to the process, never holding up the
other databases, whose relays run meanwhile in their own tasks.

    fleet = Fleet(settings, databases)
    await fleet.run()      # until fleet.stop()
"""

from __future__ import annotations

import enum
import os
import random
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import psycopg
from anyio.abc import TaskStatus

from relay import logs
from relay.core import clock
from relay.core.policy import backoff
from relay.databases import Database, connection_shares, for_database
from relay.edges.store import CONNECT_KWARGS
from relay.edges.tracing import NO_TRACING, Tracer, flush_timeout
from relay.maintenance.migrate import read_version, version_problem
from relay.pools import RECONNECT_WINDOW, split_share
from relay.runner import Relay, shared_for
from relay.serving import health, sdnotify
from relay.serving.metrics import FleetMetrics, Metrics
from relay.serving.ui.fleet import DatabaseState, FleetPage
from relay.serving.ui.web import Request, Response, serves_without_token
from relay.settings import Settings, passwords_in, scrub

FIRST_RETRY = 0.5  # seconds before a set-aside database is tried again, doubling
# ... up to this: the pools' window (relay/pools.py), so a database set aside is tried again about
# as soon as a served one's lost server is (docs/sharding.md, "How soon a server that is back is
# served again"); each try is one connection, at most about two in the window once at the cap.
MAX_RETRY = RECONNECT_WINDOW
PROBE_DEADLINE = 5.0  # one probe's connection and read, at most (relay/startup.py's attempt's)


class State(enum.Enum):
    """Where one database of the fleet stands."""

    STARTING = "starting"  # probed, its first relay starting (waiting for its pools, liveness)
    SERVING = "serving"  # its relay's lanes run
    # Down, refused, at a schema version this release cannot serve, or its relay failed: until
    # a relay of it serves again, its next relay's start included.
    SET_ASIDE = "set_aside"


@dataclass
class Member:
    """One database of the fleet: its relay while one runs, and why it was last set aside."""

    database: Database
    relay: Relay | None = None
    set_aside: str | None = None  # the reason, while set aside
    # Wall clock: when it entered its state; while set aside, when its outage began.
    since: float = field(default_factory=time.time)
    # When its served relay's server was lost, if it was when that relay failed: its outage
    # began then (set on the failure, read once by the set-aside that follows).
    lost: float | None = None

    @property
    def up(self) -> bool:
        """Served, and its LISTEN connection up (the one session that checks its server all
        the time, `select 1` when quiet): a server lost once served is ridden out by the relay
        and shows here."""
        if self.state is not State.SERVING or self.relay is None:
            return False
        listener = self.relay.view.listener()
        return listener is not None and listener.up

    @property
    def state(self) -> State:
        if self.set_aside is not None:
            return State.SET_ASIDE
        if self.relay is not None and self.relay.view.started():
            return State.SERVING
        return State.STARTING

    def lost_since(self) -> float | None:
        """While its relay's LISTEN connection is down: since when (its first failure)."""
        listener = self.relay.view.listener() if self.relay is not None else None
        return None if listener is None or listener.up else listener.down_since

    def page_state(self) -> DatabaseState:
        """The database as the status page shows it (relay/serving/ui/fleet.py): a database
        served whose LISTEN connection is down is down since that connection's first failure,
        with its error; one set aside since it was, with the reason."""
        state, relay = self.state, self.relay
        listener = relay.view.listener() if relay is not None else None
        error, since = self.set_aside, self.since
        if state is State.SERVING and listener is not None and not listener.up:
            text = logs.redact_text(listener.error or "its LISTEN connection is not connected")
            error = "lost: " + scrub(text, passwords_in(self.database.url.reveal()))
            since = self.lost_since() or since
        status = relay.status if relay is not None else None
        return DatabaseState(
            self.database.name,
            state.value,
            self.up,
            error=error,
            since=since,
            page=status.page if status is not None else None,
            backlog=status.gauges.backlog if status is not None else None,
        )


async def probe(settings: Settings) -> str | None:
    """Why the database of `settings` cannot be served now, in one line without its password
    (unreachable, refused, or its schema version), or None: one connection, one read."""
    url = settings.database_url.reveal()
    try:
        with anyio.fail_after(PROBE_DEADLINE):
            conn = await psycopg.AsyncConnection.connect(
                url, connect_timeout=int(PROBE_DEADLINE), **CONNECT_KWARGS
            )
            async with conn:
                version = await read_version(conn, settings.schema)
    except (psycopg.Error, OSError, TimeoutError) as exc:
        return "unreachable: " + scrub(logs.redact_text(logs.error_text(exc)), passwords_in(url))
    problem = version_problem(version, settings.schema)
    return None if problem is None else f"schema: {problem}"


def retry_delay(attempt: int, rand: float, *, cap: float = MAX_RETRY) -> float:
    """How long a database set aside `attempt` times in a row (from 1) waits before its next
    probe: FIRST_RETRY doubling up to `cap`, in the upper half of each step (`rand` uniform in
    [0, 1)), so replicas started together do not probe in step and none probes at once."""
    return backoff(attempt - 1, base=FIRST_RETRY, cap=cap, rand=rand, jitter=0.5)


def failure(exc: BaseException, settings: Settings) -> str:
    """A relay's failure as a set-aside reason: its first exception's type and message, without
    the passwords of its database's URLs."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    urls = (settings.database_url, settings.listen_database_url)
    passwords = [p for url in urls if url is not None for p in passwords_in(url.reveal())]
    return "failed: " + scrub(logs.redact_text(logs.error_text(exc)), passwords)


async def _ping(notifier: sdnotify.Notifier, interval: float) -> None:
    while True:
        notifier.notify("WATCHDOG=1")
        await anyio.sleep(interval)


class Fleet:
    def __init__(
        self,
        settings: Settings,
        databases: Sequence[Database],
        *,
        client: httpx.AsyncClient | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        prune_interval: float = 60.0,
        tracer: Tracer = NO_TRACING,
        max_retry: float = MAX_RETRY,
    ) -> None:
        self.settings = settings
        self.tracer = tracer
        self.shared = shared_for(settings)  # one limit, one budget, one lateness probe
        self.members = [Member(d) for d in databases]
        # Each database's pools within its share of `server_connections`, when one is set.
        self.pool_sizes = {
            name: split_share(settings, share)
            for name, share in connection_shares(settings, databases, os.environ).items()
        }
        self.max_retry = max_retry
        self._relay_options: dict[str, Any] = {
            "client": client,
            "transport": transport,
            "prune_interval": prune_interval,
            "tracer": tracer,
            "shared": self.shared,
            "keep_metrics": settings.metrics_addr is not None,  # for this fleet's /metrics
        }
        self._stop = anyio.Event()
        # Set once a database is served, or on a stop: `startup_timeout` no longer applies.
        self._startup_over = anyio.Event()
        shared = self.shared
        self.page = FleetPage(
            lambda: [m.page_state() for m in self.members],
            replica_id=settings.replica_id,
            token=settings.ui_token,
            open_without_token=serves_without_token(
                health.split_addr(settings.metrics_addr or ":0")[0]
            ),
            refresh_seconds=health.page_refresh(settings),
        )
        self.metrics = FleetMetrics(
            self.up,
            relays=self.relay_metrics,
            ready=lambda: not self.stopping,
            admission=lambda: shared.permits.view() if shared.permits is not None else None,
            retry_budget=lambda: shared.budget.view(clock.now()),
            fixed_limit=settings.post_ceiling,
            retention=settings.retention,
        )

    # -- public ------------------------------------------------------------------------------

    def stop(self) -> None:
        """Graceful shutdown of every database's relay; set-aside ones are not tried again."""
        if not self._stop.is_set():
            logs.info("shutdown_requested", replica=self.settings.replica_id)
        self._stop.set()
        self._startup_over.set()
        for member in self.members:
            if member.relay is not None:
                member.relay.stop()

    def states(self) -> dict[str, str]:
        """Each database's state, by name (for /readyz, and for tests)."""
        return {m.database.name: m.state.value for m in self.members}

    def up(self) -> dict[str, bool]:
        """Whether each database is served (`Member.up`), by name: `ledger_relay_database_up`."""
        return {m.database.name: m.up for m in self.members}

    def relay_metrics(self) -> dict[str, Metrics]:
        """The metrics of each database whose relay runs, by name (for this fleet's /metrics)."""
        return {
            m.database.name: m.relay.metrics
            for m in self.members
            if m.relay is not None and m.relay.metrics is not None
        }

    async def run(self, *, task_status: TaskStatus[Fleet] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            addr = self.settings.metrics_addr
            async with health.MetricsPort.serving(addr) if addr else nullcontext() as port:
                if port is not None:
                    port.respond = self._respond
                await self._run(task_status)
        finally:
            # The relays leave the shared tracer to the fleet: flushed once, as a relay alone
            # flushes its own (relay/runner.py).
            if self.tracer.enabled:
                bound = flush_timeout(self.settings.shutdown_timeout)
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(self.tracer.shutdown, bound)

    # -- internals ---------------------------------------------------------------------------

    async def _run(self, task_status: TaskStatus[Fleet]) -> None:
        shared = self.shared
        async with anyio.create_task_group() as background:
            if shared.permits is not None:
                background.start_soon(shared.loop_lag.run)
                background.start_soon(shared.permits.settle_when_idle)
            notifier = sdnotify.from_environ()
            if notifier is not None:
                background.start_soon(self._tell_systemd, notifier)
            if self.settings.startup_timeout > 0:
                background.start_soon(self._give_up_unless_served)
            async with anyio.create_task_group() as databases:
                for member in self.members:
                    databases.start_soon(self._serve, member, name=member.database.name)
                logs.info(
                    "fleet_started",
                    replica=self.settings.replica_id,
                    databases=[m.database.name for m in self.members],
                )
                task_status.started(self)
            background.cancel_scope.cancel()
        logs.info("shutdown", replica=self.settings.replica_id)

    async def _serve(self, member: Member) -> None:
        """One database until the fleet stops: probed, served by its relay, set aside and tried
        again whenever either fails. Its log lines name it."""
        settings = for_database(self.settings, member.database)
        with logs.bound(database=member.database.name):
            attempt = 0
            while not self._stop.is_set():
                # A probe is bounded (PROBE_DEADLINE): a stop asked meanwhile waits that long.
                reason = await probe(settings)
                if reason is None:
                    reason = await self._deliver(member, settings)
                    if reason is None:
                        return  # stopped
                    attempt = 0  # it served: a new outage starts from the first delay
                attempt += 1
                delay = retry_delay(attempt, random.random(), cap=self.max_retry)
                self._set_aside(member, reason, delay)
                with anyio.move_on_after(delay):
                    await self._stop.wait()

    async def _deliver(self, member: Member, settings: Settings) -> str | None:
        """The database's relay, run until the fleet stops (None) or it fails (the reason)."""
        name = member.database.name
        relay = Relay(
            settings, database=name, pool_sizes=self.pool_sizes.get(name), **self._relay_options
        )
        # A database set aside stays so, with its reason and since when, until this relay serves.
        member.relay = relay
        try:
            if self._stop.is_set():  # asked between the probe and now: `stop` missed this relay
                return None
            async with anyio.create_task_group() as tg:
                await tg.start(relay.run)  # its lanes run: the fleet has served
                self._startup_over.set()
                member.set_aside, member.since = None, time.time()
        except Exception as exc:  # never the process's end: the database is set aside
            if self._stop.is_set():  # a stop while it started: it returned without serving
                return None
            member.lost = member.lost_since()  # a server lost, ridden out until the relay failed
            return failure(exc, settings)
        finally:
            member.relay = None
        return None

    async def _give_up_unless_served(self) -> None:
        """`startup_timeout` in a fleet: no database served within it (every one set aside or
        still starting) ends the fleet as a relay alone ends, `refused_to_start` and exit 2,
        naming why for each; a deployment whose every URL is wrong fails where it is seen.
        Once one database is served, nothing but a stop ends the fleet: no database alone is
        ever given up on."""
        timeout = self.settings.startup_timeout
        with anyio.move_on_after(timeout):
            await self._startup_over.wait()
            return
        why = "; ".join(f"{m.database.name}: {m.set_aside or m.state.value}" for m in self.members)
        raise ConnectionError(
            f"no database of the fleet was served within startup_timeout ({timeout:g}s): {why}"
        )

    async def _tell_systemd(self, notifier: sdnotify.Notifier) -> None:
        """Under systemd (`Type=notify`): READY at once, every database's delivery started in a
        task of its own (one database down must not fail the start); the watchdog's ping while
        this event loop turns, through the drain too; STOPPING on a stop. A stalled lane of one
        database is not judged yet (a relay alone withholds its ping then)."""
        interval = sdnotify.watchdog_interval(os.environ, os.getpid())
        try:
            notifier.notify("READY=1", "STATUS=delivering")
            logs.info("sd_notify_ready", watchdog_s=interval)
            async with anyio.create_task_group() as tg:
                if interval is not None:
                    tg.start_soon(_ping, notifier, interval)  # until the fleet's end
                await self._stop.wait()
                notifier.notify("STOPPING=1", "STATUS=draining in-flight batches")
        finally:
            notifier.close()

    def _set_aside(self, member: Member, reason: str, delay: float) -> None:
        """One line when a database is set aside; while it stays aside, its retries at debug."""
        if member.set_aside is None:
            logs.warning("database_set_aside", reason=reason, retry_in=round(delay, 2))
            # Down since: its retries and its relays' failed starts are the same outage.
            member.since = member.lost or time.time()
        else:
            logs.debug("database_still_set_aside", reason=reason, retry_in=round(delay, 2))
        member.set_aside, member.lost = reason, None

    async def _respond(self, request: Request) -> Response:
        if self.page.handles(request.path):
            return await self.page.handle(request)
        accept = request.headers.get("accept", "")
        answer = health.fleet_route(
            request.method,
            request.path,
            self.states(),
            self.stopping,
            lambda: self.metrics.exposition(accept),
        )
        return Response(*answer)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()
