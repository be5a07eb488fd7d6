"""Delivery of one claim, or of one multi-run group, once its lane gave it a POST slot (DESIGN
§4.2, §5).

Check the lease is trusted long enough for a whole request (renew first if not), POST while the
lane's renewer keeps the lease (and cancels the request when it is lost), with quick retries
for blips, then carry out what the answer means. `relay.policy.decide` says that, once per
answer, as one value: ack (grouped, relay/ack.py), reschedule through the database, pause the
lane, or isolate a poison event; this module only carries it out.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import anyio

from relay import logs
from relay.ack import AckGroup
from relay.ingress import Answer, Batch, IngressClient, TransportFailure, split_results
from relay.policy import Ack, Decision, Pause, Poison, Retry, decide, misconfigured_backoff
from relay.renewal import Renewer
from relay.retries import QuickRetries
from relay.settings import Settings, redact_url
from relay.stats import LaneStats
from relay.store import AckResult, Claim, ClaimedEvent, Held, Store


@dataclass(frozen=True, slots=True)
class Reply:
    """One answer to one run's batch (or the failure to get one) and what it means."""

    answer: Answer | TransportFailure
    decision: Decision


@dataclass(frozen=True, slots=True)
class GroupReply:
    """The answers to one multi-run POST, per run. `whole`: one answer for the whole request
    (it failed, or was not 2xx), rather than a 2xx reply with one result per run."""

    replies: dict[str, Reply]
    whole: bool


class Delivery:
    """One per lane: `deliver()` / `deliver_group()` from the lane's delivery tasks, `run()` (its
    ack group and renewer) as a background task."""

    def __init__(
        self,
        lane: str,
        settings: Settings,
        store: Store,
        ingress: IngressClient,
        stats: LaneStats,
        *,
        on_ready_change: Callable[[bool], None],
        observe_ack: Callable[[AckResult], None],
    ) -> None:
        self.lane = lane
        self.settings = settings
        self.store = store
        self.ingress = ingress
        self.stats = stats
        self.on_ready_change = on_ready_change
        self.observe_ack = observe_ack  # metrics: commit-to-ack lag
        self.acks = AckGroup(store)
        self.renewer = Renewer(store, settings.lease_ttl)
        self._quick = QuickRetries(_quick, settings.http_timeout)
        self._quick_group = QuickRetries(_quick_group, settings.http_timeout)
        self.paused_until = 0.0  # the lane claims nothing before this (monotonic clock)
        self.misconfigured = 0  # consecutive misconfigured answers; 0 once one is accepted

    async def run(self) -> None:
        async with anyio.create_task_group() as background:
            background.start_soon(self.acks.run)
            background.start_soon(self.renewer.run)

    # -- one claim ---------------------------------------------------------------------------

    async def deliver(self, held: Held, free_slot: Callable[[], None]) -> bool:
        """Deliver one claim (its current value in `held`, where a widening or a renewal is
        kept). Returns True when the lease was settled (acked, released or lost). `free_slot`
        hands the POST slot back early, once only the ack is left."""
        if held.claim.widen:
            more = await self.store.widen(held.claim)
            held.claim = held.claim.widened(more)
            self.stats.widened += len(more)
        if not held.claim.trust.allows_post(anyio.current_time(), self.settings.http_timeout):
            # Waited in the local queue too long to finish a whole request inside the lease.
            self.stats.renewed_before_post += 1
            if held.claim.run_id not in await self.renewer.renew([held]):
                self._lease_lost(held.claim, "renew_before_post")
                return True
        events = held.claim.events
        reply = await self._post_renewing(held, events)
        if reply is None:
            return True  # lease lost mid-flight: abandoned, no ack
        if isinstance(reply.decision, Ack) and reply.decision.k == len(events):
            # Pipelining: the ingress has answered and nothing but the (grouped) ack is left,
            # so the next claim's POST need not wait for this commit. The run stays claimed
            # (and its lease fenced) until the ack settles it.
            free_slot()
        return await self._carry(held, events, reply)

    async def _post_renewing(self, held: Held, events: Sequence[ClaimedEvent]) -> Reply | None:
        """POST with quick retries while the lane's renewer keeps the lease (each attempt reads
        the claim's current trust window from `held`); a failed renewal cancels the request.
        Returns None when the lease was lost."""
        reply: Reply | None = None
        with self.renewer.renewing([held]) as renewal:
            reply = await self._quick(
                lambda: self._post_once(held.claim, events), lambda: held.claim.trust
            )
        if renewal.lost:
            self._lease_lost(held.claim, "renewal_failed")
            return None
        return reply

    async def _post_once(self, claim: Claim, events: Sequence[ClaimedEvent]) -> Reply:
        self.stats.posts += 1
        answer: Answer | TransportFailure
        try:
            answer = await self.ingress.post(_batch(claim, events))
        except TransportFailure as exc:
            answer = exc
        return self._reply(claim, len(events), answer)

    def _reply(self, claim: Claim, n_events: int, answer: Answer | TransportFailure) -> Reply:
        """The one place an answer is decided (the clock and the jitter come from here)."""
        decision = decide(
            answer,
            n_events,
            attempt=claim.attempts,
            now=datetime.now(UTC),
            rand=random.random(),
            cap=self.settings.max_backoff,
        )
        return Reply(answer, decision)

    # -- several small runs in one POST (ingress_batch_url) -----------------------------------

    async def deliver_group(
        self, group: list[Held], free_slot: Callable[[], None] = lambda: None
    ) -> dict[str, bool]:
        """One POST to `ingress_batch_url`; each run's answer is then carried out exactly like a
        single-run answer. Returns, per run, whether its lease was settled. `held` and
        `free_slot` as in `deliver`: the slot once every run's batch was accepted whole."""
        settled: dict[str, bool] = {}
        now = anyio.current_time()
        http_timeout = self.settings.http_timeout
        waited = [h for h in group if not h.claim.trust.allows_post(now, http_timeout)]
        if waited:
            self.stats.renewed_before_post += len(waited)
            renewed = await self.renewer.renew(waited)
            for h in waited:
                if h.claim.run_id not in renewed:
                    self._lease_lost(h.claim, "renew_before_post")
                    settled[h.claim.run_id] = True
            group = [h for h in group if h.claim.run_id not in settled]
        if not group:
            return settled
        result: GroupReply | None = None
        # A run whose renewal fails stays in the request (it cannot be unsent); its ack is
        # fenced. Only when every lease is gone is the request cancelled.
        with self.renewer.renewing(group) as renewal:
            result = await self._quick_group(
                lambda: self._post_group_once([h.claim for h in group]),
                lambda: min((h.claim.trust for h in group), key=lambda t: t.until),
            )
        live = renewal.live
        for h in group:
            if h.claim.run_id not in live:
                self._lease_lost(h.claim, "renewal_failed")
                settled[h.claim.run_id] = True
        group = [h for h in group if h.claim.run_id in live]
        if result is None or not group:
            return settled
        replies = result.replies
        refusal = next(iter(replies.values())).decision
        if result.whole and isinstance(refusal, Poison):
            # One refusal of the whole request does not say which run (if any) is poison: each
            # run is sent alone to `ingress_url`, in this slot, and only its own answer decides.
            logs.warning(
                "batch_refused", lane=self.lane, runs=len(group), status=refusal.status,
                error=refusal.excerpt[:300],
            )  # fmt: skip
            for h in group:
                settled[h.claim.run_id] = await self.deliver(h, lambda: None)
            return settled

        async def carry(h: Held) -> None:
            settled[h.claim.run_id] = await self._carry(h, h.claim.events, replies[h.claim.run_id])

        # Runs whose whole batch was accepted are acked in one call to the ack group, the rest
        # carried out concurrently (so their acks can share that group's transaction).
        whole: list[Held] = []
        rest: list[Held] = []
        for h in group:
            accepted = _accepted_whole(replies[h.claim.run_id], len(h.claim.events))
            (whole if accepted else rest).append(h)
        if not rest:
            free_slot()  # pipelining, as in `deliver`: nothing but the acks is left
        async with anyio.create_task_group() as carrying:
            for h in rest:
                carrying.start_soon(carry, h)
            if whole:
                self._ingress_ok()
                claims = [h.claim for h in whole]
                acked = await self.acks.ack_many([(c, c.events[-1].seq, False) for c in claims])
                for c, one in zip(claims, acked, strict=True):
                    answer = replies[c.run_id].answer
                    assert isinstance(answer, Answer)  # decide acks only an answer
                    settled[c.run_id] = self._acked(c, c.events, answer, one)
        return settled

    async def _post_group_once(self, group: list[Claim]) -> GroupReply:
        self.stats.posts += 1
        answer: Answer | TransportFailure
        try:
            answer = await self.ingress.post_group([_batch(c, c.events) for c in group])
        except TransportFailure as exc:
            answer = exc
        if isinstance(answer, Answer) and 200 <= answer.status < 300:
            per_run = split_results(answer, [c.run_id for c in group])
            whole = False
        else:
            per_run = {c.run_id: answer for c in group}  # the whole request failed
            whole = True
        replies = {c.run_id: self._reply(c, len(c.events), per_run[c.run_id]) for c in group}
        return GroupReply(replies, whole)

    # -- carrying out a decision -------------------------------------------------------------

    async def _carry(self, held: Held, events: Sequence[ClaimedEvent], reply: Reply) -> bool:
        """Do what the answer to `events` (a prefix of the claim) means. Returns True when the
        lease was settled; an ack that did not commit is not (the caller hands the lease back:
        fenced by token, so a no-op when the ack released it or the lease was lost)."""
        claim = held.claim
        decision = reply.decision
        if isinstance(decision, Ack) or (isinstance(decision, Retry) and decision.endpoint_ok):
            self._ingress_ok()
        match decision:
            case Ack(k=k):
                assert isinstance(reply.answer, Answer)  # decide acks only an answer
                return await self._ack(claim, events[:k], reply.answer)
            case Retry():
                return await self._reschedule(claim, decision)
            case Pause():
                return await self._pause(claim, decision)
            case Poison():
                return await self._poison(held, events, decision)

    async def _ack(
        self, claim: Claim, acked: Sequence[ClaimedEvent], answer: Answer, *, keep: bool = False
    ) -> bool:
        """Ack `acked` (a prefix of the claim). Returns True when the ack committed and the run
        is still ours (when `keep`), False when the lease was lost or the ack failed."""
        result = await self.acks.ack(claim, acked[-1].seq, keep=keep)
        return self._acked(claim, acked, answer, result)

    def _acked(
        self, claim: Claim, acked: Sequence[ClaimedEvent], answer: Answer, result: AckResult
    ) -> bool:
        """What an ack's result means for the claim (see `_ack`)."""
        if result.status == "not_committed":
            return False  # not settled: the caller's cleanup releases the lease for a redelivery
        if result.status == "stale":
            self.stats.stale_acks += 1
            self._lease_lost(claim, "ack_fenced")
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
                trace_id=_trace_id(acked[0].traceparent),
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
            self._lease_lost(claim, "release_fenced")
        return True

    async def _pause(self, claim: Claim, pause: Pause) -> bool:
        """The endpoint is misconfigured: the whole lane backs off, slowly growing."""
        now = anyio.current_time()
        if now >= self.paused_until:
            # Requests that were already in flight when the pause began don't escalate it.
            self.misconfigured += 1
            delay = misconfigured_backoff(self.misconfigured, cap=self.settings.max_backoff)
            self.paused_until = now + delay
        delay = self.paused_until - now
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
        if self.misconfigured:
            self.misconfigured = 0
            self.on_ready_change(True)
            logs.info("ingress_recovered", lane=self.lane)

    async def _poison(self, held: Held, events: Sequence[ClaimedEvent], poison: Poison) -> bool:
        """Narrow a rejected batch to the event that causes it. When the ingress names it
        (`{"rejected_event_id": ...}`) the events before it are resent as one batch (the rejection
        accepted none of them) and acked, and the named one is failed; otherwise the batch is
        resent one event at a time under the same lease, acking each accepted event (keeping the
        lease), until one is rejected. Events after the bad one stay pending: its run is blocked,
        every other run keeps flowing. Nothing is acked without a 2xx for it."""
        claim = held.claim  # its run, token and events: what a renewal leaves as they are
        named = poison.rejected_event_id
        index = next((i for i, e in enumerate(events) if e.event_id == named), None)
        if index is not None:
            if index > 0:
                before = events[:index]
                head = await self._post_renewing(held, before)
                if head is None:
                    return True
                if not isinstance(head.decision, Ack) or head.decision.k < len(before):
                    return await self._carry(held, before, head)  # acks k, retries the rest
                assert isinstance(head.answer, Answer)
                if not await self._ack(claim, before, head.answer, keep=True):
                    return True
            return await self._block(claim, events[index], poison)
        if len(events) == 1:
            return await self._block(claim, events[0], poison)
        logs.warning(
            "poison_narrowing",
            **self.who(claim),
            first_seq=claim.first_seq,
            last_seq=claim.last_seq,
            status=poison.status,
        )
        for i, event in enumerate(events):
            single = await self._post_renewing(held, [event])
            if single is None:
                return True  # lease lost: abandoned
            if isinstance(single.decision, Poison):
                return await self._block(claim, event, single.decision)
            if not isinstance(single.decision, Ack):
                return await self._carry(held, [event], single)
            assert isinstance(single.answer, Answer)
            last = i == len(events) - 1
            if not await self._ack(claim, [event], single.answer, keep=not last):
                return True
        return True

    async def _block(self, claim: Claim, event: ClaimedEvent, poison: Poison) -> bool:
        error = f"ingress answered {poison.status}: {poison.excerpt}"
        if not await self.store.fail_event(claim, event.seq, poison.status, error):
            self._lease_lost(claim, "fail_fenced")  # not blocked: the new owner sends it again
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

    def _lease_lost(self, claim: Claim, where: str) -> None:
        self.stats.lease_lost += 1
        logs.warning(
            "lease_lost",
            **self.who(claim),
            first_seq=claim.first_seq,
            last_seq=claim.last_seq,
            where=where,
        )


def _batch(claim: Claim, events: Sequence[ClaimedEvent]) -> Batch:
    """What the ingress client sends of a claim (it never sees the lease)."""
    return Batch(claim.run_id, claim.epoch, events, claim.database_time(anyio.current_time()))


def _accepted_whole(reply: Reply, n_events: int) -> bool:
    return isinstance(reply.decision, Ack) and reply.decision.k == n_events


def _quick(reply: Reply) -> bool:
    return isinstance(reply.decision, Retry) and reply.decision.quick


def _quick_group(result: GroupReply) -> bool:
    """A whole multi-run request failed with a blip; a 2xx with per-run results never is."""
    return result.whole and all(_quick(r) for r in result.replies.values())


def _trace_id(traceparent: str | None) -> str | None:
    return traceparent.split("-")[1] if traceparent else None
