"""Enqueue in large transactions (issue 28, schema version 7): a run's writers are serialised by
its `run_seqs` row lock, not by a transaction advisory lock per run, so one transaction may
write events of any number of runs (advisory locks ran out of the server's lock table past a
few thousand runs: "out of shared memory"); and a run's next seq comes from its highest in
`outbox`, so many events of one run in one transaction are numbered in order without rewriting
a row per event. No timings here: `relay bench --only enqueue_scaling` judges the speed."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from tests.support import fn, scan_counters

RUNS = 10_000  # past the ~6,000 runs issue 28 saw one transaction lock before version 7
EVENTS = 2_000
# The tables enqueue reads a run's rows from (`outbox`: its three parts, summed by scan_counters)
RUN_TABLES = ("runs", "run_seqs", "outbox")


def _locks_held(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("select count(*) from pg_locks where pid = pg_backend_pid()").fetchone()
    assert row is not None
    return int(row[0])


def test_one_transaction_enqueues_into_10k_distinct_runs(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    """Each run's first event in one transaction. The transaction's entries in the server's
    lock table do not grow with its runs. An advisory lock per run (before version 7) took one
    each, from a table shared by the whole server and sized by max_locks_per_transaction x
    (max_connections + ...): "out of shared memory" at 15,000 runs with PostgreSQL's defaults
    (64, 100 connections; 12,000 held), at 40,000 on this fixture's server (64, 300
    connections; 30,000 held). So the count is what tells the designs apart here."""
    query = sql.SQL(
        "select count({}('many-' || g, 'many-' || g || '-1', 'step', '{{\"i\":1}}'::jsonb))"
        " from generate_series(%s::int, %s::int) g"
    ).format(fn(schema, "enqueue"))
    with conn.transaction():
        assert conn.execute(query, (1, 100)).fetchone() == (100,)
        after_100 = _locks_held(conn)
        assert conn.execute(query, (101, RUNS)).fetchone() == (RUNS - 100,)
        after_all = _locks_held(conn)
    assert after_all < after_100 + 100, (after_100, after_all)
    row = conn.execute(
        sql.SQL(
            "select count(*), count(distinct run_id), min(seq), max(seq) from {}"
            " where run_id like %s"
        ).format(fn(schema, "outbox")),
        ("many-%",),
    ).fetchone()
    assert row == (RUNS, RUNS, 1, 1)
    row = conn.execute(
        sql.SQL("select count(*) from {} where run_id like %s").format(fn(schema, "runs")),
        ("many-%",),
    ).fetchone()
    assert row == (RUNS,)


def test_one_run_many_events_in_one_transaction_then_the_next_continues(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    enqueue = fn(schema, "enqueue")
    with conn.transaction():
        pairs = conn.execute(
            sql.SQL(
                "select g, {}('long', 'long-' || g, 'step', jsonb_build_object('i', g))"
                " from generate_series(1, %s) g"
            ).format(enqueue),
            (EVENTS,),
        ).fetchall()
    # the g-th call of the transaction got seq g
    assert sorted((int(g), int(s)) for g, s in pairs) == [(i, i) for i in range(1, EVENTS + 1)]
    rows = conn.execute(
        sql.SQL(
            "select seq, event_id, (payload ->> 'i')::int from {} where run_id = 'long'"
            " order by seq"
        ).format(fn(schema, "outbox"))
    ).fetchall()
    assert rows == [(i, f"long-{i}", i) for i in range(1, EVENTS + 1)]

    with conn.transaction():
        row = conn.execute(
            sql.SQL("select {}('long', 'long-next', 'step', '{{}}'::jsonb)").format(enqueue)
        ).fetchone()
    assert row == (EVENTS + 1,)


def _tuples_scanned(conn: psycopg.Connection[Any], schema: str) -> int:
    """The tuples this transaction's sequential scans of RUN_TABLES read so far."""
    counters = scan_counters(conn, schema)
    return sum(counters.get(table, (0, 0))[1] for table in RUN_TABLES)


def test_enqueue_reads_no_more_for_a_run_however_many_the_transaction_wrote(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    """Statistics taken while the tables were small (a few runs, two parts empty) make a
    sequential scan the planner's choice for each of enqueue's lookups of one run, and plpgsql
    keeps that plan for the session: every call then reads every row the transaction wrote
    before it, and 100,000 new runs in one transaction cost the square of that (issue 52 item
    4). So: ANALYZE on small tables, then one transaction of many new runs, one event each
    (half of them terminal, all with a fairness key, so that every lookup enqueue has runs),
    and the rows the last 100 calls read by scanning are no more than the first 100's. A
    count, not a time."""
    enqueue = fn(schema, "enqueue")
    query = sql.SQL(
        "select count({}(%s || g, %s || g, 'step', '{{\"i\":1}}'::jsonb, g %% 2 = 0,"
        " null, null, null, 'tenant')) from generate_series(%s::int, %s::int) g"
    ).format(enqueue)
    assert conn.execute(query, ("small-", "small-", 1, 20)).fetchone() == (20,)
    for table in RUN_TABLES:  # a partitioned table's ANALYZE takes each part's statistics too
        conn.execute(sql.SQL("analyze {}").format(fn(schema, table)))
    with conn.transaction():
        start = _tuples_scanned(conn, schema)
        assert conn.execute(query, ("new-", "new-", 1, 100)).fetchone() == (100,)
        first = _tuples_scanned(conn, schema) - start
        assert conn.execute(query, ("new-", "new-", 101, 2_100)).fetchone() == (2_000,)
        before_last = _tuples_scanned(conn, schema)
        assert conn.execute(query, ("new-", "new-", 2_101, 2_200)).fetchone() == (100,)
        last = _tuples_scanned(conn, schema) - before_last
    assert last <= first, (first, last)
