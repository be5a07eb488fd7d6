"""Poison narrowing: finding the one event of a rejected batch that the ingress refuses.

A 4xx that is not "misconfigured" rejects a batch for one bad event (DESIGN §5, §9.2). When the
ingress names it (`{"rejected_event_id": ...}`) the events before it are resent as one batch (the
rejection accepted none of them) and acked, and the named one is failed; otherwise the batch is
resent one event at a time under the same lease, acking each accepted event (keeping the lease),
until one is rejected. Events after the bad one stay pending: its run is blocked, every other
run keeps flowing. Nothing is acked without a 2xx for it.

The narrowing writes nothing itself. Each step depends on the answer to the one before, so this
module keeps the whole conversation (resend through the executor, read the answer, go on or
stop) in one loop, and every write it decides on goes through the completer's `Results`
(relay/delivery/complete.py): the acks, the failed event, and any other outcome a resend comes to (a
lost lease, a retry, a pause) carried out the ordinary way. The completer stays the one writer
of delivery results, each write fenced by the claim's token there; a pure planner driven by the
completer would split this one short story between two modules.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from relay import logs
from relay.core.policy import Ack, Poison
from relay.delivery.execute import Outcome
from relay.edges.store import Claim, ClaimedEvent, Held

Resend = Callable[[Held, Sequence[ClaimedEvent]], Awaitable[Outcome]]


class Results(Protocol):
    """The completer's writes that the narrowing asks for. Each returns whether the run's
    lease is settled, as `Completer.carry` does, except `ack_resent`."""

    def who(self, claim: Claim) -> dict[str, object]: ...

    async def carry_one(self, outcome: Outcome) -> bool:
        """Carry out a resend's outcome the ordinary way (not an ack of all it sent, not a
        rejection of the one event it sent)."""
        ...

    async def ack_resent(self, claim: Claim, resent: Outcome, *, keep: bool) -> bool:
        """Ack every event of a resend the ingress accepted whole. True when the ack committed
        and the run is still ours (with `keep`): the narrowing may go on."""
        ...

    async def block(
        self, claim: Claim, event: ClaimedEvent, poison: Poison, *, resent: Outcome | None = None
    ) -> bool:
        """Fail `event` and block its run (`resent`: the resend whose answer rejected it)."""
        ...


class Narrowing:
    """One per lane, owned by its completer: `narrow()` for each outcome decided `Poison`."""

    def __init__(self, resend: Resend, results: Results) -> None:
        self.resend = resend  # the executor's
        self.results = results

    async def narrow(self, outcome: Outcome, poison: Poison) -> bool:
        """Narrow `outcome`'s rejected batch to the event that causes it (see the module)."""
        held, events = outcome.held, outcome.events
        claim = held.claim  # its run, token and events: what a renewal leaves as they are
        named = poison.rejected_event_id
        index = next((i for i, e in enumerate(events) if e.event_id == named), None)
        if index is not None:
            return await self._named(held, claim, events, index, poison)
        if len(events) == 1:
            return await self.results.block(claim, events[0], poison)
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
                return await self.results.carry_one(head)  # lease lost, or acks k, retries
            if not await self.results.ack_resent(claim, head, keep=True):
                return True
        return await self.results.block(claim, events[index], poison)

    async def _one_by_one(
        self, held: Held, claim: Claim, events: Sequence[ClaimedEvent], poison: Poison
    ) -> bool:
        """Resend one event at a time, acking each accepted one (keeping the lease, but for the
        last), until one is rejected: that one is failed."""
        logs.warning(
            "poison_narrowing",
            **self.results.who(claim),
            first_seq=claim.first_seq,
            last_seq=claim.last_seq,
            status=poison.status,
        )
        for i, event in enumerate(events):
            single = await self.resend(held, [event])
            if not isinstance(single.decision, Ack | Poison):
                return await self.results.carry_one(single)  # lease lost, or a retry
            if isinstance(single.decision, Poison):
                return await self.results.block(claim, event, single.decision, resent=single)
            last = i == len(events) - 1
            if not await self.results.ack_resent(claim, single, keep=not last):
                return True
        return True
