"""Quick retries within one attempt (DESIGN §5): tenacity, bounded and short, with full jitter,
for blips only, only while the lease is trusted for a whole request, and only while the retry
budget lets them (issue 42). Longer outages are
rescheduled through the database instead (relay/delivery/complete.py), so a restart loses nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_result,
    stop_after_attempt,
    stop_any,
    wait_random_exponential,
)
from tenacity.stop import stop_base

from relay.core import clock
from relay.core.policy import Trust

QUICK_ATTEMPTS = 3

T = TypeVar("T")

# Told of every try's result (`relay.delivery.execute` logs each failed one, `post_failed`): the
# result, the try's number (1..QUICK_ATTEMPTS) and the wait before the next quick try, or None when
# no quick try follows (the result goes back to the caller, who reschedules a failure).
Tried = Callable[[T, int, float | None], None]


class QuickRetries(Generic[T]):
    """`await quick(post, trust)`: `post()` once, and again while `retryable` says its result
    was a blip, at most QUICK_ATTEMPTS in all. Built once per lane and kind of request:
    building tenacity's strategies per call (as this once did) cost more per POST than the
    retry machinery itself (docs/performance.md)."""

    def __init__(self, retryable: Callable[[T], bool], http_timeout: float) -> None:
        self.retryable = retryable
        self.http_timeout = http_timeout
        self._retry = retry_if_result(retryable)

    async def __call__(
        self,
        post: Callable[[], Awaitable[T]],
        trust: Callable[[], Trust],
        tried: Tried[T] | None = None,
        may_retry: Callable[[], bool] = lambda: True,
    ) -> T:
        first = await post()
        if not self.retryable(first):
            if tried is not None:
                tried(first, 1, None)
            return first
        # A blip. tenacity decides from here, starting from this first outcome (replayed as its
        # attempt 1): the common case, an answer at once, never builds a retry loop.
        replay = [first]

        async def attempt() -> T:  # a coroutine function, so tenacity awaits it
            return replay.pop() if replay else await post()

        def before_sleep(state: RetryCallState) -> None:  # a quick try follows this one
            if tried is not None and state.outcome is not None and state.next_action is not None:
                tried(state.outcome.result(), state.attempt_number, state.next_action.sleep)

        # The retry budget is asked last, only when nothing else stops: a yes holds a token.
        stop = stop_any(_STOP_AFTER, _TrustLow(trust, self.http_timeout), _BudgetSpent(may_retry))
        retrying = AsyncRetrying(
            stop=stop,
            wait=_QUICK_WAIT,
            retry=self._retry,
            retry_error_callback=_last_outcome,
            before_sleep=before_sleep,
            reraise=True,
        )
        retried: T = await retrying(attempt)
        if tried is not None:
            tried(retried, retrying.statistics.get("attempt_number", 1), None)
        return retried


class _TrustLow(stop_base):
    """Stop quick retries once the lease is not trusted for a whole request any more."""

    def __init__(self, trust: Callable[[], Trust], timeout: float) -> None:
        self.trust = trust
        self.timeout = timeout

    def __call__(self, retry_state: RetryCallState) -> bool:
        return not self.trust().allows_post(clock.now(), self.timeout)


class _BudgetSpent(stop_base):
    """Stop quick retries when the retry budget lets no more go
    (relay/admission/retry_budget.py)."""

    def __init__(self, may_retry: Callable[[], bool]) -> None:
        self.may_retry = may_retry

    def __call__(self, retry_state: RetryCallState) -> bool:
        return not self.may_retry()


def _last_outcome(state: RetryCallState) -> object:
    return state.outcome.result() if state.outcome else None


_STOP_AFTER = stop_after_attempt(QUICK_ATTEMPTS)
_QUICK_WAIT = wait_random_exponential(multiplier=0.05, max=0.4)
