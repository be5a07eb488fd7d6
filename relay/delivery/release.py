"""Releases: the completer's writes that give a claim back without acking it (DESIGN §4.2, §5).

An outcome that acks nothing ends the claim in one of these writes, each fenced by the claim's
token: a reschedule after a failed attempt (`Retry`), a retry the budget held back (`Deferred`:
not an attempt), the hand-back while the ingress is misconfigured (`Pause`: for as long as the
lane's pause gate says, not an attempt either), the failure of a poison event, which blocks its
run and clears its lease (`store.fail_event`), and the hand-back of a lease nothing settled
(shutdown, an error, an ack that did not commit). A write the token fenced changed nothing: the
lease was lost, and the new owner redelivers. `lease_lost` counts and logs that, for these
writes, for a fenced ack and for an outcome that came too late; it writes nothing.

The block write is here rather than beside the acks: like a release it ends the claim without
acking any of it, fenced by the token alone, straight through the store, while the acks share
the ack group's transaction (relay/delivery/ack.py) and count what was delivered.

The completer (relay/delivery/complete.py) holds one `Releases` per lane, as it holds its ack group,
and stays the one writer of results: it decides which write an outcome takes and hands the outcome
to its observer once the write is done. Nothing here observes, and nothing here decides how
long the lane pauses: the pause gate does (relay/delivery/pause.py), given at construction.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import anyio

from relay import logs
from relay.core import clock
from relay.core.policy import Pause, Poison, Retry
from relay.delivery.execute import Deferred, LeaseLost, Outcome
from relay.delivery.pause import PauseGate
from relay.delivery.stats import CompleteStats
from relay.edges.store import Claim, ClaimedEvent, Store
from relay.settings import Settings, redact_url

SUMMARY_INTERVAL = 10.0  # seconds: at most one `retries_deferred` line per lane in each


@dataclass(slots=True)
class Deferrals:
    """The retries a lane's budget held back since its last `retries_deferred` line."""

    since: float = field(default_factory=clock.now)
    count: int = 0
    runs: set[str] = field(default_factory=set)
    soonest: float = math.inf  # the shortest and longest waits they were given
    latest: float = 0.0

    def add(self, run_id: str, delay: float) -> None:
        self.count += 1
        self.runs.add(run_id)
        self.soonest = min(self.soonest, delay)
        self.latest = max(self.latest, delay)

    def told(self, lane: str) -> Deferrals:
        """Log them, when there were any (`retries_deferred`, info), and start a new count."""
        if self.count:
            logs.info(
                "retries_deferred",
                lane=lane,
                deferred=self.count,
                runs=len(self.runs),
                over_s=round(clock.now() - self.since, 3),
                retry_in_min=round(self.soonest, 3),
                retry_in_max=round(self.latest, 3),
                reason="retry_budget",
            )
        return Deferrals()


class Releases:
    """One per lane, owned by its completer: each write returns whether the run's lease is
    settled, as `Completer.carry` does. It counts into the completer's `stats`, and names a
    claim in its log lines as every part does (`who`)."""

    def __init__(
        self, lane: str, settings: Settings, store: Store, stats: CompleteStats, gate: PauseGate
    ) -> None:
        self.lane = lane
        self.settings = settings
        self.store = store
        self.stats = stats  # the completer's
        self.gate = gate  # the completer's: how long a misconfigured ingress pauses the lane
        self.deferrals = Deferrals()  # since the last `retries_deferred` line

    async def summarise(self, every: float = SUMMARY_INTERVAL) -> None:
        """The lane's retries the budget held back, one `retries_deferred` line per `every`
        seconds in which there were any (and one for the last ones when the lane stops), rather
        than a line per run per pass: in issue 49's outage, 2,751 of 3,703 lines."""
        try:
            while True:
                await anyio.sleep(every)
                self.deferrals = self.deferrals.told(self.lane)
        finally:
            self.deferrals = self.deferrals.told(self.lane)

    async def settle(self, outcome: Outcome) -> bool:
        """Carry out an outcome that acks nothing and blames no event: the lease lost before an
        answer could count (abandoned: nothing to write), a retry the budget deferred, a retry
        scheduled after a failed attempt, or the lane paused. The run's lease is settled."""
        claim, decision = outcome.held.claim, outcome.decision
        match decision:
            case LeaseLost(where=where):
                self.lease_lost(claim, where)
                return True
            case Deferred():
                return await self.defer(claim, decision)
            case Retry():
                return await self.reschedule(claim, decision, echo=outcome.echo)
            case Pause():
                return await self.pause(claim, decision)
        raise ValueError(f"not a release: {decision!r}")  # acks and poison are the completer's

    async def reschedule(self, claim: Claim, retry: Retry, *, echo: bool = False) -> bool:
        """A failed attempt: the run waits `retry.delay` in the outbox, when its next attempt
        goes. Its own backoff, or, when the retry budget is spent, longer (`retry.backoff` was
        the backoff): the line says `retry_budget: "spent"` then, since the budget decides.
        A warning, except for a run whose failure its request's first run has said (`echo`)."""
        self.stats.retries += 1
        released = await self.store.release(
            claim, retry.delay, error=retry.error or "no answer", status=retry.status
        )
        logs.log(
            "retry_scheduled",
            logging.INFO if echo else logging.WARNING,
            **{**self.who(claim), "attempt": claim.attempts + 1},
            first_seq=claim.first_seq,
            last_seq=claim.last_seq,
            status=retry.status,
            retry_in=round(retry.delay, 3),
            backoff=round(retry.backoff, 3) if retry.backoff is not None else None,
            retry_budget="spent" if retry.backoff is not None else None,
            error=retry.error[:200],
            fenced=not released,
        )
        if not released:
            # The token had moved on (e.g. a process frozen past its lease, whose request then
            # timed out): nothing was changed, and the new owner redelivers.
            self.lease_lost(claim, "release_fenced")
        return True

    async def defer(self, claim: Claim, deferred: Deferred) -> bool:
        """A retry the budget held back: nothing was sent, the lease goes back and the run
        waits in the outbox. Not an attempt: its backoff does not grow for it. Its own line is
        at debug; the lane's `retries_deferred` line counts them (`summarise`)."""
        released = await self.store.release(claim, deferred.delay)
        self.deferrals.add(claim.run_id, deferred.delay)
        logs.debug(
            "retry_deferred",
            **{**self.who(claim), "attempt": claim.attempts + 1},
            retry_in=round(deferred.delay, 3),
            reason="retry_budget",
            fenced=not released,
        )
        if not released:
            self.lease_lost(claim, "release_fenced")
        return True

    async def pause(self, claim: Claim, pause: Pause) -> bool:
        """The endpoint is misconfigured: the whole lane backs off (the gate says how long), and
        the claim is handed back for as long."""
        delay = self.gate.misconfigured(anyio.current_time())
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

    async def block(self, claim: Claim, event: ClaimedEvent, poison: Poison) -> bool:
        """Fail the poison event and block its run (what the narrowing found at fault)."""
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

    async def hand_back(self, claim: Claim) -> None:
        """Release an unsettled lease (shutdown, an error, a lost ack) so another replica takes
        over at once rather than after the TTL. Fenced by token: harmless when stale. Shielded
        and bounded; never raises. One that fails (the database unreachable) is owed: the
        lane's loop gives it back once the database answers (`Store.give_back`)."""
        released = False
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            try:
                await self.store.release(claim)
                released = True
            except Exception:
                pass
        if not released:
            self.store.owe(claim)

    def lease_lost(self, claim: Claim, where: str) -> None:
        self.stats.lease_lost += 1
        logs.warning(
            "lease_lost",
            **self.who(claim),
            first_seq=claim.first_seq,
            last_seq=claim.last_seq,
            where=where,
        )

    def who(self, claim: Claim) -> dict[str, object]:
        """The fields every decision about a claim logs (DESIGN §8.2)."""
        return {
            "lane": self.lane,
            "run_id": claim.run_id,
            "epoch": claim.epoch,
            "attempt": claim.attempts,
            "lease_owner": self.store.owner,
        }
