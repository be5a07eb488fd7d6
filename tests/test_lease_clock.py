"""Every lease time is read on the database clock *at the statement* (DESIGN §4.2), not at the
start of its transaction: `now()` is frozen for a transaction, so a claim, renewal, ack or release
issued from a transaction that has been open for a while (a slow client, a wait on a lock) would
otherwise compute expiries in the past and judge expiry against a stale time.

Each test runs the call from a transaction that has been open longer than the lease TTL, where
the statement clock (`clock_timestamp()`) and the transaction clock (`now()`) differ by more than
the TTL, so replacing one by the other in any of these functions turns the test red.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from tests.test_lease_sql import ack, call, claim, enq, fn, run_row, token

TTL = "1 second"
AGE = 1.4  # seconds the transaction stays open before the call: more than the TTL
SLACK = timedelta(milliseconds=100)


class Aged:
    """A transaction opened `AGE` seconds before the statements it then runs."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.started: datetime = datetime.min

    def __enter__(self) -> Aged:
        row = self.conn.execute("select now()").fetchone()  # opens the transaction
        assert row is not None
        self.started = row[0]
        self.conn.execute("select pg_sleep(%s)", (AGE,))
        return self

    def __exit__(self, *exc: object) -> None:
        self.conn.commit()

    def clock(self) -> datetime:
        row = self.conn.execute("select clock_timestamp()").fetchone()
        assert row is not None
        return row[0]

    @property
    def aged_at_least(self) -> datetime:
        """A time that the statement clock has passed by now, but the transaction clock has not."""
        return self.started + timedelta(seconds=AGE) - SLACK


@pytest.fixture
def old(pg_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_url) as c:  # not autocommit: statements share one transaction
        yield c


def test_a_claim_in_an_old_transaction_sets_its_expiry_from_the_statement_clock(
    conn: psycopg.Connection[Any], old: psycopg.Connection[Any], schema: str
) -> None:
    enq(conn, schema, "r1", "e1")
    with Aged(old) as aged:
        got = claim(old, schema, ttl=TTL)
        after = aged.clock()
    row = got["r1"][0]
    # Set from the statement clock, the lease outlives the statement; from now() it had
    # expired before the claim returned (now() + 1 s is AGE = 1.4 s in the past).
    assert row["lease_expires_at"] > after, (row["lease_expires_at"], after, aged.started)
    assert row["claimed_at"] >= aged.aged_at_least
    # Nobody else can take it while the lease runs.
    assert claim(conn, schema, owner="o2", ttl=TTL) == {}


@pytest.mark.parametrize("lane", ["ordinary", "critical", "targeted"])
def test_a_lease_that_expired_while_the_transaction_waited_is_claimable(
    conn: psycopg.Connection[Any], old: psycopg.Connection[Any], schema: str, lane: str
) -> None:
    enq(conn, schema, "r1", "e1", terminal=lane != "ordinary")
    first = claim(
        conn,
        schema,
        owner="o1",
        ttl="1 second",
        lane="critical" if lane == "critical" else "ordinary",
    )
    assert "r1" in first
    with Aged(old):
        # The lease expired during the wait (statement clock), not at the transaction's start.
        got = claim(
            old,
            schema,
            owner="o2",
            ttl=TTL,
            lane="critical" if lane == "critical" else "ordinary",
            run_id="r1" if lane == "targeted" else None,
        )
    assert "r1" in got, f"{lane}: an expired lease was not claimable from an old transaction"
    assert got["r1"][0]["epoch"] == first["r1"][0]["epoch"] + 1


def test_a_renewal_in_an_old_transaction_sees_the_lease_expired_at_the_statement(
    conn: psycopg.Connection[Any], old: psycopg.Connection[Any], schema: str
) -> None:
    enq(conn, schema, "r1", "e1")
    got = claim(conn, schema, ttl=TTL)
    with Aged(old):
        renewed = call(old, schema, "renew", ["r1"], [token(got, "r1")], timedelta(seconds=30))
    assert renewed == [], "renewed a lease that had expired before the renewal ran"
    assert run_row(conn, schema, "r1")["lease_expires_at"] == got["r1"][0]["lease_expires_at"]


def test_a_renewal_in_an_old_transaction_extends_from_the_statement_clock(
    conn: psycopg.Connection[Any], old: psycopg.Connection[Any], schema: str
) -> None:
    enq(conn, schema, "r1", "e1")
    got = claim(conn, schema, ttl="30 seconds")
    with Aged(old) as aged:
        renewed = call(old, schema, "renew", ["r1"], [token(got, "r1")], timedelta(seconds=1))
        after = aged.clock()
    assert [r[0] for r in renewed] == ["r1"]
    assert renewed[0][1] > after, "the renewed expiry was already in the past"


def test_an_ack_in_an_old_transaction_is_fenced_by_the_statement_clock(
    conn: psycopg.Connection[Any], old: psycopg.Connection[Any], schema: str
) -> None:
    enq(conn, schema, "r1", "e1")
    got = claim(conn, schema, ttl=TTL)
    with Aged(old):
        result = ack(old, schema, ("r1", token(got, "r1"), 1))
    assert [r["status"] for r in result] == ["stale"], "acked under a lease that had expired"
    states = conn.execute(
        psycopg.sql.SQL("select state from {}").format(fn(schema, "events"))
    ).fetchall()
    assert states == [("pending",)]


def test_an_ack_in_an_old_transaction_stamps_delivery_with_the_statement_clock(
    conn: psycopg.Connection[Any], old: psycopg.Connection[Any], schema: str
) -> None:
    enq(conn, schema, "r1", "e1")
    got = claim(conn, schema, ttl="30 seconds")
    with Aged(old) as aged:
        result = ack(old, schema, ("r1", token(got, "r1"), 1))
    assert [r["status"] for r in result] == ["acked"]
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(
            psycopg.sql.SQL("select delivered_at from {}").format(fn(schema, "events"))
        ).fetchone()
    assert row is not None and row["delivered_at"] >= aged.aged_at_least


def test_a_release_in_an_old_transaction_schedules_from_the_statement_clock(
    conn: psycopg.Connection[Any], old: psycopg.Connection[Any], schema: str
) -> None:
    enq(conn, schema, "r1", "e1")
    got = claim(conn, schema, ttl="30 seconds")
    with Aged(old) as aged:
        released = call(
            old, schema, "release", "r1", token(got, "r1"), timedelta(seconds=1), "boom", 503, 1, 1
        )
        after = aged.clock()
    assert released == [(True,)]
    # From now(), the retry would be due before the release even ran: no backoff at all.
    assert run_row(conn, schema, "r1")["next_attempt_at"] > after


def test_a_poison_fail_in_an_old_transaction_is_fenced_and_stamped_by_the_statement_clock(
    conn: psycopg.Connection[Any], old: psycopg.Connection[Any], schema: str
) -> None:
    enq(conn, schema, "r1", "e1")
    got = claim(conn, schema, ttl="30 seconds")
    with Aged(old) as aged:
        failed = call(old, schema, "fail_event", "r1", token(got, "r1"), 1, 422, "poison")
    assert failed == [(True,)]
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(
            psycopg.sql.SQL("select failed_at from {}").format(fn(schema, "events"))
        ).fetchone()
    assert row is not None and row["failed_at"] >= aged.aged_at_least


def test_prune_in_an_old_transaction_measures_retention_on_the_statement_clock(
    conn: psycopg.Connection[Any], old: psycopg.Connection[Any], schema: str
) -> None:
    enq(conn, schema, "r1", "e1")
    got = claim(conn, schema, ttl="30 seconds")
    assert [r["status"] for r in ack(conn, schema, ("r1", token(got, "r1"), 1))] == ["acked"]
    # The outbox's parts in turn (schema version 8): e1's part 0 closes, part 2 is current.
    call(conn, schema, "rotate_outbox", 1)
    call(conn, schema, "rotate_outbox", 2)
    with Aged(old):
        # Part 0 closed more than 1 s before the statement, but after the transaction started.
        pruned = call(old, schema, "prune", timedelta(seconds=1), 100)
    assert pruned[0][0] == 1
