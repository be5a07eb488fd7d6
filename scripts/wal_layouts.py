"""WAL per event of candidate outbox layouts (issue 28): the measurements behind docs/storage.md.

    .venv/bin/python scripts/wal_layouts.py postgresql://postgres@127.0.0.1:PORT/postgres

SQL only, no relay: each layout's tables in a scratch schema `walx` (dropped at the end), the
writes each phase of a delivery makes (enqueue one transaction per run; claim and ack 64 runs a
statement, as the relay groups them; retention in batches), a CHECKPOINT before each phase and
WAL from `pg_current_wal_lsn()` deltas, as `relay bench --only wal` measures the real relay.
Needs a superuser (CHECKPOINT). Layouts:
- lean: the leanest queue on the same rows (bigserial key; insert, then delete per run);
- v5like: today's layout (delivery state on each event, partial indexes; the ack updates rows);
- cursor: events written once, a run's `delivered_seq` advanced by the ack, a small table of
  pending terminal events for the critical lane. Variants: `seq_once` writes the run's sequence
  row once per transaction instead of once per event; `noeid` drops the unique event_id index;
  `truncate` retires delivered events by truncating (a partition, or a rotated table).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

RUNS, PER_RUN, GROUP = 2000, 10, 64
PAYLOAD = json.dumps({"pad": "x" * 189})  # 200 bytes of JSON text

RUNS_TABLE = """
create table runs (
    run_id text primary key, idle boolean not null default false,
    epoch bigint not null default 0, lease_owner text, lease_token uuid,
    lease_expires_at timestamptz, next_attempt_at timestamptz not null default '-infinity',
    attempts int not null default 0, blocked_seq bigint,
    delivered_seq bigint not null default 0, delivered_at timestamptz,
    updated_at timestamptz not null default clock_timestamp()
) with (fillfactor = 70);
create index runs_due on runs (next_attempt_at) where not idle and blocked_seq is null;
create index runs_leased on runs (lease_owner) where lease_owner is not null;
create table run_seqs (run_id text primary key, last_seq bigint not null, terminal_seq bigint);
"""
EVENT_COLUMNS = """
    run_id text not null, seq bigint not null, event_id text not null unique,
    event_type text not null, payload jsonb not null, terminal boolean not null default false,
    created_at timestamptz not null default clock_timestamp()"""
V5_TABLES = f"""
create table events ({EVENT_COLUMNS},
    state text not null default 'pending', attempts int not null default 0,
    delivered_at timestamptz, done_at timestamptz, primary key (run_id, seq));
create index events_pending on events (run_id, seq) where state = 'pending';
create index events_pending_terminal on events (created_at) where terminal and state = 'pending';
create index events_done on events (done_at) where done_at is not null;
"""
CURSOR_TABLES = f"""
create table events ({EVENT_COLUMNS}, primary key (run_id, seq));
create table pending_terminals (
    run_id text primary key, created_at timestamptz not null default clock_timestamp());
"""
LEAN_TABLES = """
create table events (
    id bigserial primary key, run_id text not null, event_id text not null,
    event_type text not null, payload jsonb not null, terminal boolean not null default false,
    created_at timestamptz not null default clock_timestamp());
"""

Conn = psycopg.Connection[Any]


@dataclass(frozen=True)
class Layout:
    name: str
    tables: str
    cursor: bool = True
    seq_once: bool = False
    truncate: bool = False


LAYOUTS = [
    Layout("lean", LEAN_TABLES, cursor=False),
    Layout("v5like", RUNS_TABLE + V5_TABLES, cursor=False),
    Layout("cursor", RUNS_TABLE + CURSOR_TABLES),
    Layout("cursor seq_once", RUNS_TABLE + CURSOR_TABLES, seq_once=True),
    Layout(
        "cursor seq_once noeid",
        RUNS_TABLE + CURSOR_TABLES.replace("event_id text not null unique", "event_id text"),
        seq_once=True,
    ),
    Layout("cursor seq_once truncate", RUNS_TABLE + CURSOR_TABLES, seq_once=True, truncate=True),
]


def groups(size: int) -> list[list[str]]:
    ids = [f"r{r}" for r in range(RUNS)]
    return [ids[i : i + size] for i in range(0, RUNS, size)]


def enqueue(c: Conn, layout: Layout) -> None:
    insert = (
        "insert into events (run_id, event_id, event_type, payload, terminal)"
        " values (%s, %s, 'step', %s, %s)"
        if layout.name == "lean"
        else "insert into events (run_id, seq, event_id, event_type, payload, terminal)"
        " values (%s, %s, %s, 'step', %s, %s)"
    )
    for (rid,) in groups(1):
        with c.transaction():
            for i in range(1, PER_RUN + 1):
                if layout.name == "lean":
                    c.execute(insert, (rid, f"{rid}-{i}", PAYLOAD, i == PER_RUN))
                    continue
                if not layout.seq_once:
                    c.execute(
                        "insert into run_seqs as s values (%s, 1, null) on conflict (run_id)"
                        " do update set last_seq = s.last_seq + 1",
                        (rid,),
                    )
                c.execute(insert, (rid, i, f"{rid}-{i}", PAYLOAD, i == PER_RUN))
            if layout.name == "lean":
                continue
            if layout.seq_once:
                c.execute("insert into run_seqs values (%s, %s, %s)", (rid, PER_RUN, PER_RUN))
            if layout.cursor:
                c.execute("insert into pending_terminals (run_id) values (%s)", (rid,))
            c.execute(
                "insert into runs (run_id, next_attempt_at) values (%s, clock_timestamp())"
                " on conflict do nothing",
                (rid,),
            )


def claim(c: Conn, layout: Layout) -> None:
    if layout.name == "lean":
        return
    for ids in groups(GROUP):
        c.execute(
            "update runs set epoch = epoch + 1, lease_owner = 'o', lease_token = gen_random_uuid(),"
            " lease_expires_at = clock_timestamp() + interval '30s',"
            " next_attempt_at = clock_timestamp() + interval '30s' where run_id = any(%s)",
            (ids,),
        )


RELEASE = (
    "lease_owner = null, lease_token = null, lease_expires_at = null, idle = true,"
    " next_attempt_at = clock_timestamp(), updated_at = clock_timestamp()"
)


def ack(c: Conn, layout: Layout) -> None:
    """The leanest queue's ack is its delete; the relay's is one statement per 64 runs."""
    if layout.name == "lean":
        for (rid,) in groups(1):
            c.execute("delete from events where run_id = %s", (rid,))
        return
    for ids in groups(GROUP):
        with c.transaction():
            if layout.cursor:
                c.execute(
                    f"update runs set delivered_seq = %s, delivered_at = clock_timestamp(),"
                    f" {RELEASE} where run_id = any(%s)",
                    (PER_RUN, ids),
                )
                c.execute("delete from pending_terminals where run_id = any(%s)", (ids,))
            else:
                c.execute(
                    "update events set state = 'delivered', delivered_at = clock_timestamp(),"
                    " done_at = clock_timestamp() where run_id = any(%s)",
                    (ids,),
                )
                c.execute(f"update runs set {RELEASE} where run_id = any(%s)", (ids,))


def retention(c: Conn, layout: Layout) -> None:
    if layout.name == "lean":
        return
    if layout.truncate:
        c.execute("truncate events")
        return
    for ids in groups(500):
        c.execute("delete from events where run_id = any(%s)", (ids,))


PHASES: list[tuple[str, Callable[[Conn, Layout], None]]] = [
    ("enqueue", enqueue),
    ("claim", claim),
    ("ack", ack),
    ("retention", retention),
]


def wal_position(c: Conn) -> int:
    row = c.execute("select pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
    assert row is not None
    return int(row[0])


def measure(c: Conn, layout: Layout) -> dict[str, float]:
    c.execute("drop schema if exists walx cascade")
    c.execute("create schema walx")
    c.execute("set search_path = walx")
    c.execute(layout.tables)
    out = {}
    for name, phase in PHASES:
        c.execute("checkpoint")
        start = wal_position(c)
        phase(c, layout)
        out[name] = (wal_position(c) - start) / (RUNS * PER_RUN)
    return out


def main(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as c:
        try:
            for layout in LAYOUTS:
                got = measure(c, layout)
                figures = " ".join(f"{k}={v:5.0f}" for k, v in got.items())
                print(f"{layout.name:26} {figures}  total={sum(got.values()):5.0f} B/event")
        finally:
            c.execute("drop schema if exists walx cascade")


if __name__ == "__main__":
    main(sys.argv[1])
