"""Which lane delivered what (DESIGN §4.3, invariant 6), read from the relay's own decision log:
terminal events committed behind a full ordinary lane are claimed and delivered by the critical
lane, the critical lane delivers nothing but them (issue 50: not even a backlog of finished
runs, each ending in its terminal, as an outage leaves behind), and each terminal event reaches
the ingress before more than a small, stated number of backlog events."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import relay
from relay.runner import Relay
from tests.support import Decisions, Rig, relay_logs, wait_for

pytestmark = [pytest.mark.anyio, pytest.mark.both_loops]  # issue 52: asyncio and uvloop

BACKLOG_RUNS = 100
EVENTS_PER_BACKLOG_RUN = 3
CONCURRENCY = 2
TERMINAL_RUNS = 5
# The stated bound: while a terminal event goes from commit to ingress, at most the ordinary
# POSTs already in flight may land first (CONCURRENCY POSTs of one backlog run each), twice over
# for a slot that frees and refills meanwhile.
MAX_BACKLOG_EVENTS_AHEAD = 2 * CONCURRENCY * EVENTS_PER_BACKLOG_RUN


@pytest.fixture
def decisions() -> Iterator[Decisions]:
    with relay_logs(Decisions()) as handler:
        yield handler


def backlog(conn: psycopg.Connection[Any], schema: str, *, finished: bool) -> None:
    """BACKLOG_RUNS runs; with `finished`, each ends in its terminal event."""
    last = EVENTS_PER_BACKLOG_RUN - 1
    with conn.transaction():
        for r in range(BACKLOG_RUNS):
            relay.enqueue_many(
                conn,
                f"b{r}",
                [
                    relay.Event(
                        event_id=f"b{r}-{i}",
                        event_type="step",
                        payload={"i": i},
                        terminal=finished and i == last,
                    )
                    for i in range(EVENTS_PER_BACKLOG_RUN)
                ],
                schema=schema,
            )


@pytest.mark.parametrize("finished", [False, True], ids=["open-runs", "finished-runs"])
async def test_terminal_events_go_critical_and_the_critical_lane_takes_no_ordinary_work(
    rig: Rig, decisions: Decisions, finished: bool
) -> None:
    s, conn, schema = rig.sink, rig.conn, rig.schema
    for r in range(BACKLOG_RUNS):  # every backlog POST is slow: the ordinary lane stays full
        s.faults.delay(0.2, run_id=f"b{r}")
    # Committed before the relay starts, as an outage's backlog is: its terminals, if any, are
    # found by discovery, not targeted.
    backlog(conn, schema, finished=finished)
    # A long safety-net poll: the critical lane finds the terminal runs by their targeted drain
    # (the terminal channel), not by polling for them.
    cfg = rig.settings(concurrency=CONCURRENCY, critical_concurrency=2, poll_interval=10)
    committed_at: dict[str, float] = {}
    async with Relay(cfg).running() as r:
        await wait_for(lambda: len(s.state.deliveries) >= 6, what="backlog delivery to start")
        for t in range(TERMINAL_RUNS):
            run_id = f"t{t}"
            with conn.transaction():
                # Only the terminal channel announces the run: no ordinary wake reaches the
                # lanes, so the critical lane has nothing but its targeted drain to find it by.
                conn.execute("select set_config('relay.notify_ordinary', 'off', true)")
                relay.enqueue(conn, run_id, f"{run_id}-0", "step", {}, schema=schema)
                relay.enqueue(conn, run_id, f"{run_id}-end", "done", {}, terminal=True,
                              schema=schema)  # fmt: skip
            committed_at[run_id] = time.time()  # the clock the sink stamps first_seen_at with
            await wait_for(
                lambda r=run_id: f"{r}-end" in s.state.deliveries,  # type: ignore[misc]
                what=f"terminal event of {run_id}",
            )
        backlog_left = BACKLOG_RUNS * EVENTS_PER_BACKLOG_RUN - sum(
            e.startswith("b") for e in s.state.deliveries
        )
        by_class = {name: lane.stats.by_class for name, lane in r.lanes.items()}
    # What the lanes claimed, by class (issue 50; ledger_relay_claimed_runs_by_class_total).
    assert by_class["critical"] == {"targeted": TERMINAL_RUNS, "finished": 0, "due": 0}
    assert by_class["ordinary"]["targeted"] == 0
    assert (by_class["ordinary"]["finished"] > 0) is finished, by_class
    assert backlog_left > 0, "the backlog drained before the terminal events: nothing was shown"

    delivered = decisions.named("delivered")
    by_run: dict[str, set[str]] = {}
    for d in delivered:
        by_run.setdefault(d["run_id"], set()).add(d["lane"])
    for t in range(TERMINAL_RUNS):
        assert by_run.get(f"t{t}") == {"critical"}, (
            f"t{t}: delivered by {by_run.get(f't{t}')}, not by the critical lane alone"
        )
    taken = [d["run_id"] for d in delivered if d["lane"] == "critical" and d["run_id"][0] != "t"]
    assert not taken, f"the critical lane delivered backlog runs, not targeted terminals: {taken}"
    claimed = {(c["run_id"], c["lane"]) for c in decisions.named("claimed")}
    for t in range(TERMINAL_RUNS):
        assert (f"t{t}", "critical") in claimed, f"t{t} was not claimed by its critical drain"
        assert (f"t{t}", "ordinary") not in claimed, f"t{t} waited in the ordinary lane"

    seen = s.state.first_seen_at
    for run_id, at in committed_at.items():
        arrived = seen[f"{run_id}-end"]
        ahead = [e for e, when in seen.items() if e.startswith("b") and at <= when < arrived]
        assert len(ahead) <= MAX_BACKLOG_EVENTS_AHEAD, (
            f"{run_id}: {len(ahead)} backlog events reached the ingress between its terminal "
            f"commit and its delivery (bound {MAX_BACKLOG_EVENTS_AHEAD})"
        )
