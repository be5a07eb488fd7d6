"""The relay's decisions as pure functions: no I/O, no event loop, the clock passed in.

What an ingress answer means (DESIGN §5: `decide`, one value per answer), how long to back off,
how far a lease can be trusted. Everything here is unit-tested without a database or a network.
"""

from __future__ import annotations

import email.utils
import enum
from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Protocol, TypeVar

import orjson


class Outcome(enum.Enum):
    ACCEPTED = "accepted"  # 2xx (maybe partially: see decide) and 409 duplicates
    TRANSIENT = "transient"  # retry later; never drop
    MISCONFIGURED = "misconfigured"  # the endpoint is wrong: back off the whole lane
    POISON = "poison"  # this batch can never be accepted: isolate the bad event


TRANSIENT_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
# 405: a POST refused for its method is refused whatever it carries, so treating it as poison
# would block every run one event at a time (issue 41 item 3). 407 likewise: a proxy between the
# relay and the ingress wants credentials, the operator's configuration (`ingress_proxy`,
# HTTP(S)_PROXY), whatever the batch holds (issue 48 item 5).
MISCONFIGURED_STATUSES = frozenset({401, 403, 404, 405, 407, 410})
BACKOFF_BASE = 0.5  # seconds: the first transient retry waits up to this long
BODY_EXCERPT = 512  # bytes of an answer kept in errors and logs
SMALL_RUN_EVENTS = 10  # runs at most this long share a multi-run POST when the ingress offers one


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


# --- what one answer means (DESIGN §5 table) -------------------------------------------------


class HttpAnswer(Protocol):
    """An ingress answer as `decide` reads it (relay.edges.ingress.Answer is one)."""

    @property
    def status(self) -> int: ...
    @property
    def body(self) -> bytes: ...
    @property
    def retry_after(self) -> str | None: ...
    @property
    def truncated(self) -> bool: ...
    @property
    def unframed(self) -> bool: ...
    @property
    def excerpt(self) -> str: ...  # the start of the body, scrubbed of secrets: for people


@dataclass(frozen=True, slots=True)
class Ack:
    """Acknowledge the first `k` events of the batch (1 <= k <= n). Events after them stay
    pending and go out again with the run's next claim."""

    k: int


@dataclass(frozen=True, slots=True)
class Retry:
    """Transient: hand the lease back, next attempt in `delay` seconds; never drop the events."""

    delay: float
    status: int | None  # None: no HTTP answer (timeout, connection error)
    error: str
    retry_after: float | None  # the ingress's Retry-After, parsed and clamped
    quick: bool  # a blip: tenacity may retry it at once, within this attempt
    endpoint_ok: bool = False  # a 2xx all the same: the endpoint is the right one
    # The run's own backoff when the retry budget, spent, made it wait longer (`delay` is then a
    # deferral's wait: relay/delivery/bookkeeping.py); None: `delay` is the backoff.
    backoff: float | None = None


@dataclass(frozen=True, slots=True)
class Pause:
    """The endpoint is misconfigured: back off the whole lane; the events are not at fault."""

    status: int
    excerpt: str


@dataclass(frozen=True, slots=True)
class Poison:
    """This batch can never be accepted: isolate the bad event and block its run."""

    status: int
    excerpt: str
    rejected_event_id: str | None  # the event the answer names, if it does


Decision = Ack | Retry | Pause | Poison


def decide(
    answer: HttpAnswer | BaseException,
    n_events: int,
    *,
    attempt: int,
    now: datetime,
    rand: float,
    cap: float,
    base: float = BACKOFF_BASE,
) -> Decision:
    """What the relay does with one answer to a batch of `n_events` (the DESIGN §5 table).

    `answer` is the exception when no answer came (timeout, connection error, reply lost).
    `attempt` counts the run's earlier attempts (the backoff grows with it), `now` is the wall
    clock in UTC (for Retry-After dates), `rand` is uniform in [0, 1) (the jitter), `cap`
    bounds every delay.
    """
    if isinstance(answer, BaseException):
        delay = backoff(attempt, base=base, cap=cap, rand=rand)
        return Retry(delay, None, str(answer), None, quick=True)
    status = answer.status
    outcome = classify(status)
    if outcome is Outcome.ACCEPTED:
        if status != 409 and answer.truncated:
            # Cut at the read limit: even a prefix that parses cannot say what was taken.
            delay = backoff(attempt, base=base, cap=cap, rand=rand)
            error = f"answer body cut at the read limit: {answer.excerpt}"
            return Retry(delay, status, error, None, quick=False, endpoint_ok=True)
        if status != 409 and answer.unframed and not answer.body.strip():
            # No length, not chunked, nothing read: the connection's end ended it, and a reset
            # right after the head ends it the same way for some transports (aiohttp's). An
            # empty body would accept everything; nobody can say the ingress sent one.
            delay = backoff(attempt, base=base, cap=cap, rand=rand)
            error = (
                "empty answer without Content-Length or chunked framing: cannot tell it from a "
                "connection reset (the ingress should frame its answers)"
            )
            return Retry(delay, status, error, None, quick=True, endpoint_ok=True)
        k = n_events if status == 409 else _accepted(answer.body, n_events)
        if k is None:
            # Cut at the read limit, or garbled: nobody can say what the ingress took.
            delay = backoff(attempt, base=base, cap=cap, rand=rand)
            error = f"answer body is not JSON: {answer.excerpt}"
            return Retry(delay, status, error, None, quick=False, endpoint_ok=True)
        if k == 0:
            delay = backoff(attempt, base=base, cap=cap, rand=rand)
            error = "ingress accepted 0 events"
            return Retry(delay, status, error, None, quick=False, endpoint_ok=True)
        return Ack(k)
    if outcome is Outcome.TRANSIENT:
        after = parse_retry_after(answer.retry_after, now, maximum=cap)
        delay = retry_delay(attempt, retry_after=after, base=base, cap=cap, rand=rand)
        # With a Retry-After the ingress said when: no quick retry sooner than that.
        quick = answer.retry_after is None
        return Retry(delay, status, answer.excerpt, after, quick=quick)
    if outcome is Outcome.MISCONFIGURED:
        return Pause(status, answer.excerpt)
    return Poison(status, answer.excerpt, rejected_event_id(answer.body))


def _accepted(body: bytes, n_events: int) -> int | None:
    """How many leading events a 2xx answer accepts: `{"accepted": k}` clamped to 0..n; all
    of them for an empty body (whitespace only counts as empty) or a JSON one without an
    integer `accepted`; None for a body that is not JSON."""
    if not body.strip():
        return n_events
    parsed = _json(body)
    if parsed is _NOT_JSON:
        return None
    if not isinstance(parsed, dict):
        return n_events
    k = parsed.get("accepted")
    if isinstance(k, bool) or not isinstance(k, int):
        return n_events
    return max(0, min(k, n_events))


def rejected_event_id(body: bytes) -> str | None:
    """The event an ingress names in a rejection body `{"rejected_event_id": "..."}`."""
    parsed = _json(body) if body else None
    if isinstance(parsed, dict):
        named = parsed.get("rejected_event_id")
        if isinstance(named, str):
            return named
    return None


_NOT_JSON = object()


def _json(body: bytes) -> object:
    try:
        parsed: object = orjson.loads(body)
    except orjson.JSONDecodeError:
        return _NOT_JSON
    return parsed


def excerpt(body: bytes) -> str:
    """The start of an answer, for errors and logs (an answer's `excerpt` is this of its body
    once scrubbed of secrets: relay/edges/ingress.py)."""
    return body[:BODY_EXCERPT].decode("utf-8", "replace")


# --- which runs share a POST ------------------------------------------------------------------


class Batch(Protocol):
    """A run's claimed prefix, as planning sees it (relay.edges.store.Claim is one)."""

    @property
    def events(self) -> Sized: ...


B = TypeVar("B", bound=Batch)


def plan_groups(
    claims: Sequence[B],
    *,
    share: bool,
    batch_size: int,
    max_bytes: int | None = None,
    size_of: Callable[[B], int] = lambda c: 0,
) -> list[list[B]]:
    """Which claims go out together. Unless `share` (the ingress offers `ingress_batch_url`),
    one POST per run. With it, small runs (where one POST each would cap the relay near the
    HTTP client's request rate) share POSTs of up to `batch_size` events and `max_bytes` of
    payload (`size_of` a claim); larger runs still go alone."""
    if not share:
        return [[c] for c in claims]
    groups: list[list[B]] = []
    current: list[B] = []
    size = 0
    nbytes = 0
    for c in claims:
        n = len(c.events)
        if n > SMALL_RUN_EVENTS:
            groups.append([c])
            continue
        b = size_of(c)
        if current and (
            size + n > batch_size or (max_bytes is not None and nbytes + b > max_bytes)
        ):
            groups.append(current)
            current, size, nbytes = [], 0, 0
        current.append(c)
        size += n
        nbytes += b
    if current:
        groups.append(current)
    return groups


# --- timing ---------------------------------------------------------------------------------


def backoff(attempt: int, *, base: float, cap: float, rand: float, jitter: float = 1.0) -> float:
    """Exponential backoff, the one every retry loop of the relay uses: the ceiling
    min(cap, base * 2**attempt), of which the share `jitter` is random. Full jitter (1.0, AWS
    architecture blog) is uniform in [0, ceiling]; 0.5 spreads it over the upper half (replicas
    started together do not knock in step, yet none retries at once); 0.0 is the ceiling itself.
    `attempt` counts from 0; `rand` is uniform in [0, 1)."""
    if attempt < 0:
        raise ValueError("attempt must be >= 0")
    ceiling = cap if attempt >= 62 else min(cap, base * (2**attempt))
    return ceiling * (1.0 - jitter + jitter * rand)


def held_back(attempt: int, *, cap: float, rand: float, floor: float) -> float:
    """How long a retry the retry budget held back waits in the outbox: the run's own backoff
    after `attempt` failures, as if it had failed again (so a long outage spaces its retries out
    as failures would), in the upper half of its range, and never less than `floor` (the
    budget's least deferral, or the wait until it has a token for the run: claimed sooner, the
    run would only be handed back again)."""
    return max(floor, backoff(attempt, base=BACKOFF_BASE, cap=cap, rand=rand, jitter=0.5))


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
