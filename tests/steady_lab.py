"""The fault suite's `Lab` (tests/faults/harness.py) for the topology scenarios of issue 29: the
relay where it runs in production (behind PgBouncer, through a rolling upgrade).

Two differences from a fault scenario:
- the producer must never fail: any error of an enqueue fails the scenario, where the fault
  scenarios retry across the faults they inject. Nothing here is a fault a producer should see.
- the clients may go through a pooler: `Database.url` is what the replicas' pools, the producer
  and the checker's queries use; `Database.direct` is for what needs a server session of its
  own (the migration's session advisory lock, docs/operations.md §3).

The row still goes to the fault report (lost, order, wakes exact, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

import relay
from tests.faults.harness import Lab


@dataclass(frozen=True)
class Database:
    url: str
    direct: str


class SteadyLab(Lab):
    pg: Database  # type: ignore[assignment]  # only `.url` is used: no crash levers here

    def _prepare_database(self) -> None:
        routed = self.pg
        self.pg = Database(routed.direct, routed.direct)
        try:
            super()._prepare_database()
        finally:
            self.pg = routed

    async def _enqueue(
        self, conn: psycopg.AsyncConnection[Any] | None, run_id: str, events: list[relay.Event]
    ) -> psycopg.AsyncConnection[Any]:
        """One producer transaction on one long-lived connection (psycopg's defaults: prepared
        statements on after 5 executions); no retry."""
        self.attempted.update(e.event_id for e in events)
        if conn is None:
            conn = await psycopg.AsyncConnection.connect(
                self.pg.url, autocommit=True, application_name="relay-steady-producer"
            )
        async with conn.transaction():
            await self.enqueue_many(conn, run_id, events)
        self.sent.update(e.event_id for e in events)
        return conn

    async def enqueue_many(
        self, conn: psycopg.AsyncConnection[Any], run_id: str, events: list[relay.Event]
    ) -> None:
        """The producer's call: this checkout's helper."""
        await relay.enqueue_many_async(conn, run_id, events, schema=self.schema)
