"""/healthz and /readyz (DESIGN §8.2) while the database is up, down (cut by a TCP fault proxy)
and back; the pure decisions behind them."""

from __future__ import annotations

import gc
import socket
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import httpx
import psycopg
import pytest
from anyio.abc import SocketStream, TaskGroup
from psycopg import sql

from relay.delivery.lane import LaneStats, LaneView
from relay.runner import GC_THRESHOLDS, Relay, tune_gc
from relay.serving import server as serving
from relay.serving.health import (
    DatabaseProbe,
    Endpoints,
    readiness,
    refresh_gap,
    refresh_interval,
    split_addr,
)
from relay.serving.metrics import Metrics
from relay.serving.progress import ListenerView, RelayView, loops_alive, stall_limit
from relay.serving.server import to_evict
from relay.tools.sink import Sink
from tests.conftest import unique
from tests.support import Decisions, Rig, relay_logs, settings, wait_for
from tests.test_metrics import get, relay_port, scrape

# -- pure -----------------------------------------------------------------------------------


def test_loops_alive() -> None:
    assert loops_alive([10.0, 11.0], since=0.0, now=12.0, limit=5.0)
    assert not loops_alive([10.0, 2.0], since=0.0, now=12.0, limit=5.0)
    # A loop that has not turned yet counts from when serving started.
    assert loops_alive([0.0], since=9.0, now=12.0, limit=5.0)
    assert not loops_alive([0.0], since=1.0, now=12.0, limit=5.0)


def test_readiness_names_what_is_missing() -> None:
    ok, checks = readiness(
        started=True, database=True, schema_problem=None, listen_up=True, ingress_ok=True
    )
    assert ok and all(v is True for v in checks.values())
    ok, checks = readiness(
        started=True, database=True, schema_problem="run `relay migrate`", listen_up=False,
        ingress_ok=True,
    )  # fmt: skip
    assert not ok
    assert checks["schema"] == "run `relay migrate`" and checks["listen"] is False


def test_bounds_follow_the_settings() -> None:
    cfg = settings("postgresql://x@h/db", "relay", "http://sink")
    assert stall_limit(cfg) > 2 * cfg.statement_timeout + cfg.poll_interval
    assert 1.0 <= refresh_interval(cfg) <= 15.0
    assert split_addr("127.0.0.1:9100") == ("127.0.0.1", 9100)
    assert split_addr(":9100") == (None, 9100)
    assert split_addr("[::1]:0") == ("::1", 0)


# -- what the endpoints read: a view, nothing else ----------------------------------------------


class FakeRelay:
    """State an observer can only read through the `RelayView` it is handed."""

    def __init__(self) -> None:
        self.started = True
        self.stopping = False
        self.listen_up = True
        self.ingress_ok = True
        self.turned_at = [0.0, 0.0]
        self.turns = [2, 2]
        self.stopped = anyio.Event()

    def view(self) -> RelayView:
        return RelayView(
            started=lambda: self.started,
            stop_requested=lambda: self.stopping,
            wait_stop_requested=self.stopped.wait,
            lanes=lambda: [
                LaneView(name, LaneStats(), 0, turns, at, misconfigured=False)
                for name, turns, at in zip(
                    ("critical", "ordinary"), self.turns, self.turned_at, strict=True
                )
            ],
            listener=lambda: ListenerView(self.listen_up, reconnects=1, received=0),
            ingress_ok=lambda: self.ingress_ok,
        )


@pytest.mark.anyio
async def test_liveness_and_readiness_read_the_view() -> None:
    cfg = settings("postgresql://x@h/db", "relay", "http://sink", poll_interval="0.2")
    relay = FakeRelay()
    endpoints = Endpoints(cfg, relay.view(), store=None, metrics=Metrics())  # type: ignore[arg-type]
    endpoints.gauges.database, endpoints.gauges.schema_problem = True, None
    now = anyio.current_time()
    relay.turned_at = [now, now]
    assert endpoints.alive()
    assert endpoints.ready() == (
        True,
        {"started": True, "database": True, "schema": True, "listen": True, "ingress": True},
    )
    relay.turned_at = [now, now - stall_limit(cfg) - 60]  # the ordinary lane is stuck
    endpoints.since = now - stall_limit(cfg) - 60
    assert not endpoints.alive()
    relay.stopping = True  # draining: alive, not ready
    assert endpoints.alive()
    assert endpoints.ready()[1]["started"] is False
    relay.stopping, relay.listen_up, relay.ingress_ok = False, False, False
    ok, checks = endpoints.ready()
    assert not ok and checks["listen"] is False and checks["ingress"] is False


# -- a TCP fault proxy in front of PostgreSQL ---------------------------------------------------


class Proxy:
    """Forwards TCP to PostgreSQL; `cut()` drops every connection and refuses new ones (closes
    them at once) until `restore()`."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.open = True
        self.port = 0
        self._scopes: set[anyio.CancelScope] = set()

    async def start(self, tg: TaskGroup) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)

        async def serve() -> None:
            async with listener:
                await listener.serve(self._handle)

        tg.start_soon(serve)

    def cut(self) -> None:
        self.open = False
        for scope in list(self._scopes):
            scope.cancel()

    def restore(self) -> None:
        self.open = True

    async def _handle(self, client: SocketStream) -> None:
        async with client:
            if not self.open:
                return
            with anyio.CancelScope() as scope:
                self._scopes.add(scope)
                try:
                    upstream = await anyio.connect_tcp(*self.target)
                    async with upstream, anyio.create_task_group() as tg:
                        tg.start_soon(_pipe, client, upstream, tg)
                        tg.start_soon(_pipe, upstream, client, tg)
                finally:
                    self._scopes.discard(scope)


async def _pipe(src: SocketStream, dst: SocketStream, tg: TaskGroup) -> None:
    try:
        async for chunk in src:
            await dst.send(chunk)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass
    tg.cancel_scope.cancel()


def via(url: str, port: int) -> str:
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0] + "@" if len(netloc) == 2 else ""
    return urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{port}"))


@pytest.mark.anyio
async def test_health_while_the_database_is_up_down_and_back(
    pg_url: str, schema: str, sink: tuple[Sink, str]
) -> None:
    _, url = sink
    target = urlsplit(pg_url)
    assert target.hostname and target.port, "the test needs PostgreSQL over TCP"
    async with anyio.create_task_group() as tg:
        proxy = Proxy(target.hostname, target.port)
        await proxy.start(tg)
        cfg = settings(
            via(pg_url, proxy.port),
            schema,
            url,
            metrics_addr="127.0.0.1:0",
            statement_timeout="1s",
            poll_interval="0.2",
        )
        async with Relay(cfg).running() as r:
            port = relay_port(r)
            assert r.endpoints is not None and r.listener is not None
            endpoints, listener = r.endpoints, r.listener

            async def status(path: str) -> int:
                return (await get(port, path)).status_code

            async def ready() -> bool:
                return await status("/readyz") == 200

            await wait_for(ready, what="ready")
            assert await status("/healthz") == 200
            assert await status("/metrics") == 200
            assert await status("/nope") == 404
            async with httpx.AsyncClient() as client:
                posted = await client.post(f"http://127.0.0.1:{port}/healthz")
            assert posted.status_code == 405

            # Down: not ready (database, LISTEN), but alive: the loops keep turning.
            proxy.cut()
            await wait_for(lambda: not listener.up, what="LISTEN to notice")
            await endpoints.probe()
            body = (await get(port, "/readyz")).json()
            assert body["ready"] is False
            assert body["checks"]["database"] is False and body["checks"]["listen"] is False
            turns = {name: lane.turns for name, lane in r.lanes.items()}
            await wait_for(
                lambda: all(lane.turns > turns[n] + 1 for n, lane in r.lanes.items()),
                what="lanes to turn while the database is down",
            )
            assert await status("/healthz") == 200

            # Back: ready again without a restart.
            proxy.restore()
            await wait_for(lambda: listener.up, what="LISTEN back")
            await endpoints.probe()
            await wait_for(ready, what="ready again")
            assert await status("/healthz") == 200
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_functions_older_than_this_relay_are_warned_once_each_then_quiet(
    aconn: psycopg.AsyncConnection[Any],
) -> None:
    """A database whose functions are older than this relay has no backlog_by_key() nor
    outbox_part_age(): each refresh leaves those figures out, and each is named in a warning
    once, not at every refresh."""
    older = unique("older")
    await aconn.execute(sql.SQL("create schema {}").format(sql.Identifier(older)))
    try:
        cfg = settings("postgresql://x@h/db", older, "http://sink")
        store = SimpleNamespace(schema=older, statement_timeout=5.0)
        gauges = DatabaseProbe(cfg, store=store, metrics=Metrics())  # type: ignore[arg-type]
        with relay_logs(Decisions()) as seen:
            for _ in range(3):
                assert await gauges._refresh_backlog_keys(aconn) == ()
                await gauges._refresh_part_age(aconn)
        assert [f["hint"] for f in seen.named("backlog_by_key_unavailable")] == [
            "run `relay migrate` (with the roles, if the relay has its own)"
        ]
        assert len(seen.named("part_age_unavailable")) == 1
    finally:
        await aconn.execute(sql.SQL("drop schema {} cascade").format(sql.Identifier(older)))


@pytest.mark.anyio
async def test_readyz_reports_a_wrong_schema_version(rig: Rig) -> None:
    async with rig.relay(metrics_addr="127.0.0.1:0").running() as r:
        port = relay_port(r)
        assert r.endpoints is not None
        endpoints = r.endpoints

        async def ready() -> bool:
            return (await get(port, "/readyz")).status_code == 200

        await wait_for(ready, what="ready")
        # Someone migrated the database past this relay's code (a newer release rolled out).
        rig.conn.execute(rig.q("insert into {s}.schema_migrations values (99, 'future', 'x')"))
        await endpoints.probe()
        got = await get(port, "/readyz")
        assert got.status_code == 503
        assert "upgrade the relay" in got.json()["checks"]["schema"]
        assert (await get(port, "/healthz")).status_code == 200


@pytest.mark.anyio
async def test_metrics_addr_in_use_is_a_clear_refusal(
    pg_url: str, schema: str, sink: tuple[Sink, str]
) -> None:
    _, url = sink
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    async with listener:
        taken = listener.extra(anyio.abc.SocketAttribute.local_port)
        cfg = settings(pg_url, schema, url, metrics_addr=f"127.0.0.1:{taken}")
        relay = Relay(cfg)
        with pytest.raises(BaseException) as info:
            async with relay.running():
                pass
    for lane in relay.lanes.values():  # built but never run: their ack queues are still open
        lane.complete.close()
    exc: BaseException = info.value
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    assert isinstance(exc, ConnectionError)
    assert f"metrics_addr 127.0.0.1:{taken}" in str(exc)


def test_a_costly_refresh_is_followed_by_a_longer_gap() -> None:
    assert refresh_gap(2.5, 0.01) == 2.5  # cheap: the period
    assert refresh_gap(2.5, 0.4) == 8.0  # 0.4 s of database time: 20 times that before the next


def test_relay_run_tunes_the_garbage_collector_for_a_long_life() -> None:
    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold() == GC_THRESHOLDS
        assert GC_THRESHOLDS[0] > 700  # rarer young collections than the default
        assert gc.get_freeze_count() > 1000  # the start-up objects: out of every collection
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


@pytest.mark.anyio
async def test_the_metrics_port_answers_from_its_first_answer_until_the_relay_runs(
    pg_url: str, schema: str, sink: tuple[Sink, str]
) -> None:
    """`metrics_addr` is bound once, at start: the start-up answers while the relay waits for
    its database and starts, then the endpoints. A probe in between is answered, never refused.
    A LISTEN connection that cannot connect holds the start for `statement_timeout` (the
    relay then starts without liveness): the stand-in used to close before that and the
    endpoints to bind after it, and a probe in that window found the port closed."""
    _, url = sink
    with socket.socket() as s:  # a free port to name in advance
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = settings(
        pg_url,
        schema,
        url,
        metrics_addr=f"127.0.0.1:{port}",
        listen_database_url="postgresql://127.0.0.1:1/none",
        statement_timeout="3s",
    )
    answers: list[int | str] = []
    done = anyio.Event()  # stop probing: before the relay stops and closes the port

    async def probe() -> None:
        while not done.is_set():
            try:
                answer: int | str = (await get(port, "/readyz")).status_code
            except httpx.ConnectError:
                answer = "refused"
            if not done.is_set():
                answers.append(answer)
            await anyio.sleep(0.02)

    async with anyio.create_task_group() as tg:
        tg.start_soon(probe)
        async with Relay(cfg).running() as r:
            assert relay_port(r) == port
            started = len(answers)
            await wait_for(lambda: len(answers) > started + 5, what="the endpoints' answers")
            done.set()
    first = next(i for i, a in enumerate(answers) if a != "refused")
    after = answers[first:]
    assert "refused" not in after, f"closed during the start after answering: {after}"
    # answered through the ~3 s of the start (at ~20 ms a probe), not ready all along (no
    # LISTEN connection)
    assert len(after) >= 10, f"the start went unanswered (bound with the endpoints): {answers}"
    assert set(after) == {503}, after


@pytest.mark.anyio
async def test_ready_gauge_is_true_without_anyone_asking_readyz(rig: Rig) -> None:
    """Under systemd nothing calls /readyz: the relay keeps `ledger_relay_ready` itself, so the
    shipped alert LedgerRelayReplicaNotReady stays quiet for a healthy replica (issue 41). Read
    first from the registry (no HTTP at all: the probe loop's own refresh), then scraped."""
    async with rig.relay(metrics_addr="127.0.0.1:0", poll_interval="0.2").running() as r:
        assert r.endpoints is not None
        registry = r.endpoints.metrics.registry
        await wait_for(
            lambda: registry.get_sample_value("ledger_relay_ready") == 1.0,
            what="the relay's own readiness refresh",
        )
        samples = await scrape(relay_port(r))
        assert samples[("ledger_relay_ready", ())] == 1.0


# -- the metrics port under a flood of unfinished requests ------------------------------------


def test_a_full_port_takes_from_the_biggest_holder_never_from_a_smaller_one() -> None:
    # every slot waiting for a head: "a" holds 3, "b" 1
    assert to_evict(["a", "a", "b", "a"], newcomer="c") == "a"
    assert to_evict(["a", "a", "b", "a"], newcomer="b") == "a"
    assert to_evict(["a", "a", "b", "a"], newcomer="a") is None  # the flood sheds its own
    assert to_evict(["a", "b"], newcomer="a") is None  # as many as the biggest: shed
    assert to_evict([], newcomer="a") is None  # every slot answering: shed


def half_open(port: int, count: int) -> list[socket.socket]:
    """`count` connections from 127.0.0.1, each holding an unfinished request head."""
    held = []
    for _ in range(count):
        c = socket.create_connection(("127.0.0.1", port))
        c.sendall(b"GET /healthz HTTP/1.1\r\nHost: flood\r\n")  # no blank line: never ends
        c.setblocking(False)
        held.append(c)
    return held


def closed_by_server(c: socket.socket) -> bool:
    try:
        return c.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


@pytest.mark.anyio
async def test_probes_are_answered_while_a_client_holds_every_slot(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """100 connections from one client, each with an unfinished request head, fill the metrics
    port (MAX_CONNECTIONS slots); the kubelet's probe comes from another address (here
    127.0.0.2, loopback too) and must be answered while they are held. They are held for longer
    than the test runs (HEAD_DEADLINE raised), so no slot frees itself meanwhile. Until issue 41
    the probe was shed (closed unanswered) for as long as the flood lasted."""
    try:  # Linux routes all of 127/8 to loopback; elsewhere only 127.0.0.1 may be there
        socket.create_server(("127.0.0.2", 0)).close()
    except OSError:
        pytest.skip("no second loopback address (127.0.0.2) to probe from")
    monkeypatch.setattr(serving, "HEAD_DEADLINE", 600.0)
    monkeypatch.setattr(serving, "REQUEST_DEADLINE", 600.0)
    async with rig.relay(metrics_addr="127.0.0.1:0").running() as r:
        port = relay_port(r)
        await wait_for(lambda: healthz_from(port, "127.0.0.2"), what="the endpoints")
        flood = half_open(port, 100)
        try:
            # The port is full: all but MAX_CONNECTIONS of the flood were shed at once.
            await wait_for(
                lambda: sum(map(closed_by_server, flood)) == len(flood) - serving.MAX_CONNECTIONS,
                what="the flood to fill the port",
            )
            holding = [c for c in flood if not closed_by_server(c)]
            assert len(holding) == serving.MAX_CONNECTIONS
            with anyio.fail_after(60):  # a hang detector, not a threshold
                for path in ("/healthz", "/readyz", "/metrics"):
                    assert await healthz_from(port, "127.0.0.2", path), path
            # Answered while the flood held on: each probe took one of its slots, no more.
            still = [c for c in holding if not closed_by_server(c)]
            assert len(still) >= serving.MAX_CONNECTIONS - 3
            # The flooding client gets the slots the probes gave back and no more: past them
            # its new connections are shed, and do not evict its own older ones.
            free = serving.MAX_CONNECTIONS - len(still)
            flood += half_open(port, free + 5)
            more = flood[-(free + 5) :]
            await wait_for(
                lambda: sum(map(closed_by_server, more)) == 5, what="the flood's own shed"
            )
            assert not any(map(closed_by_server, still))
        finally:
            for c in flood:
                c.close()


async def healthz_from(port: int, source: str, path: str = "/healthz") -> bool:
    """`path` answered (any status) to a client bound to `source`."""
    transport = httpx.AsyncHTTPTransport(local_address=source)
    async with httpx.AsyncClient(transport=transport) as client:
        got = await client.get(f"http://127.0.0.1:{port}{path}", timeout=30)
    return got.status_code in (200, 503)
