"""Schema migrations: numbered SQL files applied in order, plus re-applied functions on drift.

`relay migrate` is the only thing that changes the schema. It holds a session advisory lock
(bounded by a lock timeout) so many replicas can run it at once: one applies, the others wait
and then find nothing to do. `relay run` only reads the version (`check_version`).
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TypeVar

import psycopg
from psycopg import sql

from relay import logs
from relay.core.policy import backoff
from relay.maintenance import roles as role_grants
from relay.maintenance.roles import Roles
from relay.names import validate_schema_name as validate_schema_name  # re-exported

_MIGRATION_RE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_AHEAD_RE = re.compile(r"^-- ahead of its migration from version (\d+)\n")
FUNCTIONS_FILE = "functions.sql"
# A migration takes ACCESS EXCLUSIVE locks on tables that running relays and producers use, and
# a long wait for one hurts twice. Every statement that arrives meanwhile queues behind the
# waiting migration (a relay's statement gives up after its own lock_timeout, 2 s, and an ack
# that gives up is delivered again); and a call that already holds one of the tables and wants
# another the migration holds deadlocks with it (a previous release's ack locks `runs` before
# `events`, its enqueue `events` before `runs`: no order of the migration's suits both). So one
# attempt waits at most this long for any lock, rolls back when it cannot have it (letting go of
# what it took) and tries again after a backoff, until the call's `lock_timeout` has passed.
TABLE_LOCK_WAIT = 0.5
T = TypeVar("T")  # what one attempt of _with_short_lock_waits returns


class SchemaError(Exception):
    """The database schema is missing, older or newer than this code."""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    text: str
    # `NNNN_name.prepare.sql`: the migration's work that needs no table lock (_prepare_ahead)
    prepare: str | None = None

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def prepare_from(self) -> int | None:
        """The oldest version the prepare can run ahead on, from its first line."""
        m = _AHEAD_RE.match(self.prepare or "")
        return int(m.group(1)) if m else None


def terminal_channel(schema: str) -> str:
    return f"{schema}_terminal"


def sql_dir() -> Path:
    """The shipped SQL: `relay/schema` in an installed wheel, `../schema` in a source tree."""
    package = Path(__file__).resolve().parent.parent  # relay/, above relay/maintenance/
    for candidate in (package / "schema", package.parent / "schema"):
        if (candidate / FUNCTIONS_FILE).is_file():
            return candidate
    raise SchemaError(f"shipped SQL not found next to {package}")


@cache
def migrations() -> tuple[Migration, ...]:
    found = []
    for path in sorted(sql_dir().iterdir()):
        m = _MIGRATION_RE.match(path.name)
        if m:
            prepare = path.with_suffix(".prepare.sql")
            text = prepare.read_text() if prepare.is_file() else None
            found.append(Migration(int(m.group(1)), m.group(2), path.read_text(), text))
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise SchemaError(f"migrations must be numbered 1..n without gaps, found {versions}")
    return tuple(found)


@cache
def functions_sql() -> str:
    """`functions.sql` then every other `functions_*.sql`, in name order: re-applied as one."""
    paths = sorted(
        sql_dir().glob("functions*.sql"), key=lambda p: (p.name != FUNCTIONS_FILE, p.name)
    )
    return "\n".join(p.read_text() for p in paths)


def code_version() -> int:
    return len(migrations())


def _lock_key(schema: str) -> int:
    digest = hashlib.sha256(f"ledger-relay:migrate:{schema}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


_FINGERPRINT = """
select coalesce(md5(string_agg(pg_get_functiondef(p.oid), E'\\n' order by p.proname, p.oid)), '')
from pg_proc p join pg_namespace n on n.oid = p.pronamespace
where n.nspname = %s and p.prokind <> 'a'
"""


@dataclass
class MigrateResult:
    applied: list[int]
    functions_reapplied: bool
    version: int
    granted: Roles | None = None  # the roles given privileges (--grant-roles)


def migrate(
    conninfo: str,
    schema: str,
    *,
    lock_timeout: str = "60s",
    statement_timeout: str = "5min",
    roles: Roles | None = None,
    table_lock_wait: float = TABLE_LOCK_WAIT,
) -> MigrateResult:
    """Bring `schema` to the code's version. Safe to run from many processes at once. With `roles`,
    also create them when missing and grant each exactly its privileges
    (relay/maintenance/roles.py). `lock_timeout` bounds the whole wait for locks; `table_lock_wait`
    one attempt's wait for a table (TABLE_LOCK_WAIT)."""
    ident = sql.Identifier(schema)
    with _session(conninfo, schema, lock_timeout, statement_timeout) as conn:
        result = _migrate_locked(conn, schema, ident, table_lock_wait)
        if roles is not None:
            role_grants.grant(conn, schema, roles)
            result.granted = roles
        return result


def prepare(
    conninfo: str,
    schema: str,
    *,
    lock_timeout: str = "60s",
    statement_timeout: str = "5min",
    table_lock_wait: float = TABLE_LOCK_WAIT,
) -> list[int]:
    """Only what `migrate` does first: the pending migrations' prepares (_prepare_ahead), while
    the running version goes on. Returns the versions prepared. A later `migrate` prepares only
    what changed since, then migrates."""
    with _session(conninfo, schema, lock_timeout, statement_timeout) as conn:
        ahead = _prepare_pending(conn, schema, _read_version(conn, schema), table_lock_wait)
        return [m.version for m in ahead]


@contextmanager
def _session(
    conninfo: str, schema: str, lock_timeout: str, statement_timeout: str
) -> Iterator[psycopg.Connection]:
    """A connection holding the schema's migration lock: one migrates, the others wait."""
    validate_schema_name(schema)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("select set_config('lock_timeout', %s, false)", (lock_timeout,))
        conn.execute("select set_config('statement_timeout', %s, false)", (statement_timeout,))
        conn.execute("select pg_advisory_lock(%s)", (_lock_key(schema),))
        try:
            yield conn
        finally:
            conn.execute("select pg_advisory_unlock(%s)", (_lock_key(schema),))


def _migrate_locked(
    conn: psycopg.Connection, schema: str, ident: sql.Identifier, table_lock_wait: float
) -> MigrateResult:
    conn.execute(sql.SQL("create schema if not exists {}").format(ident))
    conn.execute(
        sql.SQL(
            "create table if not exists {}.schema_migrations ("
            " version integer primary key, name text not null, checksum text not null,"
            " applied_at timestamptz not null default now())"
        ).format(ident)
    )
    conn.execute(
        sql.SQL(
            "create table if not exists {}.schema_functions ("
            " id boolean primary key default true check (id), shipped_sha256 text not null,"
            " db_fingerprint text not null, applied_at timestamptz not null default now())"
        ).format(ident)
    )
    current = _read_version(conn, schema)
    target = code_version()
    if current > target:
        raise SchemaError(
            f"schema {schema!r} is at version {current}, newer than this relay's {target}: "
            "upgrade the relay"
        )
    pending = [m for m in migrations() if m.version > current]
    ahead = _prepare_pending(conn, schema, current, table_lock_wait)
    reapplied = _with_short_lock_waits(
        conn, table_lock_wait, lambda: _apply(conn, schema, ident, pending, ahead)
    )
    return MigrateResult([m.version for m in pending], reapplied, target)


def _prepare_pending(
    conn: psycopg.Connection, schema: str, current: int, table_lock_wait: float
) -> list[Migration]:
    """The prepares that can run ahead on a database at version `current`, run."""
    pending = [m for m in migrations() if m.version > current]
    ahead = [m for m in pending if m.prepare_from is not None and current >= m.prepare_from]
    for m in ahead:
        _prepare_ahead(conn, schema, m, table_lock_wait)
    return ahead


def _prepare_ahead(
    conn: psycopg.Connection, schema: str, m: Migration, table_lock_wait: float
) -> None:
    """A migration's prepare before its transaction, while the previous version runs on: the
    file in one short transaction (it adds what the old functions never name, and notes what
    changes from then on), then its `migrate_prepare_step` in transactions of their own until it
    returns null. The migration then only catches up with what changed meanwhile, under its
    locks. A prepare that stopped half-way is simply run again by the next `relay migrate`."""
    logs.info("migrate_prepare", version=m.version, name=m.name)
    started = time.monotonic()
    _with_short_lock_waits(conn, table_lock_wait, lambda: _run_prepare_file(conn, schema, m))
    steps = _prepare_steps(conn, schema)
    logs.info(
        "migrate_prepared",
        version=m.version,
        steps=steps,
        seconds=round(time.monotonic() - started, 3),
    )


def _run_prepare_file(conn: psycopg.Connection, schema: str, m: Migration) -> None:
    assert m.prepare is not None
    with conn.transaction():
        conn.execute(
            sql.SQL("set local search_path = {}, pg_catalog").format(sql.Identifier(schema))
        )
        conn.execute(m.prepare.encode())


def _prepare_steps(conn: psycopg.Connection, schema: str) -> int:
    step = sql.SQL("select {}.migrate_prepare_step(%s)").format(sql.Identifier(schema))
    after: str | None = None
    for steps in itertools.count(1):
        row = conn.execute(step, (after,)).fetchone()
        after = row[0] if row else None
        if after is None:
            return steps
    raise AssertionError("unreachable")  # itertools.count() does not end


def _apply(
    conn: psycopg.Connection,
    schema: str,
    ident: sql.Identifier,
    pending: list[Migration],
    prepared: list[Migration],
) -> bool:
    """The pending migrations and the functions of the new version, in one transaction: a
    migration may change a table the old functions write (version 7 turned `events` into a
    view), and a producer must never run an old function against the new layout, or find none.
    A migration's prepare that did not run ahead (`prepared`) runs here, just before it.
    Returns whether the functions were re-created."""
    with conn.transaction():
        for m in pending:
            conn.execute(
                sql.SQL("set local search_path = {}, pg_catalog").format(sql.Identifier(schema))
            )
            if m.prepare is not None and m not in prepared:
                conn.execute(m.prepare.encode())
                _prepare_steps(conn, schema)
            conn.execute(m.text.encode())
            conn.execute(
                sql.SQL(
                    "insert into {}.schema_migrations (version, name, checksum) values (%s, %s, %s)"
                ).format(ident),
                (m.version, m.name, m.checksum),
            )
        return _sync_functions(conn, schema, ident)


def _with_short_lock_waits(
    conn: psycopg.Connection, table_lock_wait: float, attempt: Callable[[], T]
) -> T:
    """Runs `attempt` (one transaction) with each lock wait bounded by `table_lock_wait`, and
    again after a backoff while a lock is not to be had, until the session's lock_timeout has
    passed (TABLE_LOCK_WAIT says why)."""
    row = conn.execute(
        "select current_setting('lock_timeout'),"
        " extract(epoch from current_setting('lock_timeout')::interval)"
    ).fetchone()
    assert row is not None
    session_setting, overall = str(row[0]), float(row[1])
    deadline = time.monotonic() + overall if overall > 0 else float("inf")  # 0: no bound
    one_wait = f"{table_lock_wait * 1000:.0f}ms"
    conn.execute("select set_config('lock_timeout', %s, false)", (one_wait,))
    try:
        for tries in itertools.count():
            try:
                return attempt()
            except psycopg.errors.LockNotAvailable as exc:
                wait = backoff(tries, base=0.05, cap=1.0, rand=random.random(), jitter=0.5)
                if time.monotonic() + wait > deadline:
                    raise SchemaError(
                        f"migrate: could not take the tables' locks within lock_timeout"
                        f" {session_setting} (each wait bounded to {table_lock_wait:g} s): {exc}"
                    ) from exc
                logs.info("migrate_lock_busy", retry_in=round(wait, 3), error=logs.error_text(exc))
                time.sleep(wait)
        raise AssertionError("unreachable")  # itertools.count() does not end
    finally:
        conn.execute("select set_config('lock_timeout', %s, false)", (session_setting,))


def _sync_functions(conn: psycopg.Connection, schema: str, ident: sql.Identifier) -> bool:
    """Re-create the functions when the shipped text changed or the bodies in the database drifted
    from what was last applied."""
    shipped = hashlib.sha256(functions_sql().encode()).hexdigest()
    row = conn.execute(
        sql.SQL("select shipped_sha256, db_fingerprint from {}.schema_functions").format(ident)
    ).fetchone()
    fingerprint = _fingerprint(conn, schema)
    if row is not None and row[0] == shipped and row[1] == fingerprint:
        return False
    with conn.transaction():
        # pg_temp last (the functions pin this path): otherwise a caller's temporary table named
        # like one of ours (`events`, `settings`) would shadow it and swallow outbox rows.
        conn.execute(sql.SQL("set local search_path = {}, pg_catalog, pg_temp").format(ident))
        conn.execute(functions_sql().encode())
        # New functions are executable by PUBLIC, and a function that is new or was re-created
        # has lost the roles' grants: take the one back and give the others again.
        role_grants.revoke_public(conn, schema)
        role_grants.regrant(conn, schema)
        conn.execute(
            sql.SQL(
                "insert into {}.schema_functions (shipped_sha256, db_fingerprint) values (%s, %s)"
                " on conflict (id) do update set shipped_sha256 = excluded.shipped_sha256,"
                " db_fingerprint = excluded.db_fingerprint, applied_at = now()"
            ).format(ident),
            (shipped, _fingerprint(conn, schema)),
        )
    return True


def _fingerprint(conn: psycopg.Connection, schema: str) -> str:
    row = conn.execute(_FINGERPRINT, (schema,)).fetchone()
    return str(row[0]) if row else ""


def _read_version(conn: psycopg.Connection, schema: str) -> int:
    row = conn.execute(
        "select to_regclass(format('%%I.schema_migrations', %s::text)) is not null", (schema,)
    ).fetchone()
    if not row or not row[0]:
        return 0
    got = conn.execute(
        sql.SQL("select coalesce(max(version), 0) from {}.schema_migrations").format(
            sql.Identifier(schema)
        )
    ).fetchone()
    return int(got[0]) if got else 0


def version_problem(db_version: int, schema: str) -> str | None:
    """The message `relay run` refuses to start with, or None when the versions match."""
    target = code_version()
    if db_version == 0:
        return f"schema {schema!r} is not installed: run `relay migrate`"
    if db_version < target:
        return (
            f"schema {schema!r} is at version {db_version}, older than this relay's {target}: "
            "run `relay migrate`"
        )
    if db_version > target:
        return (
            f"schema {schema!r} is at version {db_version}, newer than this relay's {target}: "
            "upgrade the relay"
        )
    return None


async def read_version(conn: psycopg.AsyncConnection[object], schema: str) -> int:
    cur = await conn.execute(
        "select to_regclass(format('%%I.schema_migrations', %s::text)) is not null", (schema,)
    )
    row = await cur.fetchone()
    if not row or not row[0]:  # type: ignore[index]
        return 0
    cur = await conn.execute(
        sql.SQL("select coalesce(max(version), 0) from {}.schema_migrations").format(
            sql.Identifier(schema)
        )
    )
    got = await cur.fetchone()
    return int(got[0]) if got else 0  # type: ignore[index]
