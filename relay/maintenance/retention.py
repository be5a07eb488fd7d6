"""Retention: the relay's own pruning of delivered events, a background task beside the listener.

Nothing else removes what was delivered (DESIGN §4.4). The database's `prune` function does the
removing, a part of the outbox at a time (schema/functions.sql, docs/storage.md); this part
calls it now and then, off the delivery path, and again at once while a call reached its limit
(`PRUNE_BATCH`), with a short pause between calls that leaves room for delivery. The runner
starts it in its background task group when `retention` is set (> 0), and cancels it with the
rest of that group once the lanes and the listener stopped. A failed prune is logged and tried
again at the next turn.
"""

from __future__ import annotations

import random

import anyio
import psycopg

from relay import logs
from relay.edges.store import Store

PRUNE_BATCH = 1000


class Retention:
    """Prunes through `store` about every `interval` seconds (between half of it and all of it,
    at random), what was delivered more than `retention` seconds ago."""

    def __init__(self, store: Store, retention: float, interval: float) -> None:
        self.store = store
        self.retention = retention
        self.interval = interval

    async def run(self) -> None:
        """Prune delivered events in small batches, off the delivery path (DESIGN §4.4)."""
        while True:
            await anyio.sleep(self.interval * random.uniform(0.5, 1.0))
            try:
                total = 0
                while True:
                    n = await self.store.prune(self.retention, PRUNE_BATCH)
                    total += n
                    if n < PRUNE_BATCH:
                        break
                    await anyio.sleep(0.05)  # leave room for delivery between batches
                if total:
                    logs.info("pruned", events=total)
            except (psycopg.Error, OSError, TimeoutError) as exc:
                logs.warning("prune_failed", error=logs.error_text(exc))
