"""Fetch, a lane's first part: discovery of due runs, their claims, and the hand-over of terminal
runs (DESIGN §4.2-4.3).

The relay has two (issue 50; docs/design.md, "Scheduling"): `critical` claims targeted terminals
only (a terminal event committed while the relay runs, drained by id at once whatever the lane
holds: control traffic), and `ordinary` discovers the rest, finished runs (a pending terminal)
and any due run sharing its claims (relay/delivery/discovery.py). Each has its own concurrency,
database pool, HTTP client and ack group, so a full ordinary lane cannot delay the critical one.

The lane claims runs through its two fetch parts, each of which returns the claims and calls
nothing back: the ordinary lane's by its discovery (relay/delivery/discovery.py), the critical
lane's by id (relay/delivery/targets.py: the runs a terminal event targeted, and those it could
not claim yet; the lane wakes its loop for each drain). It holds them (relay/delivery/holdings.py:
under the adaptive limit, what its share of the limit can POST soon), and starts each single
claim or multi-run group as a delivery (relay/delivery/deliveries.py) in one of its delivery
tasks (`Deliveries`, there too: kept and reused, waited for when the lane stops; it builds the
lane's executor and completer): the delivery takes a turn to POST from the lane's POST turn
(relay/delivery/post_turn.py: the lane's slots, then the replica's permits, critical first), the
executor POSTs (relay/delivery/execute.py) and the completer writes what the answers mean
(relay/delivery/complete.py, the one writer of results). The lane reads the others only through
views (`gate()`, `view()`) and the delivery's two callbacks. A single claim promoted to a
targeted terminal that would have to wait for a slot of the ordinary lane is handed to the
critical lane instead: a targeted terminal never queues behind other work.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, replace

import anyio
import psycopg

from relay import logs
from relay.core.policy import backoff, plan_groups
from relay.core.recent import Recent
from relay.delivery.complete import Completer
from relay.delivery.deliveries import Deliveries, Wiring
from relay.delivery.discovery import Discovery
from relay.delivery.holdings import Holdings
from relay.delivery.post_turn import Permits, PostTurn
from relay.delivery.stats import FetchStats, LaneStats
from relay.delivery.targets import Targets
from relay.delivery.wake import Wake
from relay.edges.store import Claim, Held, Store
from relay.settings import Settings


@dataclass(frozen=True)
class LaneView:
    """A lane as observers see it (relay/serving/health.py, relay/serving/metrics.py,
    relay/serving/sdnotify.py)."""

    name: str
    stats: LaneStats  # a copy
    inflight: int  # claims held: POSTing or queued for a POST slot
    turns: int  # discovery loop turns (liveness)
    turned_at: float  # monotonic time of the last turn
    misconfigured: bool  # the ingress answered "misconfigured" and has not recovered since
    renewals: int = 0  # leases renewed while their POST was on the wire


class Lane:
    """One lane: `run()` as its loop, `drain()` / `promote()` / `adopt()` from the runner, and
    `view()` for observers."""

    def __init__(
        self,
        name: str,
        settings: Settings,
        store: Store,
        wiring: Wiring,
        concurrency: int,
        *,
        permits: Permits | None = None,
        database: str | None = None,
    ) -> None:
        self.name = name
        self.settings = settings
        self.store = store
        self.concurrency = concurrency
        self.fetched = FetchStats()
        self.wake = Wake()
        self.slot_freed = Wake()
        # The critical lane claims targeted terminals only; the ordinary lane discovers the rest.
        self.targeted_only = name == "critical"
        # Each claim's or group's turn to POST: the lane's slots and the replica's permits,
        # critical ones first (relay/delivery/post_turn.py); in a fleet, the permits are every
        # database's, and its waiters are known by (database, run id).
        self.post_turn = PostTurn(
            name, concurrency, settings.poll_interval, permits, database=database
        )
        # The claims held, their bytes; as many as the POST turn can carry soon.
        posts = self.post_turn.posts if permits is not None else None
        self.holdings = Holdings(settings, concurrency, posts)
        # Which runs the ordinary lane claims, and how many (relay/delivery/discovery.py).
        self.discovery = Discovery(settings, store, self.holdings, self.fetched)
        # Which runs the critical lane claims by id, at once (relay/delivery/targets.py).
        self.targets = Targets(
            name, store, self.holdings, self.fetched, wanted_for=settings.lease_ttl
        )
        # Runs a terminal event targeted before this lane's claim of them came back: the claim
        # was on the wire when the notification came (or took the run before the critical lane
        # could), and arrives as a targeted terminal (`promote`). Kept a lease's time at most.
        self.foretold = Recent(settings.lease_ttl)
        # Each claim's or group's delivery (its turn, the POST, the results) and the tasks they
        # run in, kept and reused, beside the ack group and the renewer that serve them; the
        # executor and the completer are built there (relay/delivery/deliveries.py), wired to
        # the ingress and the runner's observers as `wiring` says.
        self.deliveries = Deliveries(
            name,
            settings,
            store,
            self.post_turn,
            self.holdings,
            wiring,
            settled=self._settled,
            critical_done=self.wake.set,
        )
        self.stopping = False
        # Liveness, for /healthz and the systemd watchdog (read through view()).
        self.turns = 0
        self.turned_at = 0.0

    @property
    def inflight(self) -> dict[str, Held]:
        """The claims this lane holds, by run: POSTing, or queued for a POST slot."""
        return self.holdings.inflight

    @property
    def complete(self) -> Completer:
        """The completer of the lane's deliveries (relay/delivery/complete.py), read through its
        views only: its counters, the pause gate, who a claim is."""
        return self.deliveries.completer

    @property
    def stats(self) -> LaneStats:
        """The counters of the lane's three parts, as one copy."""
        executed = self.deliveries.executor.view()
        return LaneStats.of(replace(self.fetched), executed, self.complete.view())

    def view(self) -> LaneView:
        """What health and metrics read: a snapshot, never the lane's own state."""
        stats = self.stats
        return LaneView(
            name=self.name,
            stats=stats,
            inflight=len(self.inflight),
            turns=self.turns,
            turned_at=self.turned_at,
            misconfigured=self.complete.gate().misconfigured,
            renewals=stats.renewals,
        )

    # -- wakes ------------------------------------------------------------------------------

    def drain(self, run_id: str) -> None:
        """A targeted drain: claim this run at once, without waiting for a discovery pass
        (relay/delivery/targets.py). Its wake ends any wait of the loop, for a freed slot
        included."""
        self.targets.add(run_id)
        self.wake.set()
        self.slot_freed.set()

    def delivered_elsewhere(self, run_id: str) -> None:
        """Another replica delivered this run: drained again if it was wanted here."""
        if self.targets.delivered_elsewhere(run_id):
            self.drain(run_id)

    # -- discovery ---------------------------------------------------------------------------

    async def run(self) -> None:
        """The lane's loop; returns after stop() once in-flight work is finished or released."""
        async with self.deliveries.running():
            await self._discover()
            await self.deliveries.finish(self.settings.shutdown_timeout, self.slot_freed)

    async def _discover(self) -> None:
        """Discovery passes until stop(), each started at once while busy, else after a wake."""
        failures = 0
        while not self.stopping:
            self.turns += 1  # liveness (relay/serving/health.py)
            self.turned_at = anyio.current_time()
            try:
                if self.store.owes_back:  # held unknowingly: a lost answer, a failed hand-back
                    await self.store.give_back()
                busy = await self._pass()
                failures = 0
            except (psycopg.Error, OSError, TimeoutError) as exc:
                failures += 1
                cap = self.settings.poll_interval * 5
                delay = backoff(failures, base=0.05, cap=cap, rand=random.random())
                logs.warning(
                    "claim_failed",
                    lane=self.name,
                    error=logs.error_text(exc),
                    retry_in=round(delay, 3),
                )
                await anyio.sleep(delay)
                continue
            if busy:
                continue
            await self.wake.wait(self.settings.poll_interval)

    async def _pass(self) -> bool:
        """One discovery step. Returns True when the next one should start at once."""
        now = anyio.current_time()
        paused_until = self.complete.gate().paused_until  # the ingress is misconfigured
        if now < paused_until:
            await self.wake.wait(min(paused_until - now, self.settings.poll_interval))
            return False
        if self.targets.ready():  # before the claim gate: control traffic
            self._start(await self.targets.claim())
            return True
        if self.targeted_only:
            if self.targets.pending:  # a flood of them fills the lane: the next as one settles
                await self.slot_freed.wait(self.settings.poll_interval)
                return True
            return False
        if not self.holdings.may_claim():  # the byte budget is spent, or too little room
            await self.slot_freed.wait(self.settings.poll_interval)
            return True
        found = await self.discovery.claims(now)  # spaced, sized to the room, by class
        self._start(found.claims)
        return found.full

    def _settled(self) -> None:
        """Wake the discovery loop when it may claim again (not at each settle: for nothing)."""
        if self.stopping or self.holdings.may_claim():
            self.slot_freed.set()

    def _start(self, claims: list[Claim]) -> None:
        assert self.deliveries.started
        held: list[Held] = []
        reclaimed: dict[str, list[str]] = {}  # dead owner -> the runs this claim took from it
        by_class = self.fetched.by_class
        now = anyio.current_time()
        for claim in claims:
            if self.foretold.take(claim.run_id, now):  # targeted while its claim was on the way
                claim = claim.promoted()
            self.fetched.claimed_runs += 1
            by_class[_class_of(claim)] += 1
            held.append(self.holdings.hold(claim))
            self.targets.claimed(claim.run_id)
            if claim.reclaimed_from is not None:
                self.fetched.reclaimed += 1
                reclaimed.setdefault(claim.reclaimed_from, []).append(claim.run_id)
                logs.debug(
                    "lease_reclaimed", **self.complete.who(claim), dead_owner=claim.reclaimed_from
                )
            if logs.enabled(logging.DEBUG):  # per claim: not even built otherwise
                logs.debug(
                    "claimed",
                    **self.complete.who(claim),
                    first_seq=claim.first_seq,
                    last_seq=claim.last_seq,
                    events=len(claim.events),
                    critical=claim.critical,
                )
        for dead_owner, runs in reclaimed.items():
            # One line per dead owner and claim (a claim takes at most claim_runs runs), the
            # per-run lines at debug: a killed replica's 131 runs are a few lines, not 131.
            logs.info(
                "leases_reclaimed",
                lane=self.name,
                dead_owner=dead_owner,
                runs=len(runs),
                run_ids=runs,
                lease_owner=self.store.owner,
            )
        share = bool(self.settings.ingress_batch_url)
        groups = plan_groups(
            held,
            share=share,
            batch_size=self.settings.batch_size,
            max_bytes=self.settings.max_batch_bytes,
            size_of=self.holdings.size_of,
        )
        for group in groups:
            self.deliveries.start(group)

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        self.slot_freed.set()
        self.post_turn.stop()

    # -- claims between lanes ----------------------------------------------------------------

    def promote(self, run_id: str) -> None:
        """A terminal event was committed for a run this lane holds but has not started: mark it
        critical and widen it before its POST; a queued one is handed to the critical lane. A
        run it does not hold yet is foretold: its claim may be on the way, and arrives promoted."""
        held = self.inflight.get(run_id)
        if held is None:
            self.foretold.add(run_id, anyio.current_time())
        elif run_id not in self.post_turn.posting_runs:
            held.claim = held.claim.promoted()
            self.slot_freed.set()
            # Its waiter queues again, as critical: a single claim hands itself over to the
            # critical lane, a group goes before the ordinary waiters.
            self.post_turn.promote(run_id)

    def adopt(self, claim: Claim) -> bool:
        """Take over a claim another lane holds but cannot start yet, if there is room."""
        if self.stopping or not self.deliveries.started or len(self.inflight) >= self.concurrency:
            return False
        held = self.holdings.hold(claim)
        self.targets.claimed(claim.run_id)  # no longer wanted: drained here
        self.fetched.adopted += 1
        self.deliveries.start([held])
        return True


def _class_of(claim: Claim) -> str:
    """Its class for the counters (issue 50; docs/design.md, "Scheduling")."""
    if claim.targeted:
        return "targeted"
    return "finished" if claim.critical else "due"
