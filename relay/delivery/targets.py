"""Targeted drains, the critical lane's claims by id: which runs a terminal event targeted, and
their claims (issue 50; docs/design.md, "Scheduling").

A terminal event committed while the relay runs targets its run (`add`): the run is claimed by id
at once, whatever the lane holds (control traffic). The claim gate does not hold a targeted
terminal, only the lane's capacity and byte budget do (relay/delivery/holdings.py,
`may_target`). A run it could not claim (leased elsewhere, or backing off) is wanted: targeted
again once another replica delivers its events (`delivered_elsewhere`), unless the lane claimed
it meanwhile (`claimed`). A run is wanted for a lease's time at most (relay/core/recent.py): a
run another replica delivered to its end is never claimed here again, and a set of such names
would only grow.

It claims through the store and returns the claims; waking the lane's loop for a drain and
starting the claims are the lane's (relay/delivery/lane.py), and it calls nothing back in the
lane.
"""

from __future__ import annotations

import anyio

from relay.core.recent import Recent
from relay.delivery.holdings import Holdings
from relay.delivery.stats import FetchStats
from relay.edges.store import Claim, Store


class Targets:
    """A lane's targeted drains: `add(run_id)` records a run to claim by id, `claim()` claims the
    next one and returns its claim."""

    def __init__(
        self, lane: str, store: Store, holdings: Holdings, fetched: FetchStats, *, wanted_for: float
    ) -> None:
        self.lane = lane
        self.store = store
        self.holdings = holdings  # read for the claims held and the room left, never changed here
        self.fetched = fetched  # the lane's fetch counters: its claim statements
        self.runs: list[str] = []  # runs to drain now
        self.wanted = Recent(wanted_for)  # terminal runs we could not claim yet

    @property
    def pending(self) -> bool:
        """Some run is still to be drained."""
        return bool(self.runs)

    def ready(self) -> bool:
        """A run to drain and room for it: checked before the claim gate (control traffic)."""
        return bool(self.runs) and self.holdings.may_target()

    def add(self, run_id: str) -> None:
        """Claim this run by id at once, unless the lane holds it or it is targeted already."""
        if run_id not in self.holdings.inflight and run_id not in self.runs:
            self.runs.append(run_id)

    def delivered_elsewhere(self, run_id: str) -> bool:
        """Another replica delivered this run's events: whether it was wanted here (no longer),
        and so is to be drained again."""
        return self.wanted.take(run_id, anyio.current_time())

    async def claim(self) -> list[Claim]:
        """The next run's claim by id: none if it is leased elsewhere or backing off (it is
        wanted then)."""
        run_id = self.runs.pop(0)
        self.fetched.claims += 1
        claims = await self.store.claim(self.lane, 1, run_id)
        if not claims and run_id not in self.holdings.inflight:
            # leased elsewhere or backing off; retried on delivery
            self.wanted.add(run_id, anyio.current_time())
        return claims

    def claimed(self, run_id: str) -> None:
        """The lane claimed this run (by id, or otherwise): it is no longer wanted."""
        self.wanted.discard(run_id)
