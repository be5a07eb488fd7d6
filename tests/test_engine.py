"""Engine wakes that really wake (DESIGN §6, §9.4): real absurd-sdk tasks sleeping on
`run-created:<run_id>`, resumed by the relay's acknowledgement, against the real Absurd schema,
with the relay and the reference sink in process.

- End to end: the task resumes and completes with the ack's payload; also when the event was
  acknowledged before the task awaited it (Absurd's cache).
- Wake iff ack under faults: an ack rolled back by a transient engine error, the stale ack of
  a zombie replica whose event was redelivered and acknowledged by another, and an ack that
  spans an event whose own ack committed before, neither wake the task nor emit again. An
  "emit probe" (a trigger on `absurd."e_<queue>"` counting attempted inserts in a sequence,
  which no rollback undoes) sees every call of `absurd.emit_event`, even those Absurd's
  first-write-wins would hide. The relay cannot POST an event again once its ack committed
  (claims return pending events only), so those two are the ways an ack meets such an event.
- The wake listener (relay.engine): a wake resumes the task with the stock poll 30 s away;
  also after `pg_terminate_backend` of its connection, after a silent network (a proxy that
  swallows bytes) caught by its health check, and with the sync client.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import psycopg
import pytest
from absurd_sdk import Absurd, AsyncAbsurd, AsyncTaskContext, TaskContext
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import relay
from relay.engine import WakeListener, WakeWorker
from tests.support import Rig, count, q, wait_for

pytestmark = pytest.mark.anyio

TASK = "await-run-created"
LONG_POLL = 30.0  # the stock poll of the listener tests: far beyond WAKE_DEADLINE
WAKE_DEADLINE = 15.0  # a resume within it cannot have come from a poll


def wake_name(run_id: str) -> str:
    return f"run-created:{run_id}"


def register_async(client: AsyncAbsurd) -> None:
    @client.register_task(TASK)
    async def await_run_created(params: dict[str, Any], ctx: AsyncTaskContext) -> Any:
        event = await ctx.await_event(wake_name(params["run_id"]))
        return {"run_id": params["run_id"], "event": event}


def register_sync(client: Absurd, blocker: tuple[threading.Event, threading.Event]) -> None:
    started, release = blocker

    @client.register_task(TASK)
    def await_run_created(params: dict[str, Any], ctx: TaskContext) -> Any:
        event = ctx.await_event(wake_name(params["run_id"]))
        return {"run_id": params["run_id"], "event": event}

    @client.register_task("blocker")
    def block(params: dict[str, Any], ctx: TaskContext) -> Any:
        started.set()
        return release.wait(60)


@asynccontextmanager
async def registered_client(pg_url: str, queue: str) -> AsyncIterator[AsyncAbsurd]:
    """An async client of `queue` with the task registered, closed on the way out."""
    c = AsyncAbsurd(pg_url, queue_name=queue)
    register_async(c)
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture
async def client(pg_url: str, queue: str) -> AsyncIterator[AsyncAbsurd]:
    """A worker-side client with the task registered (its one connection is the worker's)."""
    async with registered_client(pg_url, queue) as c:
        yield c


@pytest.fixture
async def driver(pg_url: str, queue: str) -> AsyncIterator[AsyncAbsurd]:
    """A second client for the test itself: spawns tasks and runs them up to their await."""
    async with registered_client(pg_url, queue) as c:
        yield c


class EmitProbe:
    """Counts attempted inserts of emitted events into `absurd."e_<queue>"` (await_event's
    NULL-payload placeholder excluded). The sequence counts attempts in rolled-back
    transactions too; the table keeps the names of committed ones."""

    def __init__(self, conn: psycopg.Connection[Any], schema: str, queue: str) -> None:
        self.conn, self.schema = conn, schema
        conn.execute(q(schema, "create sequence {s}.emit_attempts"))
        conn.execute(q(schema, "create table {s}.emit_calls (event_name text, payload jsonb)"))
        conn.execute(
            q(
                schema,
                "create function {s}.count_emit() returns trigger language plpgsql as $$ begin"
                " perform nextval('{s}.emit_attempts');"
                " insert into {s}.emit_calls values (new.event_name, new.payload);"
                " return new; end $$",
            )
        )
        conn.execute(
            sql.SQL(
                "create trigger count_emit before insert on {} for each row"
                " when (new.payload is not null) execute function {}.count_emit()"
            ).format(sql.Identifier("absurd", f"e_{queue}"), sql.Identifier(schema))
        )

    def attempts(self) -> int:
        row = self.conn.execute(
            q(self.schema, "select case when is_called then last_value else 0 end"
                           " from {s}.emit_attempts")
        ).fetchone()  # fmt: skip
        assert row is not None
        return int(row[0])

    def committed(self) -> list[str]:
        rows = self.conn.execute(q(self.schema, "select event_name from {s}.emit_calls"))
        return [r[0] for r in rows.fetchall()]


@pytest.fixture
def probe(conn: psycopg.Connection[Any], schema: str, queue: str) -> EmitProbe:
    return EmitProbe(conn, schema, queue)


class WakeInbox:
    """A LISTEN on absurd_wake; `until_marker()` returns what arrived before a marker sent now
    (notifications arrive in commit order, so nothing committed earlier can come later)."""

    def __init__(self, listener: psycopg.Connection[Any], conn: psycopg.Connection[Any]) -> None:
        self.listener, self.conn, self.n = listener, conn, 0
        listener.execute("LISTEN absurd_wake")

    def until_marker(self) -> list[str]:
        self.n += 1
        marker = f"marker:{self.n}"
        self.conn.execute("select pg_notify('absurd_wake', %s)", (marker,))
        got = []
        for note in self.listener.notifies(timeout=10):
            if note.payload == marker:
                return got
            got.append(note.payload)
        raise AssertionError(f"marker not received; got {got}")


@pytest.fixture
def inbox(pg_url: str, conn: psycopg.Connection[Any]) -> Iterator[WakeInbox]:
    with psycopg.connect(pg_url, autocommit=True) as listener:
        yield WakeInbox(listener, conn)


# --- helpers ----------------------------------------------------------------------------------


def on_queue(
    conn: psycopg.Connection[Any], table: str, queue: str, text: str, key: str
) -> psycopg.Cursor[Any]:
    """`text` run with `{}` as the queue's Absurd table `table` ("t" its tasks, "r" their runs,
    "e" its events) and `%s` as `key`."""
    return conn.execute(sql.SQL(text).format(sql.Identifier("absurd", f"{table}_{queue}")), (key,))


def task_state(conn: psycopg.Connection[Any], queue: str, task_id: str) -> tuple[str, Any]:
    text = "select state, completed_payload from {} where task_id = %s"
    row = on_queue(conn, "t", queue, text, task_id).fetchone()
    assert row is not None
    return row[0], row[1]


def claimed_by(conn: psycopg.Connection[Any], queue: str, task_id: str) -> list[str | None]:
    """Who claimed each run of the task (Absurd keeps `claimed_by` once completed)."""
    text = "select claimed_by from {} where task_id = %s order by attempt"
    return [r[0] for r in on_queue(conn, "r", queue, text, task_id).fetchall()]


def engine_event(conn: psycopg.Connection[Any], queue: str, name: str) -> tuple[bool, Any]:
    """(row exists, payload) of an event in absurd."e_<queue>"."""
    text = "select payload from {} where event_name = %s"
    row = on_queue(conn, "e", queue, text, name).fetchone()
    return (row is not None, row[0] if row else None)


def delivered_at(conn: psycopg.Connection[Any], schema: str, event_id: str) -> str | None:
    row = conn.execute(
        q(schema, "select to_json(delivered_at) #>> '{{}}' from {s}.events where event_id = %s"),
        (event_id,),
    ).fetchone()
    return row[0] if row else None


def enqueue_created(conn: psycopg.Connection[Any], schema: str, queue: str, run_id: str) -> None:
    """The producer's transaction: the run_created event with its engine wake."""
    with conn.transaction():
        relay.enqueue(
            conn,
            run_id,
            f"{run_id}-created",
            "run_created",
            {"run_id": run_id},
            wake=(queue, wake_name(run_id)),
            schema=schema,
        )


async def spawn_sleeping(
    driver: AsyncAbsurd, conn: psycopg.Connection[Any], queue: str, run_id: str
) -> str:
    """Spawn the task and run it (on the driver) until it sleeps on its event."""
    spawned = await driver.spawn(TASK, {"run_id": run_id})
    task_id = str(spawned["task_id"])
    await driver.work_batch("driver")
    assert task_state(conn, queue, task_id)[0] == "sleeping"
    return task_id


def completed(conn: psycopg.Connection[Any], queue: str, task_id: str) -> Callable[[], bool]:
    return lambda: task_state(conn, queue, task_id)[0] == "completed"


@asynccontextmanager
async def background(fn: Callable[[], Awaitable[None]]) -> AsyncIterator[None]:
    """Run `fn` for the duration of the block, then cancel it."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(fn)
        try:
            yield
        finally:
            tg.cancel_scope.cancel()


def assert_resumed_by_ack(
    conn: psycopg.Connection[Any], schema: str, queue: str, task_id: str, run_id: str
) -> None:
    state, result = task_state(conn, queue, task_id)
    assert state == "completed"
    event = result["event"]
    assert event["event_id"] == f"{run_id}-created" and event["run_id"] == run_id
    # The payload is the ack's, on the database clock: the event's delivered_at is its run's
    # last delivery (schema version 7 keeps no time per event), so the wake's is at or before
    # it, and after the event was enqueued.
    assert conn.execute(
        "select %s::timestamptz <= %s::timestamptz and %s::timestamptz > e.created_at"
        f" from {schema}.events e where e.event_id = %s",
        (
            event["delivered_at"],
            delivered_at(conn, schema, f"{run_id}-created"),
            event["delivered_at"],
            f"{run_id}-created",
        ),
    ).fetchone() == (True,)


# --- end to end -------------------------------------------------------------------------------


async def test_the_relays_ack_resumes_sleeping_tasks(
    rig: Rig, queue: str, client: AsyncAbsurd, driver: AsyncAbsurd, probe: EmitProbe
) -> None:
    """Stock absurd-sdk worker (polling): spawn, sleep, enqueue, deliver, resume, complete."""
    conn, schema = rig.conn, rig.schema
    runs = [f"run-{i}" for i in range(5)]
    tasks = {r: await spawn_sleeping(driver, conn, queue, r) for r in runs}
    for r in runs:
        enqueue_created(conn, schema, queue, r)
    async with (
        rig.relay().running(),
        background(lambda: client.start_worker(worker_id="stock", poll_interval=0.05)),
    ):
        for r in runs:
            await wait_for(completed(conn, queue, tasks[r]), what=f"task of {r} to complete")
    for r in runs:
        assert_resumed_by_ack(conn, schema, queue, tasks[r], r)
    assert sorted(probe.committed()) == sorted(wake_name(r) for r in runs)
    assert probe.attempts() == len(runs)


async def test_an_event_acknowledged_before_the_task_awaits_it_is_returned_from_the_cache(
    rig: Rig, queue: str, client: AsyncAbsurd, driver: AsyncAbsurd
) -> None:
    conn, schema = rig.conn, rig.schema
    enqueue_created(conn, schema, queue, "early")
    async with rig.relay().running():
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 1, what="ack")
    assert engine_event(conn, queue, wake_name("early"))[0]  # cached by Absurd
    task_id = str((await driver.spawn(TASK, {"run_id": "early"}))["task_id"])
    await client.work_batch("w")  # one run: the await finds the cached event and goes on
    assert_resumed_by_ack(conn, schema, queue, task_id, "early")
    assert len(claimed_by(conn, queue, task_id)) == 1


# --- wake iff ack, under faults ---------------------------------------------------------------


async def test_a_rolled_back_ack_wakes_nothing_and_the_retried_ack_wakes_once(
    rig: Rig, queue: str, driver: AsyncAbsurd, probe: EmitProbe, inbox: WakeInbox
) -> None:
    """Another transaction holds the engine's event row: the relay's ack calls emit, times out
    on the lock and rolls back whole (a transient engine error: retried, not failed). The event
    stays pending, the task asleep, no absurd_wake is sent. Once the lock goes, a retried ack
    commits and wakes the task, once."""
    conn, schema = rig.conn, rig.schema
    task_id = await spawn_sleeping(driver, conn, queue, "r1")
    enqueue_created(conn, schema, queue, "r1")
    inbox.until_marker()  # past the producer's own notification
    with psycopg.connect(rig.pg_url) as locker:  # not autocommit: the lock lives until rollback
        text = "select 1 from {} where event_name = %s for update"
        on_queue(locker, "e", queue, text, wake_name("r1"))
        async with rig.relay().running():
            # A second emit call means the first ack has certainly rolled back.
            await wait_for(lambda: probe.attempts() >= 2, what="a retried ack")
            assert probe.committed() == []
            assert engine_event(conn, queue, wake_name("r1")) == (True, None)  # placeholder
            assert task_state(conn, queue, task_id)[0] == "sleeping"
            assert count(conn, schema, "state = 'pending'") == 1
            assert queue not in inbox.until_marker()
            locker.rollback()
            await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 1, what="ack")
    assert probe.committed() == [wake_name("r1")]
    assert queue in inbox.until_marker()
    assert task_state(conn, queue, task_id)[0] == "pending"  # woken: due now
    await driver.work_batch("w")
    assert_resumed_by_ack(conn, schema, queue, task_id, "r1")


async def test_a_stale_ack_of_a_redelivered_event_does_not_call_emit(
    rig: Rig, queue: str, driver: AsyncAbsurd, probe: EmitProbe
) -> None:
    """A zombie replica: its POST hangs past its lease, a second replica redelivers the event
    and acks it (the one wake), then the zombie's POST succeeds and its ack, fenced by the
    replaced token, changes nothing and calls no emit."""
    s, conn, schema = rig.sink, rig.conn, rig.schema
    s.state.reject_stale_epochs = False  # let the zombie's late POST through to its ack
    task_id = await spawn_sleeping(driver, conn, queue, "r1")
    enqueue_created(conn, schema, queue, "r1")
    s.faults.delay(3.0, run_id="r1")
    first = rig.relay(replica_id="first", lease_ttl="30s")
    async with first.running():
        await wait_for(lambda: bool(first.lanes["ordinary"].inflight), what="first claim")
        conn.execute(
            q(schema, "update {s}.runs set lease_expires_at = clock_timestamp(),"
                      " next_attempt_at = clock_timestamp()")
        )  # fmt: skip
        second = rig.relay(replica_id="second")
        async with second.running():
            await wait_for(lambda: probe.attempts() == 1, what="the second replica's ack")
            await wait_for(
                lambda: first.lanes["ordinary"].stats.stale_acks == 1, what="the zombie's ack"
            )
    assert s.state.deliveries["r1-created"] == 2  # the ingress saw it twice
    assert probe.attempts() == 1
    assert probe.committed() == [wake_name("r1")]
    await driver.work_batch("w")
    assert_resumed_by_ack(conn, schema, queue, task_id, "r1")


async def test_an_ack_spanning_an_already_acknowledged_wake_event_does_not_call_emit(
    rig: Rig, queue: str, driver: AsyncAbsurd, probe: EmitProbe
) -> None:
    """Poison narrowing resends a rejected batch one event at a time under one lease, acking
    each: the ack of the second event (upto seq 2) covers the first again, whose own ack
    committed a moment before. Only rows an ack marks delivered call emit."""
    s, conn, schema = rig.sink, rig.conn, rig.schema
    task_id = await spawn_sleeping(driver, conn, queue, "r1")
    with conn.transaction():
        relay.enqueue_many(
            conn,
            "r1",
            [
                relay.Event("r1-created", "run_created", {"i": 1}, wake_queue=queue,
                            wake_event=wake_name("r1")),
                relay.Event("r1-step", "step", {"i": 2}),
                relay.Event("r1-bad", "step", {"i": 3}),
            ],
            schema=schema,
        )  # fmt: skip
    s.faults.poison("r1-bad", 422)
    async with rig.relay().running():
        await wait_for(lambda: count(conn, schema, "state = 'failed'") == 1, what="poison")
    assert count(conn, schema, "state = 'delivered'") == 2
    posts = [req["seqs"] for req in s.state.received if req["run_id"] == "r1"]
    assert posts == [[1, 2, 3], [1], [2], [3]]
    assert probe.attempts() == 1
    assert probe.committed() == [wake_name("r1")]
    await driver.work_batch("w")
    assert_resumed_by_ack(conn, schema, queue, task_id, "r1")


def test_the_emit_probe_sees_a_second_emit_that_absurd_ignores(
    conn: psycopg.Connection[Any], queue: str, probe: EmitProbe
) -> None:
    """The probe is what makes the tests above meaningful: first-write-wins hides the second
    call from absurd."e_<queue>", not from the probe."""
    conn.execute("select absurd.emit_event(%s, 'x', '{\"n\": 1}')", (queue,))
    conn.execute("select absurd.emit_event(%s, 'x', '{\"n\": 2}')", (queue,))
    assert engine_event(conn, queue, "x") == (True, {"n": 1})
    assert probe.attempts() == 2


# --- the wake listener ------------------------------------------------------------------------


async def wake_resumes(
    worker: WakeWorker, rig: Rig, queue: str, driver: AsyncAbsurd, run_id: str
) -> None:
    """With `worker` running and its stock poll LONG_POLL away: a task sleeping on run_id's
    event is resumed, by a claim of the wake path, within WAKE_DEADLINE of the enqueue."""
    conn, schema = rig.conn, rig.schema
    task_id = await spawn_sleeping(driver, conn, queue, run_id)
    batches = worker.wake_batches
    enqueue_created(conn, schema, queue, run_id)
    async with rig.relay().running():
        await wait_for(
            completed(conn, queue, task_id), timeout=WAKE_DEADLINE, what="a wake to resume it"
        )
    assert_resumed_by_ack(conn, schema, queue, task_id, run_id)
    assert claimed_by(conn, queue, task_id) == [worker.wake_worker_id]
    assert worker.wake_batches > batches


async def listening(worker: WakeWorker, connects: int = 1) -> None:
    await wait_for(
        lambda: (
            worker.listener.up
            and worker.listener.connects >= connects
            and worker.wake_batches >= connects
        ),  # the batch every (re)connect runs
        what="the wake listener to connect",
    )


@asynccontextmanager
async def wake_worker(
    url: str, queue: str, client: AsyncAbsurd, **options: float
) -> AsyncIterator[WakeWorker]:
    """A WakeWorker of `client` on `url`, its stock poll LONG_POLL away, running in the
    background with its listener connected."""
    worker = WakeWorker(url, queue, worker_id="w", poll_interval=LONG_POLL, **options)
    async with background(lambda: worker.run(client)):
        await listening(worker)
        yield worker


async def test_a_wake_resumes_the_task_long_before_the_poll(
    rig: Rig, queue: str, client: AsyncAbsurd, driver: AsyncAbsurd
) -> None:
    async with wake_worker(rig.pg_url, queue, client) as worker:
        await wake_resumes(worker, rig, queue, driver, "r1")
        ignored = worker.listener.ignored
    assert ignored >= 1  # the producer's `outbox:<schema>` notification woke nothing


async def test_the_wake_listener_reconnects_after_its_backend_is_killed(
    rig: Rig, queue: str, client: AsyncAbsurd, driver: AsyncAbsurd
) -> None:
    async with wake_worker(rig.pg_url, queue, client) as worker:
        pid = worker.listener.backend_pid
        assert rig.conn.execute("select pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)
        await listening(worker, connects=2)
        assert worker.listener.backend_pid != pid
        await wake_resumes(worker, rig, queue, driver, "r1")


class Blackhole:
    """A TCP proxy to PostgreSQL whose `swallow()` makes every open connection silent: bytes
    are read and dropped, nothing is closed (a dead middlebox or a partitioned network, which
    neither TCP keepalives nor the socket notice). New connections pass."""

    def __init__(self, url: str) -> None:
        info = conninfo_to_dict(url)
        self.target = (str(info.get("host") or "127.0.0.1"), int(info.get("port") or 5432))
        self.url = url
        self.generation = 0

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Blackhole]:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        self.url = make_conninfo(self.url, host="127.0.0.1", port=port)
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, self._handle)
            try:
                yield self
            finally:
                tg.cancel_scope.cancel()

    def swallow(self) -> None:
        self.generation += 1

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        generation = self.generation
        async with client, await anyio.connect_tcp(*self.target) as upstream:

            async def pipe(src: anyio.abc.SocketStream, dst: anyio.abc.SocketStream) -> None:
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    async for chunk in src:
                        if generation == self.generation:
                            await dst.send(chunk)
                tg.cancel_scope.cancel()

            async with anyio.create_task_group() as tg:
                tg.start_soon(pipe, client, upstream)
                tg.start_soon(pipe, upstream, client)


async def test_a_silent_network_is_noticed_by_the_health_check_and_the_listener_reconnects(
    rig: Rig, queue: str, client: AsyncAbsurd, driver: AsyncAbsurd
) -> None:
    """Only the listener goes through the proxy. After `swallow()` its connection is open but
    mute: the `select 1` after check_interval of quiet misses its deadline, the listener drops
    it and reconnects, and the next ack still wakes the task."""
    async with (
        Blackhole(rig.pg_url).running() as proxy,
        wake_worker(proxy.url, queue, client, check_interval=0.2, check_timeout=0.5) as worker,
    ):
        proxy.swallow()
        await listening(worker, connects=2)
        await wake_resumes(worker, rig, queue, driver, "r1")


async def test_the_sync_client_is_woken_too(rig: Rig, queue: str, driver: AsyncAbsurd) -> None:
    """`run_sync` with absurd-sdk's sync client. A blocking task keeps the stock poller busy
    (concurrency 1: it claims nothing while it runs one), so only the wake path can resume."""
    conn = rig.conn
    blocker = threading.Event(), threading.Event()
    sync_client = Absurd(rig.pg_url, queue_name=queue)
    register_sync(sync_client, blocker)
    worker = WakeWorker(rig.pg_url, queue, worker_id="sync", poll_interval=0.05)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            worker.run_sync(sync_client)
        except BaseException as exc:  # reported by the test, not lost in the thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="sync-worker")
    thread.start()
    try:
        await listening(worker)
        blocking = str((await driver.spawn("blocker", {}, queue=queue))["task_id"])
        await wait_for(blocker[0].is_set, what="the stock poller to take the blocker")
        assert claimed_by(conn, queue, blocking) == ["sync"]
        await wake_resumes(worker, rig, queue, driver, "r1")
    finally:
        blocker[1].set()
        sync_client.stop_worker()
        await anyio.to_thread.run_sync(thread.join, 30)
        sync_client.close()
    assert not thread.is_alive() and not failure
    assert task_state(conn, queue, blocking)[0] == "completed"


async def test_the_worker_refuses_a_queue_it_cannot_serve(
    pg_url: str, queue: str, client: AsyncAbsurd
) -> None:
    missing = AsyncAbsurd(pg_url, queue_name="no_such_queue")
    try:
        with pytest.raises(ValueError, match="no queue"):
            await WakeWorker(pg_url, "no_such_queue").run(missing)
    finally:
        await missing.close()


async def test_wakes_are_filtered_by_queue_and_coalesced() -> None:
    listener = WakeListener("postgresql://unused", "billing")
    assert not listener.dispatch("outbox:relay")  # a producer's enqueue
    assert not listener.dispatch("billing2")
    assert not await listener.wait(0)
    for _ in range(1000):
        assert listener.dispatch("billing")
    assert await listener.wait(0)  # a thousand wakes, one batch
    assert not await listener.wait(0)
    assert (listener.wakes, listener.ignored) == (1000, 2)
