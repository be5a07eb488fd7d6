"""A lane: discovery, concurrency and the delivery of claimed run prefixes (DESIGN §4.2-4.3, §5).

The relay has two: `critical` (runs with a pending terminal event; targeted drains) and
`ordinary` (any due run, critical ones included when it has room). Each has its own
concurrency, database pool, HTTP client and ack group, so a full ordinary lane cannot delay
the critical one.

Delivery of one claim: check the lease is trusted long enough for a whole request (renew
first if not), POST while the lane's renewer keeps the lease (and cancels the request when it
is lost), then act on the answer (DESIGN §5 table): ack (grouped), reschedule through the
database, pause the lane, or isolate a poison event.
"""

from __future__ import annotations

import copy
import logging
import random
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import anyio
import orjson
import psycopg
from anyio.abc import TaskGroup
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    retry_if_result,
    stop_after_attempt,
    stop_any,
    wait_random_exponential,
)
from tenacity.stop import stop_base

from relay import logs
from relay.ack import AckGroup
from relay.ingress import Answer, IngressClient, TransportFailure, split_results
from relay.policy import (
    Outcome,
    Trust,
    accepted_count,
    classify,
    misconfigured_backoff,
    parse_retry_after,
    renew_interval,
    retry_delay,
)
from relay.settings import Settings, redact_url
from relay.store import AckResult, Claim, ClaimedEvent, Store

BACKOFF_BASE = 0.5
QUICK_ATTEMPTS = 3
MIN_EMPTY_PASS_SPACING = 0.01  # coalesces bursts of wakes into a handful of passes
BODY_EXCERPT = 512


class Wake:
    """A level-triggered, coalescing wake-up: many set() calls, one wait() return."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self, within: float) -> bool:
        with anyio.move_on_after(within):
            await self._event.wait()
        fired = self._event.is_set()
        if fired:
            self._event = anyio.Event()
        return fired


class Renewal:
    """Claims on the wire, kept by their lane's renewer (`Lane._renewer`) while the block runs;
    the block is cancelled once none of their leases is held any more (`lost`)."""

    def __init__(self, claims: list[Claim], registry: set[Renewal]) -> None:
        self.claims = claims
        self.live = {c.run_id for c in claims}
        self.lost = False
        self._registry = registry
        self._scope = anyio.CancelScope()

    def lose(self, runs: Iterable[str]) -> None:
        self.live.difference_update(runs)
        if not self.live and not self.lost:
            self.lost = True
            self._scope.cancel()

    def __enter__(self) -> Renewal:
        self._registry.add(self)
        self._scope.__enter__()
        return self

    def __exit__(self, *exc: object) -> bool:
        self._registry.discard(self)
        return bool(self._scope.__exit__(*exc))  # type: ignore[arg-type]


@dataclass
class LaneStats:
    passes: int = 0
    claimed_runs: int = 0
    delivered: int = 0
    posts: int = 0
    acks: int = 0
    ack_groups: int = 0
    lease_lost: int = 0
    retries: int = 0
    failed: int = 0
    stale_acks: int = 0
    renewed_before_post: int = 0
    adopted: int = 0  # critical runs taken over from the ordinary lane's queue
    widened: int = 0  # events added to a claim before its first POST
    by_type: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class LaneView:
    """A lane as observers see it (relay/health.py, relay/metrics.py, relay/sdnotify.py)."""

    name: str
    stats: LaneStats  # a copy
    inflight: int  # claims held: POSTing or queued for a POST slot
    turns: int  # discovery loop turns (liveness)
    turned_at: float  # monotonic time of the last turn
    misconfigured: bool  # the ingress answered "misconfigured" and has not recovered since


class Lane:
    def __init__(
        self,
        name: str,
        settings: Settings,
        store: Store,
        ingress: IngressClient,
        concurrency: int,
        *,
        on_ready_change: Callable[[bool], None] = lambda ok: None,
        observe_ack: Callable[[AckResult], None] = lambda result: None,
    ) -> None:
        self.name = name
        self.settings = settings
        self.store = store
        self.ingress = ingress
        self.concurrency = concurrency
        self.acks = AckGroup(store)
        self.wake = Wake()
        self.slot_freed = Wake()
        self.targets: list[str] = []  # runs to drain now (critical lane)
        self.wanted: set[str] = set()  # terminal runs we could not claim yet
        # Claims this lane holds: POSTing, or queued for a POST slot. Holding up to claim_runs
        # more than the concurrency keeps the POST slots busy without a claim round trip (and
        # its commit) between one run and the next: what makes runs of one event fast.
        self.inflight: dict[str, Claim] = {}
        # With `ingress_batch_url`, one POST slot carries up to a claim's worth of small runs:
        # the lane then holds enough runs to fill every slot, plus one claim ahead (counted in
        # runs, a claim of small runs would otherwise fill the lane with one POST in flight).
        self.capacity = (
            (concurrency + 1) * settings.claim_runs
            if settings.ingress_batch_url
            else concurrency + settings.claim_runs
        )
        self.posting = anyio.Semaphore(concurrency)
        self.posting_runs: set[str] = set()  # claims past their slot wait (POST started)
        self._slot_held: set[str] = set()  # of those, the ones still holding their POST slot
        self._slot_waiters: dict[str, tuple[Claim, anyio.Event]] = {}  # queued, in FIFO order
        self.stats = LaneStats()
        self.stopping = False
        self.paused_until = 0.0
        self.misconfigured = 0
        self.on_ready_change = on_ready_change
        self._last_empty_pass = -1.0
        self._deliveries: TaskGroup | None = None
        self._renewals: set[Renewal] = set()  # claims on the wire (Lane._renewer)
        # The ordinary lane hands a critical run it cannot POST at once to the critical lane
        # (set by the runner): a terminal event never waits in the ordinary queue.
        self.handoff: Callable[[Claim], bool] = lambda claim: False
        # Operations hooks (relay/health.py, relay/metrics.py): loop turns for /healthz and the
        # systemd watchdog, and an observer of each acknowledgement for the lag histogram.
        self.turns = 0
        self.turned_at = 0.0
        self.observe_ack = observe_ack

    def view(self) -> LaneView:
        """What health and metrics read: a snapshot, never the lane's own state."""
        return LaneView(
            name=self.name,
            stats=copy.deepcopy(self.stats),
            inflight=len(self.inflight),
            turns=self.turns,
            turned_at=self.turned_at,
            misconfigured=self.misconfigured > 0,
        )

    # -- wakes ------------------------------------------------------------------------------

    def drain(self, run_id: str) -> None:
        """A targeted drain: claim this run at once, without waiting for a discovery pass."""
        if run_id not in self.inflight and run_id not in self.targets:
            self.targets.append(run_id)
        self.wake.set()

    def delivered_elsewhere(self, run_id: str) -> None:
        if run_id in self.wanted:
            self.wanted.discard(run_id)
            self.drain(run_id)

    # -- discovery ---------------------------------------------------------------------------

    async def run(self) -> None:
        """The lane's loop; returns after stop() once in-flight work is finished or released."""
        async with anyio.create_task_group() as deliveries:
            self._deliveries = deliveries
            deliveries.start_soon(self.acks.run)
            deliveries.start_soon(self._renewer)
            failures = 0
            while not self.stopping:
                self.turns += 1  # liveness (relay/health.py)
                self.turned_at = anyio.current_time()
                try:
                    busy = await self._pass()
                    failures = 0
                except (psycopg.Error, OSError, TimeoutError) as exc:
                    failures += 1
                    delay = random.uniform(
                        0, min(self.settings.poll_interval * 5, 0.05 * 2**failures)
                    )
                    logs.warning(
                        "claim_failed",
                        lane=self.name,
                        error=f"{type(exc).__name__}: {str(exc).strip()[:200]}",
                        retry_in=round(delay, 3),
                    )
                    await anyio.sleep(delay)
                    continue
                if busy:
                    continue
                await self.wake.wait(self.settings.poll_interval)
            await self._finish_inflight()
            deliveries.cancel_scope.cancel()

    async def _pass(self) -> bool:
        """One discovery step. Returns True when the next one should start at once."""
        now = anyio.current_time()
        if now < self.paused_until:
            await self.wake.wait(min(self.paused_until - now, self.settings.poll_interval))
            return False
        room = self.capacity - len(self.inflight)
        if room < max(1, self.settings.claim_runs // 2) and len(self.inflight) >= self.concurrency:
            await self.slot_freed.wait(self.settings.poll_interval)
            return True
        if self.targets:
            run_id = self.targets.pop(0)
            claims = await self.store.claim(self.name, 1, run_id)
            if not claims and run_id not in self.inflight:
                self.wanted.add(run_id)  # leased elsewhere or backing off; retried on delivery
            self._start(claims)
            return True
        # Space out passes that find nothing, so a burst of wakes costs a handful of passes.
        since = now - self._last_empty_pass
        if since < MIN_EMPTY_PASS_SPACING:
            await anyio.sleep(MIN_EMPTY_PASS_SPACING - since)
        want = min(room, self.settings.claim_runs)
        self.stats.passes += 1
        claims = await self.store.claim(self.name, want)
        self._start(claims)
        if len(claims) < want:
            self._last_empty_pass = anyio.current_time()
            return False
        return True

    def _start(self, claims: list[Claim]) -> None:
        assert self._deliveries is not None
        for claim in claims:
            self.stats.claimed_runs += 1
            self.inflight[claim.run_id] = claim
            self.wanted.discard(claim.run_id)
            logs.debug(
                "claimed",
                **self._who(claim),
                first_seq=claim.first_seq,
                last_seq=claim.last_seq,
                events=len(claim.events),
                critical=claim.critical,
            )
        for group in plan_groups(claims, self.settings):
            if len(group) == 1:
                self._deliveries.start_soon(self._deliver_guarded, group[0])
            else:
                self._deliveries.start_soon(self._deliver_group_guarded, group)

    async def _finish_inflight(self) -> None:
        with anyio.move_on_after(self.settings.shutdown_timeout):
            while self.inflight:
                await self.slot_freed.wait(0.05)

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        self.slot_freed.set()
        for _claim, waiter in self._slot_waiters.values():
            waiter.set()
        self._slot_waiters.clear()

    # -- delivery ---------------------------------------------------------------------------

    def promote(self, run_id: str) -> None:
        """A terminal event was committed for a run this lane holds but has not started: mark it
        critical and widen it before its POST; a queued one is handed to the critical lane."""
        claim = self.inflight.get(run_id)
        if claim is not None and run_id not in self.posting_runs:
            claim.critical = True
            claim.widen = True
            self.slot_freed.set()
            waiter = self._slot_waiters.pop(run_id, None)
            if waiter is not None:
                waiter[1].set()  # the queued task hands itself over to the critical lane

    def adopt(self, claim: Claim) -> bool:
        """Take over a claim another lane holds but cannot start yet, if there is room."""
        if self.stopping or self._deliveries is None or len(self.inflight) >= self.concurrency:
            return False
        self.inflight[claim.run_id] = claim
        self.stats.adopted += 1
        self._deliveries.start_soon(self._deliver_guarded, claim)
        return True

    async def _take_slot(self, claim: Claim) -> str:
        """Wait for a POST slot: "posting" once it has one, "stopping" on shutdown, "handed_off"
        when a critical claim that would wait went to the critical lane instead (a terminal
        event never queues behind ordinary work)."""
        while not self.stopping:
            try:
                self.posting.acquire_nowait()
                self.posting_runs.add(claim.run_id)
                self._slot_held.add(claim.run_id)
                return "posting"
            except anyio.WouldBlock:
                pass
            if claim.critical and self.handoff(claim):
                return "handed_off"
            # Queued: woken when a slot frees and this claim is next (critical ones first), when
            # it is promoted, on shutdown, or after poll_interval to try the handoff again.
            # One waiter per freed slot: a shared wake-up woke every queued task each time.
            waiter = self._slot_waiters[claim.run_id] = (claim, anyio.Event())
            try:
                with anyio.move_on_after(self.settings.poll_interval):
                    await waiter[1].wait()
            finally:
                if self._slot_waiters.get(claim.run_id) is waiter:
                    del self._slot_waiters[claim.run_id]
        return "stopping"

    def _wake_next_waiter(self) -> None:
        """A POST slot was freed: wake the claim queued longest for one, a critical one first."""
        if not self._slot_waiters:
            return
        run_id = next(
            (r for r, (c, _) in self._slot_waiters.items() if c.critical),
            next(iter(self._slot_waiters)),
        )
        self._slot_waiters.pop(run_id)[1].set()

    async def _deliver_guarded(self, claim: Claim) -> None:
        slot = "waiting"
        settled = False
        try:
            slot = await self._take_slot(claim)
            if slot == "posting":
                settled = await self._deliver(claim)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            logs.error(
                "delivery_error",
                **self._who(claim),
                error=f"{type(exc).__name__}: {str(exc).strip()[:300]}",
            )
        finally:
            self.inflight.pop(claim.run_id, None)
            if slot != "handed_off":  # else the critical lane owns the claim now
                if not settled:
                    # Shutdown, an error, or a lost ack: hand the lease back so another replica
                    # takes over at once rather than after the TTL. Fenced by token: harmless
                    # when stale.
                    with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                        try:
                            await self.store.release(claim)
                        except Exception:
                            pass
                if slot == "posting":
                    self.posting_runs.discard(claim.run_id)
                    self._free_slot(claim)
                if claim.critical or self.name == "critical":
                    self.wake.set()
            self.slot_freed.set()

    async def _deliver_group_guarded(self, group: list[Claim]) -> None:
        """Several small runs in one POST to `ingress_batch_url`; each run's answer is then
        handled exactly like a single-run answer."""
        settled: dict[str, bool] = {}
        try:
            async with self.posting:
                if not self.stopping:
                    settled = await self._deliver_group(group)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            logs.error("delivery_error", lane=self.name, runs=len(group), error=_error(exc))
        finally:
            for claim in group:
                if not settled.get(claim.run_id):
                    with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                        try:
                            await self.store.release(claim)
                        except Exception:
                            pass
                self.inflight.pop(claim.run_id, None)
            self._wake_next_waiter()
            self.slot_freed.set()
            if self.name == "critical" or any(c.critical for c in group):
                self.wake.set()

    async def _deliver_group(self, group: list[Claim]) -> dict[str, bool]:
        settled: dict[str, bool] = {}
        timeout = self.settings.http_timeout
        now = anyio.current_time()
        waited = [c for c in group if not c.trust.allows_post(now, timeout)]
        if waited:
            self.stats.renewed_before_post += len(waited)
            renewed = await self.store.renew(waited)
            for c in waited:
                if c.run_id not in renewed:
                    self._lease_lost(c, "renew_before_post")
                    settled[c.run_id] = True
            group = [c for c in group if c.run_id not in settled]
        if not group:
            return settled
        result: Answer | TransportFailure | None = None
        # A run whose renewal fails stays in the request (it cannot be unsent); its ack is
        # fenced. Only when every lease is gone is the request cancelled.
        with self._renewing(group) as renewal:
            try:
                result = await self._quick_retries(
                    lambda: self._post_group_once(group),
                    lambda: min((c.trust for c in group), key=lambda t: t.until),
                )
            except TransportFailure as exc:
                result = exc
        live = renewal.live
        for c in group:
            if c.run_id not in live:
                self._lease_lost(c, "renewal_failed")
                settled[c.run_id] = True
        group = [c for c in group if c.run_id in live]
        if result is None or not group:
            return settled
        if isinstance(result, Answer) and 200 <= result.status < 300:
            per_run = split_results(result, group)
        else:
            per_run = {c.run_id: result for c in group}  # the whole request failed

        async def act(c: Claim) -> None:
            settled[c.run_id] = await self._act(c, c.events, per_run[c.run_id])

        # Concurrently, so the acks of the group share one transaction in the ack group.
        async with anyio.create_task_group() as acting:
            for c in group:
                acting.start_soon(act, c)
        return settled

    async def _post_group_once(self, group: list[Claim]) -> Answer:
        self.stats.posts += 1
        return await self.ingress.post_group(group)

    async def _deliver(self, claim: Claim) -> bool:
        """Deliver one claim. Returns True when the lease was settled (acked, released or lost)."""
        if claim.widen:
            claim.widen = False
            self.stats.widened += await self.store.widen(claim)
        if not claim.trust.allows_post(anyio.current_time(), self.settings.http_timeout):
            # Waited in the local queue too long to finish a whole request inside the lease.
            self.stats.renewed_before_post += 1
            if claim.run_id not in await self.store.renew([claim]):
                self._lease_lost(claim, "renew_before_post")
                return True
        events = claim.events
        answer = await self._post_renewing(claim, events)
        if answer is None:
            return True  # lease lost mid-flight: abandoned, no ack
        if isinstance(answer, Answer) and _acks_all(answer, len(events)):
            # Pipelining: the ingress has answered and nothing but the (grouped) ack is left,
            # so the next claim's POST need not wait for this commit. The run stays claimed
            # (and its lease fenced) until the ack settles it.
            self._free_slot(claim)
        return await self._act(claim, events, answer)

    def _free_slot(self, claim: Claim) -> None:
        if claim.run_id in self._slot_held:
            self._slot_held.discard(claim.run_id)
            self.posting.release()
            self._wake_next_waiter()

    async def _post_renewing(
        self, claim: Claim, events: list[ClaimedEvent]
    ) -> Answer | TransportFailure | None:
        """POST with quick retries while the lane's renewer keeps the lease; a failed renewal
        cancels the request. Returns None when the lease was lost."""
        result: Answer | TransportFailure | None = None
        with self._renewing([claim]) as renewal:
            try:
                result = await self._post_quick_retries(claim, events)
            except TransportFailure as exc:
                result = exc
        if renewal.lost:
            self._lease_lost(claim, "renewal_failed")
            return None
        return result

    def _renewing(self, claims: list[Claim]) -> Renewal:
        return Renewal(claims, self._renewals)

    async def _renewer(self) -> None:
        """Renews the leases of every claim on the wire: one task per lane, one round trip for
        all that are due. A claim is due ttl/3 after its lease was taken or last renewed
        (DESIGN §4.2); the renewer sleeps until the first one is due, and at most ttl/12, so a
        claim that starts its POST meanwhile is seen in time. When the database cannot say (an
        error, a timeout), a claim counts as held only while its window outlasts another
        interval."""
        interval = renew_interval(self.settings.lease_ttl)
        pause = 0.0
        while True:
            now = anyio.current_time()
            first_due = min(
                (
                    c.trust.started + interval
                    for r in self._renewals
                    for c in r.claims
                    if c.run_id in r.live
                ),
                default=now + interval,
            )
            await anyio.sleep(min(max(first_due - now, pause), interval / 4))
            pause = 0.0
            now = anyio.current_time()
            due = {
                c.run_id: c
                for r in self._renewals
                for c in r.claims
                if c.run_id in r.live and now - c.trust.started >= interval
            }
            if not due:
                continue
            try:
                held = await self.store.renew(list(due.values()))
            except (psycopg.Error, OSError, TimeoutError):
                now = anyio.current_time()
                held = {run for run, c in due.items() if c.trust.remaining(now) > interval}
                pause = interval / 4  # their windows did not move: try again soon, not at once
            for r in list(self._renewals):
                r.lose(due.keys() - held)

    async def _post_quick_retries(self, claim: Claim, events: list[ClaimedEvent]) -> Answer:
        return await self._quick_retries(
            lambda: self._post_once(claim, events), lambda: claim.trust
        )

    async def _quick_retries(
        self, post: Callable[[], Awaitable[Answer]], trust: Callable[[], Trust]
    ) -> Answer:
        """Quick retries for blips (tenacity: bounded, short, full jitter), only while the lease
        is trusted for a whole request; longer outages are rescheduled through the database."""
        first: Answer | TransportFailure
        try:
            answer = await post()
        except TransportFailure as exc:
            first = exc
        else:
            if not _quick_retryable(answer):
                return answer
            first = answer
        # A blip. tenacity decides from here, starting from this first outcome (replayed as its
        # attempt 1): the common case, an answer at once, never builds a retry loop.
        replay = [first]

        async def attempt() -> Answer:  # a coroutine function, so tenacity awaits it
            if replay:
                outcome = replay.pop()
                if isinstance(outcome, TransportFailure):
                    raise outcome
                return outcome
            return await post()

        retrying = AsyncRetrying(
            stop=stop_any(_STOP_AFTER, _TrustLow(trust, self.settings.http_timeout)),
            wait=_QUICK_WAIT,
            retry=_QUICK_RETRY,
            retry_error_callback=_last_outcome,
            reraise=True,
        )
        retried: Answer = await retrying(attempt)
        return retried

    async def _post_once(self, claim: Claim, events: list[ClaimedEvent]) -> Answer:
        self.stats.posts += 1
        return await self.ingress.post(claim, events)

    async def _act(
        self, claim: Claim, events: list[ClaimedEvent], answer: Answer | TransportFailure
    ) -> bool:
        if isinstance(answer, TransportFailure):
            return await self._reschedule(claim, None, str(answer), None)
        outcome = classify(answer.status)
        if outcome is Outcome.ACCEPTED:
            self._ingress_ok()
            k = accepted_count(answer.status, answer.body, len(events))
            if k == 0:
                return await self._reschedule(
                    claim, answer.status, "ingress accepted 0 events", None
                )
            # Not settled unless it committed: the caller then hands the lease back (fenced by
            # token, so a no-op when the ack released it or the lease was lost).
            return await self._ack(claim, events[:k], answer)
        if outcome is Outcome.TRANSIENT:
            return await self._reschedule(
                claim, answer.status, _excerpt(answer.body), answer.retry_after
            )
        if outcome is Outcome.MISCONFIGURED:
            return await self._misconfigured(claim, answer)
        return await self._poison(claim, events, answer)

    async def _ack(
        self, claim: Claim, acked: list[ClaimedEvent], answer: Answer, *, keep: bool = False
    ) -> bool:
        """Ack `acked` (a prefix of the claim). Returns True when the ack committed and the run
        is still ours (when `keep`), False when the lease was lost or the ack failed."""
        result = await self.acks.ack(claim, acked[-1].seq, keep=keep)
        if result.status == "not_committed":
            return False  # not settled: the caller's cleanup releases the lease for a redelivery
        if result.status == "stale":
            self.stats.stale_acks += 1
            self._lease_lost(claim, "ack_fenced")
            return False
        self.observe_ack(result)  # metrics: commit-to-ack lag
        if result.status == "failed":
            self.stats.failed += 1
            logs.error(
                "run_blocked",
                **self._who(claim),
                reason="ack_failed",
                error=result.error,
            )
        self.stats.acks += 1
        self.stats.delivered += result.acked
        for e in acked[: result.acked]:
            self.stats.by_type[e.event_type] = self.stats.by_type.get(e.event_type, 0) + 1
        logs.info(
            "delivered",
            **self._who(claim),
            first_seq=acked[0].seq,
            last_seq=result.last_seq,
            events=result.acked,
            status=answer.status,
            http_ms=round(answer.seconds * 1000, 2),
            lag_ms=round((result.lag_seconds or 0.0) * 1000, 2),
            trace_id=_trace_id(acked[0].traceparent),
        )
        return result.status == "acked"

    async def _reschedule(
        self, claim: Claim, status: int | None, error: str, retry_after: str | None
    ) -> bool:
        delay = retry_delay(
            claim.attempts,
            retry_after=parse_retry_after(
                retry_after, datetime.now(UTC), maximum=self.settings.max_backoff
            ),
            base=BACKOFF_BASE,
            cap=self.settings.max_backoff,
            rand=random.random(),
        )
        self.stats.retries += 1
        released = await self.store.release(claim, delay, error=error or "no answer", status=status)
        logs.log(
            "retry_scheduled",
            logging.WARNING,
            **{**self._who(claim), "attempt": claim.attempts + 1},
            first_seq=claim.first_seq,
            last_seq=claim.last_seq,
            status=status,
            retry_in=round(delay, 3),
            error=error[:200],
            fenced=not released,
        )
        if not released:
            # The token had moved on (e.g. a process frozen past its lease, whose request then
            # timed out): nothing was changed, and the new owner redelivers.
            self._lease_lost(claim, "release_fenced")
        return True

    async def _misconfigured(self, claim: Claim, answer: Answer) -> bool:
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
            lane=self.name,
            status=answer.status,
            url=redact_url(self.settings.ingress_url),
            run_id=claim.run_id,
            pause_s=round(delay, 3),
            body=_excerpt(answer.body),
        )
        return True

    def _ingress_ok(self) -> None:
        if self.misconfigured:
            self.misconfigured = 0
            self.on_ready_change(True)
            logs.info("ingress_recovered", lane=self.name)

    async def _poison(self, claim: Claim, events: list[ClaimedEvent], answer: Answer) -> bool:
        """Narrow a rejected batch to the event that causes it. When the ingress names it
        (`{"rejected_event_id": ...}`) the events before it are resent as one batch (the rejection
        accepted none of them) and acked, and the named one is failed; otherwise the batch is
        resent one event at a time under the same lease, acking each accepted event (keeping the
        lease), until one is rejected. Events after the bad one stay pending: its run is blocked,
        every other run keeps flowing. Nothing is acked without a 2xx for it."""
        named = rejected_event_id(answer.body)
        index = next((i for i, e in enumerate(events) if e.event_id == named), None)
        if index is not None:
            if index > 0:
                before = events[:index]
                head = await self._post_renewing(claim, before)
                if head is None:
                    return True
                if (
                    isinstance(head, TransportFailure)
                    or classify(head.status) is not Outcome.ACCEPTED
                ):
                    return await self._act(claim, before, head)
                k = accepted_count(head.status, head.body, len(before))
                if k < len(before):
                    return await self._act(claim, before, head)  # acks k, retries the rest
                if not await self._ack(claim, before, head, keep=True):
                    return True
            return await self._block(claim, events[index], answer)
        if len(events) == 1:
            return await self._block(claim, events[0], answer)
        logs.warning(
            "poison_narrowing",
            **self._who(claim),
            first_seq=claim.first_seq,
            last_seq=claim.last_seq,
            status=answer.status,
        )
        for i, event in enumerate(events):
            single = await self._post_renewing(claim, [event])
            if single is None:
                return True  # lease lost: abandoned
            if isinstance(single, TransportFailure):
                return await self._act(claim, [event], single)
            outcome = classify(single.status)
            if outcome is Outcome.POISON:
                return await self._block(claim, event, single)
            if (
                outcome is not Outcome.ACCEPTED
                or accepted_count(single.status, single.body, 1) == 0
            ):
                return await self._act(claim, [event], single)
            last = i == len(events) - 1
            if not await self._ack(claim, [event], single, keep=not last):
                return True
        return True

    async def _block(self, claim: Claim, event: ClaimedEvent, answer: Answer) -> bool:
        error = f"ingress answered {answer.status}: {_excerpt(answer.body)}"
        if not await self.store.fail_event(claim, event.seq, answer.status, error):
            self._lease_lost(claim, "fail_fenced")  # not blocked: the new owner sends it again
            return True
        self.stats.failed += 1
        logs.error(
            "run_blocked",
            **self._who(claim),
            event_id=event.event_id,
            seq=event.seq,
            status=answer.status,
            error=error[:300],
        )
        return True

    def _who(self, claim: Claim) -> dict[str, object]:
        """The fields every decision about a claim logs (DESIGN §8.2)."""
        return {
            "lane": self.name,
            "run_id": claim.run_id,
            "epoch": claim.epoch,
            "attempt": claim.attempts,
            "lease_owner": self.store.owner,
        }

    def _lease_lost(self, claim: Claim, where: str) -> None:
        self.stats.lease_lost += 1
        logs.warning(
            "lease_lost",
            **self._who(claim),
            first_seq=claim.first_seq,
            last_seq=claim.last_seq,
            where=where,
        )


SMALL_RUN_EVENTS = 10  # runs at most this long share a multi-run POST when the ingress offers one


class _TrustLow(stop_base):
    """Stop quick retries once the lease is not trusted for a whole request any more."""

    def __init__(self, trust: Callable[[], Trust], timeout: float) -> None:
        self.trust = trust
        self.timeout = timeout

    def __call__(self, retry_state: RetryCallState) -> bool:
        return not self.trust().allows_post(anyio.current_time(), self.timeout)


def _acks_all(answer: Answer, n: int) -> bool:
    """The answer accepts the whole batch: an ack follows, and no other request."""
    return (
        classify(answer.status) is Outcome.ACCEPTED
        and accepted_count(answer.status, answer.body, n) == n
    )


def _quick_retryable(answer: Answer) -> bool:
    return classify(answer.status) is Outcome.TRANSIENT and answer.retry_after is None


def _last_outcome(state: RetryCallState) -> Answer | None:
    return state.outcome.result() if state.outcome else None


# Built once: tenacity's strategies are stateless, and building them (a class per call, as
# this once did) cost more per POST than the retry machinery itself (docs/performance.md).
_STOP_AFTER = stop_after_attempt(QUICK_ATTEMPTS)
_QUICK_WAIT = wait_random_exponential(multiplier=0.05, max=0.4)
_QUICK_RETRY = retry_if_exception_type(TransportFailure) | retry_if_result(_quick_retryable)


def plan_groups(claims: list[Claim], settings: Settings) -> list[list[Claim]]:
    """Which claims go out together. Without `ingress_batch_url`, one POST per run. With it,
    small runs (where one POST each would cap the relay near the HTTP client's request rate)
    share POSTs of up to `batch_size` events; larger runs still go alone."""
    if not settings.ingress_batch_url:
        return [[c] for c in claims]
    groups: list[list[Claim]] = []
    current: list[Claim] = []
    size = 0
    for c in claims:
        n = len(c.events)
        if n > SMALL_RUN_EVENTS:
            groups.append([c])
            continue
        if current and size + n > settings.batch_size:
            groups.append(current)
            current, size = [], 0
        current.append(c)
        size += n
    if current:
        groups.append(current)
    return groups


def rejected_event_id(body: bytes) -> str | None:
    """The event an ingress names in a rejection body `{"rejected_event_id": "..."}`."""
    try:
        parsed = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        return None
    if isinstance(parsed, dict):
        named = parsed.get("rejected_event_id")
        if isinstance(named, str):
            return named
    return None


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip()[:200]}"


def _excerpt(body: bytes) -> str:
    return body[:BODY_EXCERPT].decode("utf-8", "replace")


def _trace_id(traceparent: str | None) -> str | None:
    return traceparent.split("-")[1] if traceparent else None
