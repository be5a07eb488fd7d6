"""Operator tools (DESIGN §3, §8.1): see and fix what the relay could not deliver.

    relay status                        backlog per lane, oldest pending age, blocked runs with
                                        their error, live leases per owner, delivered in the
                                        last minute, outbox table sizes
    relay inspect RUN_ID                every event of a run (state, attempts, last error, audit)
                                        and the run's lease, epoch, backoff and block
    relay retry EVENT_ID                a failed event goes back to pending; its run is unblocked
    relay retry --run RUN_ID            the same for the failed event that blocks RUN_ID
    relay skip EVENT_ID --reason TEXT   a failed event is never sent; its run is unblocked

Each prints a table, or one JSON document on stdout with `--json`. They take `--database-url` /
`RELAY_DATABASE_URL` (or `RELAY_DATABASE_URL_FILE`) and `--schema` / `RELAY_SCHEMA`; retry and
skip record who acted (`--by`, default `$USER@host`). The work is done by the SQL functions of
schema/functions_ops.sql, one call in one transaction bounded by a lock and a statement timeout,
so they are safe while relays run: they change only failed events and blocked runs, which no
relay touches.

Exit codes (an error is one line on stderr, `relay <command>: <what is wrong>`, and changes
nothing):
    0  done
    1  any other database error
    2  invalid configuration or usage (a flag, an empty --reason or --by)
    3  database unreachable, connection lost (the outcome of a retry or skip is then unknown:
       look with `relay inspect`), or schema missing / not at this relay's version
    4  not found: no such event or run
    5  wrong state: the event is not failed, or the run is not blocked
    6  timed out waiting for a lock or a statement; safe to run again
"""

from __future__ import annotations

import argparse
import getpass
import os
import re
import socket
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from functools import partial
from typing import Any

import orjson
import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import DictRow, TupleRow, dict_row

from relay.settings import redact_url

LOCK_TIMEOUT = "5s"
STATEMENT_TIMEOUT = "30s"
CONNECT_TIMEOUT = 10

OK, DB_ERROR, USAGE, UNAVAILABLE, NOT_FOUND, WRONG_STATE, TIMED_OUT = range(7)

# SQLSTATE -> exit code (the functions' own codes are listed in functions_ops.sql).
_EXIT_CODES = {
    "22023": USAGE,  # invalid_parameter_value
    "P0002": NOT_FOUND,  # no_data_found
    "55000": WRONG_STATE,  # object_not_in_prerequisite_state
    "55P03": TIMED_OUT,  # lock_not_available (lock_timeout)
    "57014": TIMED_OUT,  # query_canceled (statement_timeout)
    "42883": UNAVAILABLE,  # undefined_function: functions not installed
    "3F000": UNAVAILABLE,  # invalid_schema_name
}

Conn = psycopg.Connection[TupleRow]
Resolve = Callable[[argparse.Namespace], str]


class OpsError(Exception):
    """One line for stderr and the exit code that goes with it."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# -- pure helpers ------------------------------------------------------------------------------


def exit_code(sqlstate: str | None) -> int:
    return _EXIT_CODES.get(sqlstate or "", DB_ERROR)


def default_operator(environ: Mapping[str, str], hostname: str) -> str:
    """`$USER@host`, the audit name of whoever runs retry or skip without --by."""
    user = environ.get("USER") or environ.get("LOGNAME")
    if not user:
        try:
            user = getpass.getuser()
        except (OSError, KeyError):  # no passwd entry (containers)
            user = "unknown"
    return f"{user}@{hostname}"


_UNPRINTABLE = re.compile(r"[^\x20-\x7e\u00a0-\U0010ffff]|[\u2028\u2029\u200e\u200f\u202a-\u202e]")


def clean(text: object, limit: int | None = None) -> str:
    """Text from the outbox (ids, ingress body excerpts) made safe for a terminal: control
    characters, escape sequences and bidi overrides shown as escapes, optionally shortened."""
    s = _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(text))
    if limit is not None and len(s) > limit:
        s = s[: limit - 1] + "…"
    return s


def fmt_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h {minutes:02d}m"
    return f"{hours // 24}d {hours % 24:02d}h"


def fmt_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def fmt_time(value: datetime | str | None, *, short: bool = False) -> str:
    """UTC to the millisecond; `short` (table cells) to the second, without the year."""
    if value is None:
        return "-"
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    value = value.astimezone(UTC)
    if short:
        return value.strftime("%m-%d %H:%M:%S")
    return value.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def run_state(run: Mapping[str, Any]) -> str:
    """One phrase for a run's scheduling state, from `inspect_run_summary`."""
    if run.get("epoch") is None:
        return "pruned (no events left; only its seq counter remains)"
    if run["blocked_seq"] is not None:
        return f"BLOCKED at seq {run['blocked_seq']} (event {clean(run['blocked_event_id'])})"
    if run["lease_live"]:
        return f"leased by {clean(run['lease_owner'])} until {fmt_time(run['lease_expires_at'])}"
    if run["idle"]:
        return "idle (nothing pending)"
    if run["attempts"] and run["next_attempt_at"] > run["db_now"]:
        return f"backing off until {fmt_time(run['next_attempt_at'])} ({run['attempts']} failed)"
    return "due (waiting for a relay)"


# -- database ----------------------------------------------------------------------------------


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
    from relay.migrate import _read_version, version_problem

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


Call = tuple[sql.Composed, tuple[Any, ...]]


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
    [rows] = _call(conn, (_fn(schema, "status", "%s"), (blocked_limit,)))
    result: dict[str, Any] = rows[0]["status"]
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


def skip_event(conn: Conn, schema: str, event_id: str, by: str, reason: str) -> dict[str, Any]:
    return _one(conn, (_fn(schema, "skip_event", "%s, %s, %s"), (event_id, by, reason)))


# -- rendering ---------------------------------------------------------------------------------


def _console() -> Any:
    from rich.console import Console

    # Piped output (a log, a ticket) gets room for the tables; a terminal gets its own width.
    return Console(highlight=False, width=None if sys.stdout.isatty() else 200)


_WRAP = frozenset({"error", "note", "value", "event", "type", "run", "owner"})


def _table(title: str, *columns: str) -> Any:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    # Text, never markup: titles and cells carry ids and ingress bodies ("[bold]" stays text).
    table = Table(title=Text(title), title_justify="left", box=box.SIMPLE_HEAD, show_edge=False)
    for column in columns:
        # Free text folds; ids, states, numbers and times stay on one line.
        wrap = column in _WRAP
        table.add_column(column, overflow="fold", no_wrap=not wrap, min_width=8 if wrap else None)
    return table


def _row(table: Any, *cells: object) -> None:
    from rich.text import Text

    table.add_row(*(Text("-" if c is None else clean(c)) for c in cells))


def render_status(data: Mapping[str, Any]) -> None:
    console = _console()
    lanes = _table("Backlog", "lane", "runs", "pending events", "oldest pending")
    for lane in data["lanes"]:
        age = fmt_age(lane["oldest_pending_age_seconds"]) if lane["events"] else "-"
        _row(lanes, lane["lane"], lane["runs"], lane["events"], age)
    b = data["blocked"]
    since = fmt_age(b["oldest_failure_age_seconds"]) + " since failure" if b["runs"] else "-"
    _row(lanes, "blocked", b["runs"], f"{b['held_events']} held", since)
    console.print(lanes)

    shown = data["blocked_runs"]
    if shown:
        title = f"Blocked runs ({b['runs']}): fix with `relay retry` or `relay skip`"
        blocked = _table(title, "run", "seq", "event", "failed", "status", "error", "held")
        for r in shown:
            failed = fmt_age(r["failed_age_seconds"]) + " ago"
            error = clean(r["last_error"] or "", 120)
            _row(blocked, r["run_id"], r["seq"], r["event_id"], failed, r["last_status"], error,
                 r["held_events"])  # fmt: skip
        console.print(blocked)
        if len(shown) < b["runs"]:
            console.print(f"… and {b['runs'] - len(shown)} more (--limit)")

    leases = _table("Live leases", "owner", "runs", "next expiry")
    for lease in data["leases"]:
        _row(leases, lease["owner"], lease["runs"], fmt_time(lease["next_expiry"]))
    if data["expired_leases"]:
        _row(leases, "(expired, claimable)", data["expired_leases"], "-")
    console.print(leases if leases.row_count else "Live leases: none")

    t = data["tables"]
    console.print(
        f"Delivered in the last minute: {data['delivered_last_minute']}\n"
        f"Outbox size: events {fmt_bytes(t['events'])}, runs {fmt_bytes(t['runs'])}, "
        f"run_seqs {fmt_bytes(t['run_seqs'])}\n"
        f"Database time: {fmt_time(data['db_now'])}"
    )


def _audit(e: Mapping[str, Any]) -> str:
    audit = []
    if e["retries"]:
        times = f" ({e['retries']}×)" if e["retries"] > 1 else ""
        when = fmt_time(e["retried_at"], short=True)
        audit.append(f"retried by {e['retried_by']} at {when}{times}")
    if e["state"] == "skipped":
        when = fmt_time(e["skipped_at"], short=True)
        audit.append(f"skipped by {e['skipped_by']} at {when}: {e['skip_reason']}")
    return "; ".join(audit) or "-"


def render_inspect(data: Mapping[str, Any], limit: int | None) -> None:
    console = _console()
    run = data["run"]
    head = _table(f"Run {clean(run['run_id'])}", "field", "value")
    head.show_header = False
    _row(head, "state", run_state(run))
    _row(head, "lane", "critical (terminal event pending)" if run["critical"] else "ordinary")
    live = "live" if run["lease_live"] else "not live"
    lease = f"{run['lease_owner'] or '-'}, expires {fmt_time(run['lease_expires_at'])} ({live})"
    _row(head, "lease", f"{lease}, epoch {run['epoch']}")
    _row(head, "next attempt", f"{fmt_time(run['next_attempt_at'])} (attempts {run['attempts']})")
    if run["last_error"]:
        _row(head, "last error", clean(run["last_error"], 300))
    counts = ", ".join(f"{k} {run[k]}" for k in ("pending", "delivered", "failed", "skipped"))
    terminal = run["terminal_seq"] or "-"
    _row(head, "events", f"{run['events_total']} ({counts}); last seq {run['last_seq']}, "
         f"terminal seq {terminal}")  # fmt: skip
    console.print(head)

    events = _table(
        "Events (times UTC)", "seq", "event", "type", "state", "att", "status", "created",
        "delivered / failed / skipped",
    )  # fmt: skip
    notes = _table("Errors and operator actions", "seq", "note")
    for e in data["events"]:
        kind = e["event_type"] + (" (terminal)" if e["terminal"] else "")
        done = {"delivered": e["delivered_at"], "skipped": e["skipped_at"]}.get(
            e["state"], e["failed_at"] if e["state"] == "failed" else None
        )
        created = fmt_time(e["created_at"], short=True)
        _row(events, e["seq"], e["event_id"], kind, e["state"], e["attempts"], e["last_status"],
             created, fmt_time(done, short=True))  # fmt: skip
        note = [f"last error: {clean(e['last_error'], 300)}"] if e["last_error"] else []
        if _audit(e) != "-":
            note.append(_audit(e))
        if note:
            _row(notes, e["seq"], "; ".join(note))
    console.print(events)
    if notes.row_count:
        console.print(notes)
    if limit and len(data["events"]) == limit and run["events_total"] > limit:
        first = data["events"][0]["seq"]
        console.print(f"showing {limit} events from seq {first} (--from-seq, --limit for more)")


def render_action(verb: str, row: Mapping[str, Any]) -> None:
    console = _console()
    table = _table(f"{verb} event {clean(row['event_id'])}", "field", "value")
    table.show_header = False
    _row(table, "run", row["run_id"])
    _row(table, "seq", row["seq"])
    _row(table, "state", row["state"])
    if verb == "retried":
        _row(table, "by", f"{row['retried_by']} at {fmt_time(row['retried_at'])}")
        _row(table, "attempts", f"{row['attempts']} (operator retries {row['retries']})")
    else:
        _row(table, "by", f"{row['skipped_by']} at {fmt_time(row['skipped_at'])}")
        _row(table, "reason", row["skip_reason"])
    if row["blocked_seq"] is None:
        _row(table, "run", "unblocked: the relay delivers the rest of it in seq order")
    else:
        _row(table, "run", f"still blocked at seq {row['blocked_seq']}")
    console.print(table)


def _print_json(data: object) -> None:
    sys.stdout.buffer.write(orjson.dumps(data, option=orjson.OPT_INDENT_2) + b"\n")
    sys.stdout.flush()


# -- commands ----------------------------------------------------------------------------------


def _run(
    command: str,
    args: argparse.Namespace,
    database_url: Resolve,
    schema_of: Resolve,
    work: Callable[[Conn, str], Any],
    validate: Callable[[], None] | None = None,
) -> int:
    """Validate the arguments, connect, do the work; print its JSON result if it returns one.
    An OpsError is one line on stderr and the exit code."""
    try:
        if validate is not None:
            validate()
        url, schema = database_url(args), schema_of(args)
        with connect(url, schema) as conn:
            result = work(conn, schema)
    except OpsError as exc:
        print(f"relay {command}: {exc}", file=sys.stderr)
        return exc.code
    if result is not None:
        _print_json(result)
    return OK


def _who(args: argparse.Namespace) -> str:
    by = args.by if args.by is not None else default_operator(os.environ, socket.gethostname())
    if not by.strip():
        raise OpsError(USAGE, "--by must not be empty: say who acts (default $USER@host)")
    return str(by)


def cmd_status(args: argparse.Namespace, database_url: Resolve, schema_of: Resolve) -> int:
    def work(conn: Conn, schema: str) -> Any:
        data = status(conn, schema, args.limit)
        if args.json:
            return data
        render_status(data)
        return None

    return _run("status", args, database_url, schema_of, work)


def cmd_inspect(args: argparse.Namespace, database_url: Resolve, schema_of: Resolve) -> int:
    limit = args.limit or None

    def work(conn: Conn, schema: str) -> Any:
        data = inspect(conn, schema, args.run_id, args.from_seq, limit)
        if args.json:
            return data
        render_inspect(data, limit)
        return None

    return _run("inspect", args, database_url, schema_of, work)


def cmd_retry(args: argparse.Namespace, database_url: Resolve, schema_of: Resolve) -> int:
    def validate() -> None:
        if (args.event_id is None) == (args.run is None):
            raise OpsError(USAGE, "give either EVENT_ID or --run RUN_ID (exactly one)")
        _who(args)

    def work(conn: Conn, schema: str) -> Any:
        if args.run is not None:
            row = retry_run(conn, schema, args.run, _who(args))
        else:
            row = retry_event(conn, schema, args.event_id, _who(args))
        if args.json:
            return {**row, "unblocked": row["blocked_seq"] is None}
        render_action("retried", row)
        return None

    return _run("retry", args, database_url, schema_of, work, validate)


def cmd_skip(args: argparse.Namespace, database_url: Resolve, schema_of: Resolve) -> int:
    def validate() -> None:
        if args.reason is None or not args.reason.strip():
            raise OpsError(USAGE, "--reason is required: say why the event is never sent")
        _who(args)

    def work(conn: Conn, schema: str) -> Any:
        row = skip_event(conn, schema, args.event_id, _who(args), args.reason)
        if args.json:
            return {**row, "unblocked": row["blocked_seq"] is None}
        render_action("skipped", row)
        return None

    return _run("skip", args, database_url, schema_of, work, validate)


def non_negative(text: str) -> int:
    """A non-negative integer flag value."""
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def add_commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    add_settings: Callable[[argparse.ArgumentParser, list[str]], None],
    database_url: Resolve,
    schema_of: Resolve,
) -> None:
    """Register status, inspect, retry and skip on the `relay` parser."""

    def parser(name: str, help_text: str, func: Callable[..., int]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_settings(p, ["database_url", "schema"])
        p.add_argument("--json", action="store_true", help="print one JSON document")
        p.set_defaults(func=partial(func, database_url=database_url, schema_of=schema_of))
        return p

    p = parser("status", "backlog, blocked runs, leases, delivery rate, table sizes", cmd_status)
    p.add_argument(
        "--limit", type=non_negative, default=100, help="blocked runs to list (default 100)"
    )

    p = parser("inspect", "every event of a run and the run's lease and block", cmd_inspect)
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument("--from-seq", type=non_negative, default=1, help="first seq to show (default 1)")
    p.add_argument(
        "--limit", type=non_negative, default=1000, help="events to show; 0 = all (1000)"
    )

    by_help = "who acts, recorded in the audit trail (default $USER@host)"
    p = parser("retry", "put a failed event back to pending and unblock its run", cmd_retry)
    p.add_argument("event_id", metavar="EVENT_ID", nargs="?")
    p.add_argument("--run", metavar="RUN_ID", help="retry the failed event that blocks RUN_ID")
    p.add_argument("--by", help=by_help)

    p = parser("skip", "never send a failed event (audited) and unblock its run", cmd_skip)
    p.add_argument("event_id", metavar="EVENT_ID")
    p.add_argument("--reason", help="why it is skipped (required)")
    p.add_argument("--by", help=by_help)
