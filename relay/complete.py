"""Complete: the one writer of delivery results, one `Completer` per lane (DESIGN §4.2, §5, §6).

It carries out each `Outcome` that relay/execute.py returns: acks (grouped, relay/ack.py),
reschedules and hand-backs (`store.release`), the failure of a poison event (`store.fail_event`)
and the hand-back of a claim while the ingress is misconfigured. Nothing else writes the result
of a delivery, so each write is fenced by the claim's token in one place.

Two parts of the completer decide without writing: the lane's pause gate (relay/pause.py: how
long the lane pauses while the ingress is misconfigured; the lane and the observers read it
through `gate()`, a value) and poison narrowing (relay/narrowing.py: which prefix or event to
resend through the executor, given at construction as `resend`, and which event is at fault),
whose acks and failed event are written here, through the `Results` it is given.

Observers hook in after the writes: once an outcome is carried out, it goes to `observe` (with
the ack's result, when it acked), given at construction: the tracer ends the delivery's span
there (relay/tracing.py). Nothing observes from inside a write.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

import anyio

from relay import logs
from relay.ack import AckGroup
from relay.execute import Deferred, LeaseLost, Outcome
from relay.ingress import Answer
from relay.narrowing import Narrowing, Resend
from relay.pause import Gate, PauseGate
from relay.policy import Ack, Pause, Poison, Retry
from relay.settings import Settings, redact_url
from relay.stats import CompleteStats
from relay.store import AckResult, Claim, ClaimedEvent, Store

Observe = Callable[[Outcome, AckResult | None], None]


class Completer:
    """One per lane: `carry()` from the lane's delivery tasks, `run()` (its ack group) as a
    background task. It is the `Results` of its narrowing (`carry_one`, `ack_resent`,
    `block`)."""

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
        observe: Observe,
    ) -> None:
        self.lane = lane
        self.settings = settings
        self.store = store
        self.stats = stats
        self.observe_ack = observe_ack  # metrics: commit-to-ack lag
        self.observe = observe  # each outcome once carried out (the tracer's spans end there)
        self.acks = AckGroup(store)
        self.pause = PauseGate(lane, cap=settings.max_backoff, on_ready_change=on_ready_change)
        self.narrowing = Narrowing(resend, self)  # resends through the executor's `resend`

    async def run(self) -> None:
        await self.acks.run()

    def close(self) -> None:
        """For a completer never run: close its ack queue."""
        self.acks.close()

    def gate(self) -> Gate:
        return self.pause.view()

    def view(self) -> CompleteStats:
        """The completer's counters, a copy (for the lane's view)."""
        return replace(self.stats, by_type=dict(self.stats.by_type), ack_groups=self.acks.groups)

    # -- carrying out outcomes ---------------------------------------------------------------

    async def carry(self, outcomes: Sequence[Outcome]) -> dict[str, bool]:
        """Do what each run's outcome means. Returns, per run, whether its lease was settled;
        an ack that did not commit is not (the lane hands the lease back: fenced by token, so
        a no-op when the ack released it or the lease was lost)."""
        if len(outcomes) == 1:
            (outcome,) = outcomes
            return {outcome.run_id: await self.carry_one(outcome)}
        settled: dict[str, bool] = {}
        for lost in (o for o in outcomes if isinstance(o.decision, LeaseLost)):
            settled[lost.run_id] = self._lost(lost)
            self.observe(lost, None)
        whole = [o for o in outcomes if o.run_id not in settled and o.accepted_whole]
        rest = [o for o in outcomes if o.run_id not in settled and not o.accepted_whole]

        async def carry(outcome: Outcome) -> None:
            settled[outcome.run_id] = await self.carry_one(outcome)

        # Runs whose whole batch was accepted are acked in one call to the ack group, the rest
        # carried out concurrently (so their acks can share that group's transaction).
        async with anyio.create_task_group() as carrying:
            for outcome in rest:
                carrying.start_soon(carry, outcome)
            if whole:
                self.pause.ingress_ok()
                claims = [o.held.claim for o in whole]
                acked = await self.acks.ack_many([(c, c.events[-1].seq, False) for c in claims])
                for o, c, one in zip(whole, claims, acked, strict=True):
                    settled[c.run_id] = self._acked(c, o, c.events, one)
                    self.observe(o, one)
        return settled

    async def carry_one(self, outcome: Outcome) -> bool:
        """Do what one run's outcome (its answer to `events`, a prefix of the claim) means,
        then hand it to the observer."""
        claim = outcome.held.claim
        decision = outcome.decision
        if isinstance(decision, Ack) or (isinstance(decision, Retry) and decision.endpoint_ok):
            self.pause.ingress_ok()
        ack = None
        match decision:
            case LeaseLost():
                settled = self._lost(outcome)
            case Deferred():
                settled = await self._defer(claim, decision)
            case Ack(k=k):
                acked = outcome.events[:k]
                ack = await self.acks.ack(claim, acked[-1].seq)
                settled = self._acked(claim, outcome, acked, ack)
            case Retry():
                settled = await self._reschedule(claim, decision)
            case Pause():
                settled = await self._pause(claim, decision)
            case Poison():
                settled = await self.narrowing.narrow(outcome, decision)
        self.observe(outcome, ack)
        return settled

    def _lost(self, outcome: Outcome) -> bool:
        """The lease was lost before an answer could count: abandoned, no ack (settled)."""
        assert isinstance(outcome.decision, LeaseLost)
        self.lease_lost(outcome.held.claim, outcome.decision.where)
        return True

    def _acked(
        self, claim: Claim, outcome: Outcome, acked: Sequence[ClaimedEvent], result: AckResult
    ) -> bool:
        """What the ack of `acked` (a prefix of the claim, all `outcome` accepted) means for the
        claim: True when it committed and the run is still ours (when the ack kept the lease),
        False when the lease was lost or the ack did not commit."""
        answer = outcome.answer
        assert isinstance(answer, Answer)  # decide acks only an answer
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
                trace_id=outcome.span.trace_id or _trace_id(acked[0].traceparent),
                span_id=outcome.span.span_id,
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

    async def _defer(self, claim: Claim, deferred: Deferred) -> bool:
        """A retry the budget held back: nothing was sent, the lease goes back and the run
        waits in the outbox. Not an attempt: its backoff does not grow for it."""
        released = await self.store.release(claim, deferred.delay)
        logs.info(
            "retry_deferred",
            **{**self.who(claim), "attempt": claim.attempts + 1},
            retry_in=round(deferred.delay, 3),
            reason="retry_budget",
            fenced=not released,
        )
        if not released:
            self.lease_lost(claim, "release_fenced")
        return True

    # -- what the pause gate and the narrowing decide ---------------------------------------

    async def _pause(self, claim: Claim, pause: Pause) -> bool:
        """The endpoint is misconfigured: the whole lane backs off (the gate says how long), and
        the claim is handed back for as long."""
        delay = self.pause.misconfigured(anyio.current_time())
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

    async def ack_resent(self, claim: Claim, resent: Outcome, *, keep: bool) -> bool:
        """Ack all a narrowing's resend sent, accepted whole (see `_acked`), then hand the
        resend to the observer."""
        result = await self.acks.ack(claim, resent.events[-1].seq, keep=keep)
        settled = self._acked(claim, resent, resent.events, result)
        self.observe(resent, result)
        return settled

    async def block(
        self, claim: Claim, event: ClaimedEvent, poison: Poison, *, resent: Outcome | None = None
    ) -> bool:
        """Fail the poison event and block its run; `resent`: the narrowing's resend that
        rejected it, handed to the observer after."""
        settled = await self._block(claim, event, poison)
        if resent is not None:
            self.observe(resent, None)
        return settled

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


def _trace_id(traceparent: str | None) -> str | None:
    return traceparent.split("-")[1] if traceparent else None
