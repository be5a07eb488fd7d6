"""`relay status / inspect / retry / skip`: argparse commands that validate, connect, do one
piece of work and print a table or (`--json`) one JSON document. An OpsError is one line on
stderr and the exit code; usage errors come before connecting."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Callable
from datetime import datetime
from functools import partial
from typing import Any

from relay.ops.format import OK, USAGE, OpsError, default_operator, parse_since
from relay.ops.queries import (
    Conn,
    connect,
    inspect,
    retry_backing_off,
    retry_event,
    retry_run,
    retry_run_now,
    run_blocked,
    skip_event,
    status,
)
from relay.ops.render import (
    output_width,
    print_json,
    render_action,
    render_due,
    render_inspect,
    render_status,
    write,
)
from relay.settings import Subcommands

Resolve = Callable[[argparse.Namespace], str]


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
        print_json(result)
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
        write(render_status(data, output_width()))
        return None

    return _run("status", args, database_url, schema_of, work)


def cmd_inspect(args: argparse.Namespace, database_url: Resolve, schema_of: Resolve) -> int:
    limit = args.limit or None

    def work(conn: Conn, schema: str) -> Any:
        data = inspect(conn, schema, args.run_id, args.from_seq, limit)
        if args.json:
            return data
        write(render_inspect(data, limit, output_width()))
        return None

    return _run("inspect", args, database_url, schema_of, work)


def cmd_retry(args: argparse.Namespace, database_url: Resolve, schema_of: Resolve) -> int:
    def validate() -> None:
        given = [args.event_id is not None, args.run is not None, args.backing_off]
        if sum(given) != 1:
            raise OpsError(USAGE, "give one of EVENT_ID, --run RUN_ID or --backing-off")
        if args.since is not None and not args.backing_off:
            raise OpsError(USAGE, "--since goes with --backing-off")
        _since(args)
        _who(args)

    def work(conn: Conn, schema: str) -> Any:
        if args.backing_off:
            return _retry_backing_off(conn, schema)
        if args.run is not None and not run_blocked(conn, schema, args.run):
            # Not blocked: a run backing off after a failed attempt is made due now.
            due = retry_run_now(conn, schema, args.run, _who(args))
            if args.json:
                return {**due, "due_now": True}
            write(render_due([due], output_width()))
            return None
        if args.run is not None:
            row = retry_run(conn, schema, args.run, _who(args))
        else:
            row = retry_event(conn, schema, args.event_id, _who(args))
        if args.json:
            return {**row, "unblocked": row["blocked_seq"] is None}
        write(render_action("retried", row, output_width()))
        return None

    def _retry_backing_off(conn: Conn, schema: str) -> Any:
        runs = retry_backing_off(conn, schema, _since(args), _who(args))
        if args.json:
            return {"due_now": len(runs), "runs": runs}
        write(render_due(runs, output_width()))
        return None

    return _run("retry", args, database_url, schema_of, work, validate)


def _since(args: argparse.Namespace) -> float | datetime | None:
    if args.since is None:
        return None
    try:
        return parse_since(args.since)
    except ValueError as exc:
        raise OpsError(USAGE, f"--since: {exc}") from None


def cmd_skip(args: argparse.Namespace, database_url: Resolve, schema_of: Resolve) -> int:
    def validate() -> None:
        if args.reason is None or not args.reason.strip():
            raise OpsError(USAGE, "--reason is required: say why the event is never sent")
        _who(args)

    def work(conn: Conn, schema: str) -> Any:
        row = skip_event(conn, schema, args.event_id, _who(args), args.reason)
        if args.json:
            return {**row, "unblocked": row["blocked_seq"] is None}
        write(render_action("skipped", row, output_width()))
        return None

    return _run("skip", args, database_url, schema_of, work, validate)


def non_negative(text: str) -> int:
    """A non-negative integer flag value."""
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def add_commands(
    sub: Subcommands,
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
    p = parser(
        "retry",
        "put a failed event back to pending and unblock its run, or make runs that back off"
        " after failed attempts due now",
        cmd_retry,
    )
    p.add_argument("event_id", metavar="EVENT_ID", nargs="?")
    p.add_argument(
        "--run",
        metavar="RUN_ID",
        help="retry the failed event that blocks RUN_ID, or, when it is backing off after a"
        " failed attempt, make its next attempt due now",
    )
    p.add_argument(
        "--backing-off",
        action="store_true",
        help="make every run backing off after a failed attempt due now (after an ingress outage)",
    )
    p.add_argument(
        "--since",
        metavar="WHEN",
        help="with --backing-off: only runs whose last attempt failed since WHEN, a duration"
        " back from now (10m) or a time (2025-05-01T10:00:00Z)",
    )
    p.add_argument("--by", help=by_help)

    p = parser("skip", "never send a failed event (audited) and unblock its run", cmd_skip)
    p.add_argument("event_id", metavar="EVENT_ID")
    p.add_argument("--reason", help="why it is skipped (required)")
    p.add_argument("--by", help=by_help)
