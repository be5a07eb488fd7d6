"""Proof under faults (issue 7, DESIGN §9): real replicas, a PostgreSQL the harness crashes, the
reference ingress, and a nemesis. Every scenario runs fault → heal → drain → check and records a
row of the fault report (tests/faults/report.py); the test asserts the row is valid.

Bounded by default (each scenario ~10-25 s); `RELAY_FAULTS_SCALE` multiplies workloads and
fault repetitions, `RELAY_FAULTS_SOAK_SECONDS` runs a long soak with faults every few seconds.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import random
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import orjson
import pytest

from relay.tools.embedded import EmbeddedPostgres
from tests.faults import own_server, scaled, soak_seconds
from tests.faults.checker import Row
from tests.faults.harness import LEASE_TTL, Lab, Replica, Workload
from tests.faults.proxy import FaultProxy, via
from tests.support import wait_for

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="session")
def fault_pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedPostgres]:
    """The fault suite's own durable cluster: scenarios crash and restart it."""
    with own_server(tmp_path_factory.mktemp("faultpg") / "data") as server:
        yield server


def assert_valid(lab: Lab) -> Row:
    row = lab.row
    assert row is not None
    assert row.valid, f"{row.scenario}: {row.problems}"
    return row


async def test_sigkill_mid_run(fault_pg: EmbeddedPostgres, tmp_path: Path) -> None:
    async with Lab.open(fault_pg, "sigkill_mid_run", tmp_path, replicas=3) as lab:
        lab.sink.faults.delay(0.02, times=100_000)  # slow enough that kills land mid-run
        lab.produce(Workload(runs=40, spread=4).scaled())
        for i in range(scaled(2)):
            await lab.wait_received(40 * (i + 1))
            await lab.restart(lab.pick())  # SIGKILL, then a fresh replica
    row = assert_valid(lab)
    assert row.faults >= 2


async def test_sigkill_after_2xx_before_ack(fault_pg: EmbeddedPostgres, tmp_path: Path) -> None:
    """The ingress processed the batch and answered 2xx; the replica dies before its ack. The
    batch must be delivered again (a counted duplicate), never lost, never acked twice."""
    async with Lab.open(fault_pg, "sigkill_after_2xx", tmp_path, replicas=3) as lab:
        kills = scaled(2)
        marks = [lab.mark(f"run{5 + 12 * i}-1", "kill") for i in range(kills)]
        lab.produce(Workload(runs=max(40, 12 * kills + 8), spread=4).scaled())
        with anyio.fail_after(60):
            for m in marks:
                await m.done.wait()
    row = assert_valid(lab)
    assert row.faults >= kills
    assert row.duplicated >= kills  # each killed batch came again: duplicates, counted


async def test_sigstop_zombie_past_its_lease(fault_pg: EmbeddedPostgres, tmp_path: Path) -> None:
    """SIGSTOP right after the ingress answered 2xx, held past the lease TTL until another
    replica took the run over, then SIGCONT: the zombie wakes holding a stale lease and an
    answered POST; its ack, renewal or (when its request timed out meanwhile) reschedule must
    be fenced, and it logs the lost lease."""
    async with Lab.open(fault_pg, "sigstop_zombie", tmp_path, replicas=3) as lab:
        stops = scaled(1)
        marks = [lab.mark(f"run{4 + 10 * i}-1", "zombie") for i in range(stops)]
        lab.produce(Workload(runs=max(30, 10 * stops + 8), spread=3).scaled())
        with anyio.fail_after(60):
            for m in marks:
                await m.done.wait()
    row = assert_valid(lab)
    assert row.faults >= stops
    assert row.leases_lost >= stops, row.notes  # the zombie's work was fenced, not acked
    # A frozen replica keeps its connection, so its liveness lock: nobody took its runs before
    # their lease expired (and nobody else died).
    assert reclaimed(lab) == []


def log_events(lab: Lab, event: str) -> list[dict[str, Any]]:
    """Every log line of the scenario's replicas with this `event`."""
    marker = f'"event":"{event}"'.encode()
    return [
        orjson.loads(line)
        for log in lab.logs
        for line in log.read_bytes().splitlines()
        if marker in line
    ]


def reclaimed(lab: Lab) -> list[dict[str, Any]]:
    """Every run a replica claimed from a dead owner, `{"run_id", "dead_owner"}`, from the
    replicas' `leases_reclaimed` lines (one per dead owner and claim; issue 41)."""
    return [
        {"run_id": run_id, "dead_owner": line["dead_owner"]}
        for line in log_events(lab, "leases_reclaimed")
        for run_id in line["run_ids"]
    ]


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


async def held_by(lab: Lab, rep: Replica) -> dict[str, float]:
    """The pending events of the runs `rep` holds an unexpired lease on: event_id -> commit
    time (the database clock; the same host clock as the sink's `first_seen_at`)."""
    rows = await lab.query(
        "select e.event_id, extract(epoch from e.created_at)::float8 from {s}.events e"
        " join {s}.runs r using (run_id)"
        " where r.lease_owner = %s and r.lease_expires_at > clock_timestamp()"
        "   and e.state = 'pending'",
        (rep.id,),
    )
    return {r[0]: float(r[1]) for r in rows}


def tcp_ports(pid: int) -> list[int]:
    """The local ports of the TCP sockets process `pid` holds (Linux /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


async def quiet(lab: Lab, rep: Replica) -> bool:
    """No statement of the (frozen) replica is still running at the server: an ack or claim it
    sent just before it froze has committed, so what it holds can be read exactly."""
    rows = await lab.query(
        "select count(*) from pg_stat_activity where client_port = any(%s) and state <> 'idle'",
        (tcp_ports(rep.proc.pid),),
    )
    return bool(rows[0][0] == 0)


async def freeze_holding(lab: Lab, rep: Replica) -> dict[str, float]:
    """SIGSTOP `rep` at a moment it holds a lease (its lock stays while frozen: nothing moves),
    and return what it holds (`held_by`)."""
    got: dict[str, float] = {}

    async def holding() -> bool:
        lab.sigstop(rep)
        lab.faults -= 1  # not a fault of its own: the kill that follows is
        await wait_for(lambda: quiet(lab, rep), timeout=30, what=f"{rep.id} quiet")
        got.update(await held_by(lab, rep))
        if not got:
            lab.sigcont(rep)
        return bool(got)

    await wait_for(holding, timeout=60, interval=0.05, what=f"{rep.id} holding a lease")
    return got


async def frozen_under_steady_traffic(
    lab: Lab, *, runs: int, spread: float, received: int
) -> tuple[Replica, dict[str, float]]:
    """A steady flow below capacity (no backlog), with POSTs slow enough that each replica
    holds several runs at any moment; then the first replica frozen while it holds a lease:
    it and what it holds (`freeze_holding`)."""
    lab.sink.faults.delay(0.2, times=100_000)
    lab.produce(Workload(runs=runs, spread=spread).scaled())
    await lab.wait_received(received)
    victim = lab.replicas[0]
    return victim, await freeze_holding(lab, victim)


async def kill_and_replace(lab: Lab, victim: Replica, rid: str | None = None) -> None:
    """SIGKILL `victim` (frozen or not) and start a replica in its slot (named `rid`)."""
    await lab.kill(victim)
    victim.stopped = False
    await lab.spawn(victim.index, rid=rid)


def run_of(event_id: str) -> str:
    return event_id.rsplit("-", 1)[0]


def delivery_p99(lab: Lab, committed: dict[str, float]) -> float:
    seen = lab.sink.state.first_seen_at
    return p99([seen[e] - at for e, at in committed.items()])


async def test_sigkill_a_replica_its_runs_are_reclaimed_at_once(
    fault_pg: EmbeddedPostgres, tmp_path: Path
) -> None:
    """SIGKILL of one replica under steady traffic with the default 30 s lease (issue 18): the
    database drops its liveness lock with its sessions, so the survivor claims every run it
    held at once (`leases_reclaimed`), long before the leases expire. The commit-to-delivery
    p99 of the events those runs held is reported, not asserted (a wall-clock figure)."""
    async with Lab.open(
        fault_pg, "sigkill_reclaim", tmp_path, replicas=2, env={"RELAY_LEASE_TTL": "30s"}
    ) as lab:
        victim, held = await frozen_under_steady_traffic(lab, runs=120, spread=5, received=40)
        killed_at = time.time()
        await kill_and_replace(lab, victim)  # a fresh replica in its place
    row = assert_valid(lab)
    runs = {run_of(e) for e in held}
    assert runs, "the killed replica held no lease: nothing to reclaim"
    taken = {e["run_id"] for e in reclaimed(lab)}
    by_dead = [e for e in reclaimed(lab) if e["dead_owner"] == victim.id]
    # Every run it held was claimed from the dead owner before its lease expired.
    assert runs <= {e["run_id"] for e in by_dead}, (runs - taken, row.notes)
    assert row.lost == row.out_of_order == row.acked_without_delivery == 0
    figure = delivery_p99(lab, held)
    last = max(lab.sink.state.first_seen_at[e] for e in held) - killed_at
    row.notes.append(
        f"{len(runs)} runs ({len(held)} events) held by the killed replica, all reclaimed;"
        f" commit-to-delivery p99 of those events {figure * 1000:.0f} ms, the last one"
        f" {last * 1000:.0f} ms after the kill (lease_ttl 30 s)"
    )
    print(row.notes[-1])


async def test_a_replica_restarted_under_its_own_id_takes_its_runs_back_at_once(
    fault_pg: EmbeddedPostgres, tmp_path: Path
) -> None:
    """A fixed replica_id (host:pid in a container is one: the pid is 1 at every start),
    SIGKILLed and started again, alone: its successor takes the same liveness lock, so only the
    incarnation tells them apart. Every event the killed one held is delivered before that
    lease's expiry (the database clock), not after it."""
    async with Lab.open(
        fault_pg, "restart_same_id", tmp_path, replicas=1, env={"RELAY_LEASE_TTL": "30s"}
    ) as lab:
        victim, held = await frozen_under_steady_traffic(lab, runs=40, spread=3, received=10)
        rows = await lab.query(
            "select run_id, extract(epoch from lease_expires_at)::float8 from {s}.runs"
            " where lease_owner = %s and lease_expires_at > clock_timestamp()",
            (victim.id,),
        )
        expiry = {r[0]: float(r[1]) for r in rows}
        await kill_and_replace(lab, victim, rid=victim.id)  # the same id, a new process
        # When the held events were acked (the sink may have had them before the kill).
        acked: dict[str, float] = {}

        async def all_acked() -> bool:
            got = await lab.query(
                "select event_id, extract(epoch from delivered_at)::float8 from {s}.events"
                " where event_id = any(%s) and delivered_at is not null",
                (list(held),),
            )
            acked.update({r[0]: float(r[1]) for r in got})
            return len(acked) == len(held)

        await wait_for(all_acked, timeout=120, what="the held events acked")
    row = assert_valid(lab)
    assert held and {run_of(e) for e in held} <= set(expiry), "nothing held at the kill"
    late = {e: t - expiry[run_of(e)] for e, t in acked.items() if t >= expiry[run_of(e)]}
    assert not late, f"acked only after the dead incarnation's lease expired: {late}"
    assert row.lost == row.out_of_order == row.acked_without_delivery == 0
    row.notes.append(f"{len(expiry)} runs ({len(held)} events) held under {victim.id}, restarted")


async def test_one_replicas_database_connections_cut_while_it_posts(
    fault_pg: EmbeddedPostgres, tmp_path: Path
) -> None:
    """Only one replica's database connections are cut (RST through its own TCP proxy, then
    silence for a while) while its POSTs go on: it looks dead (its liveness lock went with its
    session), so the other replica reclaims its runs before their 30 s leases expire. The cut
    replica's answered POSTs cannot be acked (their tokens are gone): duplicates at most,
    counted, never loss or reordering."""
    async with Lab.open(
        fault_pg, "db_cut_one_replica", tmp_path, replicas=1, env={"RELAY_LEASE_TTL": "30s"}
    ) as lab:
        pg = urlsplit(fault_pg.url)
        assert pg.hostname and pg.port
        proxy = FaultProxy(pg.hostname, pg.port, "db-one")
        await proxy.start(lab.tg)
        lab.extra_env["RELAY_DATABASE_URL"] = via(fault_pg.url, proxy.port)
        cut = await lab.spawn(1)
        del lab.extra_env["RELAY_DATABASE_URL"]
        lab.sink.faults.delay(0.5, times=100_000)  # its POSTs are in flight when the cut comes
        lab.produce(Workload(runs=100, spread=3).scaled())
        await lab.wait_received(40)
        held = await held_by(lab, cut)
        lab.faults += 2
        proxy.reset()  # every connection of that replica, the LISTEN one too: RST
        proxy.blackhole()  # and its reconnects hang until the other replica reclaimed
        # Until, not for a fixed while: the other replica's claims come as its slots free, and
        # under load (CI) none came within the 3 s this once held, so the cut replica was back
        # with its liveness lock before any claim saw it dead. 20 s is still inside the 30 s
        # leases, which the assertion is about.
        await wait_for(
            lambda: any(e["dead_owner"] == cut.id for e in reclaimed(lab)),
            timeout=20.0,
            interval=0.1,
            what="a run of the cut replica reclaimed before its lease expired",
        )
        proxy.heal()
    row = assert_valid(lab)
    runs = {run_of(e) for e in held}
    assert runs, "the cut replica held no lease when its connections were cut"
    by_cut = {e["run_id"] for e in reclaimed(lab) if e["dead_owner"] == cut.id}
    assert by_cut, "no run of the cut replica was reclaimed before its lease expired"
    row.notes.append(
        f"{len(runs)} runs held by the cut replica, {len(by_cut)} reclaimed early;"
        f" {row.duplicated} duplicates; commit-to-delivery p99 of their pending events"
        f" {delivery_p99(lab, held) * 1000:.0f} ms"
    )
    print(row.notes[-1])


async def test_pg_terminate_backend(fault_pg: EmbeddedPostgres, tmp_path: Path) -> None:
    """`pg_terminate_backend` of every relay connection (pools and LISTEN), repeatedly."""
    async with Lab.open(fault_pg, "pg_terminate_backend", tmp_path, replicas=2) as lab:
        lab.sink.faults.delay(0.01, times=100_000)
        lab.produce(Workload(runs=40, spread=5).scaled())
        for i in range(scaled(3)):
            await lab.wait_received(30 * (i + 1))
            assert await lab.terminate_backends() > 0
            await lab.hold(0.5)
    assert_valid(lab)


async def test_postgres_crash_and_restart(fault_pg: EmbeddedPostgres, tmp_path: Path) -> None:
    """PostgreSQL stopped with `-m immediate` (a crash: no checkpoint, every client cut) and
    started again on the same port: committed events survive, the relay reconnects."""
    async with Lab.open(fault_pg, "postgres_crash", tmp_path, replicas=2) as lab:
        lab.sink.faults.delay(0.01, times=100_000)
        lab.produce(Workload(runs=40, spread=5).scaled())
        for i in range(scaled(1)):
            await lab.wait_received(40 * (i + 1))
            await lab.crash_postgres(hold=1.0)
    assert_valid(lab)


async def _proxy_nemesis(lab: Lab, proxy_name: str) -> None:
    proxy = lab.db_proxy if proxy_name == "db" else lab.ingress_proxy
    assert proxy is not None
    for i in range(scaled(1)):
        await lab.wait_received(20 + 40 * i)
        lab.faults += 5
        proxy.latency(0.05)
        await lab.hold(1.5)
        proxy.reset()
        await lab.hold(0.5)
        proxy.blackhole()
        await lab.hold(LEASE_TTL * 0.8)
        proxy.heal()
        proxy.cut_after(2000)
        await lab.hold(1.5)
        proxy.heal()
        proxy.reset()


async def test_tcp_faults_between_relay_and_postgres(
    fault_pg: EmbeddedPostgres, tmp_path: Path
) -> None:
    """Latency, RST, a silent blackhole and cuts after N bytes on the relay's database path."""
    async with Lab.open(fault_pg, "tcp_relay_postgres", tmp_path, replicas=2, db_proxy=True) as lab:
        lab.produce(Workload(runs=40, spread=6).scaled())
        await _proxy_nemesis(lab, "db")
    assert_valid(lab)


async def test_tcp_faults_between_relay_and_ingress(
    fault_pg: EmbeddedPostgres, tmp_path: Path
) -> None:
    """Latency, RST, a silent blackhole and cuts after N bytes on the relay's ingress path."""
    async with Lab.open(
        fault_pg, "tcp_relay_ingress", tmp_path, replicas=2, ingress_proxy=True
    ) as lab:
        lab.produce(Workload(runs=40, spread=6).scaled())
        await _proxy_nemesis(lab, "ingress")
    assert_valid(lab)


async def test_ingress_misbehaves(fault_pg: EmbeddedPostgres, tmp_path: Path) -> None:
    """5xx, timeouts, 429 with Retry-After, replies lost after processing, partial acceptance."""
    async with Lab.open(fault_pg, "ingress_misbehaves", tmp_path, replicas=2) as lab:
        lab.produce(Workload(runs=40, spread=4).scaled())
        await lab.wait_received(20)
        f = lab.sink.faults
        n = scaled(4)
        f.fail(500, times=n)
        f.fail(503, times=n)
        f.delay(HTTP_TIMEOUT_PLUS, times=n)  # the relay times out; the sink then processes
        f.fail(429, times=n, retry_after="1")
        f.drop_reply(times=n)  # processed, reply lost: redelivered, a counted duplicate
        f.accept_only(1, times=n)  # {"accepted": 1}: the rest retried
        lab.faults += 6 * n
        await wait_faults_taken(lab)
    row = assert_valid(lab)
    assert row.duplicated >= 1  # lost replies come back as duplicates, counted


HTTP_TIMEOUT_PLUS = 1.5


async def wait_faults_taken(lab: Lab) -> None:
    from tests.support import wait_for

    await wait_for(lambda: lab.sink.faults.pending() == 0, timeout=60, what="faults consumed")


async def test_poison_events_block_only_their_runs(
    fault_pg: EmbeddedPostgres, tmp_path: Path
) -> None:
    """Two poison events (one named by the ingress, one found by narrowing): exactly their runs
    block; every other run flows; nothing after a poison event is delivered."""
    async with Lab.open(fault_pg, "poison", tmp_path, replicas=2) as lab:
        lab.inject_poison("run3-5", 422)  # found by narrowing (the 4-event batch is retried singly)
        lab.inject_poison("run7-2", 400, name=True)  # named in the rejection body
        lab.produce(Workload(runs=30, spread=3).scaled())
    row = assert_valid(lab)
    assert row.blocked_runs == row.poison_injected == 2


async def test_many_replicas_on_one_hot_run(fault_pg: EmbeddedPostgres, tmp_path: Path) -> None:
    """Four replicas contend for one run written continuously in small transactions (small
    batches, so many claims), one of them SIGKILLed in the middle."""
    async with Lab.open(
        fault_pg, "hot_run", tmp_path, replicas=4, env={"RELAY_BATCH_SIZE": "7"}
    ) as lab:
        lab.produce(Workload(runs=1, txns=scaled(60), per_txn=5, spread=5))
        await lab.wait_received(100)
        await lab.restart(lab.pick())
    assert_valid(lab)


def _libfaketime() -> str | None:
    """libfaketime itself (Debian package `faketime`). Preloaded through `env`, which execs the
    relay: the `faketime` wrapper forks instead, and a replica signalled through it was left
    running (the wrapper died, its child lived on)."""
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    return found[0] if found else None


def _started_at(log: Path) -> datetime:
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"event":"started"' in line:
            return datetime.fromisoformat(json.loads(line)["ts"])
    raise AssertionError(f"no started line in {log}")


def _skewed(offset: str, lib: str) -> list[str]:
    return ["env", f"LD_PRELOAD={lib}", f"FAKETIME={offset}"]


async def test_replica_with_a_skewed_wall_clock(fault_pg: EmbeddedPostgres, tmp_path: Path) -> None:
    """Replicas whose wall clocks are minutes off (libfaketime): leases hold because their times
    are on the database clock and trust is measured on the monotonic clock."""
    lib = _libfaketime()
    if lib is None:
        pytest.skip(
            "faketime is not installed (Debian package `faketime`, which provides libfaketime);"
            " install it to run the skewed-clock scenario"
        )
    async with Lab.open(
        fault_pg, "skewed_clock", tmp_path, replicas=1, prefix=_skewed("+300s", lib)
    ) as skewed_ahead:
        lab = skewed_ahead
        lab.command_prefix = _skewed("-300s", lib)
        await lab.spawn(1)  # one replica five minutes ahead, one five minutes behind
        lab.command_prefix = []
        await lab.spawn(2)  # and one on time
        # The clocks really are skewed: each replica stamps its log lines with its wall clock.
        now = datetime.now(UTC)
        assert (_started_at(lab.replicas[0].log) - now).total_seconds() > 250
        assert (_started_at(lab.replicas[1].log) - now).total_seconds() < -250
        lab.sink.faults.delay(0.02, times=100_000)
        lab.produce(Workload(runs=40, spread=4).scaled())
        await lab.wait_received(60)
        await lab.restart(lab.replicas[2])
    assert_valid(lab)


@pytest.mark.slow
async def test_soak(fault_pg: EmbeddedPostgres, tmp_path: Path) -> None:
    """A run with a random fault every few seconds: `RELAY_FAULTS_SOAK_SECONDS` long (e.g. 1200
    for the 20-minute soak in docs/faults/), and a bounded 20 s in `.ci/run`."""
    seconds = soak_seconds()
    async with Lab.open(
        fault_pg, "soak", tmp_path, replicas=3, db_proxy=True, ingress_proxy=True
    ) as lab:
        runs = max(40, int(seconds * 10))
        lab.produce(Workload(runs=runs, spread=seconds))
        deadline = anyio.current_time() + seconds
        await lab.wait_received(20)
        while anyio.current_time() < deadline and not lab.produced.is_set():
            await _one_random_fault(lab)
            await lab.hold(random.uniform(2.0, 5.0))
    assert_valid(lab)


async def _one_random_fault(lab: Lab) -> None:
    assert lab.db_proxy is not None and lab.ingress_proxy is not None
    choice = random.choice(
        ["kill", "stop", "terminate", "crash", "db", "ingress", "http", "lost_reply"]
    )
    if choice == "kill":
        await lab.restart(lab.pick())
    elif choice == "stop":
        rep = lab.pick()
        lab.sigstop(rep)
        await lab.hold(LEASE_TTL + 1)
        lab.sigcont(rep)
    elif choice == "terminate":
        await lab.terminate_backends()
    elif choice == "crash":
        await lab.crash_postgres(hold=1.0)
    elif choice in ("db", "ingress"):
        proxy = lab.db_proxy if choice == "db" else lab.ingress_proxy
        lab.faults += 1
        mode = random.choice(["latency", "reset", "blackhole", "cut"])
        if mode == "latency":
            proxy.latency(0.05)
        elif mode == "reset":
            proxy.reset()
        elif mode == "blackhole":
            proxy.blackhole()
        else:
            proxy.cut_after(random.randint(100, 5000))
        await lab.hold(random.uniform(0.5, LEASE_TTL))
        proxy.heal()
    elif choice == "http":
        lab.faults += 1
        lab.sink.faults.fail(random.choice([500, 502, 503, 429]), times=5, retry_after="1")
    else:
        lab.faults += 1
        lab.sink.faults.drop_reply(times=3)
