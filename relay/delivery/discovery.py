"""Discovery, the ordinary lane's claims of due work: how many runs a pass asks for, which class
it asks first, and the spacing of passes that find nothing (DESIGN §4.1-4.3; issue 50).

A pass asks for no more runs than the lane has room for (relay/delivery/holdings.py: its
capacity and its byte budget, each run counted at max_batch_bytes) and at most `claim_runs`.
Finished runs (a pending terminal) and any due run share its claims (relay/core/classes.py):
`Shares` says which class goes first, and what finished runs lack is filled from any due run in
the same pass. A pass that comes back short found all the due work there was; the next one
waits until `MIN_EMPTY_PASS_SPACING` has gone by, so a burst of wakes costs a handful of passes.

It claims through the store and returns the claims; starting them is the lane's
(relay/delivery/lane.py). The critical lane does not discover: it claims targeted terminals by
id.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio

from relay.core.classes import Discovered, Shares
from relay.delivery.holdings import Holdings
from relay.delivery.stats import FetchStats
from relay.edges.store import Claim, Store
from relay.settings import Settings

MIN_EMPTY_PASS_SPACING = 0.01  # coalesces bursts of wakes into a handful of passes


@dataclass(frozen=True)
class Found:
    """What one discovery pass claimed."""

    claims: list[Claim]
    full: bool  # as many runs as it asked for: more may be due, the next pass starts at once


class Discovery:
    """A lane's discovery passes: `claims(now)` returns what one pass claimed."""

    def __init__(
        self, settings: Settings, store: Store, holdings: Holdings, fetched: FetchStats
    ) -> None:
        self.settings = settings
        self.store = store
        self.holdings = holdings  # read for the room left, never changed here
        self.fetched = fetched  # the lane's fetch counters: its passes and claim statements
        self.shares = Shares(recheck=settings.poll_interval)
        self._last_empty_pass = -1.0

    async def claims(self, now: float) -> Found:
        """One pass: as many runs as the lane has room for, spaced after a pass that found
        nothing."""
        # Space out passes that find nothing, so a burst of wakes costs a handful of passes. The
        # clock is read again after each wait: uvloop's timers fire up to a millisecond early
        # (docs/design.md, the event loop and the clock).
        spaced_until = self._last_empty_pass + MIN_EMPTY_PASS_SPACING
        while (left := spaced_until - now) > 0:
            await anyio.sleep(left)
            now = anyio.current_time()
        holdings = self.holdings
        want = max(1, min(holdings.room(), self.settings.claim_runs, holdings.fits()))
        self.fetched.passes += 1
        claims = await self._claim(want)
        if len(claims) < want:
            self._last_empty_pass = anyio.current_time()
            return Found(claims, full=False)
        return Found(claims, full=True)

    async def _claim(self, want: int) -> list[Claim]:
        """Up to `want` runs: finished ones and any due run in their shares
        (relay/core/classes.py), what the first class lacks filled from any due run."""
        first = self.shares.first(anyio.current_time())
        self.fetched.claims += 1
        claims = await self.store.claim(first.value, want)
        self.shares.claimed(first, len(claims), want, anyio.current_time())
        if first is Discovered.FINISHED and len(claims) < want:
            self.fetched.claims += 1
            more = await self.store.claim(Discovered.DUE.value, want - len(claims))
            self.shares.claimed(Discovered.DUE, len(more), want - len(claims), anyio.current_time())
            claims += more
        return claims
