"""`Lab`: one fault scenario's world, and the nemesis' levers.

A scenario runs fault → heal → drain → check (Jepsen's nemesis schedule):

    async with Lab.open(pg, "sigkill", tmp_path, replicas=3) as lab:
        lab.produce(Workload(runs=40))        # the producer runs in the background
        await lab.wait_received(50)           # let some work flow
        lab.kill(0); await lab.restart(0)     # the fault window
    row = lab.row                             # healed, drained, checked and recorded on exit

Everything is real: `relay run` subprocesses (short leases so takeovers happen inside the
scenario), a durable PostgreSQL the harness owns (so it can crash it), the reference ingress
served in the test's event loop (so a hook can act between its 2xx and the relay's ack), and
optional TCP fault proxies in front of PostgreSQL and the ingress.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol
from urllib.parse import urlsplit

import anyio
import orjson
import psycopg
from anyio.abc import Process, TaskGroup
from psycopg import sql

import relay
from relay.maintenance.migrate import migrate
from relay.tools.sink import JSON, Fault, Sink, serve_sink
from tests.faults import checker, report, scale
from tests.faults.proxy import FaultProxy, via
from tests.support import wait_for

RELAY = [sys.executable, "-m", "relay.cli", "run"]
LEASE_TTL = 3.0
HTTP_TIMEOUT = 1.0
DRAIN_DEADLINE = 120.0
FAULTS_SCHEMA = "faults"  # the harness' own bookkeeping (engine emit attempts)


def relay_env(database_url: str, schema: str, ingress: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update(
        RELAY_DATABASE_URL=database_url,
        RELAY_SCHEMA=schema,
        RELAY_INGRESS_URL=ingress + "/runs/{run_id}/events",
        RELAY_POLL_INTERVAL="0.2",
        RELAY_LEASE_TTL=f"{LEASE_TTL}s",
        RELAY_HTTP_TIMEOUT=f"{HTTP_TIMEOUT}s",
        RELAY_STATEMENT_TIMEOUT="2s",
        RELAY_MAX_BACKOFF="2s",
        RELAY_SHUTDOWN_TIMEOUT="3s",
        RELAY_RETENTION="0",  # keep delivered rows: the checker reads them
        RELAY_LOG_LEVEL="info",
    )
    env.update(extra)
    return env


def install_faults_schema(url: str) -> None:
    """A table and trigger function that count every engine emit that commits, including the
    ones Absurd ignores (first write wins), so a second wake for one event cannot hide."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("select pg_advisory_lock(4243)")
        try:
            conn.execute(
                f"""
                create schema if not exists {FAULTS_SCHEMA};
                create table if not exists {FAULTS_SCHEMA}.emit_attempts (
                    queue text not null, event_name text not null, payload jsonb,
                    at timestamptz not null default clock_timestamp());
                create or replace function {FAULTS_SCHEMA}.count_emit() returns trigger
                language plpgsql as $$
                begin
                    insert into {FAULTS_SCHEMA}.emit_attempts (queue, event_name, payload)
                    values (tg_argv[0], new.event_name, new.payload);
                    return new;
                end $$;
                """
            )
        finally:
            conn.execute("select pg_advisory_unlock(4243)")


@dataclass
class Workload:
    """`runs` runs of `txns` producer transactions of `per_txn` events each, spread over
    `spread` seconds and interleaved across runs. A run's first event is `run_created`
    carrying an engine wake; its last is terminal (in a transaction of its own when txns > 1)."""

    runs: int = 40
    txns: int = 2
    per_txn: int = 4
    spread: float = 4.0

    def scaled(self) -> Workload:
        s = scale()
        return Workload(max(1, round(self.runs * s)), self.txns, self.per_txn, self.spread * s)


@dataclass
class Replica:
    index: int
    gen: int
    proc: Process
    log: Path
    id: str  # its replica_id (lease owner)
    stopped: bool = False

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None


class HookedSink(Sink):
    """The reference ingress, with a hook called after it processed a batch and decided a 2xx,
    before the reply leaves: the nemesis acts exactly between the ingress' answer and the
    relay's ack."""

    on_answer: Callable[[str, int, list[JSON]], Awaitable[None]] | None = None

    def __init__(self) -> None:
        super().__init__()
        # Each event's first arrival, before any injected delay: when it was POSTed, where the
        # sink's own `first_seen_at` is when it was processed.
        self.arrived: dict[str, float] = {}

    async def _process(
        self, fault: Fault | None, run_id: str, epoch: int, events: list[JSON]
    ) -> tuple[int, JSON]:
        now = time.time()
        for e in events:
            self.arrived.setdefault(e["event_id"], now)
        status, result = await super()._process(fault, run_id, epoch, events)
        if self.on_answer is not None and 200 <= status < 300:
            await self.on_answer(run_id, epoch, events)
        return status, result


@dataclass
class Marked:
    action: str  # "kill" (SIGKILL between 2xx and ack) | "zombie" (SIGSTOP past the TTL)
    done: anyio.Event = field(default_factory=anyio.Event)


class Server(Protocol):
    """What a scenario needs of its PostgreSQL: one `EmbeddedPostgres`, or a primary with its
    standby behind one multi-host URL (tests/faults/failover.py)."""

    @property
    def url(self) -> str: ...

    def start(self) -> object: ...

    def stop(self, mode: str = ...) -> None: ...


class Lab:
    def __init__(self, pg: Server, name: str, tmp: Path, tg: TaskGroup) -> None:
        self.pg = pg
        self.name = name
        self.tmp = tmp
        self.tg = tg
        self.schema = f"f_{name[:30]}_{uuid.uuid4().hex[:6]}"
        self.queue = f"fq_{uuid.uuid4().hex[:10]}"
        self.sink = HookedSink()
        self.sink_url = ""
        self.db_proxy: FaultProxy | None = None
        self.ingress_proxy: FaultProxy | None = None
        self.replicas: list[Replica] = []
        self.by_id: dict[str, Replica] = {}  # the latest replica of each id
        self.generations: list[Replica] = []  # every replica started, in order
        self.logs: list[Path] = []
        self.sent: set[str] = set()
        self.attempted: set[str] = set()
        self.poison: dict[str, tuple[int, bool]] = {}  # event_id -> (status, name it)
        self.marked: dict[str, Marked] = {}
        self.acting: list[Marked] = []
        self.faults = 0
        self.notes: list[str] = []
        self.producing = anyio.Event()
        self.produced = anyio.Event()
        self.row: checker.Row | None = None
        self.in_flight: set[str] | None = None  # at a failover (tests/faults/failover.py)
        self.extra_env: dict[str, str] = {}
        self.command_prefix: list[str] = []
        self._files: list[IO[bytes]] = []
        self._producer_error: BaseException | None = None

    # -- set-up -----------------------------------------------------------------------------

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        pg: Server,
        name: str,
        tmp: Path,
        *,
        replicas: int = 2,
        db_proxy: bool = False,
        ingress_proxy: bool = False,
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
    ) -> AsyncIterator[Lab]:
        """Set up, yield for the fault window, then heal, drain, check and record."""
        async with anyio.create_task_group() as tg:
            lab = cls(pg, name, tmp, tg)
            lab.extra_env = env or {}
            lab.command_prefix = prefix or []
            try:
                await anyio.to_thread.run_sync(lab._prepare_database)
                async with serve_sink(lab.sink) as sink_url:
                    lab.sink_url = sink_url
                    lab.sink.on_answer = lab._on_answer
                    if db_proxy:
                        pg_host = urlsplit(pg.url)
                        assert pg_host.hostname and pg_host.port
                        lab.db_proxy = FaultProxy(pg_host.hostname, pg_host.port, "db")
                        await lab.db_proxy.start(tg)
                    if ingress_proxy:
                        ingress = urlsplit(sink_url)
                        assert ingress.hostname and ingress.port
                        lab.ingress_proxy = FaultProxy(ingress.hostname, ingress.port, "ingress")
                        await lab.ingress_proxy.start(tg)
                    for i in range(replicas):
                        await lab.spawn(i, wait=False)
                    await lab.wait_started()
                    yield lab
                    await lab.finish()
            finally:
                await lab.stop_all()
                for f in lab._files:
                    f.close()
                tg.cancel_scope.cancel()

    def _prepare_database(self) -> None:
        url = self.pg.url
        migrate(url, self.schema)
        install_faults_schema(url)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("select absurd.create_queue(%s)", (self.queue,))
            conn.execute(
                sql.SQL(
                    "create trigger count_emit before insert on absurd.{} for each row"
                    " execute function {}.count_emit({})"
                ).format(
                    sql.Identifier(f"e_{self.queue}"),
                    sql.Identifier(FAULTS_SCHEMA),
                    sql.Literal(self.queue),
                )
            )

    # -- replicas ---------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        db = self.pg.url if self.db_proxy is None else via(self.pg.url, self.db_proxy.port)
        ingress = self.sink_url
        if self.ingress_proxy is not None:
            ingress = f"http://127.0.0.1:{self.ingress_proxy.port}"
        return relay_env(db, self.schema, ingress, **self.extra_env)

    async def spawn(self, index: int, *, wait: bool = True, rid: str | None = None) -> Replica:
        """A replica in slot `index`, named `r<index>.<generation>` unless `rid` is given (a
        fixed replica id, the same across restarts)."""
        gen = sum(1 for r in self.generations if r.index == index)
        log = self.tmp / f"{self.name}-r{index}.{gen}.log"
        f = log.open("wb")
        self._files.append(f)
        rid = rid or f"r{index}.{gen}"
        proc = await anyio.open_process(
            [*self.command_prefix, *RELAY],
            env={**self.env(), "RELAY_REPLICA_ID": rid},
            stdout=f,
            stderr=subprocess.STDOUT,
        )
        rep = Replica(index, gen, proc, log, rid)
        self.generations.append(rep)
        if index < len(self.replicas):
            self.replicas[index] = rep
        else:
            self.replicas.append(rep)
        self.by_id[rid] = rep
        self.logs.append(log)
        if wait:
            await self.wait_started([rep])
        return rep

    async def wait_started(self, reps: list[Replica] | None = None) -> None:
        for rep in reps or self.replicas:

            def started(rep: Replica = rep) -> bool:
                if not rep.alive:
                    tail = rep.log.read_text(errors="replace")[-2000:]
                    raise AssertionError(f"replica {rep.id} exited at start: {tail}")
                return b'"event":"started"' in rep.log.read_bytes()

            await wait_for(started, timeout=60, interval=0.05, what=f"replica {rep.id} up")

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive and not r.stopped]

    def pick(self) -> Replica:
        return random.choice(self.live())

    async def kill(self, rep: Replica) -> None:
        """SIGKILL: no release, no goodbye; its leases must expire."""
        self.faults += 1
        if rep.alive:
            rep.proc.send_signal(signal.SIGKILL)
            await rep.proc.wait()

    def sigstop(self, rep: Replica) -> None:
        self.faults += 1
        rep.stopped = True
        rep.proc.send_signal(signal.SIGSTOP)

    def sigcont(self, rep: Replica) -> None:
        rep.stopped = False
        if rep.alive:
            rep.proc.send_signal(signal.SIGCONT)

    async def restart(self, rep: Replica) -> Replica:
        if rep.alive:
            await self.kill(rep)
        return await self.spawn(rep.index)

    async def stop_all(self) -> None:
        for rep in self.replicas:
            if rep.alive:
                self.sigcont(rep)
                rep.proc.send_signal(signal.SIGTERM)
        with anyio.move_on_after(20):
            for rep in self.replicas:
                await rep.proc.wait()
        for rep in self.replicas:
            if rep.alive:
                self.notes.append(f"{rep.id} ignored SIGTERM for 20 s")
                rep.proc.kill()
                await rep.proc.wait()

    # -- database levers --------------------------------------------------------------------

    async def terminate_backends(self) -> int:
        """`pg_terminate_backend` of every relay connection (pools and LISTEN)."""
        self.faults += 1
        rows = await self.query(
            "select count(pg_terminate_backend(pid)) from pg_stat_activity"
            " where application_name = 'ledger-relay' and pid <> pg_backend_pid()"
        )
        return int(rows[0][0])

    async def crash_postgres(self, hold: float) -> None:
        """`pg_ctl stop -m immediate` (no checkpoint, clients cut), then start it again on the
        same port and data directory (crash recovery)."""
        self.faults += 1
        await anyio.to_thread.run_sync(self.pg.stop, "immediate")
        await anyio.sleep(hold)  # the fault window
        await anyio.to_thread.run_sync(self.pg.start)

    async def query(self, text: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        q = sql.SQL(text).format(
            s=sql.Identifier(self.schema),
            e=sql.Identifier(f"e_{self.queue}"),
            f=sql.Identifier(FAULTS_SCHEMA),
        )
        async with await psycopg.AsyncConnection.connect(
            self.pg.url, autocommit=True, application_name="relay-faults", connect_timeout=5
        ) as conn:
            cur = await conn.execute(q, params)
            return await cur.fetchall() if cur.description else []

    # -- the ingress hook -------------------------------------------------------------------

    def inject_poison(self, event_id: str, status: int = 422, *, name: bool = False) -> None:
        """The ingress rejects every batch holding `event_id` (until the end: poison stays)."""
        self.faults += 1
        self.poison[event_id] = (status, name)
        self.sink.faults.poison(event_id, status, name=name)

    def mark(self, event_id: str, action: str) -> Marked:
        m = self.marked[event_id] = Marked(action)
        return m

    async def _on_answer(self, run_id: str, epoch: int, events: list[JSON]) -> None:
        hits = [e["event_id"] for e in events if e["event_id"] in self.marked]
        if not hits:
            return
        rows = await self.query(
            "select lease_owner from {s}.runs where run_id = %s and epoch = %s", (run_id, epoch)
        )
        rep = self.by_id.get(rows[0][0]) if rows and rows[0][0] else None
        if rep is None or not rep.alive or rep.stopped:
            return  # the lease moved on already: wait for another marked batch
        marks = [self.marked.pop(h) for h in hits]
        self.acting.extend(marks)
        # Frozen before the reply leaves: it cannot ack; the 2xx reaches its socket meanwhile.
        self.sigstop(rep)
        self.tg.start_soon(self._after_answer, rep, run_id, epoch, marks)

    async def _after_answer(
        self, rep: Replica, run_id: str, epoch: int, marks: list[Marked]
    ) -> None:
        try:
            if marks[0].action == "kill":
                await anyio.sleep(0.2)  # the fault window: the 2xx is in its socket buffer
                await self.kill(rep)
                self.faults -= 1  # one fault (the stop was part of it)
                rep.stopped = False
                await self.spawn(rep.index)
            else:
                # A zombie: frozen past its lease until another replica took the run over.
                await anyio.sleep(LEASE_TTL + 0.5)

                async def taken_over() -> bool:
                    return bool(
                        await self.query(
                            "select 1 from {s}.runs where run_id = %s and epoch > %s",
                            (run_id, epoch),
                        )
                    )

                try:
                    await wait_for(taken_over, timeout=LEASE_TTL * 15, interval=0.1)
                except AssertionError:  # a loaded machine: still released, but say so
                    self.notes.append(f"{run_id}: not taken over while the zombie was frozen")
                self.sigcont(rep)
        finally:
            for m in marks:
                m.done.set()

    # -- the producer -----------------------------------------------------------------------

    def produce(self, w: Workload, *, prefix: str = "run") -> None:
        self.tg.start_soon(self._produce, w, prefix)

    def plan(self, w: Workload, prefix: str = "run") -> list[tuple[str, list[relay.Event]]]:
        """The transactions, in commit order: runs interleave, each run's in order."""
        keyed: list[tuple[int, int, str, list[relay.Event]]] = []
        for r in range(w.runs):
            run_id = f"{prefix}{r}"
            n = 0
            for t in range(w.txns):
                events: list[relay.Event] = []
                for _ in range(w.per_txn):
                    first, last = n == 0, t == w.txns - 1 and len(events) == w.per_txn - 1
                    events.append(
                        relay.Event(
                            event_id=f"{run_id}-{n}",
                            event_type="run_created"
                            if first
                            else "run_finished"
                            if last
                            else "step",
                            payload={"run": run_id, "n": n},
                            terminal=last,
                            wake_queue=self.queue if first else None,
                            wake_event=f"run-created:{run_id}" if first else None,
                        )
                    )
                    n += 1
                keyed.append((r + 3 * t, t, run_id, events))
        keyed.sort(key=lambda k: (k[0], k[1]))
        return [(run_id, events) for _, _, run_id, events in keyed]

    async def _produce(self, w: Workload, prefix: str) -> None:
        plan = self.plan(w, prefix)
        pause = w.spread / max(1, len(plan))
        conn: psycopg.AsyncConnection[Any] | None = None
        self.producing.set()
        started = anyio.current_time()
        try:
            for i, (run_id, events) in enumerate(plan, 1):
                conn = await self._enqueue(conn, run_id, events)
                # Workload pacing (not a wait for an effect), on a fixed schedule: the time
                # each commit takes, and stalls during faults, are caught up rather than added,
                # so a long soak's production ends near its `spread` however many faults hit.
                await anyio.sleep(max(0.0, started + i * pause - anyio.current_time()))
        except BaseException as exc:
            self._producer_error = exc
            raise
        finally:
            if conn is not None:
                await conn.close()
            self.produced.set()

    async def _enqueue(
        self, conn: psycopg.AsyncConnection[Any] | None, run_id: str, events: list[relay.Event]
    ) -> psycopg.AsyncConnection[Any]:
        """Enqueue one transaction, retrying across crashes and cut connections. A retry of a
        transaction whose commit outcome was unknown is safe: re-enqueueing identical content is
        a no-op (DESIGN §3)."""
        self.attempted.update(e.event_id for e in events)
        deadline = time.monotonic() + 90
        while True:
            try:
                if conn is None or conn.closed:
                    conn = await psycopg.AsyncConnection.connect(
                        self.pg.url, autocommit=True, application_name="relay-faults-producer",
                        connect_timeout=3,
                    )  # fmt: skip
                with anyio.fail_after(10):
                    async with conn.transaction():
                        await relay.enqueue_many_async(conn, run_id, events, schema=self.schema)
                self.sent.update(e.event_id for e in events)
                return conn
            except (psycopg.Error, OSError, TimeoutError) as exc:
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await conn.close()
                conn = None
                if time.monotonic() > deadline:
                    raise AssertionError(f"producer could not enqueue {run_id}: {exc}") from exc
                await anyio.sleep(0.2)  # retry backoff

    # -- waiting ----------------------------------------------------------------------------

    async def wait_received(self, n: int, timeout: float = 60) -> None:  # noqa: ASYNC109
        """Until the ingress processed at least `n` distinct events (so far, in this scenario)."""
        await wait_for(
            lambda: len(self.sink.state.deliveries) >= n,
            timeout=timeout,
            what=f"{n} events at the ingress",
        )

    async def hold(self, seconds: float) -> None:
        """Keep a fault in place for a while: the nemesis' window, not a wait for an effect."""
        await anyio.sleep(seconds)

    # -- heal, drain, check -----------------------------------------------------------------

    def heal(self) -> None:
        self.sink.faults.clear()
        for event_id, (status, name) in self.poison.items():
            self.sink.faults.poison(event_id, status, name=name)  # poison stays poison
        for proxy in (self.db_proxy, self.ingress_proxy):
            if proxy is not None:
                proxy.heal()
        for rep in self.replicas:
            if rep.stopped:
                self.sigcont(rep)

    async def finish(self) -> None:
        with anyio.fail_after(120):
            await self.produced.wait()
            for m in self.acting:
                await m.done.wait()  # a kill or zombie in progress completes its fault first
        if self.marked:
            self.notes.append(f"{len(self.marked)} marked events never hit a held lease")
            self.marked.clear()
        if self._producer_error is not None:
            raise self._producer_error
        self.heal()
        for rep in list(self.replicas):
            if not rep.alive:
                await self.spawn(rep.index)
        started = time.monotonic()
        await wait_for(self._drained, timeout=DRAIN_DEADLINE * scale(), interval=0.1,
                       what=f"{self.name}: drain")  # fmt: skip
        drain_seconds = time.monotonic() - started
        await self.stop_all()
        facts = await self.gather(drain_seconds)
        self.row = checker.check(facts)
        report.record(self.row)

    async def _drained(self) -> bool:
        rows = await self.query(
            "select (select count(*) from {s}.events e join {s}.runs r using (run_id)"
            "        where e.state = 'pending' and r.blocked_seq is null),"
            "       (select count(*) from {s}.events where event_id = any(%s))",
            (list(self.sent),),
        )
        pending, present = rows[0]
        return bool(pending == 0 and present == len(self.sent))

    async def gather(self, drain_seconds: float) -> checker.Facts:
        outbox = await self.query("select event_id, run_id, seq, state::text from {s}.events")
        blocked = await self.query(
            "select run_id, blocked_seq from {s}.runs where blocked_seq is not null"
        )
        expected = await self.query(
            "select wake_event from {s}.events where state = 'delivered' and wake_event is not null"
        )
        emitted = await self.query("select event_name from absurd.{e} where payload is not null")
        attempts = await self.query(
            "select event_name from {f}.emit_attempts where queue = %s", (self.queue,)
        )
        mismatches = await self.query(
            "select count(*) from absurd.{e} w left join {s}.events e"
            "   on e.event_id = w.payload->>'event_id'"
            " where w.payload is not null and (e.event_id is null or e.state <> 'delivered'"
            # the wake's time is its ack's; the event's delivered_at is its run's last delivery
            # (schema version 7 keeps no time per event): at or after the wake's
            "   or (w.payload->>'delivered_at')::timestamptz"
            "      not between e.created_at and e.delivered_at"
            "   or e.wake_event <> w.event_name)"
        )
        lease_lost: Counter[str] = Counter()
        for log in self.logs:
            for line in log.read_bytes().splitlines():
                if b'"event":"lease_lost"' in line:
                    try:
                        lease_lost[str(orjson.loads(line).get("where"))] += 1
                    except orjson.JSONDecodeError:
                        lease_lost["unparsed"] += 1
        st = self.sink.state
        return checker.Facts(
            scenario=self.name,
            sent=set(self.sent),
            attempted=set(self.attempted),
            received=dict(st.deliveries),
            first_order={k: list(v) for k, v in st.first_order.items()},
            stale_epochs=st.stale_epochs,
            outbox=[(r[0], r[1], int(r[2]), r[3]) for r in outbox],
            blocked={r[0]: int(r[1]) for r in blocked},
            poison=set(self.poison),
            wakes_expected={r[0] for r in expected},
            wakes_emitted={r[0] for r in emitted},
            emit_attempts=Counter(r[0] for r in attempts),
            wake_payload_mismatches=int(mismatches[0][0]),
            lease_lost=lease_lost,
            drain_seconds=drain_seconds,
            faults=self.faults,
            notes=self.notes,
            in_flight=self.in_flight,
        )
