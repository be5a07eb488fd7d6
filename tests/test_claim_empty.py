"""The claim's empty path against a real PostgreSQL (schema/functions.sql `claim`, `v_empty`,
`settle_run`): a run is due with nothing after its cursor when the ack that caught it up found a
producer mid-enqueue (the ack's settle skipped it, to look again shortly). A claim that picks such
a run returns none of its rows, gives its lease back at once, and sets it idle only under the
run's run_seqs row lock, so that a producer still between its enqueue and its commit never sees
its event stranded in an idle run (DESIGN §9.1)."""

from __future__ import annotations

from typing import Any

import psycopg

from tests.test_lease_sql import ack, claim, enq, run_row, seqs, token, wait_due


def caught_up_while_a_producer_rolled_back(
    pg_url: str, conn: psycopg.Connection[Any], schema: str, run_id: str
) -> None:
    """`run_id`'s only event delivered, the run left active and due in 200 ms: its ack found a
    producer holding the run's lock, and that producer rolled back."""
    enq(conn, schema, run_id, f"{run_id}-1")
    got = claim(conn, schema, run_id=run_id)
    with psycopg.connect(pg_url) as producer, producer.transaction():
        enq(producer, schema, run_id, f"{run_id}-rolled-back")
        assert [r["status"] for r in ack(conn, schema, (run_id, token(got, run_id), 1))] == [
            "acked"
        ]
        raise psycopg.Rollback()
    row = run_row(conn, schema, run_id)
    assert (row["idle"], row["lease_token"], row["delivered_seq"]) == (False, None, 1)


def test_a_claim_that_finds_a_run_empty_gives_its_lease_back_and_settles_it(
    pg_url: str, conn: psycopg.Connection[Any], schema: str
) -> None:
    """The empty run is taken (its epoch moves) and handed back in the same call: no rows, no
    owner, no token, no expiry, idle; the run beside it with one event after its cursor is
    claimed with that event. A lease kept on a run the relay got no rows for is one the relay
    never learns of: the run's next event would wait out the TTL."""
    caught_up_while_a_producer_rolled_back(pg_url, conn, schema, "quiet")
    enq(conn, schema, "next", "next-1")
    enq(conn, schema, "next", "next-2")
    first = claim(conn, schema, run_id="next")
    ack(conn, schema, ("next", token(first, "next"), 1))  # released, seq 2 after its cursor
    epoch = run_row(conn, schema, "quiet")["epoch"]
    wait_due(conn, schema, "quiet")

    got = claim(conn, schema)

    assert sorted(got) == ["next"], "a run with nothing after its cursor was returned as claimed"
    assert seqs(got, "next") == [2], "a run with one event after its cursor was taken as empty"
    quiet = run_row(conn, schema, "quiet")
    assert quiet["epoch"] == epoch + 1, "the claim did not take the empty run: nothing was tested"
    assert (quiet["lease_owner"], quiet["lease_token"], quiet["lease_expires_at"]) == (
        None,
        None,
        None,
    ), "the claim kept the lease of a run it returned no rows for"
    assert quiet["idle"] is True, "a run with nothing pending and no producer was left active"
    # the run's next event is claimable at once: no lease the relay does not know of holds it
    enq(conn, schema, "quiet", "quiet-2")
    assert seqs(claim(conn, schema, run_id="quiet"), "quiet") == [2]


def test_a_claim_that_finds_a_run_empty_while_a_producer_writes_it_never_strands_its_event(
    pg_url: str, conn: psycopg.Connection[Any], schema: str
) -> None:
    """The claim's settle runs while a producer is between its enqueue and its commit (the
    producer's update of the run matched nothing: the run was active then). Only the run's
    run_seqs row lock, which the producer holds, tells the settle so; without it the run goes
    idle and the producer's event, committed after, is never claimed."""
    enq(conn, schema, "r1", "e1")
    got = claim(conn, schema)
    with psycopg.connect(pg_url) as producer:
        with producer.transaction():
            enq(producer, schema, "r1", "e2")
            ack(conn, schema, ("r1", token(got, "r1"), 1))  # its settle skips the held run
            wait_due(conn, schema, "r1")

            assert claim(conn, schema) == {}  # e2 is not committed: the run is empty

            row = run_row(conn, schema, "r1")
            assert row["epoch"] == 2, "the claim did not take the empty run: nothing was tested"
            assert row["lease_token"] is None
            assert row["idle"] is False, (
                "the claim's settle set the run idle while a producer held its lock:"
                " the producer's event is stranded"
            )
        # the producer committed e2: the run is looked at again shortly, and e2 is claimed
        wait_due(conn, schema, "r1")
        assert seqs(claim(conn, schema), "r1") == [2]
