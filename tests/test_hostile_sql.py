"""Hostile input through the real SQL API (issue 13): a relay role that fails events it does not
hold, and wake or trace fields large enough to commit and then block the run at ack."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import errors

import relay
from tests.support import q
from tests.test_lease_sql import claim, enq, run_row, token
from tests.test_security import RoleSet, denied, granted  # noqa: F401 - the fixture

MB = 1024 * 1024


def test_the_relay_role_cannot_fail_an_event_of_a_run_it_does_not_hold(
    granted: RoleSet,  # noqa: F811 - the fixture
    schema: str,
    conn: psycopg.Connection[Any],
) -> None:
    enq(conn, schema, "victim", "victim-1")
    held = claim(conn, schema, owner="other-replica", ttl="1 minute")
    live = run_row(conn, schema, "victim")
    with psycopg.connect(granted.url(granted.roles.relay), autocommit=True) as r:
        with pytest.raises(errors.InvalidParameterValue, match="lease token is required"):
            r.execute(q(schema, "select {s}.fail_event('victim', null, 1, 500, 'x')"))
        stale = r.execute(
            q(schema, "select {s}.fail_event('victim', gen_random_uuid(), 1, 500, 'x')")
        ).fetchone()
        assert stale == (False,)
        # The unfenced helper that ack uses is not the relay role's to call.
        assert denied(r, q(schema, "select {s}.block_event('victim', 1, 500, 'x')"))
    after = run_row(conn, schema, "victim")
    assert after["blocked_seq"] is None, "the run was blocked by a caller without its lease"
    assert (after["lease_owner"], after["lease_token"]) == ("other-replica", live["lease_token"])
    assert str(after["lease_token"]) == token(held, "victim")
    states = conn.execute(q(schema, "select state from {s}.events")).fetchall()
    assert states == [("pending",)]


def test_fail_event_needs_a_live_lease_not_only_its_token(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    enq(conn, schema, "r1", "r1-1")
    got = claim(conn, schema, ttl="1 minute")
    conn.execute(q(schema, "update {s}.runs set lease_expires_at = clock_timestamp()"))
    failed = conn.execute(
        q(schema, "select {s}.fail_event('r1', %s, 1, 422, 'late')"), (token(got, "r1"),)
    ).fetchone()
    assert failed == (False,)
    assert run_row(conn, schema, "r1")["blocked_seq"] is None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("wake_event", "w" * MB, "wake_event of event e1 is 1048576 bytes"),
        ("wake_queue", "q" * 58, "wake_queue of event e1 is 58 bytes"),
        ("traceparent", "0" * MB, "traceparent of event e1 is 1048576 bytes"),
    ],
)
def test_oversized_wake_and_trace_fields_are_refused_at_enqueue_with_a_short_error(
    conn: psycopg.Connection[Any], schema: str, queue: str, field: str, value: str, message: str
) -> None:
    fields: dict[str, Any] = {"wake_queue": queue, "wake_event": "w:e1", "traceparent": None}
    fields[field] = value
    with pytest.raises(errors.InvalidParameterValue) as caught:
        relay.enqueue(
            conn,
            "r1",
            "e1",
            "step",
            {},
            schema=schema,
            wake=(fields["wake_queue"], fields["wake_event"]),
            traceparent=fields["traceparent"],
        )
    text = str(caught.value)
    assert message in text
    assert len(text) < 500, f"the error quotes the oversized value ({len(text)} characters)"
    assert conn.execute(q(schema, "select count(*) from {s}.events")).fetchone() == (0,)


def test_a_wake_event_at_the_limit_commits_and_acks(
    conn: psycopg.Connection[Any], schema: str, queue: str
) -> None:
    """The limit leaves room for `run-created:<the longest run id>`, and Absurd takes it."""
    name = "run-created:" + "r" * 200 + "x" * (1024 - 212)
    assert len(name.encode()) == 1024
    relay.enqueue(conn, "r1", "e1", "step", {}, schema=schema, wake=(queue, name))
    got = claim(conn, schema)
    rows = conn.execute(
        q(schema, "select status from {s}.ack(%s::jsonb)"),
        (f'[{{"run_id": "r1", "token": "{token(got, "r1")}", "upto": 1}}]',),
    ).fetchall()
    assert rows == [("acked",)]
