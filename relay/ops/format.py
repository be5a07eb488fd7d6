"""The pure part of the operator tools: exit codes, the error they travel in, and the phrases
and figures the tables show. No I/O, no database."""

from __future__ import annotations

import getpass
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

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


class OpsError(Exception):
    """One line for stderr and the exit code that goes with it."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


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


def _escape(ch: str) -> str:
    """One character as printable text: itself, or its Python escape (\\x1b, \\u2066)."""
    return ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")


def clean(text: object, limit: int | None = None) -> str:
    """Text from the outbox (ids, ingress body excerpts) made safe for a terminal and a page:
    every character Unicode calls "Other" or "Separator" but the ASCII space (str.isprintable:
    control characters, escape sequences, bidi overrides and isolates, zero-width and other
    format characters, line and paragraph separators, unassigned code points) shown as an
    escape, optionally shortened."""
    s = str(text)
    if not s.isprintable():
        s = "".join(map(_escape, s))
    if limit is not None and len(s) > limit:
        s = s[: limit - 1] + "…"
    return s


def key_label(key: str | None, limit: int | None = None) -> str:
    """A fairness key as `backlog_by_key()` gives it (issue 50 item 4), as text: None is the
    keys beyond the top ones, `(other)`; '' the runs that name none, `(default)`; any other key
    is a producer's text, cleaned."""
    if key is None:
        return "(other)"
    return "(default)" if key == "" else clean(key, limit)


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


def parse_since(text: str) -> float | datetime:
    """`relay retry --backing-off --since`: a duration back from the database's now ('10m',
    '90s', '2h') or a time with its UTC offset ('2025-05-01T10:00:00Z'); ValueError else."""
    from relay.settings import parse_duration

    try:
        return parse_duration(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"{text!r} is neither a duration (10m, 90s, 2h) nor a time (2025-05-01T10:00:00Z)"
        ) from None
    if when.tzinfo is None:
        raise ValueError(f"{text!r} has no UTC offset: add Z or +hh:mm")
    return when


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
    # last_error: set by a failed attempt, cleared by the ack and an operator's retry (attempts
    # count an event's failures kept from before a retry too)
    if run["attempts"] and run["last_error"] and run["next_attempt_at"] > run["db_now"]:
        return f"backing off until {fmt_time(run['next_attempt_at'])} ({run['attempts']} failed)"
    if run.get("retry_waived"):  # schema version 11
        return "due, past the retry budget (relay retry): the next claim sends it"
    return "due (waiting for a relay)"


def operator(by: str | None, role: str | None) -> str:
    """Who acted: the name given with --by and, beside it, the database role that called
    (recorded by the database; absent on actions taken before schema version 4)."""
    return f"{by} (role {role})" if role else str(by)


def audit(event: Mapping[str, Any]) -> str:
    """Who retried or skipped an event, when and why; "-" when no operator touched it."""
    done = []
    if event["retries"]:
        times = f" ({event['retries']}×)" if event["retries"] > 1 else ""
        when = fmt_time(event["retried_at"], short=True)
        who = operator(event["retried_by"], event.get("retried_role"))
        done.append(f"retried by {who} at {when}{times}")
    if event["state"] == "skipped":
        when = fmt_time(event["skipped_at"], short=True)
        who = operator(event["skipped_by"], event.get("skipped_role"))
        done.append(f"skipped by {who} at {when}: {event['skip_reason']}")
    return "; ".join(done) or "-"
