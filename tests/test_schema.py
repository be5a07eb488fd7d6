"""Migrations against a real PostgreSQL (DESIGN §3 "Migrations"): the catalog a fresh migrate
produces, idempotence, many concurrent `relay migrate`s, function drift, version checks and
schema-name validation."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

import relay
from relay.maintenance import migrate as mig
from relay.maintenance.migrate import (
    SchemaError,
    code_version,
    migrate,
    read_version,
    validate_schema_name,
    version_problem,
)

REPO = Path(__file__).resolve().parent.parent

# The catalog of a freshly migrated schema at the code's version. A new migration updates this
# on purpose: the diff of this block is the reviewable summary of what the migration does.
EXPECTED_TABLES = {
    "settings": None,
    "run_seqs": None,
    "runs": [
        "fillfactor=70",
        "autovacuum_vacuum_scale_factor=0.02",
        "autovacuum_vacuum_cost_delay=0",
    ],
    # 0007_delivery_cursor: the version-6 `events` table, renamed (events is a view now);
    # 0008_outbox_parts: partitioned into three parts that take turns (part 0 is the old table)
    "outbox": None,
    **{
        f"outbox_p{part}": [
            "autovacuum_vacuum_scale_factor=0.02",
            "autovacuum_analyze_scale_factor=0.02",
            "autovacuum_vacuum_cost_delay=0",
        ]
        for part in range(3)
    },
    "outbox_parts": None,
    "event_failures": None,
    "event_skips": None,
    "pending_terminals": None,
    "replicas": None,
    "schema_migrations": None,
    "schema_functions": None,
    # 0009_fairness_keys: a key's weight and passes, each lane's clock (issue 50 item 3)
    "fairness_keys": None,
    "fairness_clock": None,
}

EXPECTED_COLUMNS = {
    "settings": [("key", "text", True), ("value", "text", True)],
    "run_seqs": [
        ("run_id", "text", True),
        ("last_seq", "bigint", True),
        ("terminal_seq", "bigint", False),
    ],
    "runs": [
        ("run_id", "text", True),
        ("idle", "boolean", True),
        ("epoch", "bigint", True),
        ("lease_owner", "text", False),
        ("lease_token", "uuid", False),
        ("lease_expires_at", "timestamp with time zone", False),
        ("next_attempt_at", "timestamp with time zone", True),
        ("attempts", "integer", True),
        ("last_error", "text", False),
        ("blocked_seq", "bigint", False),
        ("updated_at", "timestamp with time zone", True),
        # 0007_delivery_cursor: the cursor, and the last failed attempt's status
        ("delivered_seq", "bigint", True),
        ("delivered_at", "timestamp with time zone", False),
        ("last_status", "integer", False),
        # 0009_fairness_keys: the run's key, set by its first event
        ("fairness_key", "text", True),
        # 0011_retry_waiver: an operator's retry lets the next attempt past the retry budget
        ("retry_waived", "boolean", True),
    ],
    # 0007_delivery_cursor: written once; the delivery columns moved to the run and to
    # event_failures / event_skips. 0008_outbox_parts: the parts of the partitioned outbox.
    **{
        f"outbox_p{part}": [
            ("run_id", "text", True),
            ("seq", "bigint", True),
            ("event_id", "text", True),
            ("event_type", "text", True),
            ("payload", "jsonb", True),
            ("terminal", "boolean", True),
            ("wake_queue", "text", False),
            ("wake_event", "text", False),
            ("traceparent", "text", False),
            ("created_at", "timestamp with time zone", True),
            ("part", "smallint", True),
        ]
        for part in range(3)
    },
    "outbox_parts": [
        ("part", "smallint", True),
        ("current", "boolean", True),
        ("opened_at", "timestamp with time zone", False),
        ("closed_at", "timestamp with time zone", False),
    ],
    "event_failures": [
        ("run_id", "text", True),
        ("seq", "bigint", True),
        ("attempts", "integer", True),
        ("last_status", "integer", False),
        ("last_error", "text", False),
        ("failed_at", "timestamp with time zone", True),
        ("retried_by", "text", False),
        ("retried_role", "text", False),
        ("retried_at", "timestamp with time zone", False),
        ("retries", "integer", True),
    ],
    "event_skips": [
        ("run_id", "text", True),
        ("seq", "bigint", True),
        ("skipped_by", "text", True),
        ("skipped_role", "text", False),
        ("skip_reason", "text", True),
        ("skipped_at", "timestamp with time zone", True),
    ],
    "pending_terminals": [
        ("run_id", "text", True),
        ("seq", "bigint", True),
        ("created_at", "timestamp with time zone", True),
        # 0009_fairness_keys: the run's key, for the critical lane's shares
        ("fairness_key", "text", True),
    ],
    # 0003_replicas: replica liveness (issue 18)
    "replicas": [
        ("owner", "text", True),
        ("started_at", "timestamp with time zone", True),
        ("seen_at", "timestamp with time zone", True),
        # 0004: the incarnation of the process holding the lock
        ("incarnation", "text", False),
        # 0005_replica_reports: what each replica reports for the status page (issue 17)
        ("reported_at", "timestamp with time zone", False),
        ("report", "jsonb", False),
        # 0006_replica_server_lifetime: the server lifetime the lock was taken in (issue 29)
        ("server_started_at", "timestamp with time zone", True),
    ],
    "schema_migrations": [
        ("version", "integer", True),
        ("name", "text", True),
        ("checksum", "text", True),
        ("applied_at", "timestamp with time zone", True),
    ],
    "schema_functions": [
        ("id", "boolean", True),
        ("shipped_sha256", "text", True),
        ("db_fingerprint", "text", True),
        ("applied_at", "timestamp with time zone", True),
    ],
    "fairness_keys": [
        ("key", "text", True),
        ("weight", "integer", True),
        ("pass_critical", "bigint", True),
        ("pass_ordinary", "bigint", True),
    ],
    "fairness_clock": [("lane", "text", True), ("vtime", "bigint", True)],
}

# Index definitions with the schema name replaced by `S`.
EXPECTED_INDEXES = {
    "settings_pkey": "CREATE UNIQUE INDEX settings_pkey ON S.settings USING btree (key)",
    "run_seqs_pkey": "CREATE UNIQUE INDEX run_seqs_pkey ON S.run_seqs USING btree (run_id)",
    "runs_pkey": "CREATE UNIQUE INDEX runs_pkey ON S.runs USING btree (run_id)",
    "runs_due": "CREATE INDEX runs_due ON S.runs USING btree (next_attempt_at)"
    " WHERE ((NOT idle) AND (blocked_seq IS NULL))",
    "runs_idle": "CREATE INDEX runs_idle ON S.runs USING btree (updated_at) WHERE idle",
    "runs_leased": "CREATE INDEX runs_leased ON S.runs USING btree (lease_owner)"
    " WHERE (lease_owner IS NOT NULL)",
    **{
        f"outbox_p{part}_pkey": f"CREATE UNIQUE INDEX outbox_p{part}_pkey ON S.outbox_p{part}"
        " USING btree (run_id, seq)"
        for part in range(3)
    },
    **{
        f"outbox_p{part}_event_id_key": f"CREATE UNIQUE INDEX outbox_p{part}_event_id_key"
        f" ON S.outbox_p{part} USING btree (event_id)"
        for part in range(3)
    },
    "outbox_parts_pkey": "CREATE UNIQUE INDEX outbox_parts_pkey ON S.outbox_parts"
    " USING btree (part)",
    "outbox_parts_one_current": "CREATE UNIQUE INDEX outbox_parts_one_current"
    " ON S.outbox_parts USING btree (current) WHERE current",
    "event_failures_pkey": "CREATE UNIQUE INDEX event_failures_pkey ON S.event_failures"
    " USING btree (run_id, seq)",
    "event_failures_failed_at": "CREATE INDEX event_failures_failed_at ON S.event_failures"
    " USING btree (failed_at)",
    "event_skips_pkey": "CREATE UNIQUE INDEX event_skips_pkey ON S.event_skips"
    " USING btree (run_id, seq)",
    "pending_terminals_pkey": "CREATE UNIQUE INDEX pending_terminals_pkey"
    " ON S.pending_terminals USING btree (run_id)",
    "pending_terminals_created_at": "CREATE INDEX pending_terminals_created_at"
    " ON S.pending_terminals USING btree (created_at)",
    "replicas_pkey": "CREATE UNIQUE INDEX replicas_pkey ON S.replicas USING btree (owner)",
    "schema_migrations_pkey": "CREATE UNIQUE INDEX schema_migrations_pkey"
    " ON S.schema_migrations USING btree (version)",
    "schema_functions_pkey": "CREATE UNIQUE INDEX schema_functions_pkey"
    " ON S.schema_functions USING btree (id)",
    # 0009_fairness_keys
    "runs_due_by_key": "CREATE INDEX runs_due_by_key ON S.runs USING btree"
    " (fairness_key, next_attempt_at) WHERE ((NOT idle) AND (blocked_seq IS NULL))",
    "pending_terminals_by_key": "CREATE INDEX pending_terminals_by_key"
    " ON S.pending_terminals USING btree (fairness_key, created_at)",
    "fairness_keys_pkey": "CREATE UNIQUE INDEX fairness_keys_pkey ON S.fairness_keys"
    " USING btree (key)",
    "fairness_clock_pkey": "CREATE UNIQUE INDEX fairness_clock_pkey ON S.fairness_clock"
    " USING btree (lane)",
    # 0010_fairness_walk: the shared claim walks the keys in each lane's pass order
    "fairness_keys_by_pass_critical": "CREATE INDEX fairness_keys_by_pass_critical"
    " ON S.fairness_keys USING btree (pass_critical, key)",
    "fairness_keys_by_pass_ordinary": "CREATE INDEX fairness_keys_by_pass_ordinary"
    " ON S.fairness_keys USING btree (pass_ordinary, key)",
}

# name -> identity arguments: the SQL API producers and the relay are written against. Other
# shipped functions (operator tools) may exist too: every installed function must be shipped.
EXPECTED_FUNCTIONS = {
    "liveness_key": "p_owner text",
    "hold_liveness": "p_owner text, p_incarnation text",
    "replica_stopped": "p_owner text",
    "terminal_channel": "",
    "setting": "p_key text",
    "enqueue": "p_run_id text, p_event_id text, p_event_type text, p_payload jsonb,"
    " p_terminal boolean, p_wake_queue text, p_wake_event text, p_traceparent text,"
    " p_fairness_key text",
    "exists_absurd_queue": "p_queue text",
    "enqueue_many": "p_run_id text, p_events jsonb, p_fairness_key text",
    "lock_run_for_enqueue": "p_run_id text",
    "has_pending": "p_run_id text, p_cursor bigint",
    "settle_run": "p_run_id text",
    "dead_owners": "p_owner text",
    "pick_run": "p_run_id text, p_dead text[]",
    "pick_critical": "p_runs integer, p_dead text[]",
    "pick_ordinary": "p_runs integer, p_dead text[]",
    "lane_keys": "p_lane text, p_limit integer",
    "pick_of_keys": "p_lane text, p_keys text[], p_quotas integer[], p_dead text[],"
    " p_exclude text[]",
    "pick_lane": "p_lane text, p_runs integer, p_dead text[], p_exclude text[]",
    "pick_shared": "p_lane text, p_runs integer, p_dead text[], p_exclude text[]",
    "claim": "p_owner text, p_runs integer, p_batch integer, p_ttl interval, p_lane text,"
    " p_run_id text, p_max_bytes bigint, p_claim uuid",
    "claim_token": "p_claim uuid, p_run_id text",
    "release_claims": "p_owner text, p_claims uuid[]",
    "claimed_prefixes": "p_taken text[], p_epochs bigint[], p_tokens uuid[],"
    " p_expires timestamp with time zone[], p_attempts integer[], p_cursors bigint[],"
    " p_reclaimed text[], p_waived boolean[], p_empty text[], p_batch integer,"
    " p_max_bytes bigint, p_now timestamp with time zone",
    "renew": "p_run_ids text[], p_tokens uuid[], p_ttl interval",
    "release": "p_run_id text, p_token uuid, p_delay interval, p_error text, p_status integer,"
    " p_first_seq bigint, p_last_seq bigint",
    "fail_event": "p_run_id text, p_token uuid, p_seq bigint, p_status integer, p_error text",
    "block_event": "p_run_id text, p_seq bigint, p_status integer, p_error text",
    "ack": "p_batches jsonb",
    "ack_round": "p_i bigint[], p_runs text[], p_tokens uuid[], p_upto bigint[], p_keep boolean[]",
    "emit_wakes": "p_run_id text, p_from bigint, p_upto bigint, p_now timestamp with time zone",
    "delivered_note": "p_run_id text, p_last_seq bigint, p_event_ids text[]",
    "prune": "p_retention interval, p_limit integer",
    "current_outbox_part": "",
    "empty_outbox_part": "p_part smallint, p_current smallint, p_limit integer",
    "rotate_outbox": "p_to smallint",
    "not_done_in_part": "p_part smallint, p_limit integer",
    "forget_finished_runs": "p_retention interval, p_limit integer",
    # functions_ops.sql: the operator tools
    "unblock_run": "p_run_id text",
    "check_operator": "p_fn text, p_by text",
    "lock_failed_event": "p_fn text, p_verb text, p_event_id text, OUT o_run_id text,"
    " OUT o_seq bigint",
    "retry_event": "p_event_id text, p_by text",
    "retry_run": "p_run_id text, p_by text",
    "skip_event": "p_event_id text, p_by text, p_reason text",
    "inspect_run": "p_run_id text, p_from_seq bigint, p_limit integer",
    "inspect_run_summary": "p_run_id text",
    "status": "p_blocked_limit integer",
    "set_fairness_weight": "p_key text, p_weight integer",
}

EXPECTED_SETTINGS = {
    "max_payload_bytes": "262144",
    "max_id_bytes": "200",
    "notify_ordinary": "on",
    "enqueue_lock_timeout": "5s",
    "outbox_part_lock_timeout": "200ms",
}


@pytest.fixture
def fresh(pg_url: str) -> Iterator[str]:
    """A schema name that does not exist yet; dropped afterwards."""
    name = f"m_{uuid.uuid4().hex[:10]}"
    yield name
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(name)))


def rows(conn: psycopg.Connection[Any], query: Any, *params: Any) -> list[tuple[Any, ...]]:
    return conn.execute(query, params or None).fetchall()


def catalog(conn: psycopg.Connection[Any], schema: str) -> dict[str, Any]:
    """Everything a migration decides, with the schema name replaced by `S`."""

    def unschema(text: str) -> str:
        return re.sub(rf"\b{re.escape(schema)}\b", "S", text)

    tables = {
        name: opts
        for name, opts in rows(
            conn,
            "select relname, reloptions from pg_class where relnamespace = %s::regnamespace"
            " and relkind in ('r', 'p')",
            schema,
        )
    }
    columns: dict[str, list[tuple[str, str, bool]]] = {}
    for table, column, typ, notnull in rows(
        conn,
        "select c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull"
        " from pg_attribute a join pg_class c on c.oid = a.attrelid"
        " where c.relnamespace = %s::regnamespace and c.relkind = 'r'"
        " and a.attnum > 0 and not a.attisdropped order by c.relname, a.attnum",
        schema,
    ):
        columns.setdefault(table, []).append((column, typ, notnull))
    indexes = {
        name: unschema(definition)
        for name, definition in rows(
            conn,
            "select c.relname, pg_get_indexdef(c.oid) from pg_class c"
            " where c.relnamespace = %s::regnamespace and c.relkind = 'i'",
            schema,
        )
    }
    functions = {
        name: args
        for name, args in rows(
            conn,
            "select proname, pg_get_function_identity_arguments(oid) from pg_proc"
            " where pronamespace = %s::regnamespace",
            schema,
        )
    }
    other = rows(
        conn,
        "select relname, relkind from pg_class where relnamespace = %s::regnamespace"
        " and relkind not in ('r', 'i', 'p')",
        schema,
    )
    return {
        "tables": tables,
        "columns": columns,
        "indexes": indexes,
        "functions": functions,
        "other": other,
    }


def function_defs(conn: psycopg.Connection[Any], schema: str) -> dict[str, str]:
    return {
        name: re.sub(rf"\b{re.escape(schema)}\b", "S", definition)
        for name, definition in rows(
            conn,
            "select proname, pg_get_functiondef(oid) from pg_proc"
            " where pronamespace = %s::regnamespace",
            schema,
        )
    }


def shipped_function_names() -> set[str]:
    text = mig.functions_sql()
    pattern = r"\bcreate\s+(?:or\s+replace\s+)?(?:function|procedure)\s+(\w+)\s*\("
    return set(re.findall(pattern, text, flags=re.I))


def assert_current_schema(conn: psycopg.Connection[Any], schema: str) -> None:
    got = catalog(conn, schema)
    assert got["tables"] == EXPECTED_TABLES
    assert got["columns"] == EXPECTED_COLUMNS
    assert got["indexes"] == EXPECTED_INDEXES
    assert {name: got["functions"].get(name) for name in EXPECTED_FUNCTIONS} == EXPECTED_FUNCTIONS
    # every shipped function is installed, and nothing else
    assert set(got["functions"]) == shipped_function_names()
    # 0007_delivery_cursor: `events` is a view of the outbox with each event's state
    assert got["other"] == [("events", "v")]
    versions = rows(
        conn,
        sql.SQL("select version, name, checksum from {} order by version").format(
            sql.Identifier(schema, "schema_migrations")
        ),
    )
    assert versions == [(m.version, m.name, m.checksum) for m in mig.migrations()]


def test_migrate_from_empty_builds_the_expected_catalog(pg_url: str, fresh: str) -> None:
    result = migrate(pg_url, fresh)

    assert result.applied == list(range(1, code_version() + 1))
    assert result.version == code_version()
    assert result.functions_reapplied is True
    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert_current_schema(conn, fresh)
        settings = dict(
            rows(
                conn,
                sql.SQL("select key, value from {}").format(sql.Identifier(fresh, "settings")),
            )
        )
        assert settings == EXPECTED_SETTINGS
        # Every function pins its search_path to the schema (so the schema name is
        # configurable and no caller's search_path redirects it) ...
        for name, config in rows(
            conn,
            "select proname, proconfig from pg_proc where pronamespace = %s::regnamespace",
            fresh,
        ):
            paths = [c for c in (config or []) if c.startswith("search_path=")]
            assert len(paths) == 1, name
            parts = [p.strip() for p in paths[0].removeprefix("search_path=").split(",")]
            assert parts[0] == fresh, name
            # ... with pg_temp last: otherwise a caller's temporary table named like one of
            # ours (say `events`) would silently receive the outbox rows.
            assert parts[-1] == "pg_temp", name
        channel = conn.execute(
            sql.SQL("select {}()").format(sql.Identifier(fresh, "terminal_channel"))
        ).fetchone()
        assert channel == (mig.terminal_channel(fresh),)


def test_functions_ignore_a_callers_temporary_tables(
    pg_url: str, schema: str, conn: psycopg.Connection[Any]
) -> None:
    """A producer session that happens to own a temp table called `events` or `settings` must
    still write to the outbox (a lost event otherwise)."""
    conn.execute(
        sql.SQL("create temp table events (like {} including all)").format(
            sql.Identifier(schema, "events")
        )
    )
    conn.execute("create temp table settings (key text primary key, value text not null)")
    conn.execute("insert into pg_temp.settings values ('max_payload_bytes', '1')")
    seq = conn.execute(
        sql.SQL("select {}('r1', 'e1', 't', %s::jsonb)").format(sql.Identifier(schema, "enqueue")),
        ('{"a": 1}',),
    ).fetchone()
    assert seq == (1,)
    assert conn.execute("select count(*) from pg_temp.events").fetchone() == (0,)
    assert conn.execute(
        sql.SQL("select event_id from {}").format(sql.Identifier(schema, "events"))
    ).fetchall() == [("e1",)]


def test_second_migrate_is_a_noop(pg_url: str, fresh: str) -> None:
    migrate(pg_url, fresh)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        before_versions = rows(
            conn,
            sql.SQL("select version, applied_at from {}").format(
                sql.Identifier(fresh, "schema_migrations")
            ),
        )
        before_functions = rows(
            conn,
            sql.SQL("select shipped_sha256, db_fingerprint, applied_at from {}").format(
                sql.Identifier(fresh, "schema_functions")
            ),
        )
        # xmin changes whenever `create or replace` rewrites a pg_proc row.
        before_procs = rows(
            conn,
            "select oid, xmin::text from pg_proc where pronamespace = %s::regnamespace"
            " order by oid",
            fresh,
        )

    again = migrate(pg_url, fresh)

    assert again.applied == []
    assert again.functions_reapplied is False
    assert again.version == code_version()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert_current_schema(conn, fresh)
        assert (
            rows(
                conn,
                sql.SQL("select version, applied_at from {}").format(
                    sql.Identifier(fresh, "schema_migrations")
                ),
            )
            == before_versions
        )
        assert (
            rows(
                conn,
                sql.SQL("select shipped_sha256, db_fingerprint, applied_at from {}").format(
                    sql.Identifier(fresh, "schema_functions")
                ),
            )
            == before_functions
        )
        assert (
            rows(
                conn,
                "select oid, xmin::text from pg_proc where pronamespace = %s::regnamespace"
                " order by oid",
                fresh,
            )
            == before_procs
        )


def test_fresh_schema_matches_a_second_fresh_schema(pg_url: str, fresh: str) -> None:
    """Two schemas migrated from empty have the same catalog and the same function
    definitions (modulo the schema name): nothing depends on the name or on timing."""
    other = f"{fresh}_b"
    migrate(pg_url, fresh)
    migrate(pg_url, other)
    try:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            assert catalog(conn, fresh) == catalog(conn, other)
            assert function_defs(conn, fresh) == function_defs(conn, other)
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(sql.SQL("drop schema {} cascade").format(sql.Identifier(other)))


_CHILD = r"""
import json, sys
from relay.maintenance.migrate import migrate
url, schema = sys.argv[1], sys.argv[2]
print("ready", flush=True)
sys.stdin.readline()
r = migrate(url, schema)
print(json.dumps({"applied": r.applied, "functions_reapplied": r.functions_reapplied,
                  "version": r.version}), flush=True)
"""


def test_six_concurrent_migrates_end_with_one_correct_schema(pg_url: str, fresh: str) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, pg_url, fresh],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        for _ in range(6)
    ]
    try:
        # Start them together: each has imported the code and waits for "go".
        for p in procs:
            assert p.stdout is not None
            assert p.stdout.readline().strip() == "ready"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        outcomes = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            assert err == ""
            outcomes.append(json.loads(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    everything = list(range(1, code_version() + 1))
    assert sorted(o["applied"] for o in outcomes) == [[]] * 5 + [everything]
    assert sorted(o["functions_reapplied"] for o in outcomes) == [False] * 5 + [True]
    assert {o["version"] for o in outcomes} == {code_version()}
    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert_current_schema(conn, fresh)  # includes: each version recorded exactly once
        assert rows(
            conn,
            sql.SQL("select count(*) from {}").format(sql.Identifier(fresh, "schema_functions")),
        ) == [(1,)]


@pytest.mark.parametrize(
    "drift",
    [
        # a changed body
        "create or replace function {s}.terminal_channel() returns text language sql"
        " as $$ select 'x' $$",
        # a dropped function
        "drop function {s}.settle_run(text)",
        # a changed attribute, body untouched: the search_path pin is gone
        "alter function {s}.enqueue(text, text, text, jsonb, boolean, text, text, text, text)"
        " reset search_path",
        # a changed attribute: volatility
        "alter function {s}.setting(text) volatile",
        # a result type of before version 4 (no operator role): `create or replace` alone
        # cannot change it, functions_ops.sql drops it first
        "drop function {s}.retry_event(text, text);"
        " create function {s}.retry_event(p_event_id text, p_by text) returns table (run_id text,"
        " seq bigint, event_id text, state text, attempts int, retries int, retried_by text,"
        " retried_at timestamptz, blocked_seq bigint) language sql as $$ select null::text,"
        " null::bigint, null::text, null::text, 0, 0, null::text, null::timestamptz,"
        " null::bigint $$",
    ],
    ids=["body", "dropped", "search_path", "volatility", "old_result_type"],
)
def test_migrate_repairs_function_drift(pg_url: str, fresh: str, drift: str) -> None:
    migrate(pg_url, fresh)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        shipped = function_defs(conn, fresh)
        conn.execute(drift.format(s=sql.Identifier(fresh).as_string(conn)))
        assert function_defs(conn, fresh) != shipped

    result = migrate(pg_url, fresh)

    assert result.applied == []
    assert result.functions_reapplied is True
    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert function_defs(conn, fresh) == shipped
        channel = conn.execute(
            sql.SQL("select {}()").format(sql.Identifier(fresh, "terminal_channel"))
        ).fetchone()
        assert channel == (f"{fresh}_terminal",)
    # and once repaired, the next migrate is quiet again
    assert migrate(pg_url, fresh).functions_reapplied is False


def test_newer_schema_makes_migrate_refuse_and_touch_nothing(pg_url: str, fresh: str) -> None:
    migrate(pg_url, fresh)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "insert into {} (version, name, checksum) values (%s, 'from_the_future', 'x')"
            ).format(sql.Identifier(fresh, "schema_migrations")),
            (code_version() + 1,),
        )
        # A newer relay's function body: an old relay must not overwrite it.
        conn.execute(
            sql.SQL(
                "create or replace function {}() returns text language sql as $$ select 'new' $$"
            ).format(sql.Identifier(fresh, "terminal_channel"))
        )

    with pytest.raises(SchemaError, match="upgrade the relay"):
        migrate(pg_url, fresh)

    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert conn.execute(
            sql.SQL("select {}()").format(sql.Identifier(fresh, "terminal_channel"))
        ).fetchone() == ("new",)


def test_version_problem_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    target = code_version()
    assert version_problem(target, "relay") is None

    missing = version_problem(0, "relay")
    assert missing is not None
    assert "not installed" in missing
    assert "run `relay migrate`" in missing

    newer = version_problem(target + 1, "relay")
    assert newer is not None
    assert "newer" in newer
    assert "upgrade the relay" in newer
    assert "relay migrate" not in newer

    # "older" needs a code version above 1 (the database has at least version 1).
    monkeypatch.setattr(mig, "code_version", lambda: 3)
    older = version_problem(2, "relay")
    assert older is not None
    assert "older" in older
    assert "run `relay migrate`" in older
    assert "upgrade the relay" not in older
    assert version_problem(3, "relay") is None


@pytest.mark.anyio
async def test_read_version_sees_missing_and_current(pg_url: str, fresh: str) -> None:
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as aconn:
        assert await read_version(aconn, fresh) == 0
        assert version_problem(await read_version(aconn, fresh), fresh) is not None
        migrate(pg_url, fresh)
        assert await read_version(aconn, fresh) == code_version()
        assert version_problem(await read_version(aconn, fresh), fresh) is None


@pytest.mark.parametrize(
    "name", ["relay", "_relay", "t_1", "relay2", "a" * 54, "a", "public_outbox"]
)
def test_valid_schema_names_are_accepted(name: str) -> None:
    assert validate_schema_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "Relay",
        "1relay",
        "re-lay",
        "re lay",
        'a"b',
        "a;drop schema public cascade",
        "a.b",
        "a" * 55,  # `<schema>_terminal` would not fit a 63-byte channel name
        "relé",
        "relay\n",
        "pg_relay",  # pg_ names are reserved for system schemas
        "pg_catalog",
    ],
)
def test_invalid_schema_names_are_rejected(pg_url: str, name: str) -> None:
    with pytest.raises(ValueError, match="not valid"):
        validate_schema_name(name)
    # and nothing reaches the database: not migrate, not the producer helper
    with pytest.raises(ValueError, match="not valid"):
        migrate(pg_url, name)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        with pytest.raises(ValueError, match="not valid"):
            relay.enqueue(conn, "r", "e", "t", {}, schema=name)
        assert conn.execute(
            "select count(*) from pg_namespace where nspname = %s", (name,)
        ).fetchone() == (0 if name != "pg_catalog" else 1,)
