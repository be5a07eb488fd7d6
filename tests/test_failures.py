"""DESIGN §5's answer table, row by row, against a real HTTP server that gives that answer:
what reached the ingress, the rows' states, and the log line. Plus poison isolation, Retry-After,
and acks that fail or whose outcome is unknown."""

from __future__ import annotations

import io
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import orjson
import psycopg
import pytest

import relay
from relay import logs
from relay.edges.store import AckResult, Store
from relay.runner import Relay
from relay.tools.sink import Sink
from tests.support import LogLines, assert_acked_only_if_received, count, q, settings, wait_for
from tests.test_relay import enqueue_runs

pytestmark = pytest.mark.anyio


def events_of(conn: psycopg.Connection[Any], schema: str, run_id: str) -> list[tuple[Any, ...]]:
    return conn.execute(
        q(schema, "select seq, state, attempts, last_status from {s}.events"
                  " where run_id = %s order by seq"),
        (run_id,),
    ).fetchall()  # fmt: skip


@pytest.mark.parametrize("status", [200, 201, 204])
async def test_2xx_acks_the_batch(
    status: int, pg_url: str, schema: str, conn: psycopg.Connection[Any],
    sink: tuple[Sink, str], log_lines: LogLines,
) -> None:  # fmt: skip
    s, url = sink
    s.faults.fail(status, body=b"")
    enqueue_runs(conn, schema, 1, 3, terminal=False)
    async with Relay(settings(pg_url, schema, url)).running():
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 3, what="ack")
    assert [r["seqs"] for r in s.state.received] == [[1, 2, 3]]  # one POST, nothing resent
    line = next(x for x in log_lines() if x["event"] == "delivered")
    assert line["status"] == status and line["first_seq"] == 1 and line["last_seq"] == 3
    assert line["run_id"] == "r0" and line["lane"] == "ordinary" and "epoch" in line


async def test_409_acks_as_duplicates(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str],
    log_lines: LogLines,
) -> None:  # fmt: skip
    s, url = sink
    s.faults.fail(409)
    enqueue_runs(conn, schema, 1, 2, terminal=False)
    async with Relay(settings(pg_url, schema, url)).running():
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 2, what="ack")
    assert [r["status"] for r in s.state.received] == [409]
    assert any(x["event"] == "delivered" and x["status"] == 409 for x in log_lines())


async def test_accepted_k_acks_only_the_first_k(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str],
) -> None:  # fmt: skip
    s, url = sink
    s.faults.accept_only(3)
    enqueue_runs(conn, schema, 1, 5, terminal=False)
    async with Relay(settings(pg_url, schema, url)).running():
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 5, what="ack")
    assert [r["seqs"] for r in s.state.received] == [[1, 2, 3, 4, 5], [4, 5]]
    assert s.state.first_order["r0"] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("status", [408, 425, 429, 500, 502, 503, 504])
async def test_transient_status_is_retried_then_rescheduled(
    status: int, pg_url: str, schema: str, conn: psycopg.Connection[Any],
    sink: tuple[Sink, str], log_lines: LogLines,
) -> None:  # fmt: skip
    s, url = sink
    s.faults.fail(status, times=3)  # outlasts the quick retries: rescheduled through the DB
    enqueue_runs(conn, schema, 1, 2, terminal=False)
    async with Relay(settings(pg_url, schema, url, max_backoff="0.3s")).running():
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 2, what="delivery")
    assert [r["status"] for r in s.state.received] == [status, status, status, 200]
    assert_acked_only_if_received(conn, schema, s.state.deliveries)
    # Transient failures are the run's (schema version 7): counted on the run while it backs
    # off, reset by the ack; an event keeps attempts only when it fails for good.
    assert events_of(conn, schema, "r0") == [
        (1, "delivered", 0, None),
        (2, "delivered", 0, None),
    ]
    line = next(x for x in log_lines() if x["event"] == "retry_scheduled")
    assert line["status"] == status and line["level"] == "warning" and line["run_id"] == "r0"


async def test_timeout_is_transient(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str],
    log_lines: LogLines,
) -> None:  # fmt: skip
    s, url = sink
    s.faults.delay(2.0, times=3)
    enqueue_runs(conn, schema, 1, 1, terminal=False)
    cfg = settings(pg_url, schema, url, http_timeout="0.2s", lease_ttl="5s", max_backoff="0.3s")
    async with Relay(cfg).running():
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 1, what="delivery")
    line = next(x for x in log_lines() if x["event"] == "retry_scheduled")
    assert "timed out" in line["error"] and line["status"] is None


def failed_tries(lines: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [
        (x["run_id"], x["attempt"], x["try_number"], x["status"], x["next"])
        for x in lines
        if x["event"] == "post_failed"
    ]


async def test_every_failed_try_logs_its_cause_and_what_comes_next(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str],
    log_lines: LogLines,
) -> None:  # fmt: skip
    """Issue 41: each failed try, the quick retries within an attempt included, is one
    `post_failed` line with its cause and what comes next (before, only the attempt's last
    try reached the log, as `retry_scheduled`)."""
    s, url = sink
    s.faults.fail(503, body=b"upstream down", times=4)  # one attempt's 3 tries, then 1 more
    enqueue_runs(conn, schema, 1, 1, terminal=False)
    async with Relay(settings(pg_url, schema, url, max_backoff="0.3s")).running():
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 1, what="delivery")
    tries = failed_tries(log_lines())
    assert tries[:3] == [
        ("r0", 1, 1, 503, "quick_retry"),
        ("r0", 1, 2, 503, "quick_retry"),
        ("r0", 1, 3, 503, "reschedule"),
    ]
    # Attempt 2's first try fails too. Whether a quick try follows it is the retry budget's
    # answer then: attempt 1's two quick tries spent its reserve of two tokens, which come back
    # slice by slice, and attempt 2 goes once one is back (with a random share of a slice), so
    # the second may or may not be back too. The line says which, and it is what came next.
    assert [t[:4] for t in tries[3:]] == [("r0", 2, 1, 503)]
    quick = tries[3][4] == "quick_retry"
    rescheduled = [x["attempt"] for x in log_lines() if x["event"] == "retry_scheduled"]
    assert rescheduled == ([1] if quick else [1, 2]), (tries, rescheduled)
    lines = [x for x in log_lines() if x["event"] == "post_failed"]
    assert all(x["error"] == "upstream down" for x in lines)
    # A warning when a quick try follows; the attempt's last try at info: its retry_scheduled
    # warns of the same failure (one warning per failed POST, issue 49 item 3).
    last = "warning" if quick else "info"
    assert [x["level"] for x in lines] == ["warning", "warning", "info", last]
    assert [x["retry_in"] is not None for x in lines] == [True, True, False, quick]


async def test_a_hung_ingress_logs_each_try_as_it_times_out(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str],
    log_lines: LogLines,
) -> None:  # fmt: skip
    """A hung ingress: the first try's timeout is logged while the second try hangs, not
    after the attempt's three tries."""
    s, url = sink
    s.faults.delay(30.0, times=3)
    enqueue_runs(conn, schema, 1, 1, terminal=False)
    cfg = settings(pg_url, schema, url, http_timeout="1s", lease_ttl="20s")
    async with Relay(cfg).running():
        await wait_for(lambda: bool(failed_tries(log_lines())), what="the first try's line")
        # Logged while the attempt goes on: its reschedule has not come yet.
        assert not [x for x in log_lines() if x["event"] == "retry_scheduled"]
    first = next(x for x in log_lines() if x["event"] == "post_failed")
    assert (first["try_number"], first["status"], first["next"]) == (1, None, "quick_retry")
    assert first["error"] == "timed out after 1s"


async def test_connection_refused_is_transient_and_nothing_is_dropped(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], log_lines: LogLines,
) -> None:  # fmt: skip
    enqueue_runs(conn, schema, 1, 2, terminal=False)
    cfg = settings(pg_url, schema, "http://127.0.0.1:9", max_backoff="0.2s")
    async with Relay(cfg).running():
        await wait_for(
            lambda: sum(x["event"] == "retry_scheduled" for x in log_lines()) >= 2,
            what="two rescheduled attempts",
        )
    assert [r[1] for r in events_of(conn, schema, "r0")] == ["pending", "pending"]
    run = conn.execute(
        q(schema, "select attempts, last_error from {s}.runs where run_id = 'r0'")
    ).fetchone()
    assert run is not None and run[0] >= 2, run  # the failed attempts, counted on the run
    assert "refused" in (run[1] or "").lower() or "connect" in (run[1] or "").lower(), run


async def test_lost_reply_is_redelivered_and_deduped_by_the_ingress(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str],
) -> None:  # fmt: skip
    s, url = sink
    s.faults.drop_reply(times=3)
    enqueue_runs(conn, schema, 1, 2, terminal=False)
    async with Relay(settings(pg_url, schema, url, max_backoff="0.3s")).running():
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 2, what="delivery")
    assert s.state.deliveries == {"r0-0": 4, "r0-1": 4}  # processed 4x, replies lost 3x
    assert s.state.duplicates == 6 and s.state.first_order["r0"] == [1, 2]
    assert_acked_only_if_received(conn, schema, s.state.deliveries)


@pytest.mark.parametrize("status", [401, 403, 404, 405, 410, 301, 302, 307, 308])
async def test_misconfigured_endpoint_pauses_the_lane_and_recovers(
    status: int, pg_url: str, schema: str, conn: psycopg.Connection[Any],
    sink: tuple[Sink, str], log_lines: LogLines,
) -> None:  # fmt: skip
    s, url = sink
    s.faults.set_default(status)
    enqueue_runs(conn, schema, 3, 2, terminal=False)
    with_userinfo = url.replace("http://", "http://admin:hunter2@")
    async with Relay(settings(pg_url, schema, with_userinfo)).running() as r:
        await wait_for(lambda: not r.health.ingress_ok, what="not ready")
        # Nothing failed and no attempt was charged to the events: the endpoint is at fault.
        assert count(conn, schema, "state <> 'pending'") == 0
        assert count(conn, schema, "attempts > 0") == 0
        requests_then = len(s.state.received)
        s.faults.set_default(None)
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 6, what="recovery")
        assert r.health.ingress_ok
    # The lane backed off as a whole: each run was tried once (those requests were in flight
    # together); none was retried while the lane was paused.
    assert requests_then <= 3
    assert sum(x["event"] == "ingress_misconfigured" for x in log_lines()) <= 3
    line = next(x for x in log_lines() if x["event"] == "ingress_misconfigured")
    assert line["level"] == "error" and line["status"] == status
    assert "hunter2" not in line["url"] and "admin" not in line["url"]
    assert any(x["event"] == "ingress_recovered" for x in log_lines())


@pytest.mark.parametrize("status", [400, 413, 422])
async def test_poison_fails_the_event_and_blocks_only_its_run(
    status: int, pg_url: str, schema: str, conn: psycopg.Connection[Any],
    sink: tuple[Sink, str], log_lines: LogLines,
) -> None:  # fmt: skip
    s, url = sink
    s.faults.poison("r1-1", status)
    enqueue_runs(conn, schema, 3, 3, terminal=False)
    async with Relay(settings(pg_url, schema, url)).running():
        await wait_for(lambda: count(conn, schema, "state = 'failed'") == 1, what="poison")
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 7, what="others")
    assert [r[:2] for r in events_of(conn, schema, "r1")] == [
        (1, "delivered"), (2, "failed"), (3, "pending"),
    ]  # fmt: skip
    row = conn.execute(
        q(schema, "select last_status, last_error, failed_at is not null from {s}.events"
                  " where state = 'failed'")
    ).fetchone()  # fmt: skip
    assert row is not None and row[0] == status and f"({status})" in row[1] and row[2]
    assert "r1-2" not in s.state.deliveries
    assert_acked_only_if_received(conn, schema, s.state.deliveries)
    blocked = conn.execute(
        q(schema, "select run_id, blocked_seq from {s}.runs where blocked_seq is not null")
    )
    assert blocked.fetchall() == [("r1", 2)]
    line = next(x for x in log_lines() if x["event"] == "run_blocked")
    assert line["level"] == "error" and line["run_id"] == "r1" and line["status"] == status


@pytest.mark.parametrize("named", [False, True])
async def test_poison_in_the_middle_of_a_100_event_batch(
    named: bool, pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str],
) -> None:  # fmt: skip
    s, url = sink
    enqueue_runs(conn, schema, 1, 100, terminal=False)
    s.faults.poison("r0-49", 422, name=named)  # the 50th event
    async with Relay(settings(pg_url, schema, url)).running():
        await wait_for(lambda: count(conn, schema, "state = 'failed'") == 1, what="poison")
    states = [r[1] for r in events_of(conn, schema, "r0")]
    assert states[:49] == ["delivered"] * 49  # the 49 before it delivered and acked
    assert states[49] == "failed"
    assert states[50:] == ["pending"] * 50  # the 50 after it held
    assert s.state.first_order["r0"] == list(range(1, 50))
    assert_acked_only_if_received(conn, schema, s.state.deliveries)
    if named:  # the ingress named the event: no one-at-a-time narrowing was needed
        assert [len(r["seqs"]) for r in s.state.received] == [100, 49]


async def test_a_blocked_run_does_not_hold_up_other_runs(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str],
) -> None:  # fmt: skip
    s, url = sink
    s.faults.poison("r0-0")
    enqueue_runs(conn, schema, 40, 3, terminal=False)
    async with Relay(settings(pg_url, schema, url, concurrency=2)).running():
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 117, what="others")
        blocked_requests = sum(r["run_id"] == "r0" for r in s.state.received)
        # More discovery passes happen; the blocked run is never claimed again.
        enqueue_runs(conn, schema, 5, 1, prefix="late", terminal=False)
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 122, what="late")
    # Its batch, then the narrowing request for its head: and never again once blocked.
    assert sum(r["run_id"] == "r0" for r in s.state.received) == blocked_requests == 2


@pytest.mark.parametrize("form", ["seconds", "http-date"])
async def test_retry_after_is_honoured(
    form: str, pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str],
) -> None:  # fmt: skip
    s, url = sink
    later = (datetime.now(UTC) + timedelta(seconds=3)).replace(microsecond=0)
    value = "2" if form == "seconds" else format_datetime(later, usegmt=True)
    s.faults.fail(429, retry_after=value)
    enqueue_runs(conn, schema, 1, 1, terminal=False)
    async with Relay(settings(pg_url, schema, url)).running():
        # the failed attempt is the run's (schema version 7)
        await wait_for(
            lambda: conn.execute(q(schema, "select attempts from {s}.runs")).fetchone() == (1,),
            what="first failure",
        )
        # Scheduled by the database no sooner than the ingress asked (no quick retry either).
        row = conn.execute(
            q(schema, "select extract(epoch from next_attempt_at - updated_at), next_attempt_at"
                      " from {s}.runs")
        ).fetchone()  # fmt: skip
        assert row is not None
        if form == "seconds":
            assert float(row[0]) >= 1.99
        else:  # the date itself (the test's and the database's clocks are the same machine's)
            assert row[1] >= later - timedelta(milliseconds=50)
        assert len(s.state.received) == 1
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 1, what="delivery")
    first, second = s.state.received
    assert first["status"] == 429 and second["status"] == 200


async def test_engine_rejecting_a_wake_fails_the_event_instead_of_looping(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str],
    log_lines: LogLines,
) -> None:  # fmt: skip
    _, url = sink
    conn.execute("select absurd.create_queue('doomed_q')")
    with conn.transaction():
        relay.enqueue(conn, "w", "w-0", "step", {}, schema=schema)
        relay.enqueue(
            conn, "w", "w-1", "run_created", {}, wake=("doomed_q", "run-created:w"), schema=schema
        )
        relay.enqueue(conn, "w", "w-2", "step", {}, schema=schema)
    conn.execute("select absurd.drop_queue('doomed_q')")  # the engine will refuse the wake
    async with Relay(settings(pg_url, schema, url)).running():
        await wait_for(lambda: count(conn, schema, "state = 'failed'") == 1, what="failed")
    assert [r[1] for r in events_of(conn, schema, "w")] == ["delivered", "failed", "pending"]
    err = conn.execute(
        q(schema, "select last_error from {s}.events where state = 'failed'")
    ).fetchone()
    assert err is not None and "engine wake failed" in err[0]
    line = next(x for x in log_lines() if x["event"] == "run_blocked")
    assert line["reason"] == "ack_failed"


class _LossyStore(Store):
    """A real store whose ack loses its connection either just before or just after COMMIT."""

    mode = "after_commit"

    async def ack(self, items: Any) -> list[AckResult]:
        if self.mode == "before_commit":
            self.mode = "done"
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        result = await super().ack(items)
        if self.mode == "after_commit":
            self.mode = "done"
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return result


@pytest.mark.parametrize("mode", ["after_commit", "before_commit"])
async def test_ack_with_unknown_outcome_is_resolved_by_rereading(
    mode: str, pg_url: str, schema: str, conn: psycopg.Connection[Any],
    sink: tuple[Sink, str], log_lines: LogLines, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    s, url = sink
    _LossyStore.mode = mode
    monkeypatch.setattr("relay.pools.Store", _LossyStore)
    enqueue_runs(conn, schema, 1, 2, terminal=False)
    async with Relay(settings(pg_url, schema, url)).running():
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 2, what="delivery")
        await wait_for(lambda: any(x["event"] == "ack_outcome_resolved" for x in log_lines()),
                       what="resolution")  # fmt: skip
    resolved = next(x for x in log_lines() if x["event"] == "ack_outcome_resolved")
    if mode == "after_commit":
        assert resolved["outcome"] == "acked"
        assert s.state.deliveries == {"r0-0": 1, "r0-1": 1}  # not redelivered: it had committed
    else:
        # It had not committed: sent again while the lease is ours, not redelivered (the
        # ingress has the events; a redelivery would be a duplicate, DESIGN §9.5).
        assert resolved["outcome"] == "not_committed"
        again = next(x for x in log_lines() if x["event"] == "ack_sent_again")
        assert again["outcome"] == "acked" and again["upto"] == resolved["upto"]
        assert s.state.deliveries == {"r0-0": 1, "r0-1": 1}


@pytest.mark.parametrize("fmt", ["json", "text"])
async def test_every_decision_logs_its_fields(
    fmt: str, pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    """DESIGN §8.2: claimed and delivered lines carry run id, seq range, lane, epoch, attempt,
    lease owner, status, durations and lag; `--log-format text` renders the same as key=value."""
    _, url = sink
    stream = io.StringIO()
    logs.configure(fmt, "debug", stream)
    try:
        enqueue_runs(conn, schema, 1, 2)
        async with Relay(settings(pg_url, schema, url, replica_id="replica-x")).running():
            await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 2, what="ack")
    finally:
        logs.configure("json", "warning")
    text = stream.getvalue()
    fields = ("run_id", "lane", "epoch", "attempt", "lease_owner", "first_seq", "last_seq")
    if fmt == "json":
        lines = [orjson.loads(line) for line in text.splitlines()]
        claimed = next(x for x in lines if x["event"] == "claimed")
        delivered = next(x for x in lines if x["event"] == "delivered")
        for key in fields:
            assert key in claimed and key in delivered, key
        assert delivered["lease_owner"] == "replica-x" and delivered["status"] == 200
        assert {"http_ms", "lag_ms"} <= set(delivered)
    else:
        line = next(x for x in text.splitlines() if " delivered " in x)
        for key in (*fields, "http_ms", "lag_ms"):
            assert f" {key}=" in line, key
        assert "lease_owner=replica-x" in line


async def test_a_fenced_reschedule_is_a_lost_lease(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str],
    log_lines: LogLines,
) -> None:  # fmt: skip
    """The request timed out after the run was taken over (a process frozen past its lease,
    say): the reschedule changes nothing, and says the lease was lost."""
    s, url = sink
    s.faults.delay(1.0, times=3)  # every quick retry times out
    enqueue_runs(conn, schema, 1, 1, terminal=False)
    # A long lease, so no renewal (every ttl/3 = 10 s) notices the theft first.
    cfg = settings(pg_url, schema, url, lease_ttl="30s", http_timeout="0.3s")
    async with Relay(cfg).running() as r:
        lane = r.lanes["ordinary"]
        await wait_for(lambda: bool(lane.post_turn.posting_runs), what="the first POST")
        conn.execute(q(schema, "update {s}.runs set lease_token = gen_random_uuid()"))
        await wait_for(lambda: lane.stats.lease_lost == 1, what="the fenced reschedule")
    lost = [x for x in log_lines() if x["event"] == "lease_lost"]
    assert [x["where"] for x in lost] == ["release_fenced"] and lost[0]["run_id"] == "r0"
    retry = next(x for x in log_lines() if x["event"] == "retry_scheduled")
    assert retry["fenced"] is True and "timed out" in retry["error"]
    assert lane.stats.acks == 0 and count(conn, schema, "state = 'pending'") == 1
    # Untouched: the thief's lease stands, no attempt was counted against the run.
    row = conn.execute(q(schema, "select attempts, lease_token is not null from {s}.runs"))
    assert row.fetchone() == (0, True)
