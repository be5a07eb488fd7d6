"""The POST turn, a part of its own beside each lane (issue 42 item 5): a claim's (or a multi-run
group's) turn to POST, under the lane's slots and the replica's adaptive limit, critical first.

The lane (relay/delivery/lane.py) keeps discovery and claims; for each single claim or group it asks
`PostTurn.take()` for a turn, and the executor (relay/delivery/execute.py) POSTs only once it has
one. A turn is two things, taken in this order and given back together:

1. **a slot of the lane's own** (relay/delivery/slots.py: `concurrency` of them, targeted
   terminals first). A single targeted claim of the ordinary lane (promoted while it waited)
   that would have to wait for one is handed to the critical lane instead (`handoff`), so a
   targeted terminal never queues behind other work in the relay;
2. **a permit of the replica's** (`Permits`, one per replica, shared by both lanes): the
   adaptive limit on POSTs in flight to the ingress, with a reserve only targeted terminals
   may take (relay/admission/permits.py, relay/admission/limit.py), so a targeted terminal never
   queues behind more than a few other POSTs at the ingress either. A run that discovery found
   with a pending terminal is prioritised work, not control traffic: it takes the ordinary
   share (issue 50, docs/design.md "Scheduling"). Without `Permits` (`post_limit =
   fixed`) the slots alone bound the POSTs, as before issue 42.

A promotion (a terminal event committed for a run whose claim waits for its turn) wakes the
waiter, which queues again as targeted: for a slot, or for a permit if it holds its slot.
The turn is freed once (`Turn.free`): early when only the acks are left, else at the end. Each
answer to a POST under the turn goes to the limit (`Turn.answered`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import anyio

from relay import logs
from relay.admission.limit import Change, LimitEvent, Sample
from relay.admission.permits import Admission, AdmissionView, Permit, Priority, Ticket
from relay.admission.windows import WindowedMax
from relay.core import clock
from relay.delivery.slots import Slots
from relay.edges.store import Claim, Held

LAG_TICK = 0.01  # seconds between the loop-lag probe's wakes while answers read its value
LAG_SPAN = 1.0  # seconds over which the most the loop ran late counts
LAG_IDLE_TICK = 0.5  # seconds between its wakes once no answer has read it for LAG_SPAN
SETTLE_TICK = 1.0  # seconds between asking the limit whether an idle replica is still fallen


class Slot(enum.Enum):
    """Where a claim (or a group sharing one POST) stands with its turn."""

    WAITING = "waiting"  # queued for one
    POSTING = "posting"  # has one: its delivery runs
    STOPPING = "stopping"  # the lane stopped before it got one
    HANDED_OFF = "handed_off"  # given to the critical lane instead, which owns it now


@dataclass(eq=False, slots=True)
class _Waiter:
    """One caller queued for a permit: woken with one, or without (`Permits.wake`)."""

    ticket: Ticket
    keys: tuple[Hashable, ...]
    permit: Permit | None = None
    woken: anyio.Event = field(default_factory=anyio.Event)


def probe_tick(quiet_for: float) -> float:
    """The loop-lag probe's next sleep, `quiet_for` seconds after an answer last read its value:
    dense while answers come, sparse once none has for LAG_SPAN (nothing reads it meanwhile)."""
    return LAG_TICK if quiet_for < LAG_SPAN else LAG_IDLE_TICK


class LoopLag:
    """How late this process's event loop runs (`run()` as a background task): a probe that
    sleeps and notes by how much it overslept, the most over the last LAG_SPAN. A busy relay
    reads its answers that much late, which the adaptive limit must not take for the ingress's
    queueing: against a 0.6 ms ingress, a CPU-bound relay's round trips swung by tens of
    milliseconds and its limit with them (issue 42's bench).

    It sleeps LAG_TICK (100 wakes a second) from the start and while POSTs go (`stir()`, as each
    takes its permit) or answers read its value; once neither has for LAG_SPAN, LAG_IDLE_TICK
    (2 a second: an idle relay pays next to nothing, issue 52 item 3), and the next POST wakes
    it at once to sleep LAG_TICK again, so the first answer after a quiet spell reads lateness
    measured densely while its POST was on the wire. The value means the same either way, the
    most a sleep of the probe overran in the last LAG_SPAN."""

    def __init__(self) -> None:
        self._most = WindowedMax(LAG_SPAN)
        self._value = 0.0  # the window's most, as of the last wake: read once per answer
        self._stirred = False  # a POST went or an answer read the value since the last wake
        self._woken: anyio.Event | None = None  # the probe's wake while it sleeps LAG_IDLE_TICK
        self.tick = LAG_TICK  # the probe's sleep now

    async def run(self) -> None:
        stirred_at = anyio.current_time()  # a relay starts with POSTs to come: dense at first
        while True:
            asked = anyio.current_time()
            if self._stirred:
                self._stirred, stirred_at = False, asked
            self.tick = probe_tick(asked - stirred_at)
            if self.tick == LAG_TICK:
                await anyio.sleep(LAG_TICK)
            else:
                await self._sleep_idle()
            now = anyio.current_time()
            # Woken early by a stir, it overslept nothing: the max ignores the 0.0.
            self._most.add(max(0.0, now - asked - self.tick), now)
            self._value = self._most.value(now) or 0.0

    async def _sleep_idle(self) -> None:
        self._woken = woken = anyio.Event()
        with anyio.move_on_after(LAG_IDLE_TICK):
            await woken.wait()
        self._woken = None

    def stir(self) -> None:
        """Work is under way (a POST about to go, an answer read): measure densely from now; a
        probe sleeping sparse is woken at once."""
        self._stirred = True
        if self._woken is not None:
            self._woken.set()

    def value(self) -> float:
        """Seconds the loop ran late at most, lately (0.0 before the probe ran)."""
        self.stir()
        return self._value


class Permits:
    """The replica's permits for POSTs to the ingress: relay/admission/permits.py's decisions,
    awaited (relay/delivery/slots.py's shape: a freed permit is handed straight to the waiter that
    goes next, and one handed to a waiter cancelled meanwhile is passed on, never leaked). Each
    answer's sample carries the event loop's recent lateness (`lag`, a `LoopLag`, which each
    POST's ask for a permit stirs)."""

    def __init__(self, admission: Admission, lag: LoopLag | None = None) -> None:
        self.admission = admission
        self.lag = lag if lag is not None else LoopLag()  # never run, it reads 0.0
        self._waiters: dict[Ticket, _Waiter] = {}
        self._by_key: dict[Hashable, _Waiter] = {}

    def view(self) -> AdmissionView:
        return self.admission.view(clock.now())

    def share(self, priority: Priority) -> int:
        return self.admission.share(priority)

    async def take(self, priority: Priority, keys: Sequence[Hashable] = ()) -> Permit | None:
        """A permit for a POST of `priority`, queued for one if none may go now: None when woken
        without one (`wake`: the caller's priority may have changed; it may ask again)."""
        permit = self.try_take(priority)
        if permit is not None:
            return permit
        waiter = _Waiter(self.admission.wait(priority), tuple(keys))
        self._waiters[waiter.ticket] = waiter
        for key in waiter.keys:
            self._by_key[key] = waiter
        try:
            await waiter.woken.wait()
        except BaseException:
            if waiter.permit is not None:  # granted, then cancelled before it ran: pass it on
                self.release(waiter.permit)
            raise
        finally:
            self._leave(waiter)
        return waiter.permit

    def try_take(self, priority: Priority) -> Permit | None:
        """A permit for a POST of `priority` if one may go now, without queueing for one. Every
        POST asks here first: the lateness probe measures densely from now (`LoopLag.stir`)."""
        self.lag.stir()
        return self.admission.try_acquire(priority, clock.now())

    def wake(self, key: Hashable) -> None:
        """Wake the waiter queued under `key` without a permit (it may queue again)."""
        waiter = self._by_key.get(key)
        if waiter is not None and waiter.permit is None:
            self._leave(waiter)
            waiter.woken.set()

    async def settle_when_idle(self) -> None:
        """The limit's idle rule (`Limit.settle`), asked every SETTLE_TICK (a background task
        under the adaptive limit): an idle replica's limit is not left fallen."""
        while True:
            await anyio.sleep(SETTLE_TICK)
            event = self.admission.limit.settle(clock.now(), inflight=self.admission.inflight)
            if event is not None:
                _log(event, self.admission.inflight)

    def answered(self, permit: Permit, sample: Sample) -> None:
        """An answer to a POST under `permit`: the limit judges it, and may let waiters go."""
        now = clock.now()
        lagged = Sample(sample.rtt, sample.signal, sample.retry_after, self.lag.value())
        event = self.admission.answered(permit, lagged, now)
        if event is not None:
            _log(event, self.admission.inflight)
        self._grant(now)

    def release(self, permit: Permit) -> None:
        """The POST is done (its answers were given to `answered`): the permit goes to the next
        waiter, if one may go."""
        now = clock.now()
        self.admission.release(permit, None, now)
        self._grant(now)

    def _grant(self, now: float) -> None:
        if not self._waiters:  # the common case at an ingress that keeps up: nobody to wake
            return
        for ticket, permit in self.admission.grants(now):
            waiter = self._waiters[ticket]
            waiter.permit = permit
            self._leave(waiter)
            waiter.woken.set()

    def _leave(self, waiter: _Waiter) -> None:
        if self._waiters.pop(waiter.ticket, None) is not None and waiter.permit is None:
            self.admission.cancel(waiter.ticket)
        for key in waiter.keys:
            if self._by_key.get(key) is waiter:
                del self._by_key[key]


def _log(event: LimitEvent, inflight: int) -> None:
    """`limit_fell` when the limit fell sharply (a warning when the event says so: overload, or
    queueing sustained), `limit_recovered` once the pressure is gone. The level it fell from is
    `from_limit`: a field named `level` would be logs.log's own argument."""
    fields = {
        "limit": event.limit, "from_limit": event.level, "reason": event.reason,
        "inflight": inflight, "fallen_s": round(event.fallen_for, 1),
    }  # fmt: skip
    if event.change is Change.RECOVERED:
        logs.info("limit_recovered", **fields)
    elif event.warning:
        logs.warning("limit_fell", **fields)
    else:
        logs.info("limit_fell", **fields)


@dataclass(eq=False)
class Turn:
    """A claim's (or group's) turn to POST: `slot` says whether it got one. `free()` gives the
    slot and the permit back, the first time only; `answered()` tells the limit of an answer."""

    slot: Slot
    permits: Permits | None = None
    permit: Permit | None = None
    release_slot: Callable[[], None] | None = None

    def answered(self, sample: Sample) -> None:
        if self.permits is not None and self.permit is not None:
            self.permits.answered(self.permit, sample)

    def free(self) -> None:
        if self.release_slot is not None:
            release, self.release_slot = self.release_slot, None
            release()
        if self.permits is not None and self.permit is not None:
            permit, self.permit = self.permit, None
            self.permits.release(permit)

    @property
    def taken(self) -> bool:
        """It holds a slot (and a permit, under the adaptive limit) not freed yet."""
        return self.release_slot is not None


NO_TURN = Turn(Slot.WAITING)


class PostTurn:
    """One lane's turns at a POST: `take()` one per single claim or group, `promote()` a run
    whose claim waits, `stop()` with the lane."""

    def __init__(
        self,
        lane: str,
        concurrency: int,
        poll_interval: float,
        permits: Permits | None,
        *,
        database: str | None = None,
    ) -> None:
        self.lane = lane
        # In a fleet the permits are every database's, and two databases may hold the same run
        # id: a waiter is known to them by (database, run id), so a promotion in one database
        # never wakes another's waiter (issue 51).
        self.database = database
        self.poll_interval = poll_interval
        self.slots = Slots(concurrency)  # one queue, critical ones first (relay/delivery/slots.py)
        self.permits = permits  # the replica's, shared with the other lane; None: fixed limit
        self.posting_runs: set[str] = set()  # claims past their wait (POST started)
        self._waiting_for_permits: set[str] = set()  # claims with a slot, waiting for a permit
        self.stopping = False
        # The ordinary lane hands a critical run it cannot POST at once to the critical lane
        # (set by the runner): a terminal event never waits in the ordinary queue.
        self.handoff: Callable[[Claim], bool] = lambda claim: False

    def posts(self) -> int:
        """POSTs this lane may have in flight now: its slots, and under the adaptive limit no
        more than its share of the limit (what the lane claims ahead is sized by it)."""
        if self.permits is None:
            return self.slots.total
        priority = Priority.CRITICAL if self.lane == "critical" else Priority.ORDINARY
        return min(self.slots.total, self.permits.share(priority))

    def stop(self) -> None:
        self.stopping = True
        self.slots.wake_all()
        if self.permits is not None:
            for run_id in self._waiting_for_permits:
                self.permits.wake((self.database, run_id))

    def promote(self, run_id: str) -> None:
        """The run's claim turned targeted while it waits: its waiter queues again, first (a
        single claim without a slot hands itself over to the critical lane)."""
        self.slots.wake(run_id)
        if self.permits is not None:
            self.permits.wake((self.database, run_id))

    def done(self, holds: Sequence[Held]) -> None:
        """The delivery of these claims is over (their turn freed or never had)."""
        for h in holds:
            self.posting_runs.discard(h.claim.run_id)

    async def take(self, holds: Sequence[Held]) -> Turn:
        """A turn for these claims (one, or a group that shares one POST): a slot of the lane's,
        then a permit of the replica's. Each wait reads the claims anew from their holders: a
        promotion while they wait makes them targeted."""
        slot = await self._take_slot(holds)
        if slot is not Slot.POSTING:
            return Turn(slot)
        release_slot = self.slots.release_once()
        permit = None
        if self.permits is not None:
            try:
                permit = await self._take_permit(holds)
            finally:
                if permit is None:  # stopped or cancelled meanwhile: the slot goes back
                    release_slot()
            if permit is None:  # the lane stopped: the claims are handed back
                return Turn(Slot.STOPPING)
        for h in holds:
            self.posting_runs.add(h.claim.run_id)
        return Turn(Slot.POSTING, self.permits, permit, release_slot)

    async def _take_permit(self, holds: Sequence[Held]) -> Permit | None:
        assert self.permits is not None
        priority = Priority.CRITICAL if _targeted(self.lane, holds) else Priority.ORDINARY
        permit = None if self.stopping else self.permits.try_take(priority)
        if permit is not None:  # the common case at an ingress that keeps up: no wait to mark
            return permit
        run_ids = [h.claim.run_id for h in holds]
        self._waiting_for_permits.update(run_ids)
        try:
            while not self.stopping:
                priority = Priority.CRITICAL if _targeted(self.lane, holds) else Priority.ORDINARY
                keys = [(self.database, r) for r in run_ids]
                permit = await self.permits.take(priority, keys)
                if permit is None:
                    continue  # woken without one: promoted (asks again, as critical) or stopping
                if self.stopping:
                    self.permits.release(permit)
                    break
                return permit
            return None
        finally:
            self._waiting_for_permits.difference_update(run_ids)

    async def _take_slot(self, holds: Sequence[Held]) -> Slot:
        """Wait for a slot of the lane's: POSTING once they have one, STOPPING on shutdown,
        HANDED_OFF when a single targeted claim that would wait went to the critical lane."""
        while not self.stopping:
            if self.slots.take_nowait():
                return Slot.POSTING
            single = holds[0].claim if len(holds) == 1 else None
            if single is not None and single.targeted and self.handoff(single):
                return Slot.HANDED_OFF
            # Queued: handed a freed slot when these claims are next (targeted ones first), or
            # woken without one when promoted (they may turn targeted) or on shutdown.
            first = _targeted(self.lane, holds)
            run_ids = [h.claim.run_id for h in holds]
            got = False
            if single is not None and single.targeted:  # tries the handoff again each poll
                with anyio.move_on_after(self.poll_interval):
                    got = await self.slots.take(first, run_ids)
            else:  # no timer: one per queued claim was measurable (docs/performance.md)
                got = await self.slots.take(first, run_ids)
            if got:
                if self.stopping:  # the lane stopped meanwhile: the claims are handed back
                    self.slots.release()
                    break
                return Slot.POSTING
        return Slot.STOPPING


def _targeted(lane: str, holds: Sequence[Held]) -> bool:
    """The critical lane's POSTs (it holds targeted terminals only), and the ordinary lane's
    that carry a targeted terminal (promoted while they waited), go first. A run discovery found
    with a pending terminal does not (issue 50): it is prioritised work, not control traffic."""
    if lane == "critical":
        return True
    for h in holds:  # a loop, not any(): once per POST
        if h.claim.targeted:
            return True
    return False
