"""Replica liveness (issue 18, DESIGN §4.2): a lease whose owner is provably gone (its liveness
lock, a session advisory lock the database drops when the session ends, is free) is claimable
before its expiry; a live or frozen owner keeps its lease until expiry; an owner that never
recorded its liveness (a relay of the previous version) is never judged dead. The fence does
not change: the old token's ack, renewal, release and fail change nothing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from relay.runner import Relay
from relay.tools.sink import Sink, serve_sink
from tests.support import settings, wait_for
from tests.test_lease_sql import ack, call, claim, enq, fn, run_row, states, token

pytestmark = pytest.mark.anyio


class Holder:
    """A separate session that holds an owner's liveness lock, as a replica's LISTEN
    connection does."""

    def __init__(
        self, pg_url: str, schema: str, owner: str, incarnation: str | None = None
    ) -> None:
        self.conn = psycopg.connect(pg_url, autocommit=True)
        self.pid = self.conn.info.backend_pid
        row = self.conn.execute(
            sql.SQL("select {}(%s, %s)").format(fn(schema, "hold_liveness")), (owner, incarnation)
        ).fetchone()
        assert row == (True,)


def backend_gone(conn: psycopg.Connection[Any], pid: int) -> bool:
    row = conn.execute("select count(*) from pg_stat_activity where pid = %s", (pid,)).fetchone()
    return row == (0,)


@pytest.fixture
def holders(pg_url: str, schema: str) -> Iterator[list[Holder]]:
    made: list[Holder] = []
    yield made
    for h in made:
        h.conn.close()


def hold(
    pg_url: str, schema: str, owner: str, holders: list[Holder], incarnation: str | None = None
) -> Holder:
    h = Holder(pg_url, schema, owner, incarnation)
    holders.append(h)
    return h


async def die(h: Holder, conn: psycopg.Connection[Any]) -> None:
    h.conn.close()
    await wait_for(lambda: backend_gone(conn, h.pid), timeout=30, what="the session ended")


def fail(conn: psycopg.Connection[Any], schema: str, run_id: str, tok: str) -> bool:
    row = call(conn, schema, "fail_event", run_id, tok, 1, 400, "poison")
    return bool(row[0][0])


async def test_a_dead_owners_lease_is_claimable_at_once_and_the_fence_holds(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], holders: list[Holder]
) -> None:
    for i in (1, 2):
        enq(conn, schema, "r1", f"e{i}")
    alive = hold(pg_url, schema, "dead", holders)
    old = claim(conn, schema, owner="dead", ttl="1 hour")
    assert list(old) == ["r1"]
    assert old["r1"][0]["reclaimed_from"] is None
    before = run_row(conn, schema, "r1")
    # While the owner lives its lease holds.
    assert claim(conn, schema, owner="other") == {}

    await die(alive, conn)
    got = claim(conn, schema, owner="other", ttl="1 hour")
    assert list(got) == ["r1"]  # an hour before its lease expires
    assert [r["seq"] for r in got["r1"]] == [1, 2]
    assert got["r1"][0]["reclaimed_from"] == "dead"
    after = run_row(conn, schema, "r1")
    assert after["epoch"] == before["epoch"] + 1
    assert after["lease_owner"] == "other"
    assert str(after["lease_token"]) != token(old, "r1")

    # The dead owner's token changes nothing: renew, release, fail, ack.
    stale = token(old, "r1")
    assert call(conn, schema, "renew", ["r1"], [stale], "1 hour") == []
    assert call(conn, schema, "release", "r1", stale, "1 hour", "boom", 500, 1, 2) == [(False,)]
    assert not fail(conn, schema, "r1", stale)
    assert [r["status"] for r in ack(conn, schema, ("r1", stale, 2))] == ["stale"]
    assert run_row(conn, schema, "r1") == after
    assert states(conn, schema, "r1") == [(1, "pending"), (2, "pending")]
    # The new owner's token works.
    assert [r["status"] for r in ack(conn, schema, ("r1", token(got, "r1"), 2))] == ["acked"]


async def test_all_three_paths_reclaim_a_dead_owners_runs(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], holders: list[Holder]
) -> None:
    enq(conn, schema, "ord", "o1")
    enq(conn, schema, "crit", "c1", terminal=True)
    enq(conn, schema, "target", "t1", terminal=True)
    h = hold(pg_url, schema, "dead", holders)
    assert set(claim(conn, schema, owner="dead", ttl="1 hour")) == {"ord", "crit", "target"}
    await die(h, conn)

    targeted = claim(conn, schema, owner="b", lane="critical", run_id="target")
    assert targeted["target"][0]["reclaimed_from"] == "dead"
    critical = claim(conn, schema, owner="b", lane="critical")
    assert list(critical) == ["crit"]
    assert critical["crit"][0]["reclaimed_from"] == "dead"
    ordinary = claim(conn, schema, owner="b", lane="ordinary")
    assert list(ordinary) == ["ord"]
    assert ordinary["ord"][0]["reclaimed_from"] == "dead"


async def test_a_reclaim_respects_the_claim_size(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], holders: list[Holder]
) -> None:
    for i in range(6):
        enq(conn, schema, f"r{i}", f"e{i}")
    h = hold(pg_url, schema, "dead", holders)
    assert len(claim(conn, schema, owner="dead", runs=4, ttl="1 hour")) == 4
    await die(h, conn)
    # Two runs due anyway, four of a dead owner: three asked for, the dead owner's first.
    got = claim(conn, schema, owner="b", runs=3)
    assert len(got) == 3
    assert all(rows[0]["reclaimed_from"] == "dead" for rows in got.values())
    rest = claim(conn, schema, owner="b", runs=10)
    assert len(rest) == 3
    assert sum(rows[0]["reclaimed_from"] == "dead" for rows in rest.values()) == 1


def test_a_live_owners_lease_is_not_claimable(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], holders: list[Holder]
) -> None:
    enq(conn, schema, "r1", "e1", terminal=True)
    hold(pg_url, schema, "live", holders)
    got = claim(conn, schema, owner="live", ttl="1 hour")
    assert list(got) == ["r1"]
    for lane, run_id in (("ordinary", None), ("critical", None), ("critical", "r1")):
        assert claim(conn, schema, owner="other", lane=lane, run_id=run_id) == {}
    assert run_row(conn, schema, "r1")["lease_owner"] == "live"
    # ... and its holder keeps working under it.
    assert [r[0] for r in call(conn, schema, "renew", ["r1"], [token(got, "r1")], "1 hour")] == [
        "r1"
    ]


def test_a_frozen_owner_keeps_its_lease_until_expiry(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], holders: list[Holder]
) -> None:
    """Frozen (SIGSTOP, GC pause): the connection and its lock stay; only expiry frees the run."""
    enq(conn, schema, "r1", "e1")
    hold(pg_url, schema, "frozen", holders)
    claim(conn, schema, owner="frozen", ttl="1 hour")
    assert claim(conn, schema, owner="other") == {}
    # Its lease expires (moved into the past on the database clock, as time would).
    conn.execute(
        sql.SQL(
            "update {} set lease_expires_at = clock_timestamp() - interval '1 second',"
            " next_attempt_at = clock_timestamp() - interval '1 second'"
        ).format(fn(schema, "runs"))
    )
    got = claim(conn, schema, owner="other")
    assert list(got) == ["r1"]
    assert got["r1"][0]["reclaimed_from"] is None  # taken after expiry: no early reclaim


async def test_an_owner_without_a_replicas_row_is_never_reclaimed(
    pg_url: str, schema: str, conn: psycopg.Connection[Any]
) -> None:
    """A relay of the previous version holds no liveness lock and records nothing: its free
    lock proves nothing, so its lease runs to expiry."""
    enq(conn, schema, "r1", "e1")
    claim(conn, schema, owner="old-version", ttl="1 hour")
    assert claim(conn, schema, owner="other") == {}
    assert claim(conn, schema, owner="other", lane="critical", run_id="r1") == {}
    assert run_row(conn, schema, "r1")["lease_owner"] == "old-version"


async def test_hold_liveness_records_the_owner_once_per_lock(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], holders: list[Holder]
) -> None:
    first = hold(pg_url, schema, "r", holders)
    # Another session cannot take the same owner's lock (e.g. the same replica id twice).
    with psycopg.connect(pg_url, autocommit=True) as other:
        assert call(other, schema, "hold_liveness", "r") == [(False,)]
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        call(conn, schema, "hold_liveness", "")
    rows = conn.execute(sql.SQL("select owner from {}").format(fn(schema, "replicas"))).fetchall()
    assert rows == [("r",)]
    await die(first, conn)
    with psycopg.connect(pg_url, autocommit=True) as again:
        assert call(again, schema, "hold_liveness", "r") == [(True,)]


async def test_a_restart_under_the_same_owner_id_ends_its_predecessors_leases_at_once(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], holders: list[Holder]
) -> None:
    """A fixed replica_id (or host:pid in a container, pid 1 each time) restarted: the new
    process takes the lock its dead predecessor held, so the lock alone cannot tell them
    apart. The incarnation does: the predecessor's unexpired leases end when the new one takes
    the lock; the same process taking it again on a reconnect keeps its own."""
    for run_id in ("r1", "r2"):
        enq(conn, schema, run_id, f"{run_id}-e1")
    first = hold(pg_url, schema, "pod-0:1", holders, incarnation="aaaa")
    old = claim(conn, schema, owner="pod-0:1", ttl="1 hour")
    assert sorted(old) == ["r1", "r2"]
    # Its LISTEN session drops and it reconnects: same incarnation, its leases are kept.
    await die(first, conn)
    again = hold(pg_url, schema, "pod-0:1", holders, incarnation="aaaa")
    assert claim(conn, schema, owner="other") == {}
    assert run_row(conn, schema, "r1")["lease_owner"] == "pod-0:1"
    # The process dies; its successor starts under the same owner id with a new incarnation.
    await die(again, conn)
    hold(pg_url, schema, "pod-0:1", holders, incarnation="bbbb")
    got = claim(conn, schema, owner="other")
    assert sorted(got) == ["r1", "r2"]  # at once, not after the hour
    # The fence as ever: the predecessor's tokens are dead.
    assert [r["status"] for r in ack(conn, schema, ("r1", token(old, "r1"), 1))] == ["stale"]
    assert run_row(conn, schema, "r1")["lease_owner"] == "other"


def test_a_second_process_with_the_same_owner_id_ends_no_lease(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], holders: list[Holder]
) -> None:
    """While the first holds the lock, a second process under the same id (a misconfiguration,
    or a restart before the server dropped the old session) takes nothing and ends nothing."""
    enq(conn, schema, "r1", "e1")
    hold(pg_url, schema, "dup", holders, incarnation="aaaa")
    claim(conn, schema, owner="dup", ttl="1 hour")
    with psycopg.connect(pg_url, autocommit=True) as second:
        assert call(second, schema, "hold_liveness", "dup", "bbbb") == [(False,)]
    assert claim(conn, schema, owner="other") == {}
    assert run_row(conn, schema, "r1")["lease_owner"] == "dup"


async def test_prune_forgets_dead_replicas_without_live_leases(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], holders: list[Holder]
) -> None:
    enq(conn, schema, "r1", "e1")
    hold(pg_url, schema, "live", holders)
    h = hold(pg_url, schema, "dead-leasing", holders)
    gone = hold(pg_url, schema, "dead-idle", holders)
    claim(conn, schema, owner="dead-leasing", ttl="1 hour")
    await die(h, conn)
    await die(gone, conn)

    call(conn, schema, "prune", "1 day", 100)

    def owners() -> list[str]:
        return [
            r[0]
            for r in conn.execute(
                sql.SQL("select owner from {} order by owner").format(fn(schema, "replicas"))
            ).fetchall()
        ]

    # The dead owner that still holds a lease stays: its run is still to be reclaimed.
    assert owners() == ["dead-leasing", "live"]
    claim(conn, schema, owner="live")
    call(conn, schema, "prune", "1 day", 100)
    assert owners() == ["live"]


async def test_status_shows_replicas_by_liveness(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], holders: list[Holder]
) -> None:
    hold(pg_url, schema, "a-live", holders)
    await die(hold(pg_url, schema, "b-dead", holders), conn)
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(sql.SQL("select {}(10) as s").format(fn(schema, "status"))).fetchone()
    assert row is not None
    got = [(r["owner"], r["alive"]) for r in row["s"]["replicas"]]
    assert got == [("a-live", True), ("b-dead", False)]


def alive(conn: psycopg.Connection[Any], schema: str) -> dict[str, bool]:
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(sql.SQL("select {}(0) as s").format(fn(schema, "status"))).fetchone()
    assert row is not None
    return {r["owner"]: r["alive"] for r in row["s"]["replicas"]}


async def test_a_relay_holds_its_liveness_and_reclaims_a_dead_owners_runs(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], holders: list[Holder]
) -> None:
    """The whole path in one process: the relay takes its liveness lock before its lanes claim,
    takes over the run of an owner that died an hour before its lease would expire, counts and
    logs the reclaim, and its lock goes with it when it stops."""
    enq(conn, schema, "r1", "e1")
    enq(conn, schema, "r1", "e2", terminal=True)
    h = hold(pg_url, schema, "crashed", holders)
    claim(conn, schema, owner="crashed", ttl="1 hour")
    await die(h, conn)
    sink = Sink()
    async with serve_sink(sink) as url:
        s = settings(pg_url, schema, url, replica_id="live-one", metrics_addr="127.0.0.1:0")
        async with Relay(s).running() as r:
            assert r.listener is not None and r.listener.liveness_held  # before any claim
            assert alive(conn, schema) == {"crashed": False, "live-one": True}
            await wait_for(lambda: sink.state.first_order.get("r1") == [1, 2], what="r1")
            assert sum(lane.stats.reclaimed for lane in r.lanes.values()) == 1
            assert r.endpoints is not None
            body, _ = r.endpoints.metrics.exposition()
            counted = [
                float(line.rsplit(b" ", 1)[1])
                for line in body.splitlines()
                if line.startswith(b"ledger_relay_leases_reclaimed_total{")
            ]
            assert sum(counted) == 1, body
    await wait_for(lambda: not alive(conn, schema).get("live-one"), timeout=30, what="lock gone")


async def test_a_replica_taking_its_lock_forgets_dead_replicas_without_live_leases(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], holders: list[Holder]
) -> None:
    """With retention off prune never runs: the table still stays small, because every replica
    that takes its lock forgets the dead ones with nothing left to reclaim."""
    enq(conn, schema, "r1", "e1")
    for owner in ("old-1", "old-2"):
        await die(hold(pg_url, schema, owner, holders), conn)
    leasing = hold(pg_url, schema, "old-leasing", holders)
    claim(conn, schema, owner="old-leasing", ttl="1 hour")
    await die(leasing, conn)
    hold(pg_url, schema, "new", holders)
    rows = conn.execute(
        sql.SQL("select owner from {} order by owner").format(fn(schema, "replicas"))
    ).fetchall()
    assert rows == [("new",), ("old-leasing",)]


async def test_an_owner_that_still_claims_without_its_lock_is_not_robbed(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], holders: list[Holder]
) -> None:
    """Its LISTEN session is gone (lock free) but its process works on and claims: the claim
    itself proves it alive and forgets its row, so its leases expire as before instead of
    going back and forth between replicas whose LISTEN connections lag their pools."""
    enq(conn, schema, "r1", "e1")
    enq(conn, schema, "r2", "e2")
    h = hold(pg_url, schema, "cut-off", holders)
    assert list(claim(conn, schema, owner="cut-off", runs=1, ttl="1 hour")) == ["r1"]
    await die(h, conn)  # its LISTEN connection dropped; the process did not
    assert list(claim(conn, schema, owner="cut-off", runs=1, ttl="1 hour")) == ["r2"]
    assert claim(conn, schema, owner="other") == {}
    rows = conn.execute(sql.SQL("select owner from {}").format(fn(schema, "replicas")))
    assert rows.fetchall() == []
    # Its LISTEN connection back: recorded (and protected by its lock) again.
    hold(pg_url, schema, "cut-off", holders)
    assert claim(conn, schema, owner="other") == {}


async def test_an_owner_recorded_before_a_restart_is_not_judged_dead_by_its_free_lock(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], holders: list[Holder]
) -> None:
    """A restart of PostgreSQL or a failover to a standby drops every session lock while the
    `replicas` rows stay (issue 29, DESIGN §9.5): until its LISTEN session takes its lock again,
    a live owner's lock is free. A row recorded in an earlier server lifetime is therefore not
    proof of death: its leases run to their expiry. Recorded again (its LISTEN back) in this
    lifetime, the owner is judged by its lock as before: dead, its runs are reclaimed at once."""
    enq(conn, schema, "r1", "e1", terminal=True)
    h = hold(pg_url, schema, "survivor", holders)
    assert list(claim(conn, schema, owner="survivor", ttl="1 hour")) == ["r1"]
    await die(h, conn)
    # What a restart leaves: the row of the server's previous lifetime, and no lock.
    conn.execute(
        sql.SQL(
            "update {} set server_started_at = server_started_at - interval '1 hour'"
            " where owner = 'survivor'"
        ).format(fn(schema, "replicas"))
    )
    for lane, run_id in (("ordinary", None), ("critical", None), ("critical", "r1")):
        assert claim(conn, schema, owner="other", lane=lane, run_id=run_id) == {}
    assert run_row(conn, schema, "r1")["lease_owner"] == "survivor"
    # Its LISTEN session reconnects: recorded in this lifetime, alive while it holds the lock.
    again = hold(pg_url, schema, "survivor", holders)
    assert claim(conn, schema, owner="other") == {}
    # ... and dead the moment it lets go: reclaimed at once, an hour before the lease expires.
    await die(again, conn)
    got = claim(conn, schema, owner="other")
    assert list(got) == ["r1"]
    assert got["r1"][0]["reclaimed_from"] == "survivor"


# -- a clean stop (issue 41): told apart from a death ---------------------------------------------


def stopped(c: psycopg.Connection[Any], schema: str, owner: str) -> bool:
    row = c.execute(sql.SQL("select {}(%s)").format(fn(schema, "replica_stopped")), (owner,))
    got = row.fetchone()
    assert got is not None
    return bool(got[0])


def recorded_key(conn: psycopg.Connection[Any], schema: str, owner: str) -> int:
    """The liveness key the owner's `replicas` row records (liveness_key_of)."""
    row = conn.execute(
        sql.SQL("select {}(owner, incarnation) from {} where owner = %s").format(
            fn(schema, "liveness_key_of"), fn(schema, "replicas")
        ),
        (owner,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def lock_free(conn: psycopg.Connection[Any], key: int) -> bool:
    """Whether no session holds the advisory lock `key` (tried, and given back, from `conn`)."""
    taken = conn.execute("select pg_try_advisory_lock(%s)", (key,)).fetchone()
    if taken == (True,):
        conn.execute("select pg_advisory_unlock(%s)", (key,))
        return True
    return False


async def test_a_clean_stop_forgets_the_owner_and_gives_its_lock_up(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], holders: list[Holder]
) -> None:
    """Only the session that holds the owner's lock may say it stopped: not another replica's,
    nor one holding nothing. Then the owner is not listed at all (a row whose lock is free is
    what `relay status` shows as dead), every hold of its lock is given up, and the session
    lives on."""
    h = hold(pg_url, schema, "stopping", holders)
    assert h.conn.execute(
        sql.SQL("select {}(%s)").format(fn(schema, "hold_liveness")), ("stopping",)
    ).fetchone() == (True,)  # held twice: the lock is re-entrant
    other = hold(pg_url, schema, "other", holders)
    for c in (other.conn, conn):
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="liveness lock"):
            stopped(c, schema, "stopping")
    assert alive(conn, schema) == {"other": True, "stopping": True}
    key = recorded_key(conn, schema, "stopping")
    assert not lock_free(conn, key)

    assert stopped(h.conn, schema, "stopping") is True
    assert alive(conn, schema) == {"other": True}
    assert lock_free(conn, key)
    assert h.conn.execute("select 1").fetchone() == (1,)


async def test_a_clean_stop_that_still_holds_a_lease_leaves_it_to_be_reclaimed(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], holders: list[Holder]
) -> None:
    """A replica that could not release a lease (its release failed) stops as a dead one would:
    its row stays, its lock is free, and the others take the run at once, fenced as ever."""
    enq(conn, schema, "r1", "e1")
    h = hold(pg_url, schema, "leaving", holders)
    old = claim(conn, schema, owner="leaving", ttl="1 hour")
    assert stopped(h.conn, schema, "leaving") is False
    assert alive(conn, schema) == {"leaving": False}
    got = claim(conn, schema, owner="other", ttl="1 hour")
    assert got["r1"][0]["reclaimed_from"] == "leaving"
    assert [r["status"] for r in ack(conn, schema, ("r1", token(old, "r1"), 1))] == ["stale"]


async def test_a_relay_stopped_cleanly_is_not_listed_and_takes_its_lock_no_more(
    pg_url: str, schema: str, conn: psycopg.Connection[Any]
) -> None:
    """Relay.stop(): once the lanes are done the LISTEN session says so before it closes, so
    the replica is gone from `replicas` the moment the run returns, not left as a dead row."""
    enq(conn, schema, "r1", "e1", terminal=True)
    sink = Sink()
    async with serve_sink(sink) as url:
        s = settings(pg_url, schema, url, replica_id="clean-one")
        async with Relay(s).running() as r:
            assert r.listener is not None and r.listener.liveness_held
            assert alive(conn, schema) == {"clean-one": True}
            key = recorded_key(conn, schema, "clean-one")
            await wait_for(lambda: sink.state.first_order.get("r1") == [1], what="r1")
        assert not r.listener.liveness_held
    assert alive(conn, schema) == {}
    assert lock_free(conn, key)
