"""Operator tools (issue 3, DESIGN §3 and §8.1): the SQL functions of functions_ops.sql against a
real PostgreSQL, the `relay status|inspect|retry|skip` commands in subprocesses, and retry and
skip on a live relay that blocked a run on a poison event."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import anyio
import psycopg
import pytest
from psycopg import errors, sql
from psycopg.rows import dict_row

import relay
from relay import ops
from tests.support import Rig, count, q, scans, wait_for
from tests.test_relay import enqueue_runs

RELAY = [sys.executable, "-m", "relay.cli"]
Conn = psycopg.Connection[Any]


# -- helpers -----------------------------------------------------------------------------------


def call(conn: Conn, schema: str, name: str, *args: Any) -> list[dict[str, Any]]:
    placeholders = sql.SQL(", ").join(sql.Placeholder() * len(args))
    query = sql.SQL("select * from {}({})").format(sql.Identifier(schema, name), placeholders)
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query, args).fetchall()


TABLES = (
    ("outbox", "run_id, seq"), ("event_failures", "run_id, seq"), ("event_skips", "run_id, seq"),
    ("pending_terminals", "run_id"), ("runs", "run_id"), ("run_seqs", "run_id"),
)  # fmt: skip


def snapshot(conn: Conn, schema: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of the outbox tables (schema version 7: `events` is a view over them): an
    operator error must leave all of them as they were."""
    return {
        table: conn.execute(q(schema, f"select * from {{s}}.{table} order by {order}")).fetchall()
        for table, order in TABLES
    }


def add_run(conn: Conn, schema: str, run_id: str, n: int, *, terminal: bool = False) -> None:
    with conn.transaction():
        for i in range(1, n + 1):
            relay.enqueue(
                conn, run_id, f"{run_id}-{i}", "step", {"i": i},
                terminal=terminal and i == n, schema=schema,
            )  # fmt: skip


def claim(conn: Conn, schema: str, run_id: str, owner: str = "replica-a") -> list[dict[str, Any]]:
    return call(conn, schema, "claim", owner, 1, 100, timedelta(seconds=60), "ordinary", run_id)


def deliver(conn: Conn, schema: str, run_id: str, upto: int) -> None:
    """What a relay does for a 2xx: claim the run and ack its events up to `upto`."""
    rows = claim(conn, schema, run_id)
    assert rows, f"{run_id} not claimable"
    batch = [{"run_id": run_id, "token": str(rows[0]["lease_token"]), "upto": upto}]
    acked = call(conn, schema, "ack", json.dumps(batch))
    assert acked[0]["status"] == "acked"


def block(
    conn: Conn, schema: str, run_id: str, seq: int, status: int = 422, error: str = "bad payload"
) -> None:
    """What a relay does for a poison answer: the event fails and its run is blocked."""
    if seq > 1:
        deliver(conn, schema, run_id, seq - 1)
    call(conn, schema, "block_event", run_id, seq, status, error)


def blocked_run(conn: Conn, schema: str, run_id: str, n: int = 3, seq: int = 1) -> None:
    add_run(conn, schema, run_id, n)
    block(conn, schema, run_id, seq)


def one_row(conn: Conn, schema: str, text: str, key: str) -> dict[str, Any]:
    """The one row `text` (`{s}` the schema, `%s` the key) reads, as a dict."""
    with conn.cursor(row_factory=dict_row) as cur:
        got = cur.execute(q(schema, text), (key,)).fetchone()
    assert got is not None
    return got


def run_row(conn: Conn, schema: str, run_id: str) -> dict[str, Any]:
    return one_row(conn, schema, "select * from {s}.runs where run_id = %s", run_id)


def event_row(conn: Conn, schema: str, event_id: str) -> dict[str, Any]:
    return one_row(conn, schema, "select * from {s}.events where event_id = %s", event_id)


def next_prefix(conn: Conn, schema: str, run_id: str) -> list[int]:
    """The seqs a relay's next claim of the run would POST, in order (lease given back)."""
    rows = claim(conn, schema, run_id, owner="probe")
    if rows:
        token = rows[0]["lease_token"]
        assert call(conn, schema, "release", run_id, token)[0]["release"]
    return [r["seq"] for r in rows]


# -- retry -------------------------------------------------------------------------------------


def test_retry_event_puts_the_failed_event_back_and_unblocks_its_run(
    pg_url: str, schema: str, conn: Conn
) -> None:
    blocked_run(conn, schema, "r1", n=4, seq=2)
    failed = event_row(conn, schema, "r1-2")
    assert next_prefix(conn, schema, "r1") == []  # blocked: the relay takes nothing

    with psycopg.connect(pg_url, autocommit=True) as listener:
        listener.execute(sql.SQL("listen {}").format(sql.Identifier(f"{schema}_terminal")))
        got = call(conn, schema, "retry_event", "r1-2", "alice@ops")
        notes = list(listener.notifies(timeout=10, stop_after=1))

    assert len(got) == 1
    row = got[0]
    assert (row["run_id"], row["seq"], row["event_id"], row["state"]) == (
        "r1",
        2,
        "r1-2",
        "pending",
    )
    assert row["retried_by"] == "alice@ops" and row["retries"] == 1
    assert row["blocked_seq"] is None
    event = event_row(conn, schema, "r1-2")
    assert event["state"] == "pending"
    assert event["attempts"] == failed["attempts"] == 1  # kept: the history of the event
    assert event["last_status"] == 422 and event["last_error"] == "bad payload"
    assert event["failed_at"] == failed["failed_at"]
    assert event["retried_by"] == "alice@ops" and event["retried_at"] == row["retried_at"]
    run = run_row(conn, schema, "r1")
    assert run["blocked_seq"] is None and run["attempts"] == 0 and run["last_error"] is None
    assert not run["idle"] and run["lease_token"] is None
    db_now = conn.execute("select clock_timestamp()").fetchone()
    assert db_now is not None and run["next_attempt_at"] <= db_now[0]  # due now
    # A relay is woken, and its next claim takes the retried event first, then the rest.
    assert [json.loads(n.payload) for n in notes] == [{"kind": "run_unblocked", "run_id": "r1"}]
    assert next_prefix(conn, schema, "r1") == [2, 3, 4]


def test_retry_run_retries_the_event_that_blocks_it(schema: str, conn: Conn) -> None:
    blocked_run(conn, schema, "r1", n=3, seq=3)
    row = call(conn, schema, "retry_run", "r1", "bob")[0]
    assert (row["event_id"], row["seq"], row["state"], row["retried_by"]) == (
        "r1-3", 3, "pending", "bob",
    )  # fmt: skip
    assert run_row(conn, schema, "r1")["blocked_seq"] is None
    assert next_prefix(conn, schema, "r1") == [3]


def test_retry_twice_counts_both(schema: str, conn: Conn) -> None:
    blocked_run(conn, schema, "r1", n=2)
    call(conn, schema, "retry_event", "r1-1", "alice")
    block(conn, schema, "r1", 1, status=400, error="still bad")
    row = call(conn, schema, "retry_event", "r1-1", "bob")[0]
    assert (row["retries"], row["retried_by"], row["attempts"]) == (2, "bob", 2)


def test_a_run_stays_blocked_while_an_earlier_event_is_failed(schema: str, conn: Conn) -> None:
    """Defensive: should a run be blocked again at an earlier event (the relay only ever blocks
    its head), the block moves there and nothing after it is delivered. Since schema version 7
    a run has one failed event, its blocked head (runs.blocked_seq): the later event's failure
    stays in event_failures as history, and the event is pending again behind the head, so it
    cannot be retried (in version 6 it stayed failed, and retrying it left the run blocked)."""
    add_run(conn, schema, "r1", 3)
    call(conn, schema, "block_event", "r1", 3, 422, "late")
    call(conn, schema, "block_event", "r1", 1, 422, "early")
    assert run_row(conn, schema, "r1")["blocked_seq"] == 1
    late = event_row(conn, schema, "r1-3")
    assert (late["state"], late["last_error"]) == ("pending", "late")
    with pytest.raises(errors.ObjectNotInPrerequisiteState, match="is pending"):
        call(conn, schema, "retry_event", "r1-3", "alice")
    assert run_row(conn, schema, "r1")["blocked_seq"] == 1
    assert next_prefix(conn, schema, "r1") == []
    assert call(conn, schema, "retry_run", "r1", "alice")[0]["blocked_seq"] is None
    assert next_prefix(conn, schema, "r1") == [1, 2, 3]


# -- skip --------------------------------------------------------------------------------------


# -- retry now: runs backing off after a failed attempt (issue 41) ---------------------------


def backing_off(conn: Conn, schema: str, run_id: str, n: int = 2, status: int = 503) -> None:
    """What a relay does for a transient failure: the run's lease is released with an error
    and a backoff of five minutes (attempts + 1)."""
    add_run(conn, schema, run_id, n)
    token = claim(conn, schema, run_id)[0]["lease_token"]
    delay = timedelta(minutes=5)
    got = call(conn, schema, "release", run_id, token, delay, "ingress answered 503", status)
    assert got[0]["release"]


def test_retry_run_now_makes_a_run_backing_off_due_and_only_that_moves(
    pg_url: str, schema: str, conn: Conn
) -> None:
    """A run backing off after a failed attempt waits up to max_backoff; retry_run_now makes
    its next attempt due now (a relay's claim takes it, past the retry budget: retry_waived),
    keeps its failed attempts and last error, and wakes the relays."""
    backing_off(conn, schema, "r1", n=3)
    before = run_row(conn, schema, "r1")
    assert next_prefix(conn, schema, "r1") == []  # backing off: no claim takes it

    with psycopg.connect(pg_url, autocommit=True) as listener:
        listener.execute(sql.SQL("listen {}").format(sql.Identifier(f"{schema}_terminal")))
        got = call(conn, schema, "retry_run_now", "r1", "alice@ops")
        notes = list(listener.notifies(timeout=10, stop_after=1))

    assert [(r["run_id"], r["attempts"], r["last_status"]) for r in got] == [("r1", 1, 503)]
    assert got[0]["last_error"] == "ingress answered 503"
    assert got[0]["was_due_at"] == before["next_attempt_at"]
    assert got[0]["failed_at"] == before["updated_at"]
    after = run_row(conn, schema, "r1")
    changed = {k for k in before if before[k] != after[k]}
    # attempts, error, epoch, lease, updated_at kept
    assert changed == {"next_attempt_at", "retry_waived"} and after["retry_waived"]
    db_now = conn.execute("select clock_timestamp()").fetchone()
    assert db_now is not None and after["next_attempt_at"] <= db_now[0]
    assert [json.loads(n.payload) for n in notes] == [
        {"kind": "run_due", "run_id": "r1", "by": "alice@ops"}
    ]
    assert next_prefix(conn, schema, "r1") == [1, 2, 3]


def test_retry_run_now_refuses_a_run_that_is_not_backing_off_and_changes_nothing(
    schema: str, conn: Conn
) -> None:
    """A leased run (whoever holds it: a live owner's lease is never moved), a blocked one, an
    idle one, a due one and a missing one are each refused with the reason."""
    add_run(conn, schema, "leased", 1)
    claim(conn, schema, "leased", owner="replica-live")
    blocked_run(conn, schema, "blocked", n=2)
    add_run(conn, schema, "due", 1)
    add_run(conn, schema, "idle", 1)
    deliver(conn, schema, "idle", 1)
    call(conn, schema, "settle_run", "idle")
    backing_off(conn, schema, "leased-after-failure")
    # Made due by hand and claimed again: leased, with a failed attempt behind it.
    conn.execute(q(schema, "update {s}.runs set next_attempt_at = '-infinity'"
                           " where run_id = 'leased-after-failure'"))  # fmt: skip
    claim(conn, schema, "leased-after-failure", owner="replica-live")
    before = snapshot(conn, schema)
    for run_id, reason in [
        ("leased", "a relay holds its lease (replica-live)"),
        ("leased-after-failure", "a relay holds its lease (replica-live)"),
        ("blocked", "it is blocked at seq 1"),
        ("due", "no attempt of it failed"),
        ("idle", "it is idle"),
    ]:
        with pytest.raises(errors.ObjectNotInPrerequisiteState, match="not backing off") as exc:
            call(conn, schema, "retry_run_now", run_id, "alice")
        assert reason in str(exc.value)
    with pytest.raises(errors.NoDataFound, match="no run nope"):
        call(conn, schema, "retry_run_now", "nope", "alice")
    with pytest.raises(errors.InvalidParameterValue):
        call(conn, schema, "retry_run_now", "leased", "")
    assert snapshot(conn, schema) == before


def test_retry_backing_off_since_a_time_takes_the_runs_that_failed_since(
    schema: str, conn: Conn
) -> None:
    """After an outage: every run that failed against the ingress at or after a time is due
    now; runs that failed before it, leased runs and blocked runs are left as they are."""
    backing_off(conn, schema, "early")
    backing_off(conn, schema, "late-1")
    since = run_row(conn, schema, "late-1")["updated_at"]  # the failure's time (db clock)
    backing_off(conn, schema, "late-2")
    add_run(conn, schema, "leased", 1)
    claim(conn, schema, "leased", owner="replica-live")
    blocked_run(conn, schema, "blocked")
    leased = run_row(conn, schema, "leased")

    got = call(conn, schema, "retry_backing_off", since, "bob")
    assert [r["run_id"] for r in got] == ["late-1", "late-2"]  # oldest failure first
    assert next_prefix(conn, schema, "early") == []  # failed before: still backing off
    assert next_prefix(conn, schema, "late-1") == [1, 2]
    assert run_row(conn, schema, "leased") == leased
    assert run_row(conn, schema, "blocked")["blocked_seq"] == 1
    # Without a time: every run backing off (here the early one); none left is not an error.
    assert [r["run_id"] for r in call(conn, schema, "retry_backing_off", None, "bob")] == ["early"]
    assert call(conn, schema, "retry_backing_off", None, "bob") == []


def test_skip_event_records_who_why_and_when_and_unblocks_its_run(schema: str, conn: Conn) -> None:
    blocked_run(conn, schema, "r1", n=4, seq=2)
    row = call(conn, schema, "skip_event", "r1-2", "carol@ops", "schema v1 payload, superseded")[0]
    assert (row["event_id"], row["state"], row["skipped_by"], row["skip_reason"]) == (
        "r1-2", "skipped", "carol@ops", "schema v1 payload, superseded",
    )  # fmt: skip
    assert row["blocked_seq"] is None and row["skipped_at"] is not None
    event = event_row(conn, schema, "r1-2")
    assert event["state"] == "skipped" and event["done_at"] == row["skipped_at"]
    assert event["delivered_at"] is None  # never sent
    assert run_row(conn, schema, "r1")["blocked_seq"] is None
    # The relay delivers the rest in order, without the skipped event.
    assert next_prefix(conn, schema, "r1") == [3, 4]


def test_skipping_the_last_event_lets_the_run_settle(schema: str, conn: Conn) -> None:
    blocked_run(conn, schema, "r1", n=2, seq=2)
    call(conn, schema, "skip_event", "r1-2", "carol", "bad")
    assert next_prefix(conn, schema, "r1") == []  # claim finds nothing, settles the run
    assert run_row(conn, schema, "r1")["idle"] is True


# -- errors: clear, and nothing changes --------------------------------------------------------


def _states(conn: Conn, schema: str) -> None:
    """One run per event state (and an unblocked run) to aim the errors at."""
    blocked_run(conn, schema, "failed", n=2)  # failed-1 failed, failed-2 pending (held)
    add_run(conn, schema, "pending", 1)
    add_run(conn, schema, "delivered", 1)
    deliver(conn, schema, "delivered", 1)
    blocked_run(conn, schema, "skipped", n=1)
    call(conn, schema, "skip_event", "skipped-1", "carol", "superseded")


ERRORS = [
    # (function, args, SQLSTATE class, words the message must contain)
    ("retry_event", ("nope", "alice"), errors.NoDataFound, "no event with event_id nope"),
    ("retry_event", ("pending-1", "alice"), errors.ObjectNotInPrerequisiteState, "is pending"),
    ("retry_event", ("failed-2", "alice"), errors.ObjectNotInPrerequisiteState, "is pending"),
    ("retry_event", ("delivered-1", "alice"), errors.ObjectNotInPrerequisiteState, "is delivered"),
    ("retry_event", ("skipped-1", "alice"), errors.ObjectNotInPrerequisiteState, "is skipped"),
    ("retry_event", ("failed-1", ""), errors.InvalidParameterValue, "who acts"),
    ("retry_event", ("failed-1", None), errors.InvalidParameterValue, "who acts"),
    ("retry_event", ("", "alice"), errors.InvalidParameterValue, "event_id"),
    ("retry_run", ("nope", "alice"), errors.NoDataFound, "no run nope"),
    ("retry_run", ("pending", "alice"), errors.ObjectNotInPrerequisiteState, "not blocked"),
    ("retry_run", ("delivered", "alice"), errors.ObjectNotInPrerequisiteState, "not blocked"),
    ("retry_run", ("failed", " "), errors.InvalidParameterValue, "who acts"),
    ("skip_event", ("nope", "carol", "r"), errors.NoDataFound, "no event with event_id nope"),
    ("skip_event", ("pending-1", "carol", "r"), errors.ObjectNotInPrerequisiteState, "is pending"),
    ("skip_event", ("delivered-1", "c", "r"), errors.ObjectNotInPrerequisiteState, "is delivered"),
    ("skip_event", ("skipped-1", "carol", "r"), errors.ObjectNotInPrerequisiteState, "is skipped"),
    ("skip_event", ("failed-1", "carol", ""), errors.InvalidParameterValue, "reason is required"),
    ("skip_event", ("failed-1", "carol", "  "), errors.InvalidParameterValue, "reason"),
    ("skip_event", ("failed-1", "carol", None), errors.InvalidParameterValue, "reason"),
    ("skip_event", ("failed-1", "carol", "x" * 2001), errors.InvalidParameterValue, "2000"),
    ("skip_event", ("failed-1", "", "r"), errors.InvalidParameterValue, "who acts"),
    ("inspect_run", ("nope",), errors.NoDataFound, "no run nope"),
    ("inspect_run_summary", ("nope",), errors.NoDataFound, "no run nope"),
]


@pytest.mark.parametrize(("name", "args", "error", "words"), ERRORS)
def test_operator_errors_are_clear_and_change_nothing(
    schema: str, conn: Conn, name: str, args: tuple[Any, ...], error: type[Exception], words: str
) -> None:
    _states(conn, schema)
    before = snapshot(conn, schema)
    with pytest.raises(error) as raised:
        call(conn, schema, name, *args)
    message = str(raised.value)
    assert message.startswith(f"relay.{name}: ") and words in message, message
    assert snapshot(conn, schema) == before


def test_a_second_retry_or_a_skip_after_retry_is_refused(schema: str, conn: Conn) -> None:
    blocked_run(conn, schema, "r1", n=2)
    call(conn, schema, "retry_event", "r1-1", "alice")
    before = snapshot(conn, schema)
    with pytest.raises(errors.ObjectNotInPrerequisiteState):
        call(conn, schema, "retry_event", "r1-1", "alice")
    with pytest.raises(errors.ObjectNotInPrerequisiteState):
        call(conn, schema, "skip_event", "r1-1", "alice", "changed my mind")
    with pytest.raises(errors.ObjectNotInPrerequisiteState):
        call(conn, schema, "retry_run", "r1", "alice")
    assert snapshot(conn, schema) == before


# -- inspect -----------------------------------------------------------------------------------


def test_inspect_shows_every_event_its_audit_and_the_lease(schema: str, conn: Conn) -> None:
    add_run(conn, schema, "r1", 4, terminal=True)
    block(conn, schema, "r1", 1, status=400, error="missing field")
    call(conn, schema, "retry_event", "r1-1", "alice")
    block(conn, schema, "r1", 2, status=422, error="bad payload")  # r1-1 delivered on the way
    call(conn, schema, "skip_event", "r1-2", "bob", "superseded by r1-3")
    lease = claim(conn, schema, "r1", owner="replica-a")  # a relay is now delivering 3 and 4

    events = call(conn, schema, "inspect_run", "r1")
    assert [(e["seq"], e["event_id"], e["state"]) for e in events] == [
        (1, "r1-1", "delivered"), (2, "r1-2", "skipped"), (3, "r1-3", "pending"),
        (4, "r1-4", "pending"),
    ]  # fmt: skip
    first, second = events[0], events[1]
    assert first["retried_by"] == "alice" and first["retries"] == 1
    assert first["retried_at"] is not None and first["delivered_at"] is not None
    assert first["last_status"] == 400 and first["failed_at"] is not None  # history kept
    # Failed attempts only (event_failures, schema version 7): version 6 counted the delivery
    # too (2). The delivery time is the run's last delivery: no time is kept per event.
    assert first["attempts"] == 1
    assert first["delivered_at"] == run_row(conn, schema, "r1")["delivered_at"]
    assert (second["skipped_by"], second["skip_reason"]) == ("bob", "superseded by r1-3")
    assert second["skipped_at"] is not None and second["last_status"] == 422
    assert second["last_error"] == "bad payload" and second["delivered_at"] is None
    assert [e["terminal"] for e in events] == [False, False, False, True]

    run = call(conn, schema, "inspect_run_summary", "r1")[0]
    assert run["lease_owner"] == "replica-a" and run["lease_live"] is True
    assert run["lease_expires_at"] == lease[0]["lease_expires_at"]
    assert run["epoch"] == lease[0]["epoch"]
    assert run["blocked_seq"] is None and run["critical"] is True
    assert (run["events_total"], run["pending"], run["delivered"], run["skipped"]) == (4, 2, 1, 1)
    assert run["failed"] == 0
    assert (run["last_seq"], run["terminal_seq"]) == (4, 4)
    assert "lease_token" not in run

    window = call(conn, schema, "inspect_run", "r1", 2, 2)
    assert [e["seq"] for e in window] == [2, 3]


def test_inspect_summary_of_a_blocked_run(schema: str, conn: Conn) -> None:
    blocked_run(conn, schema, "r1", n=3, seq=2)
    run = call(conn, schema, "inspect_run_summary", "r1")[0]
    assert (run["blocked_seq"], run["blocked_event_id"], run["failed"]) == (2, "r1-2", 1)
    assert (run["events_total"], run["pending"], run["delivered"], run["skipped"]) == (3, 1, 1, 0)
    assert run["last_error"] == "bad payload" and run["lease_live"] is False
    assert ops.run_state(run).startswith("BLOCKED at seq 2")


def test_inspect_counts_the_heads_failed_attempts_alike_in_the_run_and_the_event(
    schema: str, conn: Conn
) -> None:
    """Issue 41: the run's attempts and its head event's `att` agree: while the run backs off
    (counted on the run, no event_failures row yet) and once it is blocked (the failed event's
    count, which takes the run's and the one that failed it); before, inspect showed the
    blocked run's `attempts 0` beside its event's `att 1`."""
    backing_off(conn, schema, "r1", n=2)
    summary = call(conn, schema, "inspect_run_summary", "r1")[0]
    head, rest = call(conn, schema, "inspect_run", "r1")
    assert (summary["attempts"], head["attempts"], rest["attempts"]) == (1, 1, 0)
    assert ops.run_state(summary).startswith("backing off until")

    blocked_run(conn, schema, "r2", n=2)  # failed at its first attempt
    summary = call(conn, schema, "inspect_run_summary", "r2")[0]
    head, rest = call(conn, schema, "inspect_run", "r2")
    assert (summary["attempts"], head["attempts"], rest["attempts"]) == (1, 1, 0)

    conn.execute(q(schema, "update {s}.runs set next_attempt_at = '-infinity' where run_id = 'r1'"))
    token = claim(conn, schema, "r1")[0]["lease_token"]
    call(conn, schema, "fail_event", "r1", token, 1, 422, "bad payload")  # its second attempt
    summary = call(conn, schema, "inspect_run_summary", "r1")[0]
    head, _ = call(conn, schema, "inspect_run", "r1")
    assert (summary["attempts"], head["attempts"]) == (2, 2)


def test_inspect_summary_after_retention(schema: str, conn: Conn) -> None:
    """The counts are the events still in the outbox; the last seq is the run's, whether its
    events are there (the highest seq) or retention removed them all (a finished run's terminal
    seq; enqueue no longer writes run_seqs.last_seq per event, nor retention since it truncates
    whole parts of the outbox, schema version 8)."""
    add_run(conn, schema, "gone", 4, terminal=True)
    deliver(conn, schema, "gone", 4)
    blocked_run(conn, schema, "held", n=5, seq=3)
    add_run(conn, schema, "fresh", 2)
    assert call(conn, schema, "prune", timedelta(0), 100)[0]["prune"] == 6
    assert run_row(conn, schema, "held")["delivered_seq"] == 2

    gone = call(conn, schema, "inspect_run_summary", "gone")[0]
    assert (gone["last_seq"], gone["terminal_seq"], gone["events_total"]) == (4, 4, 0)
    assert gone["epoch"] is None and gone["critical"] is False  # the run row is forgotten too
    assert call(conn, schema, "inspect_run", "gone") == []
    held = call(conn, schema, "inspect_run_summary", "held")[0]
    assert (held["last_seq"], held["events_total"]) == (5, 3)
    assert (held["pending"], held["failed"], held["delivered"], held["skipped"]) == (2, 1, 0, 0)
    fresh = call(conn, schema, "inspect_run_summary", "fresh")[0]
    assert (fresh["last_seq"], fresh["events_total"], fresh["pending"]) == (2, 2, 2)


# -- status ------------------------------------------------------------------------------------


def test_status_figures_of_a_known_state(schema: str, conn: Conn) -> None:
    add_run(conn, schema, "crit", 2, terminal=True)  # critical: 1 run, 2 events
    add_run(conn, schema, "ord1", 3)  # ordinary: 2 runs, 4 events
    add_run(conn, schema, "ord2", 1)
    blocked_run(conn, schema, "blk", n=3)  # blocked at seq 1, 2 events held
    add_run(conn, schema, "done", 4)
    deliver(conn, schema, "done", 4)
    add_run(conn, schema, "old", 2)
    deliver(conn, schema, "old", 2)
    conn.execute(
        q(
            schema,
            "update {s}.runs set delivered_at = delivered_at - interval '2 minutes',"
            " updated_at = updated_at - interval '2 minutes' where run_id = 'old'",
        )
    )  # delivered, but not in the last minute (its cursor moved two minutes ago)
    conn.execute(
        q(
            schema,
            "update {s}.outbox set created_at = clock_timestamp() - interval '10 minutes'"
            " where run_id = 'ord1'",
        )
    )
    conn.execute(
        q(
            schema,
            "update {s}.outbox set created_at = clock_timestamp() - interval '5 minutes'"
            " where run_id = 'crit'",
        )
    )
    claim(conn, schema, "ord1", owner="replica-a")
    claim(conn, schema, "ord2", owner="replica-b")
    claim(conn, schema, "crit", owner="replica-b")
    conn.execute(
        q(
            schema,
            "update {s}.runs set lease_expires_at = clock_timestamp() - interval '1 second'"
            " where run_id = 'crit'",
        )
    )  # an expired lease: claimable, not live

    got = call(conn, schema, "status")[0]["status"]

    lanes = {lane["lane"]: lane for lane in got["lanes"]}
    assert (lanes["critical"]["runs"], lanes["critical"]["events"]) == (1, 2)
    assert (lanes["ordinary"]["runs"], lanes["ordinary"]["events"]) == (2, 4)
    assert lanes["ordinary"]["oldest_pending_age_seconds"] >= 600
    assert 300 <= lanes["critical"]["oldest_pending_age_seconds"] < 600
    assert got["blocked"] == {
        "runs": 1, "events": 1, "held_events": 2,
        "oldest_failure_age_seconds": got["blocked"]["oldest_failure_age_seconds"],
    }  # fmt: skip
    [b] = got["blocked_runs"]
    assert (b["run_id"], b["seq"], b["event_id"], b["last_status"], b["last_error"]) == (
        "blk", 1, "blk-1", 422, "bad payload",
    )  # fmt: skip
    assert b["held_events"] == 2 and b["attempts"] == 1
    assert [(x["owner"], x["runs"]) for x in got["leases"]] == [("replica-a", 1), ("replica-b", 1)]
    assert got["expired_leases"] == 1
    # Runs, not events (schema version 7 keeps no delivery time per event): "done" delivered
    # its four in the last minute, "old" two minutes ago.
    assert got["runs_delivered_last_minute"] == 1
    assert "delivered_last_minute" not in got
    assert set(got["tables"]) == {name for name, _ in TABLES}
    assert all(size > 0 for size in got["tables"].values()), got["tables"]

    assert call(conn, schema, "status", 0)[0]["status"]["blocked_runs"] == []


def test_status_lists_at_most_the_limit_oldest_failure_first(schema: str, conn: Conn) -> None:
    for i in range(3):
        blocked_run(conn, schema, f"b{i}", n=1)
    got = call(conn, schema, "status", 2)[0]["status"]
    assert [b["run_id"] for b in got["blocked_runs"]] == ["b0", "b1"]
    assert got["blocked"]["runs"] == 3


def test_status_of_an_empty_outbox(schema: str, conn: Conn) -> None:
    got = call(conn, schema, "status")[0]["status"]
    assert [(x["lane"], x["runs"], x["events"]) for x in got["lanes"]] == [
        ("critical", 0, 0), ("ordinary", 0, 0),
    ]  # fmt: skip
    assert got["blocked"]["runs"] == 0 and got["blocked_runs"] == [] and got["leases"] == []
    assert got["blocked"]["held_events"] == 0 and got["runs_delivered_last_minute"] == 0


def test_runs_delivered_last_minute_finds_every_kind_of_run(schema: str, conn: Conn) -> None:
    """status()'s runs_delivered_last_minute is read through three indexes (runs_idle, runs_due,
    event_failures), one per kind of run a delivery can leave behind: each must be found."""
    add_run(conn, schema, "idle", 2)
    deliver(conn, schema, "idle", 2)  # all delivered: the run goes idle
    add_run(conn, schema, "released", 3)
    deliver(conn, schema, "released", 1)  # part delivered, lease given back: due now
    add_run(conn, schema, "kept", 3)
    token = str(claim(conn, schema, "kept")[0]["lease_token"])
    batch = [{"run_id": "kept", "token": token, "upto": 1, "keep": True}]
    assert call(conn, schema, "ack", json.dumps(batch))[0]["status"] == "acked"  # still leased
    blocked_run(conn, schema, "blocked", n=3, seq=2)  # delivered 1, then blocked at 2
    blocked_run(conn, schema, "skipped", n=2)
    call(conn, schema, "skip_event", "skipped-1", "carol", "r")  # a skip is not a delivery
    add_run(conn, schema, "pending", 2)
    assert not run_row(conn, schema, "released")["idle"]
    assert run_row(conn, schema, "kept")["lease_token"] is not None

    def figure() -> int:
        return int(call(conn, schema, "status")[0]["status"]["runs_delivered_last_minute"])

    assert figure() == 4  # idle, released, kept, blocked
    for run in ("idle", "released", "kept", "blocked"):  # each moved its cursor 2 minutes ago
        conn.execute(
            q(
                schema,
                "update {s}.runs set delivered_at = delivered_at - interval '2 minutes'"
                " where run_id = %s",
            ),
            (run,),
        )
        assert figure() == 3
        conn.execute(
            q(
                schema,
                "update {s}.runs set delivered_at = delivered_at + interval '2 minutes'"
                " where run_id = %s",
            ),
            (run,),
        )


def _delivered_history(conn: Conn, schema: str, runs: int, per_run: int, long: int) -> None:
    """`runs` runs of `per_run` events and one run ("long") of `long` events, all delivered an
    hour ago and idle: the history retention keeps, written straight into the version-7 tables
    (the rows enqueue and the ack leave, without 10^4 calls)."""
    statements = [
        """insert into {s}.runs (run_id, idle, delivered_seq, delivered_at, updated_at,
                                next_attempt_at, epoch)
           select r.run_id, true, r.n, t.at, t.at, t.at, 1
           from (select 'h' || g as run_id, %(per_run)s as n from generate_series(1, %(runs)s) g
                 union all select 'long', %(long)s) r,
                (select clock_timestamp() - interval '1 hour' as at) t""",
        "insert into {s}.run_seqs (run_id, last_seq) select run_id, 0 from {s}.runs",
        """insert into {s}.outbox (run_id, seq, event_id, event_type, payload, created_at)
           select r.run_id, i, r.run_id || '-' || i, 'step', '{{}}',
                  clock_timestamp() - interval '2 hours'
           from {s}.runs r, generate_series(1, r.delivered_seq) i""",
        "analyze {s}.runs",
        "analyze {s}.run_seqs",
        "analyze {s}.outbox",
    ]
    params = {"runs": runs, "per_run": per_run, "long": long}
    for statement in statements:
        conn.execute(q(schema, statement), params if "%(" in statement else None)


def test_status_and_inspect_are_index_backed_whatever_the_delivered_history(
    schema: str, conn: Conn
) -> None:
    """Schema version 7 derives each event's state from its run's cursor (the `events` view):
    a reader that filters the view on state reads the whole outbox. status(), the status page's
    ui_status() and inspect read the tables through their indexes instead, so 25,000 delivered
    events cost them nothing: no sequential scan of the outbox (nor of runs, but for status()'s
    backlog(), functions_ops_metrics.sql, whose blocked total joins runs to event_failures), and
    the outbox entries read are those of the few runs with work, not of the history."""
    _delivered_history(conn, schema, 2_000, 10, 5_000)
    add_run(conn, schema, "crit", 2, terminal=True)
    add_run(conn, schema, "ord", 3)
    blocked_run(conn, schema, "blk", n=3, seq=2)  # delivered 1 now, blocked at 2, holds 1
    add_run(conn, schema, "done", 2)
    deliver(conn, schema, "done", 2)

    def read(statement: str, runs: bool = True) -> tuple[Any, dict[str, tuple[int, int]]]:
        rows, delta = scans(conn, schema, lambda: conn.execute(q(schema, statement)).fetchall())
        assert delta["outbox"][0] == 0, (statement, delta)  # no sequential scan of the outbox
        assert not runs or delta["runs"][0] == 0, (statement, delta)  # nor of runs
        return rows, delta

    def outbox_read(delta: dict[str, tuple[int, int]]) -> int:
        return sum(t for name, (_, t) in delta.items() if name.startswith("outbox"))

    [[got]], delta = read("select {s}.status(50)", runs=False)
    assert outbox_read(delta) <= 30, delta
    lanes = {x["lane"]: (x["runs"], x["events"]) for x in got["lanes"]}
    assert lanes == {"critical": (1, 2), "ordinary": (1, 3)}
    assert (got["blocked"]["runs"], got["blocked"]["held_events"]) == (1, 1)
    assert [(b["run_id"], b["held_events"]) for b in got["blocked_runs"]] == [("blk", 1)]
    assert got["runs_delivered_last_minute"] == 2  # blk and done; the history an hour ago

    [[page]], delta = read("select {s}.ui_status(50, 0, 60)")
    assert outbox_read(delta) <= 10, delta
    assert page["held_events"] == 1
    assert [(b["run_id"], b["held_events"]) for b in page["blocked_runs"]] == [("blk", 1)]

    [[summary]], delta = read("select to_jsonb(x) from {s}.inspect_run_summary('h7') x")
    assert outbox_read(delta) <= 30, delta  # the run's ten events, not the history
    assert (summary["events_total"], summary["delivered"], summary["last_seq"]) == (10, 10, 10)
    rows, delta = read("select seq, state from {s}.inspect_run('long', 4000, 5)")
    assert rows == [(seq, "delivered") for seq in range(4000, 4005)]
    assert outbox_read(delta) <= 10, delta  # a window of the run's primary key


# -- pure helpers ------------------------------------------------------------------------------


def test_clean_defuses_terminal_escapes_and_shortens() -> None:
    assert ops.clean("a\nb\x1b[31mc\u202ed") == "a\\nb\\x1b[31mc\\u202ed"
    assert ops.clean("héllo [bold]x[/bold]") == "héllo [bold]x[/bold]"
    assert ops.clean("abcdef", 4) == "abc…"


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("run\u2066evil\u2069", "run\\u2066evil\\u2069"),  # bidi isolates (issue 32, item 7)
        ("a\u2067b\u2068c", "a\\u2067b\\u2068c"),
        ("zero\u200bwidth", "zero\\u200bwidth"),  # format characters (Cf)
        ("\ufeffbom", "\\ufeffbom"),
        ("arabic\u061cmark", "arabic\\u061cmark"),
        ("line\u2028sep", "line\\u2028sep"),
        ("nb\u00a0sp", "nb\\xa0sp"),  # looks like a space, is not one
        ("a b", "a b"),
        ("日本語 ñ", "日本語 ñ"),
    ],
)
def test_clean_escapes_every_format_and_separator_character(raw: str, shown: str) -> None:
    assert ops.clean(raw) == shown


def test_default_operator_and_exit_codes() -> None:
    assert ops.default_operator({"USER": "alice"}, "host1") == "alice@host1"
    assert ops.default_operator({"LOGNAME": "bob"}, "h") == "bob@h"
    assert ops.exit_code("P0002") == ops.NOT_FOUND
    assert ops.exit_code("55000") == ops.WRONG_STATE
    assert ops.exit_code("55P03") == ops.exit_code("57014") == ops.TIMED_OUT
    assert ops.exit_code("22023") == ops.USAGE
    assert ops.exit_code("XX000") == ops.exit_code(None) == ops.DB_ERROR


def test_formatting() -> None:
    assert ops.fmt_age(0.25) == "250 ms"
    assert ops.fmt_age(75) == "1m 15s"
    assert ops.fmt_age(3 * 3600 + 120) == "3h 02m"
    assert ops.fmt_age(3 * 86400) == "3d 00h"
    assert ops.fmt_bytes(512) == "512 B" and ops.fmt_bytes(3 * 1024 * 1024) == "3.0 MiB"
    assert ops.fmt_time("2026-01-02T03:04:05.678+01:00") == "2026-01-02 02:04:05.678Z"


# -- the CLI, in subprocesses ------------------------------------------------------------------


def cli_env(pg_url: str, schema: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update(RELAY_DATABASE_URL=pg_url, RELAY_SCHEMA=schema, USER="tester")
    return env


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RELAY, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def cli_json(env: dict[str, str], *args: str) -> Any:
    got = cli(env, *args, "--json")
    assert got.returncode == 0, got.stderr
    return json.loads(got.stdout)


def test_cli_status_inspect_retry_skip(pg_url: str, schema: str, conn: Conn) -> None:
    env = cli_env(pg_url, schema)
    blocked_run(conn, schema, "r1", n=3)
    blocked_run(conn, schema, "r2", n=3, seq=2)
    blocked_run(conn, schema, "r3", n=2)

    status = cli_json(env, "status")
    assert sorted(b["run_id"] for b in status["blocked_runs"]) == ["r1", "r2", "r3"]
    assert status["blocked"]["held_events"] == 4

    inspect = cli_json(env, "inspect", "r2")
    assert inspect["run"]["blocked_seq"] == 2
    assert [(e["seq"], e["state"]) for e in inspect["events"]] == [
        (1, "delivered"), (2, "failed"), (3, "pending"),
    ]  # fmt: skip
    assert inspect["events"][1]["last_error"] == "bad payload"

    retried = cli_json(env, "retry", "r1-1", "--by", "alice")
    assert (retried["event_id"], retried["state"], retried["retried_by"]) == (
        "r1-1", "pending", "alice",
    )  # fmt: skip
    assert retried["unblocked"] is True
    by_run = cli_json(env, "retry", "--run", "r2")
    assert (by_run["event_id"], by_run["retried_by"]) == ("r2-2", "tester@" + socket.gethostname())
    skipped = cli_json(env, "skip", "r3-1", "--reason", "superseded", "--by", "carol")
    assert (skipped["state"], skipped["skipped_by"], skipped["skip_reason"]) == (
        "skipped", "carol", "superseded",
    )  # fmt: skip
    assert cli_json(env, "status")["blocked_runs"] == []

    # Human tables: the audit trail is visible in inspect.
    text = cli(env, "inspect", "r3")
    assert text.returncode == 0, text.stderr
    assert "skipped by carol" in text.stdout and "superseded" in text.stdout
    text = cli(env, "inspect", "r1")
    assert "retried by alice" in text.stdout and "bad payload" in text.stdout


def test_cli_retry_makes_runs_backing_off_due_now(pg_url: str, schema: str, conn: Conn) -> None:
    """`relay retry --run` of a run that is only backing off makes it due now (it answered "not
    blocked", exit 5, before issue 41); `--backing-off --since` does so for every run that
    failed since; a run neither blocked nor backing off is exit 5 with its state."""
    env = cli_env(pg_url, schema)
    backing_off(conn, schema, "r1")
    backing_off(conn, schema, "r2")
    backing_off(conn, schema, "r3")
    add_run(conn, schema, "fresh", 1)

    one = cli_json(env, "retry", "--run", "r1", "--by", "alice")
    assert (one["run_id"], one["due_now"], one["attempts"], one["last_status"]) == (
        "r1", True, 1, 503,
    )  # fmt: skip
    assert next_prefix(conn, schema, "r1") == [1, 2]
    text = cli(env, "retry", "--backing-off", "--since", "10m")
    assert text.returncode == 0, text.stderr
    assert "2 runs due now" in text.stdout and "r2" in text.stdout and "r3" in text.stdout
    assert next_prefix(conn, schema, "r3") == [1, 2]
    none = cli_json(env, "retry", "--backing-off")
    assert none == {"due_now": 0, "runs": []}

    refused = cli(env, "retry", "--run", "fresh")
    assert refused.returncode == ops.WRONG_STATE
    assert "not backing off: no attempt of it failed" in refused.stderr
    for args in (
        ["--since", "10m"],
        ["--backing-off", "--since", "yesterday"],
        ["--backing-off", "--since", "2025-05-01T10:00:00"],
        ["r1-1", "--backing-off"],
    ):
        bad = cli(env, "retry", *args)
        assert bad.returncode == ops.USAGE, (args, bad.stderr)


def test_the_audit_trail_records_the_database_role_beside_the_name_typed(
    pg_url: str, schema: str, conn: Conn
) -> None:
    """`--by` is whatever the caller types; the role the caller logged in as (session_user) is
    recorded beside it by the database, and shown by `relay inspect` (issue 13)."""
    role = f"relay_op_{os.getpid()}"
    owner = conn.execute("select current_user").fetchone()
    assert owner is not None
    conn.execute(sql.SQL("drop role if exists {}").format(sql.Identifier(role)))
    # A second login that acts on the schema through membership of its owner's role.
    conn.execute(
        sql.SQL("create role {} login in role {}").format(
            sql.Identifier(role), sql.Identifier(owner[0])
        )
    )
    try:
        blocked_run(conn, schema, "r1", n=2)
        blocked_run(conn, schema, "r2", n=2)
        env = cli_env(psycopg.conninfo.make_conninfo(pg_url, user=role), schema)
        retried = cli_json(env, "retry", "r1-1", "--by", "somebody-else")
        assert (retried["retried_by"], retried["retried_role"]) == ("somebody-else", role)
        skipped = cli_json(env, "skip", "r2-1", "--by", "nobody", "--reason", "test")
        assert (skipped["skipped_by"], skipped["skipped_role"]) == ("nobody", role)
        # Recorded on the events, shown by inspect (JSON and the table).
        assert event_row(conn, schema, "r1-1")["retried_role"] == role
        assert event_row(conn, schema, "r2-1")["skipped_role"] == role
        events = cli_json(env, "inspect", "r2")["events"]
        assert (events[0]["skipped_by"], events[0]["skipped_role"]) == ("nobody", role)
        text = cli(env, "inspect", "r1").stdout
        assert f"retried by somebody-else (role {role})" in text
        # The SQL API records the caller's own login too.
        blocked_run(conn, schema, "r3", n=1)
        row = call(conn, schema, "retry_event", "r3-1", "alice")[0]
        assert (row["retried_by"], row["retried_role"]) == ("alice", owner[0])
    finally:
        conn.execute(sql.SQL("drop role if exists {}").format(sql.Identifier(role)))


def test_cli_human_tables(pg_url: str, schema: str, conn: Conn) -> None:
    env = cli_env(pg_url, schema)
    blocked_run(conn, schema, "r1", n=2)
    conn.execute(
        q(schema, "update {s}.event_failures set last_error = %s where run_id = 'r1' and seq = 1"),
        ("ingress said \x1b[2J\x1b[31mboom [bold]x[/bold]",),
    )
    status = cli(env, "status")
    assert status.returncode == 0, status.stderr
    words = ("Backlog", "finished", "due", "Blocked runs", "r1-1", "422", "Outbox size",
             "Current outbox part: taking new events for",
             "outbox ", "event_failures ", "Runs with deliveries in the last minute")  # fmt: skip
    for word in words:
        assert word in status.stdout, status.stdout
    assert "\x1b" not in status.stdout  # an ingress body cannot drive the operator's terminal
    assert "\\x1b[2J" in status.stdout and "[bold]x[/bold]" in status.stdout  # shown, not run
    retry = cli(env, "retry", "r1-1")
    assert retry.returncode == 0 and "unblocked" in retry.stdout and "tester@" in retry.stdout
    skip_env = dict(env)
    blocked_run(conn, schema, "r2", n=1)
    skip = cli(skip_env, "skip", "r2-1", "--reason", "duplicate of r1")
    assert skip.returncode == 0 and "duplicate of r1" in skip.stdout


def test_cli_human_tables_need_no_rich(pg_url: str, schema: str, conn: Conn) -> None:
    """rich is only in the demo extra: with it unimportable (any `import rich...` raises), the
    tables print all the same."""
    blocked_run(conn, schema, "r1", n=2)
    no_rich = "import sys; sys.modules['rich'] = None\nfrom relay.cli import main\nsys.exit(main())"
    env = cli_env(pg_url, schema)
    for args, words in (
        (("status",), ("Backlog", "Blocked runs (1)", "r1-1", "bad payload", "Outbox size")),
        (("inspect", "r1"), ("Run r1", "BLOCKED at seq 1", "Events (times UTC)", "r1-2")),
        (("retry", "r1-1", "--by", "alice"), ("retried event r1-1", "alice (role ", "unblocked")),
    ):
        got = subprocess.run(
            [sys.executable, "-c", no_rich, *args],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert got.returncode == 0, got.stderr
        for word in words:
            assert word in got.stdout, got.stdout


CLI_ERRORS = [
    (("retry", "nope"), ops.NOT_FOUND, "no event with event_id nope"),
    (("retry", "r1-2"), ops.WRONG_STATE, "is pending, not failed"),
    (("retry", "--run", "ok"), ops.WRONG_STATE, "not backing off: it is idle"),
    (("retry", "--run", "nope"), ops.NOT_FOUND, "no run nope"),
    (("retry",), ops.USAGE, "give one of EVENT_ID, --run RUN_ID or --backing-off"),
    (
        ("retry", "r1-1", "--run", "r1"),
        ops.USAGE,
        "give one of EVENT_ID, --run RUN_ID or --backing-off",
    ),
    (("retry", "r1-1", "--by", " "), ops.USAGE, "--by"),
    (("skip", "r1-1"), ops.USAGE, "--reason is required"),
    (("skip", "r1-1", "--reason", " "), ops.USAGE, "--reason is required"),
    (("skip", "r1-2", "--reason", "x"), ops.WRONG_STATE, "is pending, not failed"),
    (("skip", "ok-1", "--reason", "x"), ops.WRONG_STATE, "is delivered, not failed"),
    (("inspect", "nope"), ops.NOT_FOUND, "no run nope"),
    (("status", "--schema", "t_not_migrated"), ops.UNAVAILABLE, "run `relay migrate`"),
    (("status", "--schema", "Bad-Name"), ops.USAGE, "schema"),
]


@pytest.mark.parametrize(("args", "code", "words"), CLI_ERRORS)
def test_cli_errors_are_one_line_with_their_exit_code_and_change_nothing(
    pg_url: str, schema: str, conn: Conn, args: tuple[str, ...], code: int, words: str
) -> None:
    blocked_run(conn, schema, "r1", n=2)
    add_run(conn, schema, "ok", 1)
    deliver(conn, schema, "ok", 1)
    before = snapshot(conn, schema)
    for json_flag in ((), ("--json",)):
        got = cli(cli_env(pg_url, schema), *args, *json_flag)
        assert got.returncode == code, (got.returncode, got.stderr)
        lines = got.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], got.stderr
        assert got.stdout == ""
    assert snapshot(conn, schema) == before


def test_cli_never_prints_the_database_password(pg_url: str, schema: str, conn: Conn) -> None:
    password = "s3cret-pw-41"
    info = psycopg.conninfo.conninfo_to_dict(pg_url)
    with_password = psycopg.conninfo.make_conninfo(pg_url, password=password)
    env = cli_env(with_password, schema)  # the test server trusts, so the password is unused
    blocked_run(conn, schema, "r1", n=1)
    outputs = [
        cli(env, "status"), cli(env, "status", "--json"), cli(env, "inspect", "r1"),
        cli(env, "inspect", "nope"), cli(env, "retry", "nope"),
    ]  # fmt: skip
    unreachable = f"postgresql://{info.get('user', 'postgres')}:{password}@127.0.0.1:1/db"
    down = cli(cli_env(unreachable, schema), "status")
    outputs.append(down)
    assert down.returncode == ops.UNAVAILABLE
    assert "cannot connect" in down.stderr and ":***@127.0.0.1:1" in down.stderr
    garbled = cli(cli_env(f"postgresql://u:{password}@x@127.0.0.1:1/db", schema), "status")
    outputs.append(garbled)
    assert garbled.returncode == ops.USAGE and "%40" in garbled.stderr
    for out in outputs:
        assert password not in out.stdout + out.stderr


def test_cli_usage_errors_come_before_connecting(schema: str) -> None:
    env = cli_env("postgresql://u@127.0.0.1:1/db", schema)  # nothing listens there
    for args in (("retry",), ("skip", "e1"), ("retry", "e1", "--by", "")):
        got = cli(env, *args)
        assert got.returncode == ops.USAGE, got.stderr
        assert "cannot connect" not in got.stderr
    got = cli(env, "inspect", "r1", "--limit", "-1")
    assert got.returncode == ops.USAGE and "non_negative" in got.stderr


def test_cli_shows_markup_in_ids_as_text(pg_url: str, schema: str, conn: Conn) -> None:
    blocked_run(conn, schema, "[red]r1[/red]", n=1)
    got = cli(cli_env(pg_url, schema), "inspect", "[red]r1[/red]")
    assert got.returncode == 0, got.stderr
    assert "Run [red]r1[/red]" in got.stdout
    got = cli(cli_env(pg_url, schema), "retry", "[red]r1[/red]-1")
    assert got.returncode == 0 and "retried event [red]r1[/red]-1" in got.stdout


# -- on a live relay ---------------------------------------------------------------------------


async def _cli_async(env: dict[str, str], *args: str) -> Any:
    """The CLI in a subprocess without blocking the event loop the relay runs on."""
    got = await anyio.run_process([*RELAY, *args, "--json"], env=env, check=False)
    assert got.returncode == 0, got.stderr.decode()
    return json.loads(got.stdout)


@asynccontextmanager
async def _live_relay_blocked_on_poison(rig: Rig) -> AsyncIterator[None]:
    """A running relay on runs r0..r2 of 4 events each, r1 blocked on its first event, which
    the ingress rejected (422); the ingress takes everything from then on."""
    s, conn, schema = rig.sink, rig.conn, rig.schema
    async with rig.relay().running():
        s.faults.fail(422, times=1000, run_id="r1", body={"error": "schema violation"})
        enqueue_runs(conn, schema, 3, 4)
        await wait_for(lambda: rig.count("state = 'delivered'") == 8, what="r0 and r2")
        await wait_for(lambda: rig.count("state = 'failed'") == 1, what="r1 blocked")
        assert event_row(conn, schema, "r1-0")["state"] == "failed"
        assert run_row(conn, schema, "r1")["blocked_seq"] == 1
        assert not any(k.startswith("r1-") for k in s.state.deliveries)  # nothing after it
        s.faults.clear()
        yield


@pytest.mark.anyio
async def test_retry_on_a_live_relay_delivers_the_rest_of_the_run_in_order(rig: Rig) -> None:
    s, conn, schema = rig.sink, rig.conn, rig.schema
    async with _live_relay_blocked_on_poison(rig):
        got = await _cli_async(cli_env(rig.pg_url, schema), "retry", "r1-0", "--by", "alice")
        assert got["unblocked"] is True
        await wait_for(lambda: count(conn, schema, "state <> 'delivered'") == 0, what="r1")
    assert s.state.first_order["r1"] == [1, 2, 3, 4]
    assert s.state.order_violations == 0
    inspect = await _cli_async(cli_env(rig.pg_url, schema), "inspect", "r1")
    first = inspect["events"][0]
    assert (first["state"], first["retried_by"], first["last_status"]) == (
        "delivered", "alice", 422,
    )  # fmt: skip


@pytest.mark.anyio
async def test_skip_on_a_live_relay_never_sends_the_event_and_delivers_the_rest(rig: Rig) -> None:
    s, conn, schema = rig.sink, rig.conn, rig.schema
    async with _live_relay_blocked_on_poison(rig):
        got = await _cli_async(
            cli_env(rig.pg_url, schema), "skip", "r1-0", "--reason", "bad schema", "--by", "bob"
        )
        assert got["unblocked"] is True
        await wait_for(lambda: count(conn, schema, "state = 'pending'") == 0, what="the rest of r1")
    assert s.state.first_order["r1"] == [2, 3, 4]
    assert "r1-0" not in s.state.deliveries
    assert s.state.order_violations == 0
    inspect = await _cli_async(cli_env(rig.pg_url, schema), "inspect", "r1")
    assert [(e["seq"], e["state"]) for e in inspect["events"]] == [
        (1, "skipped"), (2, "delivered"), (3, "delivered"), (4, "delivered"),
    ]  # fmt: skip
    assert (inspect["events"][0]["skipped_by"], inspect["events"][0]["skip_reason"]) == (
        "bob", "bad schema",
    )  # fmt: skip
