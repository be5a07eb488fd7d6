"""Unit tests for the pure decisions in relay.core.policy (DESIGN §4.2, §5): no database, no
network, no clock but the one passed in."""

from __future__ import annotations

import ast
import email.utils
import itertools
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from relay.core.policy import (
    Ack,
    Outcome,
    Retry,
    Trust,
    backoff,
    classify,
    decide,
    held_back,
    lease_margin,
    misconfigured_backoff,
    parse_retry_after,
    renew_interval,
    retry_delay,
    utc_after,
)
from relay.edges.ingress import Answer

NOW = datetime(2024, 5, 17, 12, 0, 0, tzinfo=UTC)
JUST_BELOW_ONE = 1.0 - 2**-53  # the largest float random.random() can return

# --- classify: the DESIGN §5 table, row by row ------------------------------------------------


@pytest.mark.parametrize("status", [200, 201, 202, 204, 206, 299])
def test_2xx_is_accepted(status: int) -> None:
    assert classify(status) is Outcome.ACCEPTED


def test_409_duplicates_are_accepted() -> None:
    assert classify(409) is Outcome.ACCEPTED


@pytest.mark.parametrize("status", [408, 425, 429, 500, 502, 503, 504])
def test_listed_transient_statuses(status: int) -> None:
    assert classify(status) is Outcome.TRANSIENT


@pytest.mark.parametrize("status", [501, 505, 507, 511, 520, 599])
def test_other_5xx_are_transient(status: int) -> None:
    assert classify(status) is Outcome.TRANSIENT


@pytest.mark.parametrize("status", [401, 403, 404, 405, 410])
def test_misconfigured_4xx(status: int) -> None:
    assert classify(status) is Outcome.MISCONFIGURED


@pytest.mark.parametrize("status", [300, 301, 302, 303, 304, 307, 308, 399])
def test_3xx_is_misconfigured(status: int) -> None:
    # Redirects are never followed: an ingress that redirects is pointed at the wrong place.
    assert classify(status) is Outcome.MISCONFIGURED


@pytest.mark.parametrize("status", [400, 402, 411, 413, 415, 422, 431, 451, 499])
def test_other_4xx_are_poison(status: int) -> None:
    assert classify(status) is Outcome.POISON


@pytest.mark.parametrize("status", [0, 1, 99, 100, 101, 103, 199, 600, 999, -1])
def test_odd_codes_are_transient_never_accepted(status: int) -> None:
    # A nonsense status must never count as delivery (DESIGN §9.1: never acked without a 2xx).
    assert classify(status) is Outcome.TRANSIENT


@hsettings(deadline=None)  # no wall-clock threshold: the machine may be busy
@given(st.integers(min_value=-(10**6), max_value=10**6))
def test_only_2xx_and_409_are_accepted(status: int) -> None:
    accepted = classify(status) is Outcome.ACCEPTED
    assert accepted == (200 <= status < 300 or status == 409)


# --- how much of a 2xx is accepted (decide) ----------------------------------------------------


def accepted(status: int, body: bytes, n: int) -> int | None:
    """How many leading events of an n-event batch `decide` acks for this answer: 0 when it
    reschedules the batch after a 2xx (nothing accepted), None when the body is unreadable."""
    d = decide(Answer(status, body, None, 0.0), n, attempt=0, now=NOW, rand=0.5, cap=60.0)
    if isinstance(d, Ack):
        assert 1 <= d.k <= n
        return d.k
    assert isinstance(d, Retry) and d.endpoint_ok and not d.quick and d.status == status
    return None if d.error.startswith("answer body is not JSON") else 0


@pytest.mark.parametrize(
    ("k", "n", "expected"),
    [(0, 5, 0), (1, 5, 1), (3, 5, 3), (5, 5, 5), (6, 5, 5), (10**30, 5, 5), (-1, 5, 0), (-9, 1, 0)],
)
def test_accepted_k_is_clamped(k: int, n: int, expected: int) -> None:
    assert accepted(200, f'{{"accepted": {k}}}'.encode(), n) == expected


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b" \r\n",
        b"[1, 2]",
        b"3",
        b'"accepted"',
        b"null",
        b"{}",
        b'{"ok": true}',
        b'{"accepted": true}',
        b'{"accepted": false}',
        b'{"accepted": 2.0}',
        b'{"accepted": 1.5}',
        b'{"accepted": "2"}',
        b'{"accepted": null}',
        b'{"accepted": [2]}',
        b'{"accepted": {"k": 2}}',
    ],
)
def test_no_body_or_json_without_an_integer_accepted_means_all(body: bytes) -> None:
    assert accepted(200, body, 4) == 4


@pytest.mark.parametrize(
    "body", [b"not json", b"OK", b"\xff\xfe", b'{"accepted": 2', b'{"accepted": 1}{', b"<html>"]
)
def test_a_2xx_body_that_is_not_json_acks_nothing(body: bytes) -> None:
    # DESIGN §5: unparseable (or cut at the read limit): a transient failure, never an ack.
    assert accepted(200, body, 4) is None


def test_409_means_all_whatever_the_body() -> None:
    assert accepted(409, b'{"accepted": 1}', 7) == 7
    assert accepted(409, b"", 7) == 7
    assert accepted(409, b"not json", 7) == 7


@pytest.mark.parametrize("status", [200, 201, 202, 204])
def test_partial_acceptance_applies_to_every_2xx(status: int) -> None:
    assert accepted(status, b'{"accepted": 2, "note": "x"}', 3) == 2


@hsettings(deadline=None)  # no wall-clock threshold: the machine may be busy
@given(st.integers(), st.integers(min_value=1, max_value=10_000))
def test_accepted_count_always_within_0_n(k: int, n: int) -> None:
    got = accepted(200, f'{{"accepted": {k}}}'.encode(), n)
    assert got is not None and 0 <= got <= n
    if 0 <= k <= n:
        assert got == k


@hsettings(deadline=None)  # no wall-clock threshold: the machine may be busy
@given(st.binary(max_size=64), st.integers(min_value=1, max_value=1000))
def test_a_2xx_never_raises_and_never_acks_more_than_the_batch(body: bytes, n: int) -> None:
    got = accepted(200, body, n)
    assert got is None or 0 <= got <= n


# --- backoff: full jitter -----------------------------------------------------------------------


def test_backoff_rand_zero_is_zero() -> None:
    assert backoff(0, base=0.5, cap=60.0, rand=0.0) == 0.0
    assert backoff(10, base=0.5, cap=60.0, rand=0.0) == 0.0


@pytest.mark.parametrize(("attempt", "ceiling"), [(0, 0.5), (1, 1.0), (2, 2.0), (5, 16.0)])
def test_backoff_rand_near_one_reaches_the_ceiling(attempt: int, ceiling: float) -> None:
    got = backoff(attempt, base=0.5, cap=60.0, rand=JUST_BELOW_ONE)
    assert got < ceiling
    assert got == pytest.approx(ceiling)


def test_backoff_is_capped() -> None:
    assert backoff(7, base=0.5, cap=60.0, rand=JUST_BELOW_ONE) == pytest.approx(60.0)
    assert backoff(7, base=0.5, cap=60.0, rand=JUST_BELOW_ONE) < 60.0


@pytest.mark.parametrize("attempt", [61, 62, 63, 64, 100, 1023, 1024, 1025, 10**6])
def test_backoff_cap_honoured_for_huge_attempts(attempt: int) -> None:
    got = backoff(attempt, base=1.0, cap=300.0, rand=0.5)
    assert got == pytest.approx(150.0)


@pytest.mark.parametrize("attempt", [-1, -2, -(10**6)])
def test_backoff_negative_attempt_raises(attempt: int) -> None:
    with pytest.raises(ValueError, match="attempt"):
        backoff(attempt, base=1.0, cap=10.0, rand=0.5)


@hsettings(deadline=None)  # no wall-clock threshold: the machine may be busy
@given(
    attempt=st.integers(min_value=0, max_value=10_000),
    base=st.floats(min_value=0.001, max_value=10.0),
    cap=st.floats(min_value=0.01, max_value=86_400.0),
    rand=st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
)
def test_backoff_bounds(attempt: int, base: float, cap: float, rand: float) -> None:
    got = backoff(attempt, base=base, cap=cap, rand=rand)
    ceiling = min(cap, base * 2.0 ** min(attempt, 1000))
    assert 0.0 <= got <= ceiling
    assert got == pytest.approx(rand * ceiling)


@hsettings(deadline=None)  # no wall-clock threshold: the machine may be busy
@given(
    attempt=st.integers(min_value=0, max_value=200),
    rand=st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
)
def test_backoff_ceiling_never_shrinks_with_attempts(attempt: int, rand: float) -> None:
    a = backoff(attempt, base=0.25, cap=300.0, rand=rand)
    b = backoff(attempt + 1, base=0.25, cap=300.0, rand=rand)
    assert a <= b


@pytest.mark.parametrize(("attempt", "ceiling"), [(0, 0.5), (3, 4.0), (9, 60.0)])
def test_half_jitter_spreads_the_delay_over_the_upper_half_of_the_ceiling(
    attempt: int, ceiling: float
) -> None:
    assert backoff(attempt, base=0.5, cap=60.0, rand=0.0, jitter=0.5) == ceiling / 2
    got = backoff(attempt, base=0.5, cap=60.0, rand=JUST_BELOW_ONE, jitter=0.5)
    assert got == pytest.approx(ceiling)


@given(attempt=st.integers(min_value=0, max_value=100), rand=st.floats(0.0, 1.0, exclude_max=True))
def test_no_jitter_is_the_ceiling_whatever_rand(attempt: int, rand: float) -> None:
    got = backoff(attempt, base=0.1, cap=2.0, rand=rand, jitter=0.0)
    assert got == min(2.0, 0.1 * 2.0 ** min(attempt, 100))


@pytest.mark.parametrize(
    ("attempt", "rand", "floor", "waits"),
    [
        (0, 0.0, 5.0, 5.0),  # a first retry's backoff (0.25..0.5 s) is below the floor
        (9, 0.0, 5.0, 128.0),  # a long outage: the run's own backoff, its upper half
        (9, 0.0, 200.0, 200.0),  # the budget has no token for longer
        (30, 0.0, 5.0, 150.0),  # capped, half of it the least
    ],
)
def test_a_retry_the_budget_held_back_waits_its_backoff_or_the_floor(
    attempt: int, rand: float, floor: float, waits: float
) -> None:
    assert held_back(attempt, cap=300.0, rand=rand, floor=floor) == waits


# The hand-made backoffs not yet on policy.backoff (issue 27 item 5): this list only shrinks.
HAND_MADE_BACKOFF_LEFT: set[str] = set()


def test_every_retry_loop_backs_off_through_policy_backoff() -> None:
    """Exponential growth (a power of 2) is written once, in relay/core/policy.py; a retry loop that
    grows its delay by hand has its own cap and jitter to get wrong."""
    package = Path(__file__).resolve().parent.parent / "relay"
    hand_made = set()
    for path in package.rglob("*.py"):
        if "tools" in path.relative_to(package).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.BinOp)
                and isinstance(node.op, ast.Pow)
                and isinstance(node.left, ast.Constant)
                and node.left.value == 2
            ):
                hand_made.add(path.name)
    assert hand_made - {"policy.py"} <= HAND_MADE_BACKOFF_LEFT


# --- Retry-After --------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "seconds"), [("0", 0.0), ("7", 7.0), (" 120 ", 120.0)])
def test_retry_after_delta_seconds(value: str, seconds: float) -> None:
    assert parse_retry_after(value, NOW) == seconds


def test_retry_after_http_date_gmt() -> None:
    value = email.utils.format_datetime(NOW + timedelta(seconds=90), usegmt=True)
    assert value.endswith("GMT")
    assert parse_retry_after(value, NOW) == 90.0


@pytest.mark.parametrize(
    "value",
    [
        "Fri, 17 May 2024 12:02:00 GMT",  # IMF-fixdate
        "Friday, 17-May-24 12:02:00 GMT",  # obsolete RFC 850 form
        "Fri May 17 12:02:00 2024",  # obsolete asctime form: no zone, UTC by definition
    ],
)
def test_retry_after_accepts_every_http_date_form(value: str) -> None:
    assert parse_retry_after(value, NOW) == 120.0


def test_retry_after_http_date_with_numeric_zone() -> None:
    later = (NOW + timedelta(seconds=45)).astimezone(timezone(timedelta(hours=2)))
    assert parse_retry_after(email.utils.format_datetime(later), NOW) == 45.0


@pytest.mark.parametrize(
    "value",
    [
        "soon",
        "1.5",
        "-5",
        "+5",
        "5s",
        "0x10",
        "Tomorrow at noon",
        "Fri, 99 Foo 2024 25:61:61 GMT",
        "²",  # str.isdigit() is true for it, int() refuses it
        "١٢",  # Arabic-Indic digits: not delta-seconds (RFC 9110: 1*DIGIT, ASCII)
        "\x00",
    ],
)
def test_retry_after_garbage_is_none(value: str) -> None:
    assert parse_retry_after(value, NOW) is None


@pytest.mark.parametrize("value", [None, "", "   "])
def test_retry_after_absent_is_none(value: str | None) -> None:
    assert parse_retry_after(value, NOW) is None


def test_retry_after_past_date_clamps_to_minimum() -> None:
    past = email.utils.format_datetime(NOW - timedelta(hours=1), usegmt=True)
    assert parse_retry_after(past, NOW) == 0.0
    assert parse_retry_after(past, NOW, minimum=0.5) == 0.5


def test_retry_after_far_future_clamps_to_maximum() -> None:
    future = email.utils.format_datetime(NOW + timedelta(days=400), usegmt=True)
    assert parse_retry_after(future, NOW) == 3600.0
    assert parse_retry_after(future, NOW, maximum=60.0) == 60.0
    assert parse_retry_after("86400000", NOW, maximum=60.0) == 60.0


def test_retry_after_huge_delta_clamps_instead_of_raising() -> None:
    # int() refuses strings over 4300 digits; a hostile header must not crash the lane.
    assert parse_retry_after("9" * 5000, NOW) == 3600.0


def test_retry_after_small_delta_clamps_to_minimum() -> None:
    assert parse_retry_after("0", NOW, minimum=1.0) == 1.0


@hsettings(deadline=None)  # no wall-clock threshold: the machine may be busy
@given(st.text(max_size=60))
def test_retry_after_never_raises(value: str) -> None:
    got = parse_retry_after(value, NOW, minimum=0.0, maximum=3600.0)
    assert got is None or 0.0 <= got <= 3600.0


@hsettings(deadline=None)  # no wall-clock threshold: the machine may be busy
@given(st.integers(min_value=-(10**7), max_value=10**7))
def test_retry_after_http_date_roundtrip(offset: int) -> None:
    value = email.utils.format_datetime(NOW + timedelta(seconds=offset), usegmt=True)
    assert parse_retry_after(value, NOW, maximum=1e9) == max(0.0, float(offset))


def test_retry_delay_prefers_retry_after() -> None:
    assert retry_delay(0, retry_after=42.0, base=1.0, cap=10.0, rand=0.0) == 42.0
    assert retry_delay(9, retry_after=0.0, base=1.0, cap=10.0, rand=0.9) == 0.0


def test_retry_delay_falls_back_to_backoff() -> None:
    assert retry_delay(3, retry_after=None, base=1.0, cap=100.0, rand=0.5) == backoff(
        3, base=1.0, cap=100.0, rand=0.5
    )


def test_utc_after() -> None:
    assert utc_after(NOW, 1.5) == NOW + timedelta(seconds=1.5)


# --- Trust window -------------------------------------------------------------------------------


def test_trust_until_and_remaining() -> None:
    t = Trust(started=100.0, ttl=30.0, margin=6.0)
    assert t.until == 124.0
    assert t.remaining(100.0) == 24.0
    assert t.remaining(124.0) == 0.0
    assert t.remaining(130.0) == -6.0


def test_trust_allows_post_only_when_the_lease_outlives_the_request() -> None:
    t = Trust(started=100.0, ttl=30.0, margin=6.0)
    assert t.allows_post(100.0, http_timeout=10.0)
    assert t.allows_post(113.9, http_timeout=10.0)
    assert not t.allows_post(114.0, http_timeout=10.0)  # exactly the timeout left: not enough
    assert not t.allows_post(120.0, http_timeout=10.0)
    assert not t.allows_post(200.0, http_timeout=0.0)


@hsettings(deadline=None)  # no wall-clock threshold: the machine may be busy
@given(
    started=st.floats(min_value=0, max_value=1e6),
    ttl=st.floats(min_value=1.0, max_value=3600.0),
    elapsed=st.floats(min_value=0, max_value=7200.0),
    http_timeout=st.floats(min_value=0.05, max_value=600.0),
)
def test_trust_never_allows_a_post_that_could_outlive_the_db_lease(
    started: float, ttl: float, elapsed: float, http_timeout: float
) -> None:
    t = Trust(started=started, ttl=ttl, margin=lease_margin(ttl))
    if t.allows_post(started + elapsed, http_timeout):
        # The request's deadline ends before the lease expires, with the margin to spare.
        assert elapsed + http_timeout + lease_margin(ttl) < ttl + 1e-6


def test_trust_is_immutable() -> None:
    t = Trust(started=0.0, ttl=30.0, margin=6.0)
    with pytest.raises(AttributeError):
        t.ttl = 60.0  # type: ignore[misc]


def test_lease_margin() -> None:
    assert lease_margin(30.0) == 6.0
    assert lease_margin(5.0) == 1.0
    assert lease_margin(1.0) == 0.2  # floor
    assert lease_margin(0.5) == 0.2


def test_renew_interval_is_a_third_of_the_ttl() -> None:
    assert renew_interval(30.0) == 10.0
    assert renew_interval(3.0) == 1.0


def test_renewals_happen_well_inside_the_trust_window() -> None:
    for ttl in (1.0, 3.0, 30.0, 3600.0):
        assert renew_interval(ttl) < ttl - lease_margin(ttl)


def test_misconfigured_backoff_grows_then_caps() -> None:
    delays = [misconfigured_backoff(n, cap=60.0) for n in range(10)]
    assert delays[:6] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
    assert delays[6:] == [60.0] * 4
    assert all(a <= b for a, b in itertools.pairwise(delays))


@pytest.mark.parametrize("n", [16, 17, 100, 10**9])
def test_misconfigured_backoff_huge_counts_hit_the_cap(n: int) -> None:
    assert misconfigured_backoff(n, cap=300.0) == 300.0
    assert isinstance(misconfigured_backoff(n, cap=300.0), float)
