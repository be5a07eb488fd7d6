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
    event_exists,
    inspect,
    retry_backing_off,
    retry_event,
    retry_run,
    retry_run_now,
    run_blocked,
    run_exists,
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
from relay.ops.targets import Target, where
from relay.settings import Subcommands

Resolve = Callable[[argparse.Namespace], str]
Targets = Callable[[argparse.Namespace], list[Target]]
Work = Callable[[Conn, str], Any]
Find = Callable[[Conn, str], bool]


def _run(
    command: str,
    args: argparse.Namespace,
    targets_of: Targets,
    schema_of: Resolve,
    work: Work,
    validate: Callable[[], None] | None = None,
    find: tuple[str, Find] | None = None,
) -> int:
    """Validate the arguments, then on each database chosen (relay/ops/targets.py) connect and
    do the work; print its JSON result if it returns one. `find`: the work is about one run or
    event (what it is, and whether a database holds it): with several databases it is done only
    in the one that holds it. An OpsError is one line on stderr and the exit code."""
    try:
        if validate is not None:
            validate()
        chosen, schema = targets_of(args), schema_of(args)
        if find is not None and len(chosen) > 1:
            chosen = [_locate(command, chosen, schema, *find)]
        # The one-database form (no name): its output names no database, as it always did.
        one = chosen[0] if chosen[0].name is None else None
        result = None if one is None else _on(one, schema, work)
    except OpsError as exc:
        print(f"relay {command}: {exc}", file=sys.stderr)
        return exc.code
    if one is None:
        return _each(command, args, chosen, schema, work)
    if result is not None:
        print_json(result)
    return OK


def _on(target: Target, schema: str, work: Work) -> Any:
    with connect(target.url, schema) as conn:
        return work(conn, schema)


def _each(
    command: str, args: argparse.Namespace, chosen: list[Target], schema: str, work: Work
) -> int:
    """The work on every database of the list in turn: in plain text each part under its
    header line, with `--json` one document keyed by database name. A database that fails is
    one line on stderr naming it (and `{"error", "exit_code"}` under its name) and the others
    still run; the exit code is the first failure's, in the list's order."""
    code, results = OK, {}
    for i, target in enumerate(chosen):
        if not args.json:
            write(("\n" if i else "") + target.header())
        try:
            results[target.name] = _on(target, schema, work)
        except OpsError as exc:
            print(f"relay {command}: {target.name}: {exc}", file=sys.stderr)
            results[target.name] = {"error": str(exc), "exit_code": exc.code}
            code = code or exc.code
    if args.json:
        print_json(results)
    return code


def _locate(command: str, chosen: list[Target], schema: str, what: str, find: Find) -> Target:
    """The one database of `chosen` that holds `what`, each searched; a database that cannot
    be searched is one line on stderr naming it, and then OpsError (targets.where)."""
    found, down = [], []
    for target in chosen:
        try:
            with connect(target.url, schema) as conn:
                if find(conn, schema):
                    found.append(target)
        except OpsError as exc:
            print(f"relay {command}: {target.name}: {exc}", file=sys.stderr)
            down.append(target)
    return where(what, chosen, found, down)


def _who(args: argparse.Namespace) -> str:
    by = args.by if args.by is not None else default_operator(os.environ, socket.gethostname())
    if not by.strip():
        raise OpsError(USAGE, "--by must not be empty: say who acts (default $USER@host)")
    return str(by)


def cmd_status(args: argparse.Namespace, targets_of: Targets, schema_of: Resolve) -> int:
    def work(conn: Conn, schema: str) -> Any:
        data = status(conn, schema, args.limit)
        if args.json:
            return data
        write(render_status(data, output_width()))
        return None

    return _run("status", args, targets_of, schema_of, work)


def cmd_inspect(args: argparse.Namespace, targets_of: Targets, schema_of: Resolve) -> int:
    limit = args.limit or None

    def work(conn: Conn, schema: str) -> Any:
        data = inspect(conn, schema, args.run_id, args.from_seq, limit)
        if args.json:
            return data
        write(render_inspect(data, limit, output_width()))
        return None

    find = (f"run {args.run_id!r}", lambda conn, schema: run_exists(conn, schema, args.run_id))
    return _run("inspect", args, targets_of, schema_of, work, find=find)


def cmd_retry(args: argparse.Namespace, targets_of: Targets, schema_of: Resolve) -> int:
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

    return _run("retry", args, targets_of, schema_of, work, validate, _retried(args))


def _retried(args: argparse.Namespace) -> tuple[str, Find] | None:
    """What `relay retry` is about, to find where it is; None: --backing-off, every database."""
    if args.run is not None:
        return f"run {args.run!r}", lambda conn, schema: run_exists(conn, schema, args.run)
    if args.event_id is not None:
        return _event(args.event_id)
    return None


def _event(event_id: str) -> tuple[str, Find]:
    return f"event {event_id!r}", lambda conn, schema: event_exists(conn, schema, event_id)


def _since(args: argparse.Namespace) -> float | datetime | None:
    if args.since is None:
        return None
    try:
        return parse_since(args.since)
    except ValueError as exc:
        raise OpsError(USAGE, f"--since: {exc}") from None


def cmd_skip(args: argparse.Namespace, targets_of: Targets, schema_of: Resolve) -> int:
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

    return _run("skip", args, targets_of, schema_of, work, validate, _event(args.event_id))


DATABASE_HELP = (
    "with RELAY_DATABASES / RELAY_DATABASES_FILE: act on this database of the list only"
    " (default: every one; a command about one run or event, where it is)"
)


def non_negative(text: str) -> int:
    """A non-negative integer flag value."""
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def add_commands(
    sub: Subcommands,
    add_settings: Callable[[argparse.ArgumentParser, list[str]], None],
    targets_of: Targets,
    schema_of: Resolve,
) -> None:
    """Register status, inspect, retry and skip on the `relay` parser."""

    def parser(name: str, help_text: str, func: Callable[..., int]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_settings(p, ["database_url", "schema"])
        p.add_argument("--json", action="store_true", help="print one JSON document")
        p.add_argument("--database", metavar="NAME", help=DATABASE_HELP)
        p.set_defaults(func=partial(func, targets_of=targets_of, schema_of=schema_of))
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
