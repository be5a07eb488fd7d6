"""A replica's liveness lock cannot be taken by another role (issue 48 item 6).

The key was `hashtextextended('ledger-relay:live:<schema>:' || owner, 0)` and owner ids
(`host:pid`, or a fixed `replica_id`) are predictable, so the producer role could take a
replica's lock before it started: the replica logged `liveness_lock_busy`, was never recorded
in `replicas`, wrote no report, and its death was noticed only when its leases expired. The key
is now secret and new at each hold (`liveness_key_of`: the process's incarnation and a random
part recorded in the `replicas` row, which no role but the schema's owner reads), and a key
another role took after its replica's session ended proves nothing. Rows a replica of the
previous version recorded keep their old key, so old and new judge each other during a rolling
upgrade."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay.runner import Relay
from relay.tools.sink import Sink, serve_sink
from tests.support import q, settings, wait_for
from tests.test_lease_sql import ack, call, claim, enq, run_row, token
from tests.test_liveness import alive, backend_gone
from tests.test_security import RoleSet, granted  # noqa: F401 - the fixture

pytestmark = pytest.mark.anyio


def old_key(conn: psycopg.Connection[Any], schema: str, owner: str) -> int:
    """The key anyone can compute from an owner id: the only one before issue 48."""
    row = conn.execute(
        "select hashtextextended('ledger-relay:live:' || %s || ':' || %s, 0)", (schema, owner)
    ).fetchone()
    assert row is not None
    return int(row[0])


def keys_held_by(conn: psycopg.Connection[Any], pid: int) -> list[int]:
    """The advisory keys a session holds, as every role can read them in pg_locks."""
    rows = conn.execute(
        "select (classid::int8 << 32) | objid::int8 from pg_locks"
        " where locktype = 'advisory' and objsubid = 1 and granted and pid = %s",
        (pid,),
    ).fetchall()
    return [int(r[0]) for r in rows]


def hold(c: psycopg.Connection[Any], schema: str, owner: str, incarnation: str) -> bool:
    row = c.execute(q(schema, "select {s}.hold_liveness(%s, %s)"), (owner, incarnation)).fetchone()
    return bool(row and row[0])


async def gone(conn: psycopg.Connection[Any], c: psycopg.Connection[Any]) -> None:
    pid = c.info.backend_pid
    c.close()
    await wait_for(lambda: backend_gone(conn, pid), timeout=30, what="the session ended")


async def test_the_producer_cannot_take_a_replicas_liveness_lock_before_it_starts(
    granted: RoleSet,  # noqa: F811 - the fixture
    schema: str,
    conn: psycopg.Connection[Any],
) -> None:
    """The issue's reproduction: the producer role holds the key it can compute for the owner
    id a replica will start with. The replica (a real relay, under the relay role) still holds
    its liveness, is recorded and alive, and writes its report."""
    owner = "pod-7:1"
    with psycopg.connect(granted.url(granted.roles.producer), autocommit=True) as producer:
        producer.execute("select pg_advisory_lock(%s)", (old_key(producer, schema, owner),))
        enq(conn, schema, "r1", "e1", terminal=True)
        sink = Sink()
        async with serve_sink(sink) as url:
            cfg = settings(
                granted.url(granted.roles.relay),
                schema,
                url,
                replica_id=owner,
                metrics_addr="127.0.0.1:0",
            )
            # What is seen is asserted after the relay's stop, which a failing assertion
            # inside would have to unwind.
            async with Relay(cfg).running() as r:
                assert r.listener is not None
                held, seen = r.listener.liveness_held, alive(conn, schema)
                if held:
                    await wait_for(lambda: sink.state.first_order.get("r1") == [1], what="r1")
                    reported = q(schema, "select reported_at is not null from {s}.replicas")
                    await wait_for(
                        lambda: conn.execute(reported).fetchall() == [(True,)], what="its report"
                    )
        assert held, "liveness_lock_busy: the producer holds the replica's key"
        assert seen == {owner: True}
        # Its clean stop too is said on the session that holds its lock.
        assert alive(conn, schema) == {}


async def test_a_key_taken_after_its_replica_died_keeps_no_one_out(
    granted: RoleSet,  # noqa: F811 - the fixture
    schema: str,
    conn: psycopg.Connection[Any],
) -> None:
    """A replica's key is visible in pg_locks while it holds it. The producer role takes it once
    the replica's session is gone: the same process reconnecting holds its liveness again (a
    new key), and so does a new process under the same owner id, which ends the dead one's
    leases at once, as a restart does."""
    relay_url = granted.url(granted.roles.relay)
    for run_id in ("r1", "r2"):
        enq(conn, schema, run_id, f"{run_id}-e1")
    producer = psycopg.connect(granted.url(granted.roles.producer), autocommit=True)
    try:
        first = psycopg.connect(relay_url, autocommit=True)
        assert hold(first, schema, "pod-0:1", "aaaa")
        old = claim(conn, schema, owner="pod-0:1", ttl="1 hour")
        assert sorted(old) == ["r1", "r2"]
        for _ in ("the LISTEN session drops", "the process dies"):
            (seen,) = keys_held_by(producer, first.info.backend_pid)
            await gone(conn, first)
            producer.execute("select pg_advisory_lock(%s)", (seen,))
            if _ == "the LISTEN session drops":  # the same process comes back: same incarnation
                first = psycopg.connect(relay_url, autocommit=True)
                assert hold(first, schema, "pod-0:1", "aaaa")
                assert alive(conn, schema) == {"pod-0:1": True}
                assert claim(conn, schema, owner="other") == {}  # its leases kept
        # A new process under the same owner id: not kept out, and the predecessor is dead.
        with psycopg.connect(relay_url, autocommit=True) as second:
            assert hold(second, schema, "pod-0:1", "bbbb")
            assert alive(conn, schema) == {"pod-0:1": True}
            got = claim(conn, schema, owner="other")
            assert sorted(got) == ["r1", "r2"]  # at once, not after the hour
            assert [r["status"] for r in ack(conn, schema, ("r1", token(old, "r1"), 1))] == [
                "stale"
            ]
    finally:
        producer.close()


async def test_a_replica_holding_the_old_key_across_the_upgrade_is_judged_by_it(
    granted: RoleSet,  # noqa: F811 - the fixture
    schema: str,
    conn: psycopg.Connection[Any],
) -> None:
    """A replica of the previous version took the owner-derived key and recorded its
    incarnation without a secret part, and holds it while `relay migrate` re-creates the
    functions. The new functions judge it by that key: alive while its session lives (its
    report and clean stop accepted, a second process under its id kept out), dead when it ends
    (its leases taken at once), and then its owner id held anew with a new key."""
    relay_url = granted.url(granted.roles.relay)
    enq(conn, schema, "r1", "e1")
    previous = psycopg.connect(relay_url, autocommit=True)
    # What hold_liveness of schema version 8 did: the owner's key, then the row.
    previous.execute("select pg_advisory_lock(%s)", (old_key(conn, schema, "old:1"),))
    conn.execute(
        q(schema, "insert into {s}.replicas (owner, incarnation) values ('old:1', 'cafe')")
    )
    old = claim(conn, schema, owner="old:1", ttl="1 hour")
    assert alive(conn, schema) == {"old:1": True}
    assert claim(conn, schema, owner="other") == {}
    report = q(schema, "select {s}.report_replica('old:1', '{{}}'::jsonb, 60)")
    assert previous.execute(report).fetchone() is not None
    with psycopg.connect(relay_url, autocommit=True) as second:
        assert not hold(second, schema, "old:1", "beef")
    await gone(conn, previous)
    assert alive(conn, schema) == {"old:1": False}
    got = claim(conn, schema, owner="other", ttl="1 hour")
    assert got["r1"][0]["reclaimed_from"] == "old:1"
    assert [r["status"] for r in ack(conn, schema, ("r1", token(old, "r1"), 1))] == ["stale"]
    with psycopg.connect(relay_url, autocommit=True) as restarted:
        assert hold(restarted, schema, "old:1", "beef")
        assert alive(conn, schema) == {"old:1": True}
        assert old_key(conn, schema, "old:1") not in keys_held_by(conn, restarted.info.backend_pid)
        assert call(restarted, schema, "replica_stopped", "old:1") == [(True,)]
    assert alive(conn, schema) == {}
    assert run_row(conn, schema, "r1")["lease_owner"] == "other"


def test_an_incarnation_with_the_separator_is_refused(
    schema: str, conn: psycopg.Connection[Any]
) -> None:
    """The row's incarnation is `<process>/<secret>`: a process part with a `/` would make
    another key of it."""
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="without"):
        conn.execute(sql.SQL("select {}.hold_liveness('x', 'a/b')").format(sql.Identifier(schema)))
