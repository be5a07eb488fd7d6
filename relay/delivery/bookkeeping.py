"""The bookkeeping of a POST's tries: what each try tells the replica's retry budget and its
turn's adaptive limit, whether a retry may go, and how long one the budget refused waits (issue
42).

The executor (relay/delivery/execute.py) POSTs; this part keeps the accounts of its tries, so the
POST path reads as the POST and issue 42's rules for it read in one place. Around each try it is
asked in a fixed order: before it, whether a retry may go (`deferrals` before a POST,
`quick_retry_allowed` before each quick try: a yes holds a budget token); after it, what came of it
(`record`, or `record_unsent` when no answer came), which settles that token and gives the limit its
sample (through its turn, relay/delivery/post_turn.py). The budget (relay/admission/retry_budget.py)
and the limit (relay/admission/limit.py) stay pure: the budget's `now` and each sample's round trip
are read here on the monotonic clock, and the sample is a pure function of the answer (`_sample`,
`_served`), testable without an event loop."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import replace

from relay import logs
from relay.admission.limit import Sample
from relay.admission.retry_budget import DEFER_AT_LEAST, SLICE, Result, RetryBudget
from relay.core import clock
from relay.core.policy import Decision, Retry, held_back
from relay.delivery.stats import ExecuteStats
from relay.edges.ingress import Answer, TransportFailure
from relay.settings import Settings

Answered = Callable[[Sample], None]  # told of each answer to a POST (its turn's limit)


class Bookkeeping:
    """One per executor (so one per lane): the accounts of its POSTs' tries with the replica's
    retry budget (shared with the other lane; None: no budget, every retry goes) and with the
    limit the caller names per POST. Counts the retries it holds back in the executor's
    `stats.deferred`; logs `limit_sample_failed` under the lane's name."""

    def __init__(
        self,
        settings: Settings,
        stats: ExecuteStats,
        *,
        lane: str,
        budget: RetryBudget | None,
    ) -> None:
        self.lane = lane
        self.budget = budget  # the replica's retry budget, shared with the other lane
        self.settings = settings
        self.stats = stats

    def deferrals(self, retried: bool, waived: bool, attempts: Iterable[int]) -> list[float]:
        """Whether a POST may go, as one answer: none when it may, else how long each of its
        runs waits in the outbox. A first attempt always goes; a retry (`retried`: a run with
        earlier attempts, and a multi-run POST is one if any of its runs is) only when the
        budget has a token for it, or an operator retried one of its runs (`waived`: `relay
        retry`, which its claim carries). Each run of a retry the budget refused waits the
        `held_back` of its `attempts` (relay/core/policy.py), counted in the executor's
        `stats.deferred` (the executor's `Deferred` carries it to the completer). When only the
        tokens of retries in flight are lacking and the ingress is healthy (`awaits_answers`),
        each waits half a slice to a slice instead: those tokens come back with their answers."""
        if self.budget is None or not retried:
            return []
        now = clock.now()
        if self.budget.try_retry(now, waived):
            return []
        if self.budget.awaits_answers(now):
            delays = [SLICE * (0.5 + 0.5 * random.random()) for _ in attempts]
        else:
            cap = self.settings.max_backoff
            delays = [
                held_back(attempt, cap=cap, rand=random.random(), floor=self._floor())
                for attempt in attempts
            ]
        self.stats.deferred += len(delays)
        return delays

    def scheduled(self, retry: Retry, attempts: int) -> Retry:
        """The reschedule of a failed attempt (the run's `attempts` before it), with the time its
        next attempt really goes (issue 49 item 3): the run's backoff, or, when the budget is
        spent now (the attempt's own tries took what it had) for more than the tokens of retries
        in flight, the wait a deferral would give it, if that is longer. Sooner, the run is
        claimed only for the budget to hand it back (`retry_scheduled retry_in=0.2` followed by
        deferrals and no POST for 20 s, in issue 49's outage). The returned `Retry` keeps the
        run's own backoff in `backoff`."""
        now = clock.now()
        if self.budget is None or not self.budget.spent(now) or self.budget.awaits_answers(now):
            return retry
        cap = self.settings.max_backoff
        held = held_back(attempts + 1, cap=cap, rand=random.random(), floor=self._floor())
        if held <= retry.delay:
            return retry
        return replace(retry, delay=held, backoff=retry.delay)

    def _floor(self) -> float:
        """The least a retry the budget holds back waits (`relay.core.policy.held_back`):
        DEFER_AT_LEAST, and no less than until the budget has a token for it (`ready_in`), spread
        over a slice of the budget's window, so the runs held back together are not all claimed
        at the instant a token frees."""
        if self.budget is None:
            return DEFER_AT_LEAST
        return max(DEFER_AT_LEAST, self.budget.ready_in(clock.now()) + random.random() * SLICE)

    def quick_retry_allowed(self) -> bool:
        """The budget lets one more quick try go (it holds a token until its answer)."""
        return self.budget is None or self.budget.try_retry(clock.now())

    def retrying(self, tries: int, retried: bool) -> bool:
        """Whether this try (the `tries`-th of a POST) holds a budget token as a retry: a quick
        try always does, a first try when a run has earlier attempts (`retried`: its token was
        taken by `deferrals`)."""
        return self.budget is not None and (tries > 1 or retried)

    def record_unsent(self, retry: bool) -> None:
        """A try that never got an answer (cancelled: every lease lost; or broken)."""
        if self.budget is not None:
            self.budget.record(Result.UNSENT, retry=retry, now=clock.now())

    def record(
        self,
        first: Answer | TransportFailure,
        decision: Decision,
        *,
        whole: bool,
        started: float,
        retry: bool,
        answered: Answered,
    ) -> None:
        """What an answered try tells the retry budget (`retry`: the budget let it go as a
        retry, holding a token) and the limit (`answered`): `first` and `decision` are the
        first run's answer and what it means, `whole` whether it was the answer to the whole
        request, `started` when the try went out."""
        failed = whole and isinstance(decision, Retry)
        now = clock.now()
        if self.budget is not None:
            self.budget.record(Result.FAILED if failed else Result.SERVED, retry=retry, now=now)
        rtt = now - started
        sample = _sample(first, decision, rtt) if whole else _served(rtt)
        try:
            answered(sample)
        except Exception as exc:  # the limit's bug must not undo an answered POST (a duplicate)
            logs.error("limit_sample_failed", lane=self.lane, error=logs.error_text(exc, 300))


def _sample(answer: Answer | TransportFailure, decision: Decision, rtt: float) -> Sample:
    """What one answer to the whole request tells the limit (relay/admission/limit.py): its status
    (or none, and whether it timed out), its round trip, and a Retry-After the policy parsed."""
    retry_after = decision.retry_after if isinstance(decision, Retry) else None
    if isinstance(answer, TransportFailure):
        return Sample.of(None, rtt, timed_out=answer.timed_out, retry_after=retry_after)
    return Sample.of(answer.status, rtt, retry_after=retry_after)


def _served(rtt: float) -> Sample:
    """A 2xx multi-run reply with per-run results: the ingress answered in `rtt`."""
    return Sample.of(200, rtt)
