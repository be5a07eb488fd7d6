"""The relay loop end to end, in process: real PostgreSQL, real HTTP sink over real sockets."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import anyio
import psycopg
import pytest

import relay
from relay.delivery.lane import Lane
from relay.delivery.post_turn import Permits
from relay.edges.listener import Listener
from relay.edges.store import Store
from relay.runner import Relay
from relay.tools.sink import Sink
from tests.support import (
    Decisions,
    Rig,
    assert_acked_only_if_received,
    bulk_backlog,
    count,
    q,
    relay_logs,
    settings,
    wait_for,
)

pytestmark = [pytest.mark.anyio, pytest.mark.both_loops]  # issue 52: asyncio and uvloop


def enqueue_runs(
    conn: psycopg.Connection[Any],
    schema: str,
    runs: int,
    per_run: int,
    *,
    prefix: str = "r",
    queue: str | None = None,
    terminal: bool = True,
) -> list[str]:
    ids = []
    with conn.transaction():
        for r in range(runs):
            run_id = f"{prefix}{r}"
            ids.append(run_id)
            events = []
            for i in range(per_run):
                wake = None
                if i == 0 and queue:
                    wake = (queue, f"run-created:{schema}:{run_id}")
                events.append(
                    relay.Event(
                        event_id=f"{run_id}-{i}",
                        event_type="run_created" if i == 0 else "step",
                        payload={"i": i, "run": run_id},
                        terminal=terminal and i == per_run - 1,
                        wake_queue=wake[0] if wake else None,
                        wake_event=wake[1] if wake else None,
                    )
                )
            relay.enqueue_many(conn, run_id, events, schema=schema)
    return ids


def engine_events(conn: psycopg.Connection[Any], queue: str) -> list[tuple[str, Any]]:
    return [
        (r[0], r[1])
        for r in conn.execute(
            psycopg.sql.SQL("select event_name, payload from absurd.{} order by 1").format(
                psycopg.sql.Identifier(f"e_{queue}")
            )
        ).fetchall()
    ]


async def test_delivers_every_event_in_order_and_wakes_engine(
    pg_url: str, schema: str, queue: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    s, url = sink
    runs = enqueue_runs(conn, schema, 30, 6, queue=queue)
    async with Relay(settings(pg_url, schema, url)).running() as r:
        await wait_for(lambda: len(s.state.deliveries) == 180, what="180 deliveries")
        await wait_for(lambda: count(conn, schema, "state <> 'delivered'") == 0, what="all acked")
        # The acks' commits are visible before the relay has their answers and counts them.
        await wait_for(
            lambda: sum(lane.stats.delivered for lane in r.lanes.values()) == 180,
            what="all acks counted",
        )
        stats = {name: lane.stats for name, lane in r.lanes.items()}
    assert s.state.order_violations == 0
    # No crash, no lost lease, no lost reply: no duplicate (invariant 5).
    assert s.state.duplicates == 0
    for run_id in runs:
        assert s.state.first_order[run_id] == [1, 2, 3, 4, 5, 6]
    # Wake iff ack: one engine event per run_created, carrying the delivered event's id.
    wakes = engine_events(conn, queue)
    assert [name for name, _ in wakes] == sorted(f"run-created:{schema}:{x}" for x in runs)
    assert all(payload["event_id"] == payload["run_id"] + "-0" for _, payload in wakes)
    assert sum(st.delivered for st in stats.values()) == 180
    # Every run ends idle and unleased.
    rows = conn.execute(q(schema, "select bool_and(idle), count(lease_token) from {s}.runs"))
    assert rows.fetchone() == (True, 0)


async def test_request_matches_ingress_contract(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    s, url = sink
    with conn.transaction():
        relay.enqueue(
            conn,
            "run/../x?%",
            "e1",
            "step",
            {"k": "v"},
            traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            schema=schema,
        )
    async with Relay(settings(pg_url, schema, url, ingress_token="tok")).running():
        await wait_for(lambda: "e1" in s.state.deliveries, what="delivery")
    req = s.state.received[0]
    assert req["run_id"] == "run/../x?%"  # decoded from the URL path by the sink: not traversed
    h = req["headers"]
    assert h["content-type"] == "application/json"
    assert h["user-agent"].startswith("ledger-relay/")
    assert h["relay-lease-epoch"] == str(req["epoch"])
    assert h["authorization"] == "Bearer tok"
    assert h["traceparent"].startswith("00-0af7651916cd43dd8448eb211c80319c-")


@pytest.mark.one_loop  # long: asyncio's own loop only (CI time)
async def test_transient_answers_are_retried_and_nothing_is_dropped(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    s, url = sink
    s.faults.fail(503, times=4)
    s.faults.drop_reply(times=1)
    enqueue_runs(conn, schema, 1, 3, terminal=False)
    async with Relay(settings(pg_url, schema, url)).running() as r:
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 3, what="delivery")
        retries = r.lanes["ordinary"].stats.retries
    assert s.state.first_order["r0"] == [1, 2, 3]
    # failed attempts are the run's (schema version 7), rescheduled and counted by the lane
    assert retries >= 1


async def test_409_counts_as_accepted_and_partial_acceptance_retries_the_rest(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    s, url = sink
    s.faults.accept_only(2, run_id="r0")
    s.faults.fail(409, run_id="r1")
    enqueue_runs(conn, schema, 2, 5, terminal=False)
    async with Relay(settings(pg_url, schema, url)).running():
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 10, what="delivery")
    # r0: only the first two were acked by the first answer; the rest came next, in order.
    r0 = [req["seqs"] for req in s.state.received if req["run_id"] == "r0"]
    assert r0[0] == [1, 2, 3, 4, 5] and r0[1] == [3, 4, 5]
    assert s.state.first_order["r0"] == [1, 2, 3, 4, 5]
    # r1: the 409 was taken as "already have them" — acked without a second POST.
    assert [req["status"] for req in s.state.received if req["run_id"] == "r1"] == [409]


async def test_stale_lease_ack_is_rejected_and_wakes_once(
    pg_url: str, schema: str, queue: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    """A lease that expires during a slow POST: another replica claims the run and redelivers,
    and the zombie's late ack comes while the new owner still holds its live lease, so only the
    lease-token check can fence it (an expiry check alone would let it through). The engine
    wake happens exactly once, from the new owner's ack."""
    s, url = sink
    s.state.reject_stale_epochs = False  # let the zombie's late POST through to its ack
    enqueue_runs(conn, schema, 1, 2, queue=queue, terminal=False)
    s.faults.delay(3.0, run_id="r0")  # the first replica's POST hangs
    # The zombie must not win the run back itself: a long poll, and its lanes stopped below.
    first = Relay(
        settings(pg_url, schema, url, replica_id="first", lease_ttl="30s", poll_interval=120)
    )
    async with first.running():
        # Its POST is on the wire once the sink took the delay. Not `inflight`: a claim is held
        # before its delivery task runs, and a lane stopped in between hands the claim back
        # unsent (no POST, no ack to fence: the wait below timed out on a loaded machine).
        await wait_for(lambda: s.faults.pending() == 0, what="the first replica's POST")
        for lane in first.lanes.values():
            lane.stop()  # it claims nothing more; its in-flight POST and that POST's ack go on
        # The lease runs out under the first replica (as if it had stalled past the TTL).
        conn.execute(
            q(schema, "update {s}.runs set lease_expires_at = clock_timestamp(),"
                      " next_attempt_at = clock_timestamp()")
        )  # fmt: skip
        s.faults.delay(6.0, run_id="r0")  # the new owner's POST outlasts the zombie's
        second = Relay(settings(pg_url, schema, url, replica_id="second", lease_ttl="30s"))
        async with second.running():
            await wait_for(
                lambda: first.lanes["ordinary"].view().stats.stale_acks == 1,
                what="the first replica's ack to be fenced",
            )
            # Fenced while the new owner held a live lease: by its token, not by its expiry.
            run = conn.execute(
                q(schema, "select lease_owner, lease_expires_at > clock_timestamp()"
                          " from {s}.runs where run_id = 'r0'")
            ).fetchone()  # fmt: skip
            assert count(conn, schema, "state = 'delivered'") == 0, "the zombie's ack landed"
            assert engine_events(conn, queue) == [], "the zombie's ack woke the engine"
            assert run == ("second", True), f"the new owner did not hold the lease: {run}"
            await wait_for(
                lambda: count(conn, schema, "state = 'delivered'") == 2, what="redelivery"
            )
    epochs = sorted({req["epoch"] for req in s.state.received if req["run_id"] == "r0"})
    assert len(epochs) == 2  # two leases, two epochs
    wakes = engine_events(conn, queue)
    assert len(wakes) == 1
    row = conn.execute(
        q(schema, "select delivered_at from {s}.events where run_id = 'r0' and seq = 1")
    ).fetchone()
    assert row is not None
    # The one engine event carries the delivery time the new owner's ack wrote.
    assert datetime.fromisoformat(wakes[0][1]["delivered_at"]) == row[0]


async def test_terminal_event_overtakes_a_large_backlog(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    """A terminal event committed while 50,000 ordinary events are pending reaches the ingress
    before that backlog drains."""
    s, url = sink
    backlog = bulk_backlog(conn, schema, 5000, 10)
    assert backlog == 50_000
    s.faults.delay(0.05, times=10_000)  # a slow ingress: the ordinary lane stays saturated
    cfg = settings(pg_url, schema, url, concurrency=4, critical_concurrency=2)
    async with Relay(cfg).running():
        await wait_for(lambda: len(s.state.deliveries) >= 500, what="backlog delivery to start")
        relay.enqueue(
            conn, "urgent", "urgent-end", "run_finished", {}, terminal=True, schema=schema
        )
        await wait_for(lambda: "urgent-end" in s.state.deliveries, what="terminal delivery")
        pending_then = count(conn, schema, "state = 'pending'")
    assert pending_then > 0
    seen_at = s.state.first_seen_at
    before_terminal = [
        e for e, t in seen_at.items() if e.startswith("b") and t <= seen_at["urgent-end"]
    ]
    assert len(before_terminal) < backlog / 2, len(before_terminal)


@asynccontextmanager
async def listening(rig: Rig) -> AsyncIterator[tuple[Relay, Listener]]:
    """A relay whose safety-net poll is 30 s away, and its listener, once LISTEN is up."""
    async with rig.relay(poll_interval="30s").running() as r:
        assert r.listener is not None
        listener = r.listener
        await wait_for(lambda: listener.up, what="LISTEN up")
        yield r, listener


async def test_burst_of_notifications_coalesces(rig: Rig) -> None:
    async with listening(rig) as (r, listener):
        ordinary = r.lanes["ordinary"]
        await wait_for(lambda: ordinary.stats.passes >= 1, what="first pass")
        before_passes, before_received = ordinary.stats.passes, listener.state.received
        rig.conn.execute(
            "select pg_notify('absurd_wake', g::text) from generate_series(1, 10000) g"
        )
        await wait_for(
            lambda: listener.state.received - before_received >= 10_000, what="10k notes"
        )
        await anyio.sleep(0.1)  # let any pass triggered by the tail run
        passes = ordinary.stats.passes - before_passes
    assert 1 <= passes <= 50, passes


async def test_listen_connection_killed_reconnects_and_keeps_delivering(rig: Rig) -> None:
    s, conn, schema = rig.sink, rig.conn, rig.schema
    async with listening(rig) as (_, listener):
        old_pid = listener.state.backend_pid
        # Events committed while the listener is gone are found by the full pass on reconnect
        # (the safety-net poll is 30 s here, so only the reconnect pass can find them in time).
        conn.execute("select pg_terminate_backend(%s)", (old_pid,))
        enqueue_runs(conn, schema, 3, 2, prefix="during", terminal=False)
        await wait_for(
            lambda: listener.up and listener.state.backend_pid not in (None, old_pid),
            what="reconnect",
        )
        await wait_for(lambda: len(s.state.deliveries) == 6, what="delivery after reconnect")
        enqueue_runs(conn, schema, 1, 1, prefix="after")
        await wait_for(lambda: "after0-0" in s.state.deliveries, what="delivery by NOTIFY")


@pytest.mark.one_loop  # long: asyncio's own loop only (CI time)
async def test_delivers_by_polling_while_listen_is_down(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    s, url = sink
    cfg = settings(
        pg_url,
        schema,
        url,
        listen_database_url="postgresql://127.0.0.1:1/none",
        poll_interval="0.1",
    )
    async with Relay(cfg).running() as r:
        assert r.listener is not None
        enqueue_runs(conn, schema, 4, 3)
        await wait_for(lambda: len(s.state.deliveries) == 12, what="delivery by polling")
        assert not r.listener.up


async def test_graceful_stop_releases_in_flight_leases(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    s, url = sink
    s.faults.delay(30.0, times=5)
    enqueue_runs(conn, schema, 2, 2, terminal=False)
    cfg = settings(pg_url, schema, url, shutdown_timeout="0.3", http_timeout="20s", lease_ttl="60s")
    async with Relay(cfg).running() as r:
        await wait_for(lambda: len(r.lanes["ordinary"].inflight) == 2, what="two POSTs in flight")
    # Stopped within shutdown_timeout, nothing acked, every lease handed back at once.
    row = conn.execute(q(schema, "select count(lease_token) from {s}.runs")).fetchone()
    assert row == (0,)
    assert count(conn, schema, "state = 'pending'") == 4


async def test_poison_event_blocks_only_its_run(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    s, url = sink
    enqueue_runs(conn, schema, 3, 3, terminal=False)
    s.faults.fail(422, times=2, run_id="r1", body={"error": "bad payload"})
    async with Relay(settings(pg_url, schema, url)).running():
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 6, what="others")
        await wait_for(lambda: count(conn, schema, "state = 'failed'") == 1, what="poison")
    row = conn.execute(
        q(schema, "select event_id, last_status, last_error from {s}.events where state='failed'")
    ).fetchone()
    assert row is not None and row[0] == "r1-0" and row[1] == 422 and "bad payload" in row[2]
    blocked = conn.execute(
        q(schema, "select run_id, blocked_seq from {s}.runs where blocked_seq is not null")
    )
    assert blocked.fetchall() == [("r1", 1)]
    assert "r1-1" not in s.state.deliveries  # nothing after the failed event


async def test_a_claim_that_waited_too_long_renews_before_its_post(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    """No POST starts unless the trusted lease outlives the whole request: with one POST slot
    and a slow first request, the claims queued behind it renew before they are sent."""
    s, url = sink
    s.faults.delay(1.0, run_id="r0")
    enqueue_runs(conn, schema, 3, 1, terminal=False)
    # Trust window 3 s - 0.6 s margin; a POST needs 2 s of it: a claim queued > 0.4 s renews.
    cfg = settings(pg_url, schema, url, concurrency=1, lease_ttl="3s", http_timeout="2s")
    async with Relay(cfg).running() as r:
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 3, what="delivery")
        lane = r.lanes["ordinary"]
    assert lane.stats.renewed_before_post >= 1
    assert lane.stats.lease_lost == 0 and s.state.duplicates == 0 and lane.stats.posts == 3


async def test_runs_as_a_library_with_an_app_owned_transport(
    pg_url: str, schema: str, conn: psycopg.Connection[Any]
) -> None:
    """DESIGN §1: an application runs the relay in its own task group and hands it its own httpx
    transport (here an in-process ASGI app: no socket at all)."""
    import httpx

    app = Sink()
    enqueue_runs(conn, schema, 2, 2)
    transport = httpx.ASGITransport(app=app)
    cfg = settings(pg_url, schema, "http://ingress.internal")
    async with anyio.create_task_group() as tg:
        r = Relay(cfg, transport=transport)
        await tg.start(r.run)
        await wait_for(lambda: len(app.state.deliveries) == 4, what="delivery via the transport")
        r.stop()
    assert app.state.first_order == {"r0": [1, 2], "r1": [1, 2]}


async def test_runs_as_a_library_with_an_app_owned_httpx_client(
    pg_url: str, schema: str, conn: psycopg.Connection[Any]
) -> None:
    """Issue 40: the application hands the relay its own `httpx.AsyncClient` (its headers, its
    event hooks); both lanes POST through it, and it is still open, the application's, after the
    relay stopped."""
    import httpx

    app = Sink()
    hooked: list[str] = []

    async def on_request(request: httpx.Request) -> None:
        hooked.append(request.url.path)

    enqueue_runs(conn, schema, 2, 2)
    cfg = settings(pg_url, schema, "http://ingress.internal")
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), event_hooks={"request": [on_request]}
    ) as client:
        async with anyio.create_task_group() as tg:
            r = Relay(cfg, client=client)
            await tg.start(r.run)
            await wait_for(lambda: len(app.state.deliveries) == 4, what="delivery via the client")
            r.stop()
        assert not client.is_closed
    assert app.state.first_order == {"r0": [1, 2], "r1": [1, 2]}
    assert len(hooked) >= 2 and all(p.startswith("/runs/") for p in hooked)


@asynccontextmanager
async def posting_slowly(rig: Rig) -> AsyncIterator[Lane]:
    """A relay leasing for 3 s, whose one event (of run r0) takes 2 s to POST: its ordinary
    lane, once that event is claimed."""
    rig.sink.faults.delay(2.0, run_id="r0")
    enqueue_runs(rig.conn, rig.schema, 1, 1, terminal=False)
    async with rig.relay(lease_ttl="3s", http_timeout="2.3s").running() as r:
        lane = r.lanes["ordinary"]
        await wait_for(lambda: bool(lane.inflight), what="claim")
        yield lane


async def test_lease_is_renewed_while_a_post_is_in_flight(rig: Rig) -> None:
    s, conn, schema = rig.sink, rig.conn, rig.schema
    expiry = q(schema, "select lease_expires_at from {s}.runs where run_id = 'r0'")
    async with posting_slowly(rig) as lane:
        first = conn.execute(expiry).fetchone()
        assert first is not None and first[0] is not None
        # Renewed every ttl/3 while the POST hangs: the expiry moves forward before it returns.
        await wait_for(
            lambda: (
                (conn.execute(expiry).fetchone() or (None,))[0] not in (None, first[0])
                and not s.state.deliveries
            ),
            timeout=10,
            what="a renewal during the POST",
        )
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 1, what="ack")
    assert lane.stats.lease_lost == 0


async def test_a_quick_retry_trusts_the_window_a_renewal_moved_during_its_post(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    """The renewer's new trust window is what the delivery reads (issue 27 item 4: the claim is
    a value, its holder keeps the renewed one). A POST that times out after a renewal may retry
    at once; on the claim's first window it could not (too little of it left for a request)."""
    s, url = sink
    s.faults.delay(2.0, times=1, run_id="r0")
    enqueue_runs(conn, schema, 1, 1, terminal=False)
    # Trust window 3 s - 0.6 s margin, renewed after 1 s; the POST times out after 1.5 s. Then
    # the first window has 0.9 s left (no retry), the renewed one about 1.9 s (retry at once).
    cfg = settings(pg_url, schema, url, lease_ttl="3s", http_timeout="1.5s")
    async with Relay(cfg).running() as r:
        lane = r.lanes["ordinary"]
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 1, what="delivery")
    assert lane.view().renewals >= 1
    assert (lane.stats.posts, lane.stats.retries, lane.stats.lease_lost) == (2, 0, 0)


async def test_a_failed_renewal_abandons_the_batch_without_an_ack(rig: Rig) -> None:
    conn, schema = rig.conn, rig.schema
    async with posting_slowly(rig) as lane:
        # Another owner takes the run (as after an expiry): the next renewal fails.
        conn.execute(
            q(schema, "update {s}.runs set lease_token = gen_random_uuid(), lease_owner = 'thief'")
        )
        await wait_for(lambda: lane.stats.lease_lost == 1, what="renewal failure")
        assert lane.stats.acks == 0
        assert count(conn, schema, "state = 'pending'") == 1  # abandoned: nothing acked
        # The thief's lease runs out; the event is delivered by a later claim.
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 1, what="redelivery")


async def test_small_runs_fill_every_post_slot_through_the_batch_endpoint(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    """With `ingress_batch_url`, a claim of small runs shares one POST slot: the lane holds
    enough runs to keep every slot busy (not concurrency + claim_runs runs, which one multi-run
    POST would fill)."""
    s, url = sink
    s.faults.delay(1.0, times=100)
    enqueue_runs(conn, schema, 12, 1, terminal=False)
    cfg = settings(
        pg_url, schema, url, ingress_batch_url=url + "/batch", concurrency=3, claim_runs=4
    )
    async with Relay(cfg).running() as r:
        lane = r.lanes["ordinary"]
        # 12 runs held, in 3 multi-run POSTs at once (every slot taken).
        await wait_for(
            lambda: len(lane.inflight) == 12 and lane.post_turn.slots.value == 0,
            what="3 POSTs at once",
        )
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 12, what="delivery")
    assert lane.stats.posts == 3 and s.state.duplicates == 0


async def test_a_multi_run_post_frees_its_slot_before_its_acks(
    pg_url: str,
    schema: str,
    conn: psycopg.Connection[Any],
    sink: tuple[Sink, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pipelining on the multi-run path too (issue 16): once the ingress has accepted every
    run of a request, its POST slot goes to the next request while the acks commit. With one
    slot and every ack held at the store until the test lets go, the second request still goes
    out; nothing is acked before."""
    s, url = sink
    enqueue_runs(conn, schema, 4, 1, terminal=False)
    cfg = settings(
        pg_url, schema, url, ingress_batch_url=url + "/batch", concurrency=1, claim_runs=2
    )
    held = anyio.Event()
    real_ack = Store.ack

    async def held_ack(store: Store, items: Any) -> Any:
        await held.wait()
        return await real_ack(store, items)

    monkeypatch.setattr(Store, "ack", held_ack)
    async with Relay(cfg).running() as r:
        await wait_for(lambda: len(s.state.first_order) == 4, timeout=20, what="both requests")
        assert count(conn, schema, "state = 'delivered'") == 0
        assert r.lanes["ordinary"].stats.posts == 2
        held.set()
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 4, what="acks")
    assert s.state.duplicates == 0 and s.state.order_violations == 0


async def test_a_multi_run_post_outlives_one_lost_lease_but_not_all(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    """The lane's renewer keeps every lease of a multi-run POST. One run whose lease is lost
    stays in the request (it cannot be unsent) and is not acked; the others are."""
    s, url = sink
    s.faults.delay(2.0)  # the whole multi-run request
    enqueue_runs(conn, schema, 2, 1, terminal=False)
    cfg = settings(
        pg_url, schema, url, ingress_batch_url=url + "/batch", lease_ttl="3s", http_timeout="2.3s"
    )
    async with Relay(cfg).running() as r:
        lane = r.lanes["ordinary"]
        await wait_for(  # a group's runs are posting like single claims (one slot queue)
            lambda: len(lane.post_turn.posting_runs) == 2 and len(lane.inflight) == 2,
            what="the POST",
        )
        conn.execute(
            q(schema, "update {s}.runs set lease_token = gen_random_uuid() where run_id = 'r0'")
        )
        await wait_for(lambda: lane.stats.lease_lost == 1, what="r0's renewal failing")
        await wait_for(lambda: lane.stats.acks == 1, what="r1's ack")
        assert lane.stats.posts == 1
        row = conn.execute(q(schema, "select run_id, state from {s}.events order by run_id"))
        assert row.fetchall() == [("r0", "pending"), ("r1", "delivered")]


async def test_a_multi_run_post_is_cancelled_when_every_lease_is_lost(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    s, url = sink
    s.faults.delay(2.0)
    enqueue_runs(conn, schema, 2, 1, terminal=False)
    cfg = settings(
        pg_url, schema, url, ingress_batch_url=url + "/batch", lease_ttl="3s", http_timeout="2.3s"
    )
    async with Relay(cfg).running() as r:
        lane = r.lanes["ordinary"]
        await wait_for(lambda: len(lane.inflight) == 2, what="claim")
        conn.execute(q(schema, "update {s}.runs set lease_token = gen_random_uuid()"))
        await wait_for(lambda: lane.stats.lease_lost == 2, what="both renewals failing")
        # Cancelled, not answered: the lane let go of both before the sink's answer (it records
        # the runs only after its 2 s delay).
        await wait_for(lambda: not lane.inflight, what="the request cancelled")
        assert not s.state.deliveries
        assert lane.stats.acks == 0 and count(conn, schema, "state = 'pending'") == 2


async def test_small_runs_share_posts_through_the_batch_endpoint(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    """With `ingress_batch_url`, runs of one or two events share requests; each run's answer
    is handled like a single answer (here: one run transient, one poison, the rest accepted)."""
    s, url = sink
    enqueue_runs(conn, schema, 40, 2, terminal=False)
    s.faults.fail(503, run_id="r3")  # only r3's part of a multi-run request
    s.faults.poison("r7-1")
    cfg = settings(pg_url, schema, url, ingress_batch_url=url + "/batch")
    async with Relay(cfg).running() as r:
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 79, what="delivery")
        await wait_for(lambda: count(conn, schema, "state = 'failed'") == 1, what="poison")
        lane = r.lanes["ordinary"]
    assert lane.stats.posts < 40  # fewer requests than runs
    assert s.state.order_violations == 0 and s.state.first_order["r3"] == [1, 2]
    assert s.state.first_order["r7"] == [1]  # r7-1 failed, nothing after it
    failed = conn.execute(q(schema, "select event_id from {s}.events where state = 'failed'"))
    assert failed.fetchall() == [("r7-1",)]
    assert_acked_only_if_received(conn, schema, s.state.deliveries)


async def test_a_refused_multi_run_request_blocks_no_run_until_each_is_sent_alone(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    """A 4xx to a whole `ingress_batch_url` request says nothing about which of its runs is
    poison: each run is sent alone to `ingress_url`, and only its own refusal blocks it. (It
    used to block every run of the request: the one-event runs without ever being sent alone.)"""
    s, url = sink
    enqueue_runs(conn, schema, 12, 1, terminal=False)
    s.faults.fail(422, body={"error": "the whole request is refused"})  # the first request
    s.faults.poison("r5-0")  # the only poison run, refused alone too
    cfg = settings(pg_url, schema, url, ingress_batch_url=url + "/batch")
    async with Relay(cfg).running():
        await wait_for(lambda: count(conn, schema, "state = 'pending'") == 0, what="settled")
    assert s.faults.pending() == 0  # the refusal was answered
    assert count(conn, schema, "state = 'delivered'") == 11
    failed = conn.execute(q(schema, "select event_id, last_status from {s}.events"
                                    " where state = 'failed'"))  # fmt: skip
    assert failed.fetchall() == [("r5-0", 422)]
    assert_acked_only_if_received(conn, schema, s.state.deliveries)


async def test_delivered_events_are_pruned_after_retention(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    """DESIGN §4.4: the relay itself prunes delivered events after `retention`; failed ones stay
    until an operator acts."""
    s, url = sink
    s.faults.poison("r1-0")
    enqueue_runs(conn, schema, 3, 2, terminal=False)
    cfg = settings(pg_url, schema, url, retention="1s")
    async with Relay(cfg, prune_interval=0.2).running():
        await wait_for(lambda: count(conn, schema, "state = 'failed'") == 1, what="poison")
        await wait_for(lambda: count(conn, schema) == 2, what="delivered events pruned")
    left = conn.execute(q(schema, "select event_id, state from {s}.events order by 1"))
    assert left.fetchall() == [("r1-0", "failed"), ("r1-1", "pending")]


async def test_a_terminal_committed_for_a_queued_run_is_handed_to_the_critical_lane(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    """The ordinary lane holds a run (claimed before its terminal event existed) queued behind
    slow requests. When the terminal event commits, the claim is widened with it and handed
    to the critical lane: it does not wait out the ordinary queue (invariant 6). Under the
    fixed limit, where a lane holds a claim's worth of runs beyond its slots; the adaptive
    limit holds one round of POSTs ahead (relay/delivery/holdings.py), tests/test_post_turn.py has
    its promotions."""
    s, url = sink
    for i in range(10):
        s.faults.delay(0.5, run_id=f"b{i}")
    enqueue_runs(conn, schema, 10, 1, prefix="b", terminal=False)
    enqueue_runs(conn, schema, 1, 1, prefix="t", terminal=False)  # t0: one step, no terminal yet
    cfg = settings(pg_url, schema, url, concurrency=1, post_limit="fixed")
    async with Relay(cfg).running() as r:
        ordinary, critical = r.lanes["ordinary"], r.lanes["critical"]
        await wait_for(lambda: len(ordinary.inflight) == 11, what="all runs held by ordinary")
        relay.enqueue(conn, "t0", "t0-end", "run_finished", {}, terminal=True, schema=schema)
        await wait_for(lambda: "t0-end" in s.state.deliveries, what="terminal delivery")
        delivered_b_then = sum(e.startswith("b") for e in s.state.deliveries)
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 12, timeout=90,
                       what="the rest")  # fmt: skip
    assert delivered_b_then < 10  # it did not wait for the ordinary backlog
    assert critical.stats.adopted == 1 and critical.stats.widened == 1
    assert s.state.first_order["t0"] == [1, 2]  # one POST carried the step and the terminal
    assert [len(x["seqs"]) for x in s.state.received if x["run_id"] == "t0"] == [2]


@pytest.mark.one_loop  # long: asyncio's own loop only (CI time)
async def test_the_database_pools_do_not_grow_with_the_post_slots(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    """64 POST slots share the lane's pool of min(concurrency, 8) + 2 connections
    (docs/operations.md, the connection budget), also when they all fail and release their
    leases together, and everything is delivered once the ingress is back. Under the fixed
    limit: the adaptive one would not send 64 POSTs at once to an ingress answering 503."""
    s, url = sink
    enqueue_runs(conn, schema, 150, 1)
    s.faults.set_default(503)  # the ingress is down
    cfg = settings(pg_url, schema, url, concurrency=64, max_backoff="0.5", post_limit="fixed")
    async with Relay(cfg).running() as r:
        assert r.lanes["ordinary"].store.pool.max_size == 10
        assert r.lanes["critical"].store.pool.max_size == 6
        lane = r.lanes["ordinary"]  # its stats are a copy per read
        await wait_for(lambda: lane.stats.retries >= 64, what="64 failed POSTs released")
        s.faults.set_default(None)
        # The retries wait out the retry budget's window of failures first (docs/admission.md
        # §3: a deferral is at least 5 s, served retries cost nothing once the window is healthy).
        await wait_for(
            lambda: count(conn, schema, "state <> 'delivered'") == 0, timeout=120, what="all acked"
        )
    assert s.state.order_violations == 0


async def test_a_failing_limit_never_undoes_an_answered_post(
    pg_url: str,
    schema: str,
    conn: psycopg.Connection[Any],
    sink: tuple[Sink, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The adaptive limit is told of each answer inside the POST's try (issue 42). An exception
    there, a bug of the limit's as the first `limit_fell` line was, is logged
    (`limit_sample_failed`) and the answered POST is acked as usual: no delivery error, no
    duplicate. (That bug made every sharp fall of the limit a duplicate delivery.)"""
    s, url = sink

    def broken(self: Permits, permit: object, sample: object) -> None:
        raise RuntimeError("a planted bug in the limit")

    monkeypatch.setattr(Permits, "answered", broken)
    enqueue_runs(conn, schema, 20, 3)
    with relay_logs(Decisions()) as seen:
        async with Relay(settings(pg_url, schema, url)).running():
            await wait_for(
                lambda: count(conn, schema, "state <> 'delivered'") == 0, what="all acked"
            )
    assert seen.named("limit_sample_failed")
    assert not seen.named("delivery_error")
    assert s.state.duplicates == 0 and s.state.order_violations == 0
