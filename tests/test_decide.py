"""The DESIGN §5 answer table, one test per row: `relay.core.policy.decide` turns one ingress answer
(or the failure to get one) into the one value the delivery carries out. Pure: no database, no
network, the clock and the jitter passed in. Plus the pure helpers beside it: which runs share
a POST (`plan_groups`) and which event a rejection names (`rejected_event_id`).

tests/test_failures.py drives every row through a real relay and HTTP server; the last test here
does so for the row this table changed (a 2xx whose body is not JSON used to be acked)."""

from __future__ import annotations

import email.utils
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from relay.core.policy import (
    BACKOFF_BASE,
    BODY_EXCERPT,
    SMALL_RUN_EVENTS,
    Ack,
    Decision,
    Pause,
    Poison,
    Retry,
    backoff,
    decide,
    plan_groups,
    rejected_event_id,
)
from relay.edges.ingress import Answer, TransportFailure
from relay.runner import Relay
from relay.tools.sink import Sink
from tests.support import assert_acked_only_if_received, count, q, settings, wait_for
from tests.test_relay import enqueue_runs

NOW = datetime(2024, 5, 17, 12, 0, 0, tzinfo=UTC)
CAP = 60.0
RAND = 0.5
N = 5  # events in the batch


def answer(status: int, body: bytes = b"", retry_after: str | None = None) -> Answer:
    return Answer(status, body, retry_after, 0.01)


def d(got: Answer | BaseException, n: int = N, *, attempt: int = 0, rand: float = RAND) -> Decision:
    return decide(got, n, attempt=attempt, now=NOW, rand=rand, cap=CAP)


def jitter(attempt: int = 0, rand: float = RAND) -> float:
    return backoff(attempt, base=BACKOFF_BASE, cap=CAP, rand=rand)


# --- 2xx ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [200, 201, 202, 204, 299])
def test_2xx_with_an_empty_body_acks_every_event(status: int) -> None:
    assert d(answer(status)) == Ack(N)
    assert d(answer(status, b" \r\n")) == Ack(N)  # whitespace only: empty too


@pytest.mark.parametrize("body", [b"{}", b'{"ok": true}', b"[1]", b"null", b'"fine"'])
def test_2xx_with_json_without_accepted_acks_every_event(body: bytes) -> None:
    assert d(answer(200, body)) == Ack(N)


@pytest.mark.parametrize("k", [1, 2, 4, 5])
def test_2xx_accepted_k_acks_the_first_k(k: int) -> None:
    assert d(answer(200, f'{{"accepted": {k}}}'.encode())) == Ack(k)


def test_2xx_accepted_0_acks_nothing_and_reschedules_the_batch() -> None:
    got = d(answer(200, b'{"accepted": 0}', retry_after="5"), attempt=2)
    # A 2xx all the same: no quick retry, and the Retry-After of a 2xx does not count.
    assert got == Retry(
        jitter(2), 200, "ingress accepted 0 events", None, quick=False, endpoint_ok=True
    )
    assert d(answer(200, b'{"accepted": -3}')) == Retry(
        jitter(0), 200, "ingress accepted 0 events", None, quick=False, endpoint_ok=True
    )


def test_2xx_accepted_more_than_the_batch_acks_the_batch() -> None:
    assert d(answer(200, b'{"accepted": 6}')) == Ack(N)
    assert d(answer(200, b'{"accepted": 100000000000000000000000}')) == Ack(N)


@pytest.mark.parametrize("flag", [b"true", b"false"])
def test_2xx_accepted_bool_is_not_a_count_and_acks_every_event(flag: bytes) -> None:
    assert d(answer(200, b'{"accepted": ' + flag + b"}")) == Ack(N)


@pytest.mark.parametrize(
    "body", [b"OK", b"<html>accepted</html>", b"\xff\xfe", b'{"accepted": 2', b"{" * 70_000]
)
def test_2xx_with_a_body_that_is_not_json_is_transient(body: bytes) -> None:
    """Garbled, or cut at the read limit: nobody can say what the ingress took. Acked never;
    rescheduled with backoff (not quick-retried: the ingress did answer)."""
    got = d(answer(200, body), attempt=1)
    assert isinstance(got, Retry)
    assert (got.status, got.delay, got.retry_after) == (200, jitter(1), None)
    assert not got.quick and got.endpoint_ok
    assert got.error.startswith("answer body is not JSON: ")
    assert len(got.error) <= len("answer body is not JSON: ") + BODY_EXCERPT


# --- 409 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [b"", b'{"accepted": 1}', b'{"accepted": 0}', b"duplicate"])
def test_409_duplicates_ack_every_event_whatever_the_body(body: bytes) -> None:
    assert d(answer(409, body)) == Ack(N)


# --- transient ----------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [408, 425, 429, 500, 502, 503, 504])
def test_transient_status_reschedules_with_backoff_and_allows_quick_retries(status: int) -> None:
    got = d(answer(status, b'{"error": "busy"}'), attempt=3, rand=0.25)
    assert got == Retry(jitter(3, 0.25), status, '{"error": "busy"}', None, quick=True)


def test_other_5xx_and_nonsense_statuses_are_transient_too() -> None:
    for status in (501, 599, 100, 0, 999):
        got = d(answer(status))
        assert isinstance(got, Retry) and got.status == status and got.quick


def test_the_backoff_grows_with_attempts_and_is_capped() -> None:
    delays = [d(answer(503), attempt=a, rand=1 - 2**-53) for a in range(12)]
    ceilings = [r.delay for r in delays if isinstance(r, Retry)]
    assert ceilings == sorted(ceilings) and ceilings[-1] == pytest.approx(CAP)
    assert d(answer(503), attempt=40, rand=0.0) == Retry(0.0, 503, "", None, quick=True)


@pytest.mark.parametrize(
    "failure",
    [
        TransportFailure("timed out after 10s"),
        TransportFailure("ConnectError: [Errno 111] Connection refused"),
        TransportFailure("the multi-run reply had no result for this run"),
    ],
)
def test_timeout_or_connection_error_is_transient(failure: TransportFailure) -> None:
    got = d(failure, attempt=1)
    assert got == Retry(jitter(1), None, str(failure), None, quick=True)


@pytest.mark.parametrize(("value", "seconds"), [("0", 0.0), ("7", 7.0), (" 30 ", 30.0)])
def test_retry_after_seconds_sets_the_delay(value: str, seconds: float) -> None:
    got = d(answer(429, retry_after=value), attempt=5)
    # The ingress said when: exactly then, and no quick retry sooner.
    assert got == Retry(seconds, 429, "", seconds, quick=False)


def test_retry_after_http_date_sets_the_delay_from_now() -> None:
    when = email.utils.format_datetime(NOW + timedelta(seconds=42), usegmt=True)
    assert d(answer(503, retry_after=when)) == Retry(42.0, 503, "", 42.0, quick=False)
    past = email.utils.format_datetime(NOW - timedelta(hours=1), usegmt=True)
    assert d(answer(503, retry_after=past)) == Retry(0.0, 503, "", 0.0, quick=False)


def test_retry_after_is_clamped_to_the_cap() -> None:
    assert d(answer(503, retry_after="86400")) == Retry(CAP, 503, "", CAP, quick=False)
    far = email.utils.format_datetime(NOW + timedelta(days=9), usegmt=True)
    assert d(answer(503, retry_after=far)) == Retry(CAP, 503, "", CAP, quick=False)


def test_unparseable_retry_after_falls_back_to_backoff_without_quick_retries() -> None:
    assert d(answer(503, retry_after="soon")) == Retry(jitter(), 503, "", None, quick=False)


# --- misconfigured ------------------------------------------------------------------------------


# 407: a proxy's, wanting credentials: the operator's to fix, like 401 (issue 48 item 5).
@pytest.mark.parametrize("status", [401, 403, 404, 405, 407, 410, 300, 301, 302, 307, 308])
def test_misconfigured_endpoint_pauses_the_lane(status: int) -> None:
    assert d(answer(status, b"wrong place")) == Pause(status, "wrong place")
    # whatever the body names, the events are not at fault
    assert d(answer(status, b'{"rejected_event_id": "e1"}')) == Pause(
        status, '{"rejected_event_id": "e1"}'
    )


# --- poison -------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [400, 413, 422, 402, 415, 451, 499])
def test_other_4xx_is_poison(status: int) -> None:
    assert d(answer(status, b'{"error": "bad payload"}')) == Poison(
        status, '{"error": "bad payload"}', None
    )


def test_poison_that_names_the_rejected_event() -> None:
    body = b'{"error": "bad", "rejected_event_id": "r1-3"}'
    assert d(answer(422, body)) == Poison(422, body.decode(), "r1-3")


def test_body_excerpts_are_bounded_and_never_raise() -> None:
    got = d(answer(400, b"\xff" + b"x" * (BODY_EXCERPT * 4)))
    assert isinstance(got, Poison) and len(got.excerpt) == BODY_EXCERPT
    assert got.excerpt.startswith("\ufffd")


# --- rejected_event_id --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (b'{"rejected_event_id": "e-7"}', "e-7"),
        (b'{"rejected_event_id": ""}', ""),
        (b'{"error": "x", "rejected_event_id": "a/b"}', "a/b"),
        (b"", None),
        (b"not json", None),
        (b'{"rejected_event_id": 7}', None),
        (b'{"rejected_event_id": null}', None),
        (b'{"rejected_event_id": ["e"]}', None),
        (b'["rejected_event_id", "e"]', None),
        (b'"e"', None),
        (b"{}", None),
    ],
)
def test_rejected_event_id(body: bytes, named: str | None) -> None:
    assert rejected_event_id(body) == named


# --- plan_groups --------------------------------------------------------------------------------


@dataclass
class Run:
    name: str
    events: list[int] = field(default_factory=list)


def runs(*sizes: int) -> list[Run]:
    return [Run(f"r{i}", list(range(n))) for i, n in enumerate(sizes)]


def names(groups: list[list[Run]]) -> list[list[str]]:
    return [[r.name for r in g] for g in groups]


def test_plan_groups_without_a_batch_endpoint_is_one_post_per_run() -> None:
    claims = runs(1, 1, 50, 2)
    assert names(plan_groups(claims, share=False, batch_size=100)) == [
        ["r0"],
        ["r1"],
        ["r2"],
        ["r3"],
    ]


def test_plan_groups_small_runs_share_posts_up_to_the_batch_size() -> None:
    claims = runs(2, 2, 2, 2, 2)
    assert names(plan_groups(claims, share=True, batch_size=6)) == [
        ["r0", "r1", "r2"],
        ["r3", "r4"],
    ]


def test_plan_groups_a_group_may_fill_the_batch_exactly() -> None:
    claims = runs(3, 3, 1)
    assert names(plan_groups(claims, share=True, batch_size=6)) == [["r0", "r1"], ["r2"]]


def test_plan_groups_larger_runs_go_alone() -> None:
    big = SMALL_RUN_EVENTS + 1
    claims = runs(1, big, 1, SMALL_RUN_EVENTS, 1)
    assert names(plan_groups(claims, share=True, batch_size=100)) == [
        ["r1"],
        ["r0", "r2", "r3", "r4"],
    ]


def test_plan_groups_keeps_every_claim_once() -> None:
    claims = runs(*[(i * 7) % 15 + 1 for i in range(40)])
    groups = plan_groups(claims, share=True, batch_size=20)
    flat = [r for g in groups for r in g]
    assert sorted(r.name for r in flat) == sorted(r.name for r in claims)
    for g in groups:
        if len(g) > 1:
            assert sum(len(r.events) for r in g) <= 20
            assert all(len(r.events) <= SMALL_RUN_EVENTS for r in g)


def test_plan_groups_of_nothing_is_nothing() -> None:
    assert plan_groups([], share=True, batch_size=10) == []


# --- the delivery carries it out ----------------------------------------------------------------


@pytest.mark.anyio
async def test_a_2xx_whose_body_is_not_json_is_not_acked_but_rescheduled(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    s, url = sink
    s.faults.fail(200, body=b"OK, I think")  # answered 200, recorded nothing
    enqueue_runs(conn, schema, 1, 2, terminal=False)
    async with Relay(settings(pg_url, schema, url, max_backoff="0.3s")).running() as r:
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 2, what="delivery")
        lane = r.lanes["ordinary"]
    # One reschedule through the database (no quick retry), then the batch again.
    assert [x["status"] for x in s.state.received] == [200, 200]
    assert lane.stats.retries == 1 and lane.stats.posts == 2
    assert_acked_only_if_received(conn, schema, s.state.deliveries)
    # The rescheduled attempt was the run's (schema version 7: counted on the run while it
    # backs off, the stats above count it); the ack cleared it, and no event row was written.
    run = conn.execute(q(schema, "select attempts, last_status, last_error from {s}.runs"))
    assert run.fetchall() == [(0, None, None)]
    rows = conn.execute(q(schema, "select state, attempts from {s}.events order by seq"))
    assert rows.fetchall() == [("delivered", 0), ("delivered", 0)]
