"""The POST turn's admission: who may POST to the ingress now under the adaptive limit, with a
critical reserve the ordinary lane cannot take and critical waiters served first (issue 42).

The limit (relay/admission/limit.py) says how many POSTs a replica may have in flight; this decides
whose they are. The critical lane may use the whole limit; the ordinary lane at most
`allowed - reserve`, where the reserve is max(1, ceil(allowed * critical_share)), at most
`max_reserve` (the critical lane's own concurrency) and never all of it. So a terminal POST
finds a permit at once unless critical POSTs hold the reserve themselves, and at the ingress it
queues behind no more ordinary POSTs than the limit lets in, which is about what the ingress
serves at once. When both lanes wait, a freed permit goes to the critical waiter that
queued first, else the ordinary one that did; a newcomer never takes a permit before a waiter
that may go.

Pure: waiting is modelled as decisions, not as awaiting. A caller asks `try_acquire()`; when it
gets nothing it queues with `wait()` and holds the `Ticket`; after each `release()` (which feeds
the POST's answer to the limit) the shell asks `grants()` which waiters go now and wakes them
with their permits, as relay/delivery/slots.py hands a freed slot straight to the next waiter. The
anyio shell around it is relay/delivery/post_turn.py's `Permits` (docs/admission.md).
"""

from __future__ import annotations

import enum
import itertools
import math
from collections import deque
from dataclasses import dataclass

from relay.admission.limit import Limit, LimitEvent, LimitView, Sample

CRITICAL_SHARE = 0.25  # of the limit, kept for the critical lane (at least one POST)


class Priority(enum.StrEnum):
    """Which lane a POST is for; critical goes first. A StrEnum for its hash: str's, in C, where
    a plain Enum hashes its name in Python, and the POST path keys a few dicts by it per POST."""

    CRITICAL = "critical"
    ORDINARY = "ordinary"


@dataclass(frozen=True, slots=True)
class Permit:
    """The right to one POST in flight: release it exactly once."""

    priority: Priority
    number: int  # unique per admission: a permit is released once
    granted_at: float
    inflight: int  # POSTs in flight once it was granted, itself included


@dataclass(frozen=True, slots=True)
class Ticket:
    """A caller's place in the queue for a permit."""

    priority: Priority
    number: int


@dataclass(frozen=True, slots=True)
class AdmissionView:
    """What observers read: the limit, and the POSTs in flight and waiting per lane."""

    limit: LimitView
    reserve: int
    inflight: dict[Priority, int]
    waiting: dict[Priority, int]


class Admission:
    """Permits for POSTs under one replica's adaptive limit."""

    def __init__(
        self,
        limit: Limit,
        *,
        critical_share: float = CRITICAL_SHARE,
        max_reserve: int | None = None,
    ) -> None:
        if limit.min_limit < 2:
            raise ValueError("the limit must allow 2 POSTs: one reserved, one ordinary")
        if not 0.0 <= critical_share < 1.0:
            raise ValueError(f"a critical share of {critical_share} is not in [0, 1)")
        self.limit = limit
        self.critical_share = critical_share
        # The reserve's most: the critical lane's own concurrency, so that at the ceiling
        # (concurrency + critical_concurrency) the ordinary lane keeps all of its own.
        self.max_reserve = max_reserve
        self._numbers = itertools.count(1)
        self._inflight = dict.fromkeys(Priority, 0)
        self._total = 0  # the sum of _inflight: read on every permit asked for
        self._reserve: tuple[int, int] = (-1, 0)  # (allowed, its reserve): moves with the limit
        self._held: set[int] = set()  # numbers of the permits not released yet
        self._queues: dict[Priority, deque[Ticket]] = {p: deque() for p in Priority}

    @property
    def reserve(self) -> int:
        """POSTs of the limit the ordinary lane may not take (it keeps at least one)."""
        allowed = self.limit.allowed
        if self._reserve[0] != allowed:  # worked out again only when the limit moved
            share = max(1, math.ceil(allowed * self.critical_share))
            if self.max_reserve is not None:
                share = min(share, max(1, self.max_reserve))
            self._reserve = (allowed, min(allowed - 1, share))
        return self._reserve[1]

    def share(self, priority: Priority) -> int:
        """POSTs of `priority` the limit lets be in flight at once now: all of it for critical
        ones, all but the reserve for ordinary ones."""
        allowed = self.limit.allowed
        return allowed if priority is Priority.CRITICAL else allowed - self.reserve

    @property
    def inflight(self) -> int:
        return self._total

    def view(self, now: float) -> AdmissionView:
        return AdmissionView(
            limit=self.limit.view(now),
            reserve=self.reserve,
            inflight=dict(self._inflight),
            waiting={p: len(q) for p, q in self._queues.items()},
        )

    def try_acquire(self, priority: Priority, now: float) -> Permit | None:
        """A permit for a POST of `priority` now, or None: no room for it, or a waiter that
        goes before it (critical ones before ordinary ones, each lane first come first served)."""
        if self._ahead(priority) or not self._room(priority):
            return None
        return self._grant(priority, now)

    def wait(self, priority: Priority) -> Ticket:
        """Queue for a permit (after `try_acquire` gave none); `grants()` says when it comes."""
        ticket = Ticket(priority, next(self._numbers))
        self._queues[priority].append(ticket)
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """The waiter gave up (cancelled, or its claim was handed elsewhere)."""
        queue = self._queues[ticket.priority]
        if ticket in queue:
            queue.remove(ticket)

    def grants(self, now: float) -> list[tuple[Ticket, Permit]]:
        """The waiters that may go now, each with its permit, critical ones first and each lane
        in the order it queued. Called after each release (the limit may have grown, too)."""
        granted = []
        for priority in Priority:  # CRITICAL first
            queue = self._queues[priority]
            while queue and self._room(priority):
                granted.append((queue.popleft(), self._grant(priority, now)))
        return granted

    def answered(self, permit: Permit, sample: Sample, now: float) -> LimitEvent | None:
        """One answer to a POST sent under `permit`, which it still holds (a permit may see a
        few: quick retries go under the same one): the limit judges it. Returns the limit's
        event, if it fell sharply or recovered."""
        if permit.number not in self._held:
            raise RuntimeError("an answer for a POST permit not held")
        return self.limit.observe(sample, inflight=permit.inflight, now=now)

    def release(self, permit: Permit, sample: Sample | None, now: float) -> LimitEvent | None:
        """The POST is done: free its permit and let the limit judge its answer (None: it was
        never sent). Returns the limit's event, if it fell sharply or recovered."""
        if permit.number not in self._held:
            raise RuntimeError("a POST permit released twice, or not ours")
        self._held.remove(permit.number)
        self._inflight[permit.priority] -= 1
        self._total -= 1
        if sample is None:
            return None
        return self.limit.observe(sample, inflight=permit.inflight, now=now)

    def _ahead(self, priority: Priority) -> bool:
        """Someone waits who goes before a newcomer of `priority`."""
        if self._queues[priority]:
            return True
        return priority is Priority.ORDINARY and bool(self._queues[Priority.CRITICAL])

    def _room(self, priority: Priority) -> bool:
        allowed = self.limit.allowed
        if priority is Priority.CRITICAL:
            # The reserve is the critical lane's even when ordinary POSTs sent under a higher
            # limit still fill the new one: in flight may then pass it by the reserve at most.
            reserved = self._inflight[Priority.CRITICAL] < self.reserve
            return reserved or self.inflight < allowed
        ordinary = self._inflight[Priority.ORDINARY]
        return self.inflight < allowed and ordinary < allowed - self.reserve

    def _grant(self, priority: Priority, now: float) -> Permit:
        self._inflight[priority] += 1
        self._total += 1
        permit = Permit(priority, next(self._numbers), now, self._total)
        self._held.add(permit.number)
        return permit
