"""The relay's decisions as pure functions: no I/O, no event loop, the clock passed in.

What an ingress answer means (DESIGN §5), how long to back off, how far a lease can be
trusted. Everything here is unit-tested without a database or a network.
"""

from __future__ import annotations

import email.utils
import enum
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import orjson


class Outcome(enum.Enum):
    ACCEPTED = "accepted"  # 2xx (maybe partially: see accepted_count) and 409 duplicates
    TRANSIENT = "transient"  # retry later; never drop
    MISCONFIGURED = "misconfigured"  # the endpoint is wrong: back off the whole lane
    POISON = "poison"  # this batch can never be accepted: isolate the bad event


TRANSIENT_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
MISCONFIGURED_STATUSES = frozenset({401, 403, 404, 410})


def classify(status: int) -> Outcome:
    """Map an HTTP status to what the relay does (DESIGN §5 table)."""
    if 200 <= status < 300 or status == 409:
        return Outcome.ACCEPTED
    if status in TRANSIENT_STATUSES or status >= 500:
        return Outcome.TRANSIENT
    if status in MISCONFIGURED_STATUSES or 300 <= status < 400:
        return Outcome.MISCONFIGURED
    if 400 <= status < 500:
        return Outcome.POISON
    # 1xx or nonsense: treat as a transient glitch rather than guess it was accepted.
    return Outcome.TRANSIENT


def accepted_count(status: int, body: bytes, n_events: int) -> int:
    """How many leading events of an accepted batch the ingress took.

    A 2xx JSON body `{"accepted": k}` acks only the first k (clamped to 0..n); anything else
    (no body, not JSON, no integer `accepted`) means all of them. 409 means all were duplicates.
    """
    if status == 409 or not body:
        return n_events
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return n_events
    if not isinstance(parsed, dict):
        return n_events
    k = parsed.get("accepted")
    if isinstance(k, bool) or not isinstance(k, int):
        return n_events
    return max(0, min(k, n_events))


def backoff(attempt: int, *, base: float, cap: float, rand: float) -> float:
    """Exponential backoff with full jitter (AWS architecture blog): uniform in
    [0, min(cap, base * 2**attempt)]. `attempt` counts from 0; `rand` is uniform in [0, 1)."""
    if attempt < 0:
        raise ValueError("attempt must be >= 0")
    ceiling = cap if attempt >= 62 else min(cap, base * (2**attempt))
    return rand * ceiling


def parse_retry_after(
    value: str | None, now: datetime, *, minimum: float = 0.0, maximum: float = 3600.0
) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or HTTP-date), clamped to
    [minimum, maximum]; None when absent or unparseable."""
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    seconds: float
    if value.isascii() and value.isdigit():
        # RFC 9110 delta-seconds is ASCII 1*DIGIT (str.isdigit alone admits '²', which int()
        # refuses); float() never hits int()'s 4300-digit limit and overflows to inf, clamped.
        seconds = float(value)
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            # RFC 9110 §5.6.7: every HTTP-date is UTC; the obsolete asctime form (which
            # recipients must accept) carries no zone at all.
            when = when.replace(tzinfo=UTC)
        seconds = (when - now).total_seconds()
    return max(minimum, min(maximum, seconds))


def retry_delay(
    attempt: int,
    *,
    retry_after: float | None,
    base: float,
    cap: float,
    rand: float,
) -> float:
    """When to try a transiently failed batch again: the ingress's Retry-After when it gave
    one (never sooner), else backoff with full jitter."""
    if retry_after is not None:
        return retry_after
    return backoff(attempt, base=base, cap=cap, rand=rand)


@dataclass(frozen=True)
class Trust:
    """How long this process trusts a lease, on its own monotonic clock (River's trust window).

    The database decides expiry on its own clock; the process starts counting when it *sent*
    the statement that set the expiry, so any delay only shortens the window it believes in.
    """

    started: float  # monotonic time when the claim/renewal statement was sent
    ttl: float
    margin: float

    @property
    def until(self) -> float:
        return self.started + self.ttl - self.margin

    def remaining(self, now: float) -> float:
        return self.until - now

    def allows_post(self, now: float, http_timeout: float) -> bool:
        """No POST starts unless the lease outlives the whole request plus the margin."""
        return self.remaining(now) > http_timeout


def renew_interval(ttl: float) -> float:
    return ttl / 3.0


def lease_margin(ttl: float) -> float:
    """Safety margin subtracted from the trust window: covers clock rate differences and the
    ack round trip. A fifth of the TTL, at least 0.2 s."""
    return max(0.2, ttl / 5.0)


def misconfigured_backoff(consecutive: int, *, cap: float) -> float:
    """The whole lane's pause after an endpoint-misconfigured answer: slow, growing retries."""
    return float(min(cap, 2.0 ** min(consecutive, 16)))


def utc_after(now: datetime, seconds: float) -> datetime:
    return now + timedelta(seconds=seconds)
