"""The capacity-limited ingress of `relay bench` (issue 42, item 6): its worker pool serves first
come first served, it records what it served, and the figures are computed from the records as
issue 42 defines them. Times are made up (no clock is read), except where the pool runs."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import httpx
import orjson
import pytest

from relay.tools.bench.capacity_ingress import (
    Capacity,
    CapacitySink,
    Post,
    Workers,
    figures,
    follows,
    in_flight,
    servable,
)
from relay.tools.sink import serve_sink


def post(arrival: float, start: float, end: float, status: int = 200, *terminals: str) -> Post:
    return Post(arrival, start, end, status, 1, terminals)


def test_in_flight_counts_the_queued_and_those_in_service() -> None:
    posts = [post(0.0, 0.0, 1.0), post(0.5, 1.0, 2.0), post(0.5, 2.0, 3.0)]
    # at 0, 0.5 (three arrived), 1 (one answered), 2, 3 (all answered): answered at t is gone
    assert in_flight(posts, 0.0, 3.0, 0.5) == [1, 3, 2, 2, 1, 1, 0]


def test_what_the_capacity_could_serve_follows_its_changes() -> None:
    changes = [Capacity(0.0, 4, 0.04), Capacity(5.0, 4, 0.4), Capacity(10.0, 4, 0.04)]
    assert servable(changes, 0.0, 5.0) == pytest.approx(500)
    assert servable(changes, 4.0, 11.0) == pytest.approx(100 + 50 + 100)
    assert servable(changes[:1], 2.0, 2.0) == 0


def test_figures_of_a_window() -> None:
    """Goodput counts the 2xx answers that ended in the window against what its capacity could
    serve; queueing is of the POSTs that arrived in it; a terminal's delay runs from its commit
    to the end of the first 2xx POST that carried it, for those committed in the window."""
    changes = [Capacity(0.0, 2, 0.5)]  # 4 POSTs/s
    posts = [
        post(0.0, 0.0, 0.5),
        post(0.0, 0.0, 0.5),
        post(0.1, 0.5, 1.0, 200, "t1-e"),
        post(0.2, 0.5, 1.0, 503),  # not served
        post(0.3, 1.0, 1.5, 200, "t1-e"),  # the terminal again: its first receipt counts
        post(1.2, 1.5, 2.0, 200, "t2-e"),
    ]
    f = figures(posts, changes, 0.0, 2.0, {"t1-e": 0.05, "t2-e": 1.1, "late-e": 2.5})
    assert f.posts == 5 and f.goodput == pytest.approx(5 / 8)
    assert f.queueing_p99 == pytest.approx(0.7) and f.queueing_x == pytest.approx(1.4)
    assert f.terminals == 2 and f.terminal_p99 == pytest.approx(0.95)
    assert f.terminal_x == pytest.approx(1.9)
    # 2, 3, 4 as they arrive, 5 from 0.3 to 0.5 s (a tenth of the window), then fewer
    assert f.in_flight_max == 5 and f.in_flight_p90 == 4 and f.in_flight_x == 2.0
    early = figures(posts, changes, 0.0, 1.0, {"t1-e": 0.05, "t2-e": 1.1})
    assert early.posts == 3 and early.terminals == 1  # the 503 at 1 s is not served
    quiet = figures([], changes, 0.0, 1.0, {})
    assert quiet.terminal_p99 is None and quiet.terminal_x is None and quiet.goodput == 0


def test_in_flight_follows_a_capacity_change_from_when_it_fits_for_good() -> None:
    samples = [10, 10, 3, 2, 9, 2, 1, 1, 1, 1]  # every 0.5 s from t = 0
    fits = lambda n: n <= 3  # noqa: E731
    assert follows(samples, 0.0, 0.5, 0.9, 5.0, fits) == pytest.approx(1.6)  # from 2.5 s
    assert follows(samples, 0.0, 0.5, 0.0, 2.5, fits) is None  # the 9 at 2 s, the last one
    assert follows(samples, 0.0, 0.5, 0.0, 2.0, fits) == 1.0
    assert follows(samples, 0.0, 0.5, 3.0, 5.0, lambda n: n >= 1) == 0


@pytest.mark.anyio
async def test_workers_serve_first_come_first_served() -> None:
    """A freed worker goes to the oldest waiter, a newcomer never passes one, fewer workers take
    effect as POSTs finish and more at once, and a waiter that gives up leaves the queue."""
    pool = Workers(1, 0.04)
    served: list[str] = []
    gates = {name: anyio.Event() for name in "abcde"}

    async def client(name: str) -> None:
        async with pool.slot() as service:
            assert service == pool.now.service
            served.append(name)
            await gates[name].wait()

    async def settle() -> None:
        for _ in range(5):
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        for name in "abc":
            tg.start_soon(client, name)
            await settle()
        assert served == ["a"] and pool.busy == 1
        gates["a"].set()
        await settle()
        tg.start_soon(client, "d")  # arrives after c: waits behind it
        await settle()
        assert served == ["a", "b"]
        pool.set(3, 0.4)  # more workers: c and d at once
        await settle()
        assert served == ["a", "b", "c", "d"] and pool.busy == 3
        pool.set(1, 0.04)  # fewer: none taken away; e waits until only none is busy
        tg.start_soon(client, "e")
        await settle()
        gates["b"].set()
        gates["c"].set()
        await settle()
        assert served == ["a", "b", "c", "d"] and pool.busy == 1
        gates["d"].set()
        await settle()
        assert served[-1] == "e"
        gates["e"].set()
    assert pool.busy == 0
    assert [(c.workers, c.service) for c in pool.changes] == [(1, 0.04), (3, 0.4), (1, 0.04)]

    with anyio.move_on_after(0.05):  # one holds the worker, one gives up waiting
        async with anyio.create_task_group() as tg:
            tg.start_soon(client, "x")
            gates["x"] = anyio.Event()
            tg.start_soon(client, "y")
            gates["y"] = anyio.Event()
            await anyio.sleep_forever()
    assert pool.busy == 0 and not pool._waiting


@pytest.mark.anyio
async def test_the_capacity_sink_records_each_post_and_keeps_the_sinks_checks() -> None:
    sink = CapacitySink(1, 0.001)
    events = [
        {"event_id": f"r-{i}", "seq": i, "type": "step", "payload": {}, "created_at": "now"}
        | {"terminal": i == 3}
        for i in (1, 2, 3)
    ]
    async with serve_sink(sink) as base, httpx.AsyncClient() as client:
        for batch in (events[:2], events[2:], events[:1]):
            body = orjson.dumps({"run_id": "r", "epoch": 1, "events": batch})
            r = await client.post(
                f"{base}/runs/r/events", content=body, headers={"relay-lease-epoch": "1"}
            )
            assert r.status_code == 200, r.text
    assert [(p.events, p.terminals, p.status) for p in sink.posts] == [
        (2, (), 200),
        (1, ("r-3",), 200),
        (1, (), 200),
    ]
    assert all(p.arrival <= p.start < p.end for p in sink.posts)
    stats = sink.state.stats()
    assert (stats["unique_events"], stats["duplicates"], stats["order_violations"]) == (3, 1, 0)
