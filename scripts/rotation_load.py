#!/usr/bin/env python3
"""A rotation of the outbox's parts under constant producer load (docs/storage.md): P producer
threads enqueue runs of N events, one transaction a run, back to back, for S seconds, while
another connection tries the rotation's hold (`hold_back_producers`, which waits at most
`outbox_part_lock_timeout`) every 50 ms. Prints how many tries got it and how long they waited.
Starts an embedded PostgreSQL of its own.

    python scripts/rotation_load.py [P=4] [N=100] [S=20]
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from psycopg.types.json import Jsonb

from relay.maintenance.migrate import migrate
from relay.tools.embedded import EmbeddedPostgres


@dataclass
class Produced:
    transactions: int = 0
    events: int = 0
    errors: int = 0
    longest: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


def produce(url: str, per_run: int, until: float, produced: Produced) -> None:
    """Runs of `per_run` events, one transaction each, back to back until `until`."""
    with psycopg.connect(url) as conn:
        while time.monotonic() < until:
            started = time.monotonic()
            run = uuid.uuid4().hex
            try:
                with conn.transaction():
                    for i in range(per_run):
                        conn.execute(
                            "select relay.enqueue(%s, %s, 't', %s)",
                            (run, f"{run}-{i}", Jsonb({"i": i})),
                        )
            except psycopg.Error:
                with produced.lock:
                    produced.errors += 1
                continue
            took = time.monotonic() - started
            with produced.lock:
                produced.transactions += 1
                produced.events += per_run
                produced.longest = max(produced.longest, took)


def try_holds(url: str, until: float) -> tuple[int, list[float]]:
    """The rotation's hold, tried every 50 ms until `until`: how many got it, and each wait."""
    got = 0
    waits: list[float] = []
    with psycopg.connect(url, autocommit=True) as conn:
        while time.monotonic() < until:
            started = time.monotonic()
            with conn.transaction():
                row = conn.execute("select relay.hold_back_producers()").fetchone()
            waits.append(time.monotonic() - started)
            got += bool(row and row[0])
            time.sleep(0.05)
    return got, sorted(waits)


def main() -> None:
    producers, per_run, seconds = (
        int(sys.argv[1]) if len(sys.argv) > 1 else 4,
        int(sys.argv[2]) if len(sys.argv) > 2 else 100,
        float(sys.argv[3]) if len(sys.argv) > 3 else 20.0,
    )
    pg = EmbeddedPostgres(Path(tempfile.mkdtemp(prefix="rotation-load-")), durable=False)
    url = pg.start()
    try:
        migrate(url, "relay")
        until = time.monotonic() + seconds
        produced = Produced()
        threads = [
            threading.Thread(target=produce, args=(url, per_run, until, produced))
            for _ in range(producers)
        ]
        for t in threads:
            t.start()
        got, waits = try_holds(url, until)
        for t in threads:
            t.join()
    finally:
        pg.stop()
    ms = [round(w * 1000, 1) for w in (waits[len(waits) // 2], waits[int(len(waits) * 0.99)])]
    print(
        f"{producers} producers, runs of {per_run}: {produced.transactions} transactions,"
        f" {produced.events} events, {produced.errors} errors, the longest"
        f" {produced.longest * 1000:.0f} ms; rotation holds: {got} of {len(waits)} got,"
        f" waits p50 {ms[0]} ms, p99 {ms[1]} ms, max {waits[-1] * 1000:.1f} ms"
    )


if __name__ == "__main__":
    main()
