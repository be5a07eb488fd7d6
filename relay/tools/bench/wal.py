"""`relay bench --only wal`: what a delivered event costs the application's database in WAL.

The outbox lives in the application's primary: every byte of WAL the relay causes is written,
shipped to standbys, archived and backed up (issue 28). The scenario measures, on one set of
rows, in one run:

- **enqueue**: `relay.enqueue` of every event, one transaction per run (as producers do);
- **claim + ack**: one `relay run` replica delivering that backlog to the reference sink (its
  start, its replica report and its stop are in the figure too: they are what a run costs);
- **retention**: `prune` of the delivered rows, in its own batches;
- **the leanest queue** on the same rows: a table with a bigserial key and the same columns,
  the rows inserted one transaction per run, then deleted by key one transaction per run.

Each phase starts after a CHECKPOINT (so full-page writes are counted alike in every phase,
as a busy server pays them) and is read as a `pg_current_wal_lsn()` delta. Autovacuum may run
in any phase: its WAL is part of what the rows cost, so it is not excluded.
"""

from __future__ import annotations

import argparse
from typing import Any

import orjson
import psycopg

from relay.tools.bench.kit import (
    BenchFailed,
    Env,
    Result,
    Scenario,
    positive,
    relay_processes,
    reset,
    until_received,
)


def _arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("wal")
    g.add_argument("--wal-runs", type=positive(int), default=2_000, help="runs (2,000)")
    g.add_argument("--wal-per-run", type=positive(int), default=10, help="events per run (10)")
    g.add_argument(
        "--wal-payload", type=positive(int), default=200, help="payload bytes as JSON (200)"
    )


SMOKE = {"wal_runs": 50, "wal_per_run": 4, "wal_payload": 200}


def payload_of(size: int) -> dict[str, str]:
    """A JSON object whose text is `size` bytes (at least its 11 bytes of structure)."""
    pad = max(0, size - len(orjson.dumps({"pad": ""})))
    return {"pad": "x" * pad}


async def _checkpoint(conn: psycopg.AsyncConnection[Any]) -> int:
    """CHECKPOINT, then the current WAL position in bytes."""
    try:
        await conn.execute("checkpoint")
    except psycopg.errors.InsufficientPrivilege as exc:
        raise BenchFailed(
            "wal: CHECKPOINT needs a superuser or the pg_checkpoint role (the embedded "
            "PostgreSQL has it; pass no --database-url)"
        ) from exc
    return await _lsn(conn)


async def _lsn(conn: psycopg.AsyncConnection[Any]) -> int:
    cur = await conn.execute("select pg_current_wal_lsn() - '0/0'::pg_lsn")
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


def _events(run: int, per_run: int) -> list[tuple[str, str, str, bool]]:
    """(run_id, event_id, event_type, terminal) of one run's events, the last terminal."""
    rid = f"w{run}"
    return [(rid, f"{rid}-{i}", "step", i == per_run) for i in range(1, per_run + 1)]


async def _enqueue(env: Env, conn: psycopg.AsyncConnection[Any], a: argparse.Namespace) -> None:
    body = orjson.dumps(payload_of(a.wal_payload)).decode()
    query = env.q("select {s}.enqueue(%s, %s, %s, %s::jsonb, %s)")
    for run in range(a.wal_runs):
        async with conn.transaction(), conn.cursor() as cur:
            rows = [(r, e, t, body, term) for r, e, t, term in _events(run, a.wal_per_run)]
            await cur.executemany(query, rows)


async def _deliver(env: Env, a: argparse.Namespace, total: int) -> None:
    base = await env.external_sink()
    async with relay_processes(env, 1, base):
        await until_received(env, base, total, "wal: claim + ack", timeout=max(120, total / 200))


async def _prune(env: Env, conn: psycopg.AsyncConnection[Any]) -> int:
    removed = 0
    while True:
        cur = await conn.execute(env.q("select {s}.prune('0 seconds'::interval, 10000)"))
        row = await cur.fetchone()
        n = int(row[0]) if row and row[0] is not None else 0
        removed += n
        if n == 0:
            return removed


LEAN_TABLE = """
create table {s}.bench_lean_queue (
    id bigserial primary key,
    run_id text not null,
    event_id text not null,
    event_type text not null,
    payload jsonb not null,
    created_at timestamptz not null default now()
)"""


async def _lean_insert(
    env: Env, conn: psycopg.AsyncConnection[Any], a: argparse.Namespace
) -> list[list[int]]:
    """The same rows into the leanest queue; returns each run's ids (what a worker deletes)."""
    body = orjson.dumps(payload_of(a.wal_payload)).decode()
    query = env.q(
        "insert into {s}.bench_lean_queue (run_id, event_id, event_type, payload)"
        " select r, e, t, %s::jsonb from unnest(%s::text[], %s::text[], %s::text[]) x(r, e, t)"
        " returning id"
    )
    ids = []
    for run in range(a.wal_runs):
        events = _events(run, a.wal_per_run)
        async with conn.transaction():
            cur = await conn.execute(
                query,
                (body, [e[0] for e in events], [e[1] for e in events], [e[2] for e in events]),
            )
            ids.append([int(r[0]) for r in await cur.fetchall()])
    return ids


async def _lean_delete(env: Env, conn: psycopg.AsyncConnection[Any], ids: list[list[int]]) -> None:
    query = env.q("delete from {s}.bench_lean_queue where id = any(%s)")
    for run_ids in ids:
        async with conn.transaction():
            await conn.execute(query, (run_ids,))


async def wal(env: Env, a: argparse.Namespace) -> Result:
    await reset(env)
    total = a.wal_runs * a.wal_per_run
    phases: dict[str, int] = {}
    async with await psycopg.AsyncConnection.connect(env.url, autocommit=True) as conn:
        start = await _checkpoint(conn)
        await _enqueue(env, conn, a)
        phases["enqueue"] = await _lsn(conn) - start

        start = await _checkpoint(conn)
        await _deliver(env, a, total)
        phases["claim + ack"] = await _lsn(conn) - start

        start = await _checkpoint(conn)
        removed = await _prune(env, conn)
        phases["retention"] = await _lsn(conn) - start
        if removed != total:
            raise BenchFailed(f"wal: prune removed {removed:,} of {total:,} delivered events")

        await conn.execute(env.q("drop table if exists {s}.bench_lean_queue"))
        await conn.execute(env.q(LEAN_TABLE))
        try:
            start = await _checkpoint(conn)
            ids = await _lean_insert(env, conn, a)
            phases["lean: insert"] = await _lsn(conn) - start
            start = await _checkpoint(conn)
            await _lean_delete(env, conn, ids)
            phases["lean: delete"] = await _lsn(conn) - start
        finally:
            await conn.execute(env.q("drop table if exists {s}.bench_lean_queue"))

    per = {name: wal_bytes / total for name, wal_bytes in phases.items()}
    relay_total = per["enqueue"] + per["claim + ack"] + per["retention"]
    lean_total = per["lean: insert"] + per["lean: delete"]
    rows = [
        {"phase": name, "wal_bytes_per_event": round(v, 1), "wal_mb": round(phases[name] / 1e6, 2)}
        for name, v in per.items()
    ]
    rows.append({"phase": "relay total", "wal_bytes_per_event": round(relay_total, 1)})
    rows.append({"phase": "leanest queue total", "wal_bytes_per_event": round(lean_total, 1)})
    return Result(
        ["phase", "wal_bytes_per_event", "wal_mb"],
        rows,
        [
            f"{total:,} events in {a.wal_runs:,} runs of {a.wal_per_run}, payloads of "
            f"{a.wal_payload} bytes; a CHECKPOINT before each phase, WAL from "
            "pg_current_wal_lsn() deltas, full-page writes as the server is set",
            f"relay / leanest queue: {relay_total / lean_total:.2f}×; claim + ack / enqueue: "
            f"{per['claim + ack'] / per['enqueue']:.2f}",
        ],
        metrics={
            "wal_enqueue_bytes_per_event": round(per["enqueue"], 1),
            "wal_claim_ack_bytes_per_event": round(per["claim + ack"], 1),
            "wal_retention_bytes_per_event": round(per["retention"], 1),
            "wal_total_bytes_per_event": round(relay_total, 1),
            "wal_lean_bytes_per_event": round(lean_total, 1),
        },
    )


SCENARIOS = [
    Scenario(
        "wal",
        "WAL per delivered event (enqueue, claim + ack, retention) against the leanest queue",
        wal,
        _arguments,
        SMOKE,
        (
            "wal_enqueue_bytes_per_event",
            "wal_claim_ack_bytes_per_event",
            "wal_retention_bytes_per_event",
            "wal_total_bytes_per_event",
            "wal_lean_bytes_per_event",
        ),
    ),
]
