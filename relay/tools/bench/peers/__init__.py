"""The peers of `relay bench`: the queues people pick instead of an outbox relay, run the way
their authors run them, doing the relay's job (one POST per event to the same `relay sink`).

- `graphile`: Graphile Worker (Node.js), one job per event in the named queue `run_id`
  (named queues run serially, so it keeps per-run order, as the relay does).
- `pgqueuer`: PgQueuer (Python), one job per event, with its benchmark tool's settings; it keeps
  no per-run order, and the sink counts the violations.

Both report events/s from the worker's start (every job enqueued before it) to the last
POST answered, the settings they ran with, and the sink's per-run order violations.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import httpx
import orjson

from relay.tools.bench.kit import BenchFailed, Env, Result, median, sink_stats

HEADERS = {"content-type": "application/json", "relay-lease-epoch": "1"}


def event_bodies(n: int, per_run: int, tag: str) -> list[bytes]:
    """`n` ingress bodies of one event each (DESIGN §5), `per_run` consecutive seqs per run,
    in seq order: what the relay would POST one event at a time."""
    now = datetime.now(UTC).isoformat()
    bodies = []
    for i in range(n):
        run = f"{tag}-{i // per_run}"
        seq = i % per_run + 1
        event = {
            "event_id": f"{run}-{seq}",
            "seq": seq,
            "type": "step",
            "terminal": False,
            "payload": {"run": run, "step": seq, "note": "benchmark event"},
            "created_at": now,
        }
        bodies.append(orjson.dumps({"run_id": run, "epoch": 1, "events": [event]}))
    return bodies


async def sink_check(base: str, jobs: int, what: str) -> int:
    """The sink's per-run order violations after a peer's repetition; raises when the peer
    lost events (a figure over fewer events than it claims is no figure)."""
    async with httpx.AsyncClient() as client:
        stats = await sink_stats(client, base)
    if int(stats["unique_events"]) < jobs:
        raise BenchFailed(f"{what}: the sink has {stats['unique_events']} of {jobs} events")
    return int(stats["order_violations"])


def skipped(key: str, why: str) -> Result:
    return Result(["key", "skipped"], [{"key": key, "skipped": why}], [why], {"why": why})


def settings_text(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in settings.items())


async def measure(
    env: Env,
    key: str,
    shown: dict[str, Any],
    reps: int,
    once: Callable[[int], Awaitable[tuple[float, int]]],
) -> tuple[float, int, dict[str, Any]]:
    """`reps` repetitions of one peer setting (`once(rep)` -> events/s, order violations):
    the median rate, the most violations of any repetition, and the setting's table row."""
    rates, violations = [], 0
    for rep in range(reps):
        with env.console.status(f"{key}: {settings_text(shown)}, rep {rep + 1}/{reps}"):
            eps, v = await once(rep)
        rates.append(eps)
        violations = max(violations, v)
    eps = median(rates)
    row = {
        "key": key,
        "events_per_s": eps,
        "reps": [round(r) for r in rates],
        "order_violations": violations,
        "settings": settings_text(shown),
    }
    return eps, violations, row
