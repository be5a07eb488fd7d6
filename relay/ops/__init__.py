"""Operator tools (DESIGN §3, §8.1): see and fix what the relay could not deliver.

    relay status                        backlog per lane, oldest pending age, blocked runs with
                                        their error, live leases per owner, runs with
                                        deliveries in the last minute, outbox table sizes
    relay inspect RUN_ID                every event of a run (state, attempts, last error, audit)
                                        and the run's lease, epoch, backoff and block
    relay retry EVENT_ID                a failed event goes back to pending; its run is unblocked
    relay retry --run RUN_ID            the same for the failed event that blocks RUN_ID; a
                                        run backing off after a failed attempt is due now
    relay retry --backing-off [--since WHEN]
                                        every run backing off after a failed attempt (since
                                        WHEN: 10m, or a time) is due now: after an outage
    relay skip EVENT_ID --reason TEXT   a failed event is never sent; its run is unblocked

Each prints a plain-text table, or one JSON document on stdout with `--json`. They take
`--database-url` / `RELAY_DATABASE_URL` (or `RELAY_DATABASE_URL_FILE`) and `--schema` /
`RELAY_SCHEMA`, or the list form (`RELAY_DATABASES`, issue 51): then they act on every database
of the list, or on `--database NAME`, each part of the output under its database's name (with
`--json` one document keyed by name), and inspect, retry and skip of one run or event only
where it is (targets.py). Retry and skip record who acted (`--by`, default `$USER@host`). The
work is done by the SQL functions of schema/functions_ops.sql, one call in one transaction
bounded by a lock and a statement timeout, so they are safe while relays run: they change only
failed events and blocked runs, which no relay touches.

Exit codes (an error is one line on stderr, `relay <command>: <what is wrong>`, and changes
nothing):
    0  done
    1  any other database error
    2  invalid configuration or usage (a flag, an empty --reason or --by)
    3  database unreachable, connection lost (the outcome of a retry or skip is then unknown:
       look with `relay inspect`), or schema missing / not at this relay's version
    4  not found: no such event or run
    5  wrong state: the event is not failed, or the run is neither blocked nor backing off
    6  timed out waiting for a lock or a statement; safe to run again

The package: format.py (pure: exit codes, OpsError, clean() and the phrases and figures),
queries.py (the database calls), render.py (the plain-text tables, pure, and the writes to
stdout; no `rich`, which only the demo extra installs), commands.py (argparse and the commands),
targets.py (pure: which databases a command acts on, and the one that holds a run or event),
checks.py (`relay check`: is this configuration able to run, here, now). Other modules import
from here. It may import relay/maintenance/ (the schema version), the edges (`relay check`'s
database and ingress), relay/core/, settings and logs; never the delivery pipeline, serving or
the runner (the status page imports its formatting, format.py).
"""

from relay.ops.commands import add_commands, non_negative
from relay.ops.format import (
    DB_ERROR,
    NOT_FOUND,
    OK,
    TIMED_OUT,
    UNAVAILABLE,
    USAGE,
    WRONG_STATE,
    OpsError,
    audit,
    clean,
    default_operator,
    exit_code,
    fmt_age,
    fmt_bytes,
    fmt_time,
    run_state,
)
from relay.ops.queries import (
    connect,
    db_error_reason,
    inspect,
    retry_backing_off,
    retry_event,
    retry_run,
    retry_run_now,
    skip_event,
    status,
)
from relay.ops.render import render_action, render_due, render_inspect, render_status, table

__all__ = [
    "DB_ERROR",
    "NOT_FOUND",
    "OK",
    "TIMED_OUT",
    "UNAVAILABLE",
    "USAGE",
    "WRONG_STATE",
    "OpsError",
    "add_commands",
    "audit",
    "clean",
    "connect",
    "db_error_reason",
    "default_operator",
    "exit_code",
    "fmt_age",
    "fmt_bytes",
    "fmt_time",
    "inspect",
    "non_negative",
    "render_action",
    "render_due",
    "render_inspect",
    "render_status",
    "retry_backing_off",
    "retry_event",
    "retry_run",
    "retry_run_now",
    "run_state",
    "skip_event",
    "status",
    "table",
]
