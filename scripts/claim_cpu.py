"""The database server's CPU per claimed and acked event, for two checkouts side by side
(docs/storage.md: what the outbox's three parts cost the claim).

    python scripts/claim_cpu.py BEFORE_TREE AFTER_TREE [RUNS] [HISTORY_RUNS]

Each tree's `relay migrate` makes a schema in one embedded PostgreSQL; each gets RUNS runs of
10 pending events (200-byte payloads) after HISTORY_RUNS runs of 10 delivered ones (with the
parts, the history sits in another part than the pending events, as after a rotation). Then
claim + ack loops of 10 runs a call on one connection, the schemas taking turns, 3 rounds. The
figure is the backend's own CPU time (utime + stime from /proc, clock ticks) per event, which
other load on a shared machine does not inflate as it does wall time; wall time is printed too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from relay.tools.embedded import EmbeddedPostgres

PER_RUN = 10
PAYLOAD = "a" * 200


def setup(url: str, tree: str, schema: str, runs: int, history: int) -> None:
    env = dict(os.environ, PYTHONPATH=tree, RELAY_DATABASE_URL=url, RELAY_SCHEMA=schema,
               RELAY_INGRESS_URL="http://unused")  # fmt: skip
    subprocess.run([sys.executable, "-m", "relay.cli", "migrate"], env=env, check=True,
                   capture_output=True)  # fmt: skip
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(f"set search_path = {schema}")
        row = c.execute("select to_regclass('outbox_parts') is not null").fetchone()
        parted = bool(row and row[0])
        into_part(c, parted, 1)
        enqueue_runs(c, "h", history)
        c.execute("update runs set delivered_seq = %s, idle = true where run_id like 'h%%'",
                  (PER_RUN,))  # fmt: skip
        into_part(c, parted, 2)
        enqueue_runs(c, "r", runs)
        c.execute("vacuum analyze")


def into_part(c: psycopg.Connection[Any], parted: bool, part: int) -> None:
    """New events go to `part` from now on (schema version 8; nothing before it)."""
    if parted:
        c.execute("select rotate_outbox(%s::smallint)", (part,))


def enqueue_runs(c: psycopg.Connection[Any], prefix: str, runs: int) -> None:
    """`runs` runs of PER_RUN events, through the real enqueue, in one statement."""
    c.execute(
        "select count(enqueue(%(p)s || r, %(p)s || r || '-' || i, 't', %(payload)s::jsonb))"
        " from generate_series(1, %(runs)s) r, generate_series(1, %(per)s) i",
        {"p": prefix, "payload": json.dumps({"x": PAYLOAD}), "runs": runs, "per": PER_RUN},
    )


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def claim_and_ack(url: str, schema: str, calls: int) -> tuple[float, float, int]:
    """(backend CPU s, wall s, events) of `calls` claim + ack round trips of 10 runs each."""
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(f"set search_path = {schema}")
        row = c.execute("select pg_backend_pid()").fetchone()
        assert row is not None
        pid = row[0]
        cpu0, wall0, events = cpu_seconds(pid), time.perf_counter(), 0
        for _ in range(calls):
            taken = c.execute(
                "select run_id, max(lease_token::text), max(seq)"
                " from claim('bench', 10, 10, '30s', 'ordinary') group by 1"
            ).fetchall()
            if not taken:
                break
            batches = [{"run_id": r, "token": t, "upto": u} for r, t, u in taken]
            c.execute("select * from ack(%s)", (json.dumps(batches),)).fetchall()
            events += len(taken) * PER_RUN
        return cpu_seconds(pid) - cpu0, time.perf_counter() - wall0, events


def main() -> int:
    before, after = sys.argv[1], sys.argv[2]
    runs = int(sys.argv[3]) if len(sys.argv) > 3 else 5000
    history = int(sys.argv[4]) if len(sys.argv) > 4 else 50_000
    with tempfile.TemporaryDirectory() as tmp:
        pg = EmbeddedPostgres(Path(tmp) / "pg", durable=True)
        url = pg.start()
        try:
            setup(url, before, "before", runs, history)
            setup(url, after, "after", runs, history)
            results: dict[str, list[tuple[float, float, int]]] = {"before": [], "after": []}
            for _ in range(3):
                for schema in results:
                    results[schema].append(claim_and_ack(url, schema, runs // 10 // 3))
        finally:
            pg.stop()
    for schema, rounds in results.items():
        cpu = [round(c * 1e6 / n, 1) for c, _, n in rounds]
        wall = [round(w * 1e6 / n, 1) for _, w, n in rounds]
        print(f"{schema}: backend CPU µs/event {cpu}, wall µs/event {wall}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
