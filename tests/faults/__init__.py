"""The fault suite's harness (issue 7, DESIGN §9): real `relay run` replicas, a PostgreSQL the
harness owns, the reference ingress, a nemesis, and a Jepsen-style queue checker.

- `proxy.py`: a TCP fault proxy (latency, reset, silent blackhole, cut after N bytes).
- `harness.py`: `Lab`, one scenario's world: schema, engine queue, sink, replicas, producer,
  and the nemesis' levers (kill, stop/cont, kill after a 2xx, terminate backends, crash
  PostgreSQL).
- `checker.py`: the report row of one scenario, computed from the sink, the outbox, the engine
  and the replicas' logs.
- `report.py`: the session's rows, printed as a table and written as JSON.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from relay.tools.absurd import install_absurd
from relay.tools.embedded import EmbeddedPostgres


def scale() -> float:
    """`RELAY_FAULTS_SCALE` (default 1): multiplies workloads and fault repetitions."""
    return max(0.1, float(os.environ.get("RELAY_FAULTS_SCALE", "1")))


def scaled(n: int) -> int:
    return max(1, round(n * scale()))


BOUNDED_SOAK_SECONDS = 20.0  # what .ci/run runs: a few faults, same checker


def soak_seconds() -> float:
    """`RELAY_FAULTS_SOAK_SECONDS` (default: the bounded 20 s soak)."""
    value = float(os.environ.get("RELAY_FAULTS_SOAK_SECONDS", "0") or 0)
    return value if value > 0 else BOUNDED_SOAK_SECONDS


@contextmanager
def own_server(data: Path) -> Iterator[EmbeddedPostgres]:
    """A durable PostgreSQL of the suite's own in `data`, with the Absurd schema: scenarios crash
    and restart it. Stopped at once on the way out."""
    server = EmbeddedPostgres(data, durable=True)
    server.start()
    install_absurd(server.url)
    try:
        yield server
    finally:
        server.stop("immediate")
