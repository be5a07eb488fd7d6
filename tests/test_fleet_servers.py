"""A fleet over three PostgreSQL servers (issue 51 item 5): three durable embedded clusters, one
outbox database each, real `relay run` replicas over all three (`RELAY_DATABASES`) and the
reference ingress in this process. One server SIGKILLed mid-stream and started again under two
replicas; a replica started while one server is down; one database at an older schema version.

Judged by outcomes, never by time: nothing lost (every event of every outbox, and every commit
the producers saw, reached the ingress), per-run order kept, the killed database's events
committed after its restart delivered, no replica exits, `/readyz` 200 at every probe, and
`ledger_relay_database_up{database=...}` 0 for the down database on every replica while it is
down and 1 once it is back. The servers are killed and started again with the tools' own levers
(`EmbeddedPostgres.kill`, `start_again`), as `relay bench --only fleet_outage` does; its
producer (commits runs at a steady rate, reconnecting while its server is gone) and its probe
of a replica are used here as they are.

tests/test_fleet.py has the in-process fleet's rules over databases of one server (a database
set aside for its schema or while unreachable, its relay's failure, one server killed under the
in-process fleet); here each database is a server of its own and each replica a process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
import psycopg
import pytest
from psycopg import sql

from relay.maintenance.migrate import code_version, migrate
from relay.ops.checks import SCHEMA
from relay.producer import enqueue
from relay.tools.bench.fleet_outage import Probe, Producer, judge_probes
from relay.tools.bench.kit import RelayProcess, free_port
from relay.tools.embedded import EmbeddedPostgres
from relay.tools.sink import Sink, serve_sink
from tests.conftest import unique
from tests.support import wait_for
from tests.test_cli import RELAY
from tests.test_fleet import database_up

pytestmark = pytest.mark.anyio

NAMES = ("s0", "s1", "s2")
KILLED = "s2"  # the one the bench's probe reads the gauge of
RATE = 10.0  # runs a second into each database while a producer runs
PER_RUN = 3  # events per run, the last its terminal


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EmbeddedPostgres]]:
    """Three durable embedded servers, started side by side: name -> server."""
    root = tmp_path_factory.mktemp("fs")  # short: a unix socket path has at most 107 bytes
    made = {name: EmbeddedPostgres(root / name, durable=True) for name in NAMES}
    try:
        with ThreadPoolExecutor(len(made)) as pool:
            for _ in pool.map(lambda s: s.start(), made.values()):
                pass
        yield made
    finally:
        for server in made.values():
            server.stop("immediate")


def answers(server: EmbeddedPostgres) -> bool:
    try:
        with psycopg.connect(server.url, connect_timeout=2):
            return True
    except psycopg.OperationalError:
        return False


@pytest.fixture
def schema(servers: dict[str, EmbeddedPostgres]) -> Iterator[str]:
    """A schema of the test's own in each server's database, migrated; every server up (one a
    test before killed and never started again is started here)."""
    name = unique("fs")
    for server in servers.values():
        if not answers(server):
            server.start_again()
        migrate(server.url, name)
    yield name
    for server in servers.values():
        if answers(server):
            with psycopg.connect(server.url, autocommit=True) as conn:
                conn.execute(sql.SQL("drop schema {} cascade").format(sql.Identifier(name)))


def fleet_env(servers: dict[str, EmbeddedPostgres], schema: str, ingress: str) -> dict[str, str]:
    """`relay run` over the three databases at its defaults, but for a quicker poll and no
    retention (the outboxes are read at the end)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update(
        RELAY_DATABASES=" ".join(f"{name}={s.url}" for name, s in servers.items()),
        RELAY_SCHEMA=schema,
        RELAY_INGRESS_URL=ingress + "/runs/{run_id}/events",
        RELAY_POLL_INTERVAL="0.2",
        RELAY_RETENTION="0",
        RELAY_SHUTDOWN_TIMEOUT="5s",
    )
    return env


@asynccontextmanager
async def replicas(env: dict[str, str], logs: Path, n: int) -> AsyncIterator[list[RelayProcess]]:
    """`n` replicas of `relay run`, each answering its probes on a port of its own, once each
    `/readyz` answered 200; on the way out each must still run and end cleanly on SIGTERM."""
    started: list[RelayProcess] = []
    try:
        for i in range(n):
            port = free_port()
            own = {"RELAY_METRICS_ADDR": f"127.0.0.1:{port}", "RELAY_REPLICA_ID": f"replica-{i}"}
            with (logs / f"replica{i}.log").open("wb") as log:
                proc = await anyio.open_process(
                    [*RELAY, "run"], env=env | own, stdout=log, stderr=subprocess.STDOUT
                )
            started.append(RelayProcess(proc, f"http://127.0.0.1:{port}"))
        for rp in started:
            await wait_for(lambda rp=rp: ready(rp), what="a replica's /readyz 200")
        yield started
        for rp in started:
            assert rp.proc.returncode is None, f"a replica exited {rp.proc.returncode}"
            rp.proc.send_signal(signal.SIGTERM)
        for rp in started:
            with anyio.fail_after(60):
                assert await rp.proc.wait() == 0
    finally:
        for rp in started:
            if rp.proc.returncode is None:
                rp.proc.kill()
                await rp.proc.wait()


async def ready(rp: RelayProcess) -> bool:
    assert rp.proc.returncode is None, f"a replica exited {rp.proc.returncode} at its start"
    try:
        async with httpx.AsyncClient(timeout=2) as http:
            return (await http.get(rp.metrics_url + "/readyz")).status_code == 200
    except httpx.HTTPError:
        return False


async def scraped_up(rp: RelayProcess) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=5) as http:
        return database_up((await http.get(rp.metrics_url + "/metrics")).text)


def outbox(url: str, schema: str) -> set[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            sql.SQL("select event_id from {}").format(sql.Identifier(schema, "outbox"))
        ).fetchall()
    return {str(r[0]) for r in rows}


def enqueue_runs(url: str, schema: str, name: str, prefix: str, runs: int = 5) -> set[str]:
    """`runs` runs of PER_RUN events in one transaction; their event ids."""
    ids = set()
    with psycopg.connect(url, autocommit=True) as conn, conn.transaction():
        for r in range(runs):
            run_id = f"{name}-{prefix}{r}"
            for k in range(1, PER_RUN + 1):
                ids.add(f"{run_id}-{k}")
                enqueue(
                    conn, run_id, f"{run_id}-{k}", "step", {"k": k},
                    terminal=k == PER_RUN, schema=schema,
                )  # fmt: skip
    return ids


def delivered(sink: Sink, ids: set[str]) -> bool:
    return ids <= set(sink.state.deliveries)


def log_lines(logs: Path) -> list[dict[str, Any]]:
    return [
        orjson.loads(line)
        for log in sorted(logs.glob("replica*.log"))
        for line in log.read_bytes().splitlines()
        if line.startswith(b"{")
    ]


async def test_a_server_killed_mid_stream_and_restarted_under_two_replicas(
    servers: dict[str, EmbeddedPostgres], schema: str, tmp_path: Path
) -> None:
    """Producers commit into all three; s2's server is SIGKILLed while its events flow, and
    started again once both replicas read it down. The others deliver meanwhile, s2's commits
    after its restart are delivered, nothing is lost, no replica exits, every probe of /readyz
    answers 200, and s2's gauge reads 0 on every replica from its detection to the restart
    (never 1 in between), then 1 again."""
    sink = Sink()
    urls = {name: s.url for name, s in servers.items()}
    producers = {n: Producer(n, u, schema, RATE, PER_RUN) for n, u in urls.items()}
    stop = anyio.Event()

    def committed(name: str, after: float = 0.0) -> set[str]:
        return {e for e, at in producers[name].committed.items() if at > after}

    # Each producer says when it returned: a commit on the way when `stop` is set lands after
    # it, and the last wait must see it (CI once read one such run of s1 as 3 events lost, the
    # relays stopped before it was sent).
    returned = {name: anyio.Event() for name in NAMES}

    async def produce(name: str) -> None:
        try:
            await producers[name].run("a", stop)
        finally:
            returned[name].set()

    async with serve_sink(sink) as ingress:
        env = fleet_env(servers, schema, ingress)
        async with replicas(env, tmp_path, 2) as fleet, anyio.create_task_group() as tg:
            probes = [Probe(rp) for rp in fleet]
            for p in probes:
                tg.start_soon(p.run)
            for name in NAMES:
                tg.start_soon(produce, name)
            for name in NAMES:  # each database's events flow
                await wait_for(
                    lambda name=name: len(committed(name) & set(sink.state.deliveries)) >= 30,
                    what=f"{name}'s events flowing",
                )
            killed = time.time()
            await anyio.to_thread.run_sync(servers[KILLED].kill)
            await wait_for(
                lambda: all(any(at > killed and up == 0 for at, _, up in p.seen) for p in probes),
                what=f"{KILLED} read down on every replica",
            )
            for name in ("s0", "s1"):  # the others deliver what they commit meanwhile
                await wait_for(lambda name=name: len(committed(name, killed)) >= 20, what="commits")
                during = committed(name, killed)
                await wait_for(lambda d=during: delivered(sink, d), what=f"{name}, {KILLED} down")
            restarted = time.time()
            await anyio.to_thread.run_sync(servers[KILLED].start_again)
            await wait_for(lambda: len(committed(KILLED, restarted)) >= 20, what="its commits")
            after = committed(KILLED, restarted)
            await wait_for(lambda: delivered(sink, after), what=f"{KILLED} after its restart")
            await wait_for(
                lambda: all(p.seen[-1][2] == 1 for p in probes), what=f"{KILLED} read up again"
            )
            stop.set()
            for done in returned.values():
                await done.wait()
            # Every event in the outboxes: a commit whose answer the producer lost included.
            everything = set().union(*(outbox(url, schema) for url in urls.values()))
            await wait_for(lambda: delivered(sink, everything), what="every event in the outboxes")
            tg.cancel_scope.cancel()
        assert [p.exited for p in probes] == [None, None]
    # Nothing lost: every commit is in its outbox, every outbox event reached the ingress.
    for name, url in urls.items():
        rows = outbox(url, schema)
        assert committed(name) <= rows, name
        assert delivered(sink, rows), f"{name}: {len(rows - set(sink.state.deliveries))} lost"
    assert sink.state.order_violations == 0
    probed = judge_probes([p.seen for p in probes], killed, restarted)
    assert probed.not_200 == 0, probed
    assert probed.down_seen_s is not None and probed.read_1 == 0 and probed.unread == 0, probed
    assert producers[KILLED].failed >= 1  # its producer saw the kill: the stream was cut
    # The killed server is ridden out by its database's relay; nothing else is set aside.
    set_aside = [x for x in log_lines(tmp_path) if x.get("event") == "database_set_aside"]
    assert {x["database"] for x in set_aside} <= {KILLED}, set_aside


async def test_a_replica_started_while_a_server_is_down_serves_the_others(
    servers: dict[str, EmbeddedPostgres], schema: str, tmp_path: Path
) -> None:
    """s2's server killed before any replica runs; a replica started then is ready, delivers
    what s0 and s1 hold, reads s2 down; once s2's server is back it serves s2 too, in the same
    process."""
    sink = Sink()
    urls = {name: s.url for name, s in servers.items()}
    early = enqueue_runs(urls[KILLED], schema, KILLED, "early")
    await anyio.to_thread.run_sync(servers[KILLED].kill)
    others = enqueue_runs(urls["s0"], schema, "s0", "a") | enqueue_runs(
        urls["s1"], schema, "s1", "a"
    )
    async with serve_sink(sink) as ingress:
        env = fleet_env(servers, schema, ingress)
        async with replicas(env, tmp_path, 1) as [replica]:
            await wait_for(lambda: delivered(sink, others), what="s0's and s1's events")
            assert await scraped_up(replica) == {"s0": 1.0, "s1": 1.0, KILLED: 0.0}
            assert await ready(replica)
            assert not delivered(sink, early)
            await anyio.to_thread.run_sync(servers[KILLED].start_again)
            late = enqueue_runs(urls[KILLED], schema, KILLED, "late")
            await wait_for(lambda: delivered(sink, early | late), what=f"{KILLED} once back")

            async def all_up() -> bool:
                return set((await scraped_up(replica)).values()) == {1.0}

            await wait_for(all_up, what=f"{KILLED} read up")
            assert await ready(replica)
    assert sink.state.order_violations == 0
    set_aside = [x for x in log_lines(tmp_path) if x.get("event") == "database_set_aside"]
    assert [x["database"] for x in set_aside] == [KILLED], set_aside
    assert set_aside[0]["reason"].startswith("unreachable: ")


async def test_a_database_at_an_older_schema_version_is_named_and_served_once_migrated(
    servers: dict[str, EmbeddedPostgres], schema: str, tmp_path: Path
) -> None:
    """s1's database one schema version behind this release (as before a `relay migrate`):
    a replica serves s0 and s2, names s1 in one log line, reads it down; `relay check` names it;
    `relay migrate --database s1` then, and the same replica serves s1's waiting events."""
    sink = Sink()
    urls = {name: s.url for name, s in servers.items()}
    with psycopg.connect(urls["s1"], autocommit=True) as conn:
        conn.execute(
            sql.SQL("delete from {} where version = %s").format(
                sql.Identifier(schema, "schema_migrations")
            ),
            (code_version(),),
        )
    ids = {name: enqueue_runs(url, schema, name, "a") for name, url in urls.items()}
    async with serve_sink(sink) as ingress:
        env = fleet_env(servers, schema, ingress)
        async with replicas(env, tmp_path, 1) as [replica]:
            await wait_for(lambda: delivered(sink, ids["s0"] | ids[KILLED]), what="s0 and s2")
            assert await scraped_up(replica) == {"s0": 1.0, "s1": 0.0, KILLED: 1.0}
            assert await ready(replica)
            assert not delivered(sink, ids["s1"])
            checked = await anyio.run_process(
                [*RELAY, "check", "--timeout", "3"], env=env, check=False
            )
            lines = checked.stdout.decode().splitlines()
            assert checked.returncode == SCHEMA, lines
            [schema_line] = [line for line in lines if line.split()[1:3] == ["schema", "[s1]"]]
            assert schema_line.startswith("FAIL") and "older" in schema_line, schema_line
            others = [line for line in lines if line.split()[1] == "schema"]
            assert sum(line.startswith("ok") for line in others) == 2, lines
            migrated = await anyio.run_process(
                [*RELAY, "migrate", "--database", "s1"], env=env, check=False
            )
            assert migrated.returncode == 0, migrated.stderr.decode()
            await wait_for(lambda: delivered(sink, ids["s1"]), what="s1 once migrated")
            assert await scraped_up(replica) == {"s0": 1.0, "s1": 1.0, KILLED: 1.0}
    assert sink.state.order_violations == 0
    lines = log_lines(tmp_path)
    set_aside = [x for x in lines if x.get("event") == "database_set_aside"]
    assert [x["database"] for x in set_aside] == ["s1"], set_aside
    assert set_aside[0]["reason"].startswith("schema: ") and "older" in set_aside[0]["reason"]
