"""The capacity-limited ingress of `relay bench` (issue 42, item 6): its worker pool serves first
come first served, it records what it served, and the figures are computed from the records as
issue 42 defines them. Times are made up (no clock is read), except where the pool runs."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import httpx
import orjson
import pytest

from relay.tools.bench.capacity import (
    DEFERRED,
    Scrape,
    Scrapes,
    _deferred_between,
    _summed,
    _sums,
)
from relay.tools.bench.capacity_ingress import (
    Capacity,
    CapacitySink,
    LimitSample,
    Post,
    Workers,
    figures,
    follows,
    in_flight,
    limit_follows,
    reaches,
    servable,
    settles,
)
from relay.tools.bench.flaky import Arrival, FlakySink, load
from relay.tools.bench.kit import BenchFailed
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


def test_the_summed_limit_follows_a_drop_for_good_and_a_recovery_once_reached() -> None:
    """Down: from the drop to the scrape from which the summed limit stays <= 3x the dropped
    workers (or the floor) until the recovery; up: from the recovery to the first scrape at
    or above the workers before the drop (or the summed ceiling)."""
    changes = [Capacity(0.0, 20, 0.04), Capacity(5.0, 2, 0.04), Capacity(10.0, 20, 0.04)]
    totals = [30, 28, 32, 25, 9, 6, 12, 5, 4, 4, 4, 8, 15, 22, 18, 40]
    at_s = [0, 1, 4, 5.2, 6, 7, 7.5, 8, 9, 9.5, 9.9, 10.2, 10.6, 11.1, 11.5, 14]
    series = [LimitSample(t, n) for t, n in zip(at_s, totals, strict=True)]
    f = limit_follows(series, changes, 5.0, 10.0, 15.0, floor=4, ceiling=72)
    assert (f.down_to, f.up_to) == (6, 20)
    assert f.down_s == pytest.approx(3.0)  # 12 at 7.5 s: for good only from 8 s
    assert f.up_s == pytest.approx(1.1)  # 22 at 11.1 s; the 18 after it is the sawtooth
    assert f.met and f.worst == pytest.approx(3.0)
    # a floor above 3x the workers is the bound; a ceiling below the old workers is the aim
    low = limit_follows(series, changes, 5.0, 10.0, 15.0, floor=12, ceiling=15)
    assert (low.down_to, low.up_to) == (12, 15) and low.down_s == pytest.approx(1.0)
    assert low.up_s == pytest.approx(0.6)
    # one that never fits: None, and not met
    never = limit_follows(series[:10], changes, 5.0, 10.0, 15.0, floor=4, ceiling=72)
    assert never.up_s is None and not never.met and never.worst is None
    assert settles(series, 5.0, 6.5, lambda n: n <= 6) is None  # 12 at 7.5 s is past 6.5
    assert settles(series, 5.0, 7.2, lambda n: n <= 6) == pytest.approx(2.0)
    assert reaches(series, 0.0, 15.0, lambda n: n >= 100) is None


def test_the_replicas_limits_are_summed_where_every_replica_gave_one() -> None:
    text = (
        "# HELP ledger_relay_post_limit POSTs in flight the limit allows now\n"
        "# TYPE ledger_relay_post_limit gauge\n"
        "ledger_relay_post_limit 7.0\n"
        "# HELP ledger_relay_post_limit_ceiling its ceiling\n"
        "# TYPE ledger_relay_post_limit_ceiling gauge\n"
        "ledger_relay_post_limit_ceiling 36.0\n"
        "# HELP ledger_relay_retries_deferred Retries held back\n"
        "# TYPE ledger_relay_retries_deferred counter\n"
        'ledger_relay_retries_deferred_total{lane="critical"} 2.0\n'
        'ledger_relay_retries_deferred_total{lane="normal"} 3.0\n'
        "# HELP ledger_relay_other other\n"
        "# TYPE ledger_relay_other gauge\n"
        "ledger_relay_other 1.0\n"
    )
    names = ("ledger_relay_post_limit", "ledger_relay_post_limit_ceiling")
    assert _sums(text, names) == dict(zip(names, (7.0, 36.0), strict=True))
    # a counter's samples are summed over its labels (the lanes)
    assert _sums(text, (DEFERRED,)) == {DEFERRED: 5.0}
    scrapes = [
        Scrape(1.0, (7.0, 5.0), (36.0, 36.0), 0.0),
        Scrape(1.1, (8.0, None), (36.0, None), None),
    ]
    assert _summed(scrapes) == [LimitSample(1.0, 12.0)]


def test_the_retries_held_back_are_read_from_the_scrapes_around_the_drain() -> None:
    """From the last full scrape up to the recovery to the first from the drain on; a scrape
    missing a replica is no reading, and no reading on either side fails the bench."""
    scrapes = [
        Scrape(0.9, (), (), 4.0),
        Scrape(1.0, (), (), 5.0),  # the last up to the recovery (1.05)
        Scrape(1.1, (), (), 9.0),
        Scrape(3.0, (), (), None),  # a replica not read: no reading
        Scrape(3.1, (), (), 30.0),  # the first from the drain (2.95) on
        Scrape(3.2, (), (), 31.0),
    ]
    assert _deferred_between(scrapes, 1.05, 2.95) == 25
    with pytest.raises(BenchFailed, match="retries_deferred_total"):
        _deferred_between(scrapes, 1.05, 3.25)
    with pytest.raises(BenchFailed, match="retries_deferred_total"):
        _deferred_between(scrapes, 0.5, 2.95)


@pytest.mark.anyio
async def test_a_wait_for_a_scrape_after_a_time_ends_at_the_first_such_scrape() -> None:
    """The outage's count is read once a scrape after the drain is in: the wait ends when one
    is added (not by polling), and not at a scrape taken earlier."""
    scrapes = Scrapes()
    scrapes.add(Scrape(1.0, (), (), 0.0))
    done: list[float] = []

    async def waiter() -> None:
        await scrapes.after(2.0)
        done.append(scrapes.taken[-1].at)

    with anyio.fail_after(30):  # a hang guard: a wait that never ends fails, named
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            scrapes.add(Scrape(2.0, (), (), 1.0))  # at the drain, not after it
            await anyio.wait_all_tasks_blocked()
            assert done == []
            scrapes.add(Scrape(2.1, (), (), 2.0))
    assert done == [2.1]
    await scrapes.after(2.0)  # one is in already: no wait


@pytest.mark.anyio
async def test_the_flaky_ingress_fails_every_other_post_and_counts_first_attempts() -> None:
    """Every other POST (retries included) is answered 503 while failing (the alternate
    pattern), all once recovered; a POST is a first attempt when its first event (run, seq)
    led no earlier POST."""
    sink = FlakySink(seed=None)

    def body(run: str, *seqs: int) -> bytes:
        events = [
            {"event_id": f"{run}-{i}", "seq": i, "type": "step", "payload": {}}
            | {"created_at": "now", "terminal": False}
            for i in seqs
        ]
        return orjson.dumps({"run_id": run, "epoch": 1, "events": events})

    async with serve_sink(sink) as base, httpx.AsyncClient() as client:

        async def send(run: str, *seqs: int) -> int:
            r = await client.post(
                f"{base}/runs/{run}/events",
                content=body(run, *seqs),
                headers={"relay-lease-epoch": "1"},
            )
            return r.status_code

        # a: 200; b: 503, its retry (more events now) 200; c: 503, its retry 200; a's next
        # event: 503; c again (a duplicate, still not a first attempt): 200
        statuses = [
            await send("a", 1),
            await send("b", 1),
            await send("b", 1, 2),
            await send("c", 1),
            await send("c", 1),
            await send("a", 2),
            await send("c", 1),
        ]
        assert statuses == [200, 503, 200, 503, 200, 503, 200]
        sink.failing = False
        assert [await send("a", 2), await send("d", 1)] == [200, 200]
    firsts = [a.first for a in sink.arrivals]
    assert firsts == [True, True, False, True, False, True, False, False, True]
    t0 = sink.arrivals[0].at
    failing = load(sink.arrivals, t0, sink.arrivals[7].at)
    assert (failing.posts, failing.first, failing.failed) == (7, 4, 3)
    assert failing.per_first == pytest.approx(7 / 4)
    assert sink.state.stats()["unique_events"] == 6  # a-1, a-2, b-1, b-2, c-1, d-1
    assert load([Arrival(0.0, 503, False)], 1.0, 2.0).per_first == 0.0


def test_the_random_pattern_fails_half_of_all_posts_from_its_seed() -> None:
    """Each POST fails on its own with probability 1/2, the same ones for the same seed."""

    def pattern(seed: int) -> list[bool]:
        sink = FlakySink(seed)
        return [sink._fails() for _ in range(2000)]

    assert pattern(7) == pattern(7) != pattern(8)
    assert 900 < sum(pattern(7)) < 1100
