"""Complete: the one writer of delivery results, one `Completer` per lane (DESIGN §4.2, §5, §6).

It carries out each `Outcome` that relay/execute.py returns: acks (grouped, relay/ack.py),
reschedules and hand-backs (`store.release`), the failure of a poison event (`store.fail_event`)
and the lane's pause gate when the ingress is misconfigured. Nothing else writes the result of
a delivery, so each write is fenced by the claim's token in one place. Poison narrowing is a
loop of the two parts: the executor resends a prefix or one event (`resend`, given at
construction), and this module acks what was accepted, keeping the lease, until it blocks the
event at fault.

The lane and the observers read the pause gate through `gate()`, a value.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace

import anyio

from relay import logs
from relay.ack import AckGroup
from relay.execute import LeaseLost, Outcome
from relay.ingress import Answer
from relay.policy import Ack, Pause, Poison, Retry, misconfigured_backoff
from relay.settings import Settings, redact_url
from relay.stats import CompleteStats
from relay.store import AckResult, Claim, ClaimedEvent, Held, Store
from relay.tracing import NO_SPAN, DeliverySpan

Resend = Callable[[Held, Sequence[ClaimedEvent]], Awaitable[Outcome]]


@dataclass(frozen=True, slots=True)
class Gate:
    """The lane's pause gate as the lane and observers read it."""

    paused_until: float  # the lane claims nothing before this (monotonic clock)
    misconfigured: bool  # the ingress answered "misconfigured" and has not recovered since


class Completer:
    """One per lane: `carry()` from the lane's delivery tasks, `run()` (its ack group) as a
    background task."""

    def __init__(
        self,
        lane: str,
        settings: Settings,
        store: Store,
        stats: CompleteStats,
        *,
        resend: Resend,
        on_ready_change: Callable[[bool], None],
        observe_ack: Callable[[AckResult], None],
    ) -> None:
        self.lane = lane
        self.settings = settings
        self.store = store
        self.stats = stats
        self.resend = resend  # the executor's, for poison narrowing
        self.on_ready_change = on_ready_change
        self.observe_ack = observe_ack  # metrics: commit-to-ack lag
        self.acks = AckGroup(store)
        self._paused_until = 0.0  # the lane claims nothing before this (monotonic clock)
        self._misconfigured = 0  # consecutive misconfigured answers; 0 once one is accepted

    async def run(self) -> None:
        await self.acks.run()

    def close(self) -> None:
        """For a completer never run: close its ack queue."""
        self.acks.close()

    def gate(self) -> Gate:
        return Gate(self._paused_until, self._misconfigured > 0)

    def view(self) -> CompleteStats:
        """The completer's counters, a copy (for the lane's view)."""
        return replace(self.stats, by_type=dict(self.stats.by_type))

    # -- carrying out outcomes ---------------------------------------------------------------

    async def carry(self, outcomes: Sequence[Outcome]) -> dict[str, bool]:
        """Do what each run's outcome means. Returns, per run, whether its lease was settled;
        an ack that did not commit is not (the lane hands the lease back: fenced by token, so
        a no-op when the ack released it or the lease was lost)."""
        if len(outcomes) == 1:
            (outcome,) = outcomes
            return {outcome.run_id: await self._carry(outcome)}
        settled: dict[str, bool] = {}
        for lost in (o for o in outcomes if isinstance(o.decision, LeaseLost)):
            with traced(lost):
                settled[lost.run_id] = self._lost(lost)
        whole = [o for o in outcomes if o.run_id not in settled and o.accepted_whole]
        rest = [o for o in outcomes if o.run_id not in settled and not o.accepted_whole]

        async def carry(outcome: Outcome) -> None:
            settled[outcome.run_id] = await self._carry(outcome)

        # Runs whose whole batch was accepted are acked in one call to the ack group, the rest
        # carried out concurrently (so their acks can share that group's transaction).
        async with anyio.create_task_group() as carrying:
            for outcome in rest:
                carrying.start_soon(carry, outcome)
            if whole:
                self._ingress_ok()
                claims = [o.held.claim for o in whole]
                acked = await self.acks.ack_many([(c, c.events[-1].seq, False) for c in claims])
                for o, c, one in zip(whole, claims, acked, strict=True):
                    assert isinstance(o.answer, Answer)  # decide acks only an answer
                    with traced(o):
                        settled[c.run_id] = self._acked(c, c.events, o.answer, one, o.span)
        return settled

    async def _carry(self, outcome: Outcome) -> bool:
        """Do what one run's outcome (its answer to `events`, a prefix of the claim) means."""
        with traced(outcome):
            return await self._carry_traced(outcome)

    async def _carry_traced(self, outcome: Outcome) -> bool:
        claim = outcome.held.claim
        decision = outcome.decision
        if isinstance(decision, Ack) or (isinstance(decision, Retry) and decision.endpoint_ok):
            self._ingress_ok()
        match decision:
            case LeaseLost():
                return self._lost(outcome)
            case Ack(k=k):
                assert isinstance(outcome.answer, Answer)  # decide acks only an answer
                return await self._ack(claim, outcome.events[:k], outcome.answer, span=outcome.span)
            case Retry():
                return await self._reschedule(claim, decision)
            case Pause():
                return await self._pause(claim, decision)
            case Poison():
                return await self._poison(outcome, decision)

    def _lost(self, outcome: Outcome) -> bool:
        """The lease was lost before an answer could count: abandoned, no ack (settled)."""
        assert isinstance(outcome.decision, LeaseLost)
        self.lease_lost(outcome.held.claim, outcome.decision.where)
        return True

    async def _ack(
        self,
        claim: Claim,
        acked: Sequence[ClaimedEvent],
        answer: Answer,
        *,
        keep: bool = False,
        span: DeliverySpan = NO_SPAN,
    ) -> bool:
        """Ack `acked` (a prefix of the claim). Returns True when the ack committed and the run
        is still ours (when `keep`), False when the lease was lost or the ack failed."""
        result = await self.acks.ack(claim, acked[-1].seq, keep=keep)
        return self._acked(claim, acked, answer, result, span)

    def _acked(
        self,
        claim: Claim,
        acked: Sequence[ClaimedEvent],
        answer: Answer,
        result: AckResult,
        span: DeliverySpan = NO_SPAN,
    ) -> bool:
        """What an ack's result means for the claim (see `_ack`)."""
        span.event("acked", status=result.status, events=result.acked, last_seq=result.last_seq)
        if result.status == "not_committed":
            return False  # not settled: the caller's cleanup releases the lease for a redelivery
        if result.status == "stale":
            self.stats.stale_acks += 1
            self.lease_lost(claim, "ack_fenced")
            return False
        self.observe_ack(result)
        if result.status == "failed":
            self.stats.failed += 1
            logs.error("run_blocked", **self.who(claim), reason="ack_failed", error=result.error)
        self.stats.acks += 1
        self.stats.delivered += result.acked
        for e in acked[: result.acked]:
            self.stats.by_type[e.event_type] = self.stats.by_type.get(e.event_type, 0) + 1
        if logs.enabled(logging.INFO):  # the hot path: not even built otherwise
            logs.info(
                "delivered",
                **self.who(claim),
                first_seq=acked[0].seq,
                last_seq=result.last_seq,
                events=result.acked,
                status=answer.status,
                http_ms=round(answer.seconds * 1000, 2),
                lag_ms=round((result.lag_seconds or 0.0) * 1000, 2),
                trace_id=span.trace_id or _trace_id(acked[0].traceparent),
                span_id=span.span_id,
            )
        return result.status == "acked"

    async def _reschedule(self, claim: Claim, retry: Retry) -> bool:
        self.stats.retries += 1
        released = await self.store.release(
            claim, retry.delay, error=retry.error or "no answer", status=retry.status
        )
        logs.log(
            "retry_scheduled",
            logging.WARNING,
            **{**self.who(claim), "attempt": claim.attempts + 1},
            first_seq=claim.first_seq,
            last_seq=claim.last_seq,
            status=retry.status,
            retry_in=round(retry.delay, 3),
            error=retry.error[:200],
            fenced=not released,
        )
        if not released:
            # The token had moved on (e.g. a process frozen past its lease, whose request then
            # timed out): nothing was changed, and the new owner redelivers.
            self.lease_lost(claim, "release_fenced")
        return True

    # -- the pause gate ----------------------------------------------------------------------

    async def _pause(self, claim: Claim, pause: Pause) -> bool:
        """The endpoint is misconfigured: the whole lane backs off, slowly growing."""
        now = anyio.current_time()
        if now >= self._paused_until:
            # Requests that were already in flight when the pause began don't escalate it.
            self._misconfigured += 1
            delay = misconfigured_backoff(self._misconfigured, cap=self.settings.max_backoff)
            self._paused_until = now + delay
        delay = self._paused_until - now
        self.on_ready_change(False)
        await self.store.release(claim, delay)  # not an attempt: the events are not at fault
        logs.error(
            "ingress_misconfigured",
            lane=self.lane,
            status=pause.status,
            url=redact_url(self.settings.ingress_url),
            run_id=claim.run_id,
            pause_s=round(delay, 3),
            body=pause.excerpt,
        )
        return True

    def _ingress_ok(self) -> None:
        if self._misconfigured:
            self._misconfigured = 0
            self.on_ready_change(True)
            logs.info("ingress_recovered", lane=self.lane)

    # -- poison narrowing --------------------------------------------------------------------

    async def _poison(self, outcome: Outcome, poison: Poison) -> bool:
        """Narrow a rejected batch to the event that causes it. When the ingress names it
        (`{"rejected_event_id": ...}`) the events before it are resent as one batch (the rejection
        accepted none of them) and acked, and the named one is failed; otherwise the batch is
        resent one event at a time under the same lease, acking each accepted event (keeping the
        lease), until one is rejected. Events after the bad one stay pending: its run is blocked,
        every other run keeps flowing. Nothing is acked without a 2xx for it."""
        held, events = outcome.held, outcome.events
        claim = held.claim  # its run, token and events: what a renewal leaves as they are
        named = poison.rejected_event_id
        index = next((i for i, e in enumerate(events) if e.event_id == named), None)
        outcome.span.event("poison_narrowing", named=index is not None, events=len(events))
        if index is not None:
            return await self._named(held, claim, events, index, poison)
        if len(events) == 1:
            return await self._block(claim, events[0], poison)
        return await self._one_by_one(held, claim, events, poison)

    async def _named(
        self,
        held: Held,
        claim: Claim,
        events: Sequence[ClaimedEvent],
        index: int,
        poison: Poison,
    ) -> bool:
        """The ingress named the event at `index`: the ones before it are resent as one batch
        and acked (keeping the lease), then it is failed."""
        if index > 0:
            head = await self.resend(held, events[:index])
            if not head.accepted_whole:
                return await self._carry(head)  # lease lost, or acks k, retries the rest
            assert isinstance(head.answer, Answer)
            with traced(head):
                if not await self._ack(claim, head.events, head.answer, keep=True, span=head.span):
                    return True
        return await self._block(claim, events[index], poison)

    async def _one_by_one(
        self, held: Held, claim: Claim, events: Sequence[ClaimedEvent], poison: Poison
    ) -> bool:
        """Resend one event at a time, acking each accepted one (keeping the lease, but for the
        last), until one is rejected: that one is failed."""
        logs.warning(
            "poison_narrowing",
            **self.who(claim),
            first_seq=claim.first_seq,
            last_seq=claim.last_seq,
            status=poison.status,
        )
        for i, event in enumerate(events):
            single = await self.resend(held, [event])
            if not isinstance(single.decision, Ack | Poison):
                return await self._carry(single)  # lease lost, or a retry
            with traced(single):
                if isinstance(single.decision, Poison):
                    return await self._block(claim, event, single.decision)
                assert isinstance(single.answer, Answer)
                last = i == len(events) - 1
                if not await self._ack(
                    claim, [event], single.answer, keep=not last, span=single.span
                ):
                    return True
        return True

    async def _block(self, claim: Claim, event: ClaimedEvent, poison: Poison) -> bool:
        error = f"ingress answered {poison.status}: {poison.excerpt}"
        if not await self.store.fail_event(claim, event.seq, poison.status, error):
            self.lease_lost(claim, "fail_fenced")  # not blocked: the new owner sends it again
            return True
        self.stats.failed += 1
        logs.error(
            "run_blocked",
            **self.who(claim),
            event_id=event.event_id,
            seq=event.seq,
            status=poison.status,
            error=error[:300],
        )
        return True

    # -- shared ------------------------------------------------------------------------------

    async def hand_back(self, claim: Claim) -> None:
        """Release an unsettled lease (shutdown, an error, a lost ack) so another replica takes
        over at once rather than after the TTL. Fenced by token: harmless when stale. Shielded
        and bounded; never raises."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            try:
                await self.store.release(claim)
            except Exception:
                pass

    def who(self, claim: Claim) -> dict[str, object]:
        """The fields every decision about a claim logs (DESIGN §8.2)."""
        return {
            "lane": self.lane,
            "run_id": claim.run_id,
            "epoch": claim.epoch,
            "attempt": claim.attempts,
            "lease_owner": self.store.owner,
        }

    def lease_lost(self, claim: Claim, where: str) -> None:
        self.stats.lease_lost += 1
        logs.warning(
            "lease_lost",
            **self.who(claim),
            first_seq=claim.first_seq,
            last_seq=claim.last_seq,
            where=where,
        )


OUTCOME_NAMES = {Ack: "accepted", Retry: "transient", Pause: "misconfigured", Poison: "poison"}


def traced(outcome: Outcome) -> AbstractContextManager[None]:
    """The outcome on its delivery span, what is done about it inside, and the span ended.
    Not tracing: one shared do-nothing context, nothing built per outcome."""
    if outcome.span is NO_SPAN:
        return _UNTRACED
    return _traced(outcome)


_UNTRACED: AbstractContextManager[None] = nullcontext()


@contextmanager
def _traced(outcome: Outcome) -> Iterator[None]:
    span = outcome.span
    decision = outcome.decision
    if isinstance(decision, LeaseLost):
        span.outcome("lease_lost", where=decision.where)
    else:
        answer = outcome.answer
        span.outcome(
            OUTCOME_NAMES[type(decision)],
            status=answer.status if isinstance(answer, Answer) else None,
            retry_after=decision.retry_after if isinstance(decision, Retry) else None,
            retry_in=decision.delay if isinstance(decision, Retry) else None,
            error=_error_of(decision),
        )
    try:
        yield
    finally:
        span.end()


def _error_of(decision: Ack | Retry | Pause | Poison) -> str | None:
    match decision:
        case Retry(error=error):
            return error[:200] or None
        case Pause(excerpt=excerpt) | Poison(excerpt=excerpt):
            return excerpt[:200] or None
    return None


def _trace_id(traceparent: str | None) -> str | None:
    return traceparent.split("-")[1] if traceparent else None
