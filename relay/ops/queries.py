"""The database side of the operator tools: a checked connection, and one call of a
functions_ops.sql function per transaction, bounded by a lock and a statement timeout, its SQL
errors turned into OpsError with the matching exit code."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import DictRow, TupleRow, dict_row

from relay.core.classes import backlog_class
from relay.ops.format import NOT_FOUND, UNAVAILABLE, USAGE, OpsError, clean, exit_code
from relay.settings import redact_url

LOCK_TIMEOUT = "5s"
STATEMENT_TIMEOUT = "30s"
CONNECT_TIMEOUT = 10

Conn = psycopg.Connection[TupleRow]
Call = tuple[sql.Composed, tuple[Any, ...]]


def _check_url(url: str) -> str | None:
    """The password if the URL parses; raises OpsError for a URL libpq would misread in a way
    that could put part of the password into its error message."""
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        raise OpsError(USAGE, "database_url is not a valid PostgreSQL URL or conninfo") from None
    m = re.match(r"[A-Za-z][A-Za-z0-9+.\-]*://([^/]*)", url)
    if m and m.group(1).count("@") > 1:
        raise OpsError(USAGE, "database_url has an unencoded '@' in its password: write it as %40")
    password = params.get("password")
    return str(password) if password else None


def db_error_reason(exc: BaseException, password: str | None) -> str:
    """The first line of a database error, with the password masked should libpq echo it."""
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0].strip()
    return reason.replace(password, "***") if password else reason


@contextmanager
def connect(url: str, schema: str) -> Iterator[Conn]:
    """A connection to a schema at this code's version, or OpsError(UNAVAILABLE)."""
    from relay.maintenance.migrate import _read_version, version_problem

    password = _check_url(url)
    try:
        conn = psycopg.connect(
            url,
            autocommit=True,
            connect_timeout=CONNECT_TIMEOUT,
            application_name="ledger-relay-ops",
        )
    except psycopg.Error as exc:
        reason = db_error_reason(exc, password)
        raise OpsError(
            UNAVAILABLE, f"cannot connect to the database at {redact_url(url)}: {reason}"
        ) from None
    with conn:
        try:
            problem = version_problem(_read_version(conn, schema), schema)
        except psycopg.Error as exc:
            raise OpsError(
                UNAVAILABLE, f"cannot read the schema version: {clean(exc, 200)}"
            ) from None
        if problem:
            raise OpsError(UNAVAILABLE, problem)
        yield conn


def _call(conn: Conn, *calls: Call, snapshot: bool = False) -> list[list[DictRow]]:
    """The calls in one transaction bounded by a lock and a statement timeout (`snapshot`: one
    read-only snapshot for all of them); SQL errors become OpsError with the matching exit code
    and roll the transaction back."""
    try:
        with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
            if snapshot:
                cur.execute("set transaction isolation level repeatable read, read only")
            cur.execute(
                "select set_config('lock_timeout', %s, true),"
                " set_config('statement_timeout', %s, true), set_config('TimeZone', 'UTC', true)",
                (LOCK_TIMEOUT, STATEMENT_TIMEOUT),
            )
            return [cur.execute(query, params).fetchall() for query, params in calls]
    except psycopg.Error as exc:
        if exc.sqlstate is None or conn.closed:
            raise OpsError(
                UNAVAILABLE,
                f"lost the database connection ({clean(str(exc).strip(), 200)}); the outcome is "
                "unknown: look with `relay inspect`",
            ) from None
        message = exc.diag.message_primary or str(exc)
        if exc.diag.message_hint:
            message += f" ({exc.diag.message_hint})"
        if exc.sqlstate in ("42883", "3F000"):
            message += ": run `relay migrate`"
        raise OpsError(exit_code(exc.sqlstate), clean(message)) from None


def _fn(schema: str, name: str, args: str) -> sql.Composed:
    return sql.SQL("select * from {}(" + args + ")").format(sql.Identifier(schema, name))


def status(conn: Conn, schema: str, blocked_limit: int = 100) -> dict[str, Any]:
    """`status()`'s JSON, each row of `lanes` with the class of runs it counts beside
    `backlog()`'s name for it (`class`: finished, due; issue 50 item 4)."""
    [rows] = _call(conn, (_fn(schema, "status", "%s"), (blocked_limit,)))
    result: dict[str, Any] = rows[0]["status"]
    result["lanes"] = [{"class": backlog_class(x["lane"]), **x} for x in result["lanes"]]
    return result


def inspect(
    conn: Conn, schema: str, run_id: str, from_seq: int = 1, limit: int | None = None
) -> dict[str, Any]:
    """The run's summary and its events (from `from_seq`, at most `limit`), one snapshot."""
    summary, events = _call(
        conn,
        (_fn(schema, "inspect_run_summary", "%s"), (run_id,)),
        (_fn(schema, "inspect_run", "%s, %s, %s"), (run_id, from_seq, limit)),
        snapshot=True,
    )
    return {"run": dict(summary[0]), "events": [dict(e) for e in events]}


def _one(conn: Conn, call: Call) -> dict[str, Any]:
    [rows] = _call(conn, call)
    return dict(rows[0])


def retry_event(conn: Conn, schema: str, event_id: str, by: str) -> dict[str, Any]:
    return _one(conn, (_fn(schema, "retry_event", "%s, %s"), (event_id, by)))


def retry_run(conn: Conn, schema: str, run_id: str, by: str) -> dict[str, Any]:
    return _one(conn, (_fn(schema, "retry_run", "%s, %s"), (run_id, by)))


def run_blocked(conn: Conn, schema: str, run_id: str) -> bool:
    """Whether the run is blocked (its failed event is what `retry --run` retries), or
    OpsError(NOT_FOUND) for no such run."""
    [rows] = _call(conn, (_fn(schema, "inspect_run_summary", "%s"), (run_id,)))
    return rows[0]["blocked_seq"] is not None


def retry_run_now(conn: Conn, schema: str, run_id: str, by: str) -> dict[str, Any]:
    """A run backing off after a failed attempt is due now (only its next attempt moves)."""
    return _one(conn, (_fn(schema, "retry_run_now", "%s, %s"), (run_id, by)))


def retry_backing_off(
    conn: Conn, schema: str, since: float | datetime | None, by: str
) -> list[dict[str, Any]]:
    """Every run backing off after a failed attempt that ended at or after `since` (seconds
    before the database's now, or a time; None: any) is due now. Returns those runs."""
    if since is None:
        call: Call = _fn(schema, "retry_backing_off", "null, %s"), (by,)
    elif isinstance(since, datetime):
        call = _fn(schema, "retry_backing_off", "%s, %s"), (since, by)
    else:  # on the database's clock, like every time the relay keeps
        since_sql = "clock_timestamp() - make_interval(secs => %s), %s"
        call = _fn(schema, "retry_backing_off", since_sql), (since, by)
    [rows] = _call(conn, call)
    return [dict(r) for r in rows]


def skip_event(conn: Conn, schema: str, event_id: str, by: str, reason: str) -> dict[str, Any]:
    return _one(conn, (_fn(schema, "skip_event", "%s, %s, %s"), (event_id, by, reason)))


def run_exists(conn: Conn, schema: str, run_id: str) -> bool:
    """Whether the database holds the run (a pruned one too: its seq counter remains), for a
    command that must find the one database of a list that holds it (relay/ops/targets.py)."""
    try:
        _call(conn, (_fn(schema, "inspect_run_summary", "%s"), (run_id,)))
    except OpsError as exc:
        if exc.code == NOT_FOUND:
            return False
        raise
    return True


def event_exists(conn: Conn, schema: str, event_id: str) -> bool:
    """Whether the database holds the event (its unique event_id index answers)."""
    query = sql.SQL("select exists (select 1 from {} where event_id = %s) as found").format(
        sql.Identifier(schema, "events")
    )
    [rows] = _call(conn, (query, (event_id,)))
    return bool(rows[0]["found"])
