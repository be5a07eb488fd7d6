"""Least privilege (issue 8, docs/security.md): the two database roles `relay migrate
--grant-roles` creates and keeps exact.

- The **producer** role may call `enqueue` and `enqueue_many` and nothing else: no privilege on
  any table, so it can neither read nor change delivery state.
- The **relay** role may call what `relay run` calls (claim, renew, release, fail_event, ack,
  prune, backlog, and hold_liveness and replica_stopped on its LISTEN connection) and read the
  few columns it reads directly (`events.run_id/seq/state` for an ack whose commit outcome was
  lost, `schema_migrations` for the version check). It cannot insert events, call enqueue, or
  change a table other than through those fenced functions.

Those functions are `security definer` (schema/functions.sql), so neither role needs table
privileges, and the relay role needs nothing in the Absurd schema: `ack` calls
`absurd.emit_event` as the schema's owner, including for queues created after the grant.

Both are group roles created NOLOGIN without a password: the operator grants them to login
roles (or makes them LOGIN and sets the password) outside the relay. Granting is idempotent and
exact: everything either role holds in the schema is revoked first, then the set above granted,
in one transaction. The names are remembered in the `settings` table so that every later
`relay migrate` that re-creates the functions grants them again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

ROLE_NAME_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")

PRODUCER_FUNCTIONS = ("enqueue", "enqueue_many")
RELAY_FUNCTIONS = (
    "claim",
    "renew",
    "release",
    "release_claims",  # a claim whose answer was lost, given back (schema version 13)
    "fail_event",
    "ack",
    "prune",
    "backlog",
    "backlog_by_key",  # the backlog per fairness key (issue 50 item 4)
    "outbox_part_age",
    "hold_liveness",
    "replica_stopped",  # on the same connection, at a clean stop (issue 41)
    # the status page (issue 17): its replica report and its two read-only queries
    "report_replica",
    "ui_status",
    "ui_run",
)
# table -> columns the relay role may SELECT (None: the whole table)
RELAY_SELECT: dict[str, tuple[str, ...] | None] = {
    "events": ("run_id", "seq", "state"),
    "schema_migrations": None,
}
SETTING_KEYS = {"producer": "producer_role", "relay": "relay_role"}


def validate_role_name(name: str) -> str:
    if not ROLE_NAME_RE.fullmatch(name) or name.startswith("pg_") or name == "public":
        raise ValueError(
            f"role {name!r} is not valid: use 1-63 characters of a-z, 0-9 and _, "
            "not starting with a digit or pg_"
        )
    return name


@dataclass(frozen=True)
class Roles:
    producer: str
    relay: str

    @classmethod
    def for_schema(
        cls, schema: str, producer: str | None = None, relay: str | None = None
    ) -> Roles:
        """The given names, or `<schema>_producer` and `<schema>_relay`."""
        roles = cls(
            validate_role_name(producer or f"{schema}_producer"),
            validate_role_name(relay or f"{schema}_relay"),
        )
        if roles.producer == roles.relay:
            raise ValueError("the producer and relay roles must be different roles")
        return roles


def grant(conn: psycopg.Connection[Any], schema: str, roles: Roles) -> None:
    """Create the roles when missing and give each exactly its privileges on `schema`; remember
    the names. Runs in one transaction (the caller holds the migrate lock)."""
    with conn.transaction():
        for role in (roles.producer, roles.relay):
            _create_if_missing(conn, role)
        _grant_exactly(conn, schema, roles)
        conn.execute(
            sql.SQL(
                "insert into {}.settings (key, value) values (%s, %s), (%s, %s)"
                " on conflict (key) do update set value = excluded.value"
            ).format(sql.Identifier(schema)),
            (SETTING_KEYS["producer"], roles.producer, SETTING_KEYS["relay"], roles.relay),
        )


def regrant(conn: psycopg.Connection[Any], schema: str) -> Roles | None:
    """Grant the remembered roles again (after the functions were re-created: a function that
    is new, or was dropped and re-created, has no grants). Call inside a transaction."""
    rows = conn.execute(
        sql.SQL("select key, value from {}.settings where key = any(%s)").format(
            sql.Identifier(schema)
        ),
        (list(SETTING_KEYS.values()),),
    ).fetchall()
    found = dict(rows)
    producer, relay = found.get(SETTING_KEYS["producer"]), found.get(SETTING_KEYS["relay"])
    if not producer or not relay:
        return None
    roles = Roles(validate_role_name(producer), validate_role_name(relay))
    exists = conn.execute(
        "select count(*) from pg_roles where rolname = any(%s)", ([producer, relay],)
    ).fetchone()
    if not exists or exists[0] != 2:
        return None  # dropped by the operator since: nothing to keep up
    _grant_exactly(conn, schema, roles)
    return roles


def revoke_public(conn: psycopg.Connection[Any], schema: str) -> None:
    """PostgreSQL grants EXECUTE on every new function to PUBLIC: take it back (idempotent)."""
    conn.execute(
        sql.SQL("revoke all on all routines in schema {} from public").format(
            sql.Identifier(schema)
        )
    )


def _create_if_missing(conn: psycopg.Connection[Any], role: str) -> None:
    row = conn.execute("select 1 from pg_roles where rolname = %s", (role,)).fetchone()
    if row:
        return
    try:
        with conn.transaction():  # a savepoint: another schema's migrate may create it first
            conn.execute(sql.SQL("create role {} nologin").format(sql.Identifier(role)))
    except psycopg.errors.DuplicateObject:
        pass


def _functions(conn: psycopg.Connection[Any], schema: str, names: tuple[str, ...]) -> list[str]:
    """The schema-qualified signatures (`"s".name(args)`) of the functions called `names`."""
    rows = conn.execute(
        "select p.proname, format('%%I.%%I(%%s)', n.nspname, p.proname,"
        " pg_get_function_identity_arguments(p.oid))"
        " from pg_proc p join pg_namespace n on n.oid = p.pronamespace"
        " where n.nspname = %s and p.proname = any(%s) order by 2",
        (schema, list(names)),
    ).fetchall()
    missing = sorted(set(names) - {r[0] for r in rows})
    if missing:
        raise psycopg.errors.UndefinedFunction(
            f"schema {schema!r} lacks {', '.join(missing)}: run `relay migrate` first"
        )
    return [str(r[1]) for r in rows]


def _grant_exactly(conn: psycopg.Connection[Any], schema: str, roles: Roles) -> None:
    s = sql.Identifier(schema)
    for role in (roles.producer, roles.relay):
        r = sql.Identifier(role)
        for what in ("tables", "sequences", "routines"):
            conn.execute(
                sql.SQL("revoke all on all {} in schema {} from {}").format(sql.SQL(what), s, r)
            )
        conn.execute(sql.SQL("revoke all on schema {} from {}").format(s, r))
        conn.execute(sql.SQL("grant usage on schema {} to {}").format(s, r))
    for role, names in ((roles.producer, PRODUCER_FUNCTIONS), (roles.relay, RELAY_FUNCTIONS)):
        for signature in _functions(conn, schema, names):
            # The signature comes from the catalog, its identifiers quoted by format('%I').
            conn.execute(
                sql.SQL("grant execute on function {} to {}").format(
                    sql.SQL(signature), sql.Identifier(role)
                )
            )
    for table, columns in RELAY_SELECT.items():
        cols: sql.Composable = sql.SQL("")
        if columns is not None:
            cols = sql.SQL(" ({})").format(sql.SQL(", ").join(map(sql.Identifier, columns)))
        conn.execute(
            sql.SQL("grant select{} on {} to {}").format(
                cols, sql.Identifier(schema, table), sql.Identifier(roles.relay)
            )
        )
