"""The producer helper: `relay.enqueue` from Python, for sync and async psycopg connections.

Runs inside the caller's transaction (nothing is sent until it commits), exactly like calling
the SQL function. Errors are the SQL function's own (`psycopg.errors.InvalidParameterValue`
for bad input, `LockNotAvailable` when another writer of the run held it too long: retry).

Its statements are never prepared on the server (`prepare=False`), whatever the connection's
`prepare_threshold`: through PgBouncer before 1.21 in transaction mode a prepared statement
lives in whichever server session ran it, so the next client there fails with `prepared
statement "_pg3_0" already exists` (tests/test_pgbouncer.py). A connection that runs the
caller's own statements through such a pooler still needs `prepare_threshold=None`
(docs/operations.md §3).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import psycopg
from psycopg import sql

from relay.names import validate_schema_name


@dataclass(frozen=True)
class Event:
    """One event for `enqueue_many`."""

    event_id: str
    event_type: str
    payload: Mapping[str, Any]
    terminal: bool = False
    wake_queue: str | None = None
    wake_event: str | None = None
    traceparent: str | None = None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "event_id": self.event_id,
            "event_type": self.event_type,
            "payload": self.payload,
            "terminal": self.terminal,
        }
        for key in ("wake_queue", "wake_event", "traceparent"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


# Without a fairness key the calls name only the parameters schema version 8 has, so a
# producer of this release enqueues on a database not migrated yet (a rolling upgrade deploys
# the application first); the key, when given, needs version 9.
def _enqueue_query(schema: str, keyed: bool) -> sql.Composed:
    key = ", %s" if keyed else ""
    return sql.SQL("select {}.enqueue(%s, %s, %s, %s::jsonb, %s, %s, %s, %s" + key + ")").format(
        sql.Identifier(validate_schema_name(schema))
    )


def _many_query(schema: str, keyed: bool) -> sql.Composed:
    key = ", %s" if keyed else ""
    return sql.SQL("select {}.enqueue_many(%s, %s::jsonb" + key + ")").format(
        sql.Identifier(validate_schema_name(schema))
    )


def _many_args(run_id: str, events: Sequence[Event], fairness_key: str | None) -> tuple[Any, ...]:
    body = orjson.dumps([e.as_json() for e in events]).decode()
    return (run_id, body) if fairness_key is None else (run_id, body, fairness_key)


def _args(
    run_id: str,
    event_id: str,
    event_type: str,
    payload: Mapping[str, Any],
    terminal: bool,
    wake: tuple[str, str] | None,
    traceparent: str | None,
    fairness_key: str | None,
) -> tuple[Any, ...]:
    queue, name = wake if wake is not None else (None, None)
    return (
        run_id,
        event_id,
        event_type,
        orjson.dumps(payload).decode(),
        terminal,
        queue,
        name,
        traceparent,
        *(() if fairness_key is None else (fairness_key,)),
    )


def enqueue(
    conn: psycopg.Connection[Any],
    run_id: str,
    event_id: str,
    event_type: str,
    payload: Mapping[str, Any],
    *,
    terminal: bool = False,
    wake: tuple[str, str] | None = None,
    traceparent: str | None = None,
    fairness_key: str | None = None,
    schema: str = "relay",
) -> int:
    """Enqueue one event in `conn`'s current transaction; returns its seq.

    `wake` is `(absurd_queue, event_name)`: emitted with the event's acknowledgement.
    `fairness_key` names the tenant the run belongs to: the relay shares its POSTs between keys
    by their weights. A run's first event sets it; a later event may omit it (the run keeps its
    key) but not name another (InvalidParameterValue)."""
    row = conn.execute(
        _enqueue_query(schema, fairness_key is not None),
        _args(run_id, event_id, event_type, payload, terminal, wake, traceparent, fairness_key),
        prepare=False,
    ).fetchone()
    assert row is not None
    return int(row[0])


async def enqueue_async(
    conn: psycopg.AsyncConnection[Any],
    run_id: str,
    event_id: str,
    event_type: str,
    payload: Mapping[str, Any],
    *,
    terminal: bool = False,
    wake: tuple[str, str] | None = None,
    traceparent: str | None = None,
    fairness_key: str | None = None,
    schema: str = "relay",
) -> int:
    """Async form of `enqueue`."""
    cur = await conn.execute(
        _enqueue_query(schema, fairness_key is not None),
        _args(run_id, event_id, event_type, payload, terminal, wake, traceparent, fairness_key),
        prepare=False,
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


def enqueue_many(
    conn: psycopg.Connection[Any],
    run_id: str,
    events: Sequence[Event],
    *,
    fairness_key: str | None = None,
    schema: str = "relay",
) -> list[int]:
    """Enqueue several events of one run in order; all or nothing. Returns their seqs.
    `fairness_key` as for `enqueue`, for every one of them."""
    row = conn.execute(
        _many_query(schema, fairness_key is not None),
        _many_args(run_id, events, fairness_key),
        prepare=False,
    ).fetchone()
    assert row is not None
    return [int(s) for s in row[0]]


async def enqueue_many_async(
    conn: psycopg.AsyncConnection[Any],
    run_id: str,
    events: Sequence[Event],
    *,
    fairness_key: str | None = None,
    schema: str = "relay",
) -> list[int]:
    """Async form of `enqueue_many`."""
    cur = await conn.execute(
        _many_query(schema, fairness_key is not None),
        _many_args(run_id, events, fairness_key),
        prepare=False,
    )
    row = await cur.fetchone()
    assert row is not None
    return [int(s) for s in row[0]]
