"""Complete: the one writer of delivery results, one `Completer` per lane (DESIGN §4.2, §5, §6).

It carries out each `Outcome` that relay/delivery/execute.py returns: acks (grouped,
relay/delivery/ack.py), reschedules and hand-backs (`store.release`), the failure of a poison
event (`store.fail_event`) and the hand-back of a claim while the ingress is misconfigured.
Nothing else writes the result of a delivery, so each write is fenced by the claim's token in
one place.

The writes are two parts it holds, one per way a claim ends: the acks (its `AckGroup`, with what
an ack means for the claim and its counters here) and the releases (relay/delivery/release.py: every
write that gives the claim back without acking it, the poison event's block among them, and the
lost lease). The completer decides which part an outcome goes to; neither part decides for it.

Two parts of the completer decide without writing: the lane's pause gate (relay/delivery/pause.py:
how long the lane pauses while the ingress is misconfigured; the lane and the observers read it
through `gate()`, a value) and poison narrowing (relay/delivery/narrowing.py: which prefix or event
to resend through the executor, given at construction as `resend`, and which event is at fault),
whose acks and failed event are written here, through the `Results` it is given.

Observers hook in after the writes: once an outcome is carried out, it goes to `observe` (with
the ack's result, when it acked), given at construction: the tracer ends the delivery's span
there (relay/edges/tracing.py). Nothing observes from inside a write.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

import anyio

from relay import logs
from relay.core.policy import Ack, Poison, Retry
from relay.delivery.ack import AckGroup
from relay.delivery.execute import LeaseLost, Outcome
from relay.delivery.narrowing import Narrowing, Resend
from relay.delivery.pause import Gate, PauseGate
from relay.delivery.release import Releases
from relay.delivery.stats import CompleteStats
from relay.edges.ingress import Answer
from relay.edges.store import AckResult, Claim, ClaimedEvent, Store
from relay.settings import Settings

Observe = Callable[[Outcome, AckResult | None], None]


class Completer:
    """One per lane: `carry()` from the lane's delivery tasks, `run()` (its ack group) as a
    background task. It is the `Results` of its narrowing (`carry_one`, `ack_resent`,
    `block`). It writes through its ack group (`acks`) and its `releases`, and hands each
    outcome to `observe` once its write is done."""

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
        self.stats = stats
        self.observe_ack = observe_ack  # metrics: commit-to-ack lag
        self.observe = observe  # each outcome once carried out (the tracer's spans end there)
        self.acks = AckGroup(store)
        self.pause = PauseGate(lane, cap=settings.max_backoff, on_ready_change=on_ready_change)
        self.releases = Releases(lane, settings, store, stats, self.pause)
        self.narrowing = Narrowing(resend, self)  # resends through the executor's `resend`

    async def run(self) -> None:
        """The ack group, and the releases' summary of the retries the budget held back."""
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self.releases.summarise)
            await self.acks.run()
            tasks.cancel_scope.cancel()

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
        if len(outcomes) != 1:
            return await self._carry_many(outcomes)
        (outcome,) = outcomes
        return {outcome.run_id: await self.carry_one(outcome)}

    async def _carry_many(self, outcomes: Sequence[Outcome]) -> dict[str, bool]:
        """A multi-run POST's outcomes: the leases lost, then the runs whose whole batch was
        accepted in one call to the ack group, while the rest are carried out one by one."""
        settled: dict[str, bool] = {}
        for lost in (o for o in outcomes if isinstance(o.decision, LeaseLost)):
            settled[lost.run_id] = await self.releases.settle(lost)
            self.observe(lost, None)
        whole = [o for o in outcomes if o.run_id not in settled and o.accepted_whole]
        rest = [o for o in outcomes if o.run_id not in settled and not o.accepted_whole]

        async def carry_rest(outcome: Outcome) -> None:
            settled[outcome.run_id] = await self.carry_one(outcome)

        # Runs whose whole batch was accepted are acked in one call to the ack group, the rest
        # carried out concurrently (so their acks can share that group's transaction).
        async with anyio.create_task_group() as carrying:
            for outcome in rest:
                carrying.start_soon(carry_rest, outcome)
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
            case Ack(k=k):
                acked = outcome.events[:k]
                ack = await self.acks.ack(claim, acked[-1].seq)
                settled = self._acked(claim, outcome, acked, ack)
            case Poison():
                settled = await self.narrowing.narrow(outcome, decision)
            case _:  # the lease lost, a retry deferred or scheduled, the lane paused
                settled = await self.releases.settle(outcome)
        self.observe(outcome, ack)
        return settled

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
            self.releases.lease_lost(claim, "ack_fenced")
            return False
        self.observe_ack(result)
        if result.status == "failed":
            self.stats.failed += 1
            logs.error(
                "run_blocked", **self.releases.who(claim), reason="ack_failed", error=result.error
            )
        self.stats.acks += 1
        self.stats.delivered += result.acked
        for e in acked[: result.acked]:
            self.stats.by_type[e.event_type] = self.stats.by_type.get(e.event_type, 0) + 1
        if logs.enabled(logging.INFO):  # the hot path: not even built otherwise
            logs.info(
                "delivered",
                **self.releases.who(claim),
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

    # -- the narrowing's writes (its `Results`) ----------------------------------------------

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
        settled = await self.releases.block(claim, event, poison)
        if resent is not None:
            self.observe(resent, None)
        return settled

    # -- shared with the lane's other parts --------------------------------------------------

    async def hand_back(self, claim: Claim) -> None:
        """Release an unsettled lease: its releases' `hand_back` (fenced by token, shielded and
        bounded; never raises)."""
        await self.releases.hand_back(claim)

    def who(self, claim: Claim) -> dict[str, object]:
        """The fields every decision about a claim logs (DESIGN §8.2), as its releases name
        them."""
        return self.releases.who(claim)


def _trace_id(traceparent: str | None) -> str | None:
    return traceparent.split("-")[1] if traceparent else None
