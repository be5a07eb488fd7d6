"""How long producers wait while `relay migrate` moves a large database to the delivery cursor
(issue 28: schema version 7; docs/storage.md has the figures this printed).

The schema is made by a release from before v7 (tests/upgrade/BEFORE_CURSOR, built from git
history), filled straight through its tables with EVENTS events in runs of PER_RUN (90% of each
run delivered, the rest pending, one run in a hundred blocked behind a failed head), and then
migrated by this checkout while a producer enqueues without pause, one event per transaction,
into existing runs and new ones. Printed: the migration's duration, and the producer's longest
wait and 99th percentile during it.

    python scripts/migrate_timing.py postgresql://... [events]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from relay.maintenance.migrate import migrate  # noqa: E402
from tests.faults.harness import relay_env  # noqa: E402
from tests.upgrade import previous_release  # noqa: E402

SCHEMA = "migrate_timing"
PER_RUN = 10


def old_schema(url: str) -> None:
    previous = previous_release(ROOT, "BEFORE_CURSOR")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(SCHEMA)))
    env = relay_env(url, SCHEMA, "http://unused")
    env.pop("PYTHONPATH", None)
    subprocess.run([*previous.command, "migrate"], env=env, check=True, capture_output=True)


def fill(url: str, events: int) -> None:
    runs = events // PER_RUN
    delivered = PER_RUN * 9 // 10
    statements = [
        f"insert into {{s}}.run_seqs (run_id, last_seq) select 'r' || r, {PER_RUN}"
        f" from generate_series(1, {runs}) r",
        f"insert into {{s}}.runs (run_id, next_attempt_at, blocked_seq)"
        f" select 'r' || r, clock_timestamp(), case when r % 100 = 0 then {delivered + 1} end"
        f" from generate_series(1, {runs}) r",
        f"insert into {{s}}.events (run_id, seq, event_id, event_type, payload, state,"
        f" delivered_at, done_at, failed_at, last_status, last_error)"
        f" select 'r' || r, i, 'r' || r || '-' || i, 'step', jsonb_build_object('i', i),"
        f" case when i <= {delivered} then 'delivered'"
        f"      when r % 100 = 0 and i = {delivered + 1} then 'failed' else 'pending' end,"
        f" case when i <= {delivered} then clock_timestamp() end,"
        f" case when i <= {delivered} then clock_timestamp() end,"
        f" case when r % 100 = 0 and i = {delivered + 1} then clock_timestamp() end,"
        f" case when r % 100 = 0 and i = {delivered + 1} then 422 end,"
        f" case when r % 100 = 0 and i = {delivered + 1} then 'poison' end"
        f" from generate_series(1, {runs}) r, generate_series(1, {PER_RUN}) i",
        "vacuum analyze {s}.events",
        "vacuum analyze {s}.runs",
        "vacuum analyze {s}.run_seqs",
    ]
    with psycopg.connect(url, autocommit=True) as conn:
        for statement in statements:
            conn.execute(sql.SQL(statement).format(s=sql.Identifier(SCHEMA)))  # type: ignore[arg-type]


class Producer(threading.Thread):
    """Enqueues one event per transaction, alternating an existing run and a new one."""

    def __init__(self, url: str, runs: int) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.runs = runs
        self.waits: list[tuple[float, float]] = []  # (start, seconds)
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        enqueue = sql.SQL("select {}.enqueue(%s, %s, 'step', %s)").format(sql.Identifier(SCHEMA))
        payload = json.dumps({"x": 1})
        with psycopg.connect(self.url, autocommit=True) as conn:
            n = 0
            while not self.stop.is_set():
                n += 1
                run = f"r{(n * 7919) % self.runs + 1}" if n % 2 else f"new-{n}"
                start = time.monotonic()
                try:
                    conn.execute(enqueue, (run, f"p-{n}", payload))
                except psycopg.Error as exc:
                    self.errors.append(str(exc).splitlines()[0])
                self.waits.append((start, time.monotonic() - start))


def main(url: str, events: int) -> None:
    old_schema(url)
    t = time.monotonic()
    fill(url, events)
    print(f"filled {events:,} events in {events // PER_RUN:,} runs in {time.monotonic() - t:.1f} s")
    producer = Producer(url, events // PER_RUN)
    producer.start()
    time.sleep(2.0)
    began = time.monotonic()
    migrate(url, SCHEMA)
    ended = time.monotonic()
    time.sleep(2.0)
    producer.stop.set()
    producer.join()
    during = [w for s, w in producer.waits if s + w >= began and s <= ended]
    before = [w for s, w in producer.waits if s + w < began]
    print(f"migration: {ended - began:.2f} s")
    ordered = sorted(during)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    print(
        f"producer during it: {len(during)} enqueues, longest wait {ordered[-1]:.3f} s,"
        f" p99 {p99:.3f} s"
    )
    print(f"producer before it: median {statistics.median(before) * 1000:.2f} ms per enqueue")
    print(f"producer errors: {len(producer.errors)} {producer.errors[:3]}")
    with psycopg.connect(url, autocommit=True) as conn:
        check: Any = conn.execute(
            sql.SQL(
                "select count(*) filter (where state = 'pending'),"
                " count(*) filter (where state = 'delivered'),"
                " count(*) filter (where state = 'failed') from {}.events"
            ).format(sql.Identifier(SCHEMA))
        ).fetchone()
        print(f"after: pending {check[0]:,}, delivered {check[1]:,}, failed {check[2]:,}")
        conn.execute(sql.SQL("drop schema {} cascade").format(sql.Identifier(SCHEMA)))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1_000_000)
