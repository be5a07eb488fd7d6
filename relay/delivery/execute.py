"""Execute: POST a claim's events, or one multi-run group's, to the ingress and reduce what
happened to one `Outcome` value per run (DESIGN §4.2, §5). It writes nothing to the database.

One path for a single claim and a group: widen a single claim before its first POST, check
each lease is trusted long enough for a whole request (renew first if not), POST (a single claim
to `ingress_url`, a group to `ingress_batch_url`) while the lane's renewer keeps the leases (and
cancels the request when every one is lost), with quick retries for blips.
`relay.core.policy.decide` says once per answer what it means; the outcome carries that decision, or
the lease lost, to the lane's completer (relay/delivery/complete.py), the only writer of results.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from relay import logs
from relay.admission.limit import Sample
from relay.admission.retry_budget import RetryBudget
from relay.core import clock
from relay.core.policy import Ack, Decision, Retry, decide
from relay.delivery.bookkeeping import Answered, Bookkeeping
from relay.delivery.renewal import Renewer
from relay.delivery.retries import QuickRetries
from relay.delivery.stats import ExecuteStats
from relay.edges.ingress import Answer, Batch, GroupAnswer, IngressClient, TransportFailure
from relay.edges.store import Claim, ClaimedEvent, Held, Store
from relay.edges.tracing import NO_SPAN, NO_TRACING, Delivery, DeliverySpan, Tracer
from relay.settings import Settings

Send = tuple[Held, Sequence[ClaimedEvent]]  # a run's holder and the events to POST (a prefix)


def retried(holds: Sequence[Held]) -> bool:
    """A retry: a run of the POST has earlier attempts (a multi-run POST is one if any is)."""
    for h in holds:  # a loop, not any(): once per POST
        if h.claim.attempts > 0:
            return True
    return False


def waived(holds: Sequence[Held]) -> bool:
    """An operator's `relay retry` lets a run of the POST past the retry budget (its claim)."""
    for h in holds:
        if h.claim.retry_waived:
            return True
    return False


def _unheard(sample: Sample) -> None:
    """No limit to tell (a resend within a turn already told, or no adaptive limit)."""


@dataclass(frozen=True, slots=True)
class LeaseLost:
    """The lease was lost before an answer could count: the batch is abandoned, no ack."""

    where: str  # renew_before_post, renewal_failed


@dataclass(frozen=True, slots=True)
class Deferred:
    """A retry the retry budget did not let go (relay/admission/retry_budget.py): nothing was
    POSTed; the lease goes back and the run waits `delay` seconds in the outbox. Not an attempt."""

    delay: float


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one run's POST came to: the events sent (a prefix of its claim), the answer (or the
    failure to get one) and what it means, or the lease lost. `whole`: the answer was to the
    whole request (a single run's, or a multi-run request that failed or was not 2xx) rather
    than this run's own result in a 2xx multi-run reply."""

    held: Held
    events: Sequence[ClaimedEvent]
    decision: Decision | LeaseLost | Deferred
    answer: Answer | TransportFailure | None = None
    whole: bool = True
    span: DeliverySpan = (
        NO_SPAN  # its trace (relay/edges/tracing.py), ended by the tracer's observer
    )
    # A run after the first of a multi-run request answered as a whole: what it came to is the
    # request's, which the first run's lines say at their level; this run's at info (one
    # warning per failed POST, issue 49 item 3, with `ingress_batch_url` too).
    echo: bool = False

    @property
    def run_id(self) -> str:
        return self.held.claim.run_id

    @property
    def accepted_whole(self) -> bool:
        """Every event sent was accepted: nothing but the (grouped) ack is left."""
        return isinstance(self.decision, Ack) and self.decision.k == len(self.events)


@dataclass(frozen=True, slots=True)
class _Replies:
    """One POST's answers, per run, and whether they are one answer for the whole request."""

    per_run: dict[str, tuple[Answer | TransportFailure, Decision]]
    whole: bool


class Executor:
    """One per lane: `execute()` / `resend()` from the lane's delivery tasks, `run()` (its
    renewer) as a background task. What each try tells the retry budget and the limit, and
    whether a retry may go, it leaves to its bookkeeping (relay/delivery/bookkeeping.py); the
    delivery spans it opens and the `post_failed` lines it writes are functions of what it sends,
    below (`_spans`, `_log_failed`)."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        ingress: IngressClient,
        stats: ExecuteStats,
        *,
        lane: str = "",
        tracer: Tracer = NO_TRACING,
        budget: RetryBudget | None = None,
    ) -> None:
        self.lane = lane
        self.books = Bookkeeping(settings, stats, lane=lane, budget=budget)
        self.tracer = tracer
        self.settings = settings
        self.store = store  # read only: the widening of a claim and the renewal of leases
        self.ingress = ingress
        self.stats = stats
        self.renewer = Renewer(store, settings.lease_ttl)
        self._quick = QuickRetries(_quick, settings.http_timeout)

    async def run(self) -> None:
        await self.renewer.run()

    def view(self) -> ExecuteStats:
        """The executor's counters, a copy (for the lane's view)."""
        return replace(self.stats, renewals=self.renewer.renewed)

    async def execute(self, holds: Sequence[Held], answered: Answered = _unheard) -> list[Outcome]:
        """POST these claims (one, or a group of small runs in one request) and return one
        outcome per run. Each holder keeps its claim's current value: a widening before the POST
        and each renewal are kept there. `answered` is told of each answer (the turn's limit).
        A retry (a claim with earlier attempts) goes only if the retry budget lets it, or an
        operator retried one of its runs (`relay retry`: the claim's `retry_waived`)."""
        is_retry, is_waived = retried(holds), waived(holds)
        attempts = (h.claim.attempts for h in holds)
        if delays := self.books.deferrals(is_retry, is_waived, attempts):
            return [
                Outcome(h, h.claim.events, Deferred(delay))
                for h, delay in zip(holds, delays, strict=True)
            ]
        group = len(holds) > 1
        if not group and holds[0].claim.widen:
            held = holds[0]
            more = await self.store.widen(held.claim)
            held.claim = held.claim.widened(more)
            self.stats.widened += len(more)
        lost = await self._renew_waited(holds, clock.now())
        gone = {o.run_id for o in lost}
        sends: list[Send] = [(h, h.claim.events) for h in holds if h.claim.run_id not in gone]
        if not sends:
            return lost
        return lost + await self._post(sends, group=group, answered=answered)

    async def resend(self, held: Held, events: Sequence[ClaimedEvent]) -> Outcome:
        """POST a part of a claim on its own (poison narrowing: a prefix, or one event), within
        the turn its claim holds. Not a retry: the budget does not charge it."""
        (outcome,) = await self._post([(held, events)], group=False, answered=_unheard)
        return outcome

    async def _renew_waited(self, holds: Sequence[Held], now: float) -> list[Outcome]:
        """Claims that waited in the local queue too long to finish a whole request inside the
        lease are renewed first. Returns the outcomes of those whose lease was lost (none, the
        common case, when no claim waited that long)."""
        timeout = self.settings.http_timeout
        waited = [h for h in holds if not h.claim.trust.allows_post(now, timeout)]
        if not waited:
            return []
        self.stats.renewed_before_post += len(waited)
        renewed = await self.renewer.renew(waited)
        return [
            Outcome(h, h.claim.events, LeaseLost("renew_before_post"))
            for h in waited
            if h.claim.run_id not in renewed
        ]

    async def _post(self, sends: list[Send], *, group: bool, answered: Answered) -> list[Outcome]:
        """POST with quick retries while the lane's renewer keeps the leases (each attempt reads
        the claims' current trust windows from their holders). A run whose renewal fails stays
        in the request (it cannot be unsent) and its outcome is the lease lost; only when every
        lease is gone is the request cancelled. The first try is a retry when a run has earlier
        attempts (its token was taken in `execute`); each quick try is one, let go by the
        budget (relay/delivery/retries.py)."""
        holds = [h for h, _ in sends]
        is_retry = retried(holds)
        spans = _spans(self.tracer, self.lane, sends)
        replies: _Replies | None = None
        tries = 0

        def tried(replies: _Replies, try_no: int, retry_in: float | None) -> None:
            _log_failed(self.lane, sends, replies, try_no, retry_in)

        async def post_once() -> _Replies:
            nonlocal tries
            tries += 1
            retry = self.books.retrying(tries, is_retry)
            return await self._post_once(
                sends, group=group, spans=spans, retry=retry, answered=answered
            )

        with self.renewer.renewing(holds) as renewal:
            replies = await self._quick(
                post_once,
                lambda: min((h.claim.trust for h in holds), key=lambda t: t.until),
                tried,
                self.books.quick_retry_allowed,
            )
        outcomes: list[Outcome] = []
        for i, ((held, events), span) in enumerate(zip(sends, spans, strict=True)):
            run_id = held.claim.run_id
            if run_id not in renewal.live or replies is None:
                outcomes.append(Outcome(held, events, LeaseLost("renewal_failed"), span=span))
            else:
                answer, decision = replies.per_run[run_id]
                if isinstance(decision, Retry):  # when it really goes, the budget considered
                    decision = self.books.scheduled(decision, held.claim.attempts)
                echo = replies.whole and i > 0
                outcomes.append(
                    Outcome(held, events, decision, answer, replies.whole, span, echo=echo)
                )
        return outcomes

    async def _post_once(
        self,
        sends: list[Send],
        *,
        group: bool,
        spans: list[DeliverySpan],
        retry: bool,
        answered: Answered,
    ) -> _Replies:
        """One try: the POST, what its answer means per run, and what it tells the limit and
        the retry budget (`retry`: the budget let it go as a retry, holding a token), told to
        the bookkeeping once the try is over."""
        self.stats.posts += 1
        started = clock.now()
        try:
            replies = await self._try(sends, group=group, spans=spans)
        except BaseException:  # cancelled (every lease lost) or broken: never answered
            self.books.record_unsent(retry)
            raise
        first, decision = next(iter(replies.per_run.values()))
        self.books.record(
            first, decision, whole=replies.whole, started=started, retry=retry, answered=answered
        )
        return replies

    async def _try(self, sends: list[Send], *, group: bool, spans: list[DeliverySpan]) -> _Replies:
        answer: Answer | GroupAnswer | TransportFailure
        batches = [_batch(h.claim, e) for h, e in sends]
        try:
            answer = await self._send(batches, group=group, spans=spans)
        except TransportFailure as exc:
            answer = exc
        if not group:  # the common case: one run, one answer
            assert not isinstance(answer, GroupAnswer)  # post() answers one run
            ((held, events),) = sends
            decision = self._decide(held.claim, len(events), answer)
            return _Replies({held.claim.run_id: (answer, decision)}, True)
        per_run: dict[str, Answer | TransportFailure]
        runs = [h.claim.run_id for h, _ in sends]
        if isinstance(answer, GroupAnswer):  # per run, or one answer for the whole request
            per_run, whole = answer.per_run, answer.whole
        else:  # no answer: one failure for the whole request
            per_run, whole = dict.fromkeys(runs, answer), True
        decided = {
            run_id: (per_run[run_id], self._decide(held.claim, len(events), per_run[run_id]))
            for (held, events), run_id in zip(sends, runs, strict=True)
        }
        return _Replies(decided, whole)

    async def _send(
        self, batches: list[Batch], *, group: bool, spans: list[DeliverySpan]
    ) -> Answer | GroupAnswer:
        """The POST itself; when tracing, as a client span (of a multi-run request, inside the
        first run's delivery span, linked to the others') whose context goes out as the
        `traceparent` header."""
        if not self.tracer.enabled:
            if group:
                return await self.ingress.post_group(batches)
            return await self.ingress.post(batches[0])
        url = self.ingress.group_url() if group else self.ingress.url(batches[0])
        with spans[0].post(url, spans[1:]) as post:
            answer: Answer | GroupAnswer
            try:
                if group:
                    answer = await self.ingress.post_group(batches, post.traceparent)
                else:
                    answer = await self.ingress.post(batches[0], post.traceparent)
            except TransportFailure as exc:
                post.failed(str(exc))
                raise
            post.answered(answer.status)
            return answer

    def _decide(self, claim: Claim, n_events: int, answer: Answer | TransportFailure) -> Decision:
        """The one place an answer is decided (the clock and the jitter come from here)."""
        return decide(
            answer,
            n_events,
            attempt=claim.attempts,
            now=datetime.now(UTC),
            rand=random.random(),
            cap=self.settings.max_backoff,
        )


def _log_failed(
    lane: str, sends: list[Send], replies: _Replies, try_no: int, retry_in: float | None
) -> None:
    """One `post_failed` line per run whose try failed for a transient cause (a timeout, a
    connection error, a 5xx, 429, a garbled 2xx): the cause and what happens next, a quick
    try in `retry_in` seconds or the run's reschedule (its `retry_scheduled` line follows).
    Poison and misconfigured answers have lines of their own (run_blocked,
    ingress_misconfigured). A warning when a quick try follows; the attempt's last try at info,
    since its `retry_scheduled` warning says the same failure with when the run goes next: one
    warning per failed POST (issue 49 item 3): of a multi-run request that failed as a whole,
    only the first run's line is a warning (`Outcome.echo`)."""
    for i, (held, _) in enumerate(sends):
        answer, decision = replies.per_run[held.claim.run_id]
        if not isinstance(decision, Retry):
            continue
        claim = held.claim
        warned = retry_in is not None and not (replies.whole and i > 0)
        logs.log(
            "post_failed",
            logging.WARNING if warned else logging.INFO,
            lane=lane,
            run_id=claim.run_id,
            epoch=claim.epoch,
            attempt=claim.attempts + 1,
            try_number=try_no,
            status=decision.status,
            error=decision.error[:200],
            http_ms=round(answer.seconds * 1000, 2) if isinstance(answer, Answer) else None,
            next="quick_retry" if retry_in is not None else "reschedule",
            retry_in=round(retry_in, 3) if retry_in is not None else None,
        )


def _spans(tracer: Tracer, lane: str, sends: list[Send]) -> list[DeliverySpan]:
    """One delivery span per run of the request, when tracing (else the no-op span)."""
    if not tracer.enabled:
        return [NO_SPAN] * len(sends)
    return [
        tracer.delivery(
            Delivery(
                lane=lane,
                run_id=held.claim.run_id,
                epoch=held.claim.epoch,
                first_seq=events[0].seq,
                last_seq=events[-1].seq,
                events=len(events),
                attempt=held.claim.attempts,
                traceparents=[e.traceparent for e in events],
                outbox_wait_seconds=_outbox_wait(held.claim, events[0]),
            )
        )
        for held, events in sends
    ]


def _batch(claim: Claim, events: Sequence[ClaimedEvent]) -> Batch:
    """What the ingress client sends of a claim (it never sees the lease)."""
    return Batch(claim.run_id, claim.epoch, events, claim.database_time(clock.now()))


def _outbox_wait(claim: Claim, first: ClaimedEvent) -> float | None:
    """Seconds the first event waited in the outbox: its created_at to the claim, both on the
    database's clock (created_at comes as naive UTC)."""
    claimed = claim.claimed_at
    if claimed.tzinfo is not None:
        claimed = claimed.astimezone(UTC).replace(tzinfo=None)
    return max(0.0, (claimed - first.created_at).total_seconds())


def _quick(replies: _Replies) -> bool:
    """A blip: a whole request failed in a way worth retrying at once (a 2xx multi-run reply
    with per-run results never is)."""
    if not replies.whole:
        return False
    for _, decision in replies.per_run.values():  # a loop, not all(): once per POST
        if not (isinstance(decision, Retry) and decision.quick):
            return False
    return True
