"""Lease renewal while claims are on the wire (DESIGN §4.2).

One `Renewer` per lane keeps the leases of every claim whose POST is in flight, in one round
trip for all that are due. A delivery registers its claims with `renewing(claims)` for the
duration of the request; when none of their leases is held any more the request is cancelled
(`Renewal.lost`), and the batch is abandoned without an ack.

The store only answers which leases it renewed and their new trust windows; moving a claim's
window forward happens here, in the lane's own code: each renewed claim's holder (`Held`) gets
the claim under its new window, where the delivery reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import anyio
import psycopg

from relay.core import clock
from relay.core.policy import renew_interval
from relay.edges.store import Held, Store


class Renewal:
    """Claims on the wire, kept by their lane's renewer while the block runs; the block is
    cancelled once none of their leases is held any more (`lost`)."""

    def __init__(self, claims: list[Held], registry: set[Renewal]) -> None:
        self.claims = claims
        self.live = {h.claim.run_id for h in claims}
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


class Renewer:
    """The lane's renewer: `run()` as a background task, `renewing()` around each request."""

    def __init__(self, store: Store, lease_ttl: float) -> None:
        self.store = store
        self.interval = renew_interval(lease_ttl)
        self._renewals: set[Renewal] = set()
        self.renewed = 0  # leases renewed (the status page's "renewals")

    def renewing(self, claims: list[Held]) -> Renewal:
        return Renewal(claims, self._renewals)

    async def renew(self, claims: Sequence[Held]) -> set[str]:
        """Renew these leases now; returns the run ids renewed (their holders keep the claims
        under the new trust windows)."""
        trusts = await self.store.renew([h.claim for h in claims])
        self.renewed += len(trusts)
        for held in claims:
            trust = trusts.get(held.claim.run_id)
            if trust is not None:
                held.claim = held.claim.renewed(trust)
        return set(trusts)

    async def run(self) -> None:
        """Renews the leases of every claim on the wire: one task per lane, one round trip for
        all that are due. A claim is due ttl/3 after its lease was taken or last renewed
        (DESIGN §4.2); the renewer sleeps until the first one is due, and at most ttl/12, so a
        claim that starts its POST meanwhile is seen in time. When the database cannot say (an
        error, a timeout), a claim counts as held only while its window outlasts another
        interval."""
        interval = self.interval
        pause = 0.0
        while True:
            now = clock.now()
            first_due = min(
                (
                    h.claim.trust.started + interval
                    for r in self._renewals
                    for h in r.claims
                    if h.claim.run_id in r.live
                ),
                default=now + interval,
            )
            # On uvloop this sleep may end before first_due on the hot paths' clock (its timers
            # keep whole milliseconds, relay/core/clock.py): nothing is due yet, and it sleeps
            # again for what is left.
            await anyio.sleep(min(max(first_due - now, pause), interval / 4))
            pause = 0.0
            now = clock.now()
            due = {
                h.claim.run_id: h
                for r in self._renewals
                for h in r.claims
                if h.claim.run_id in r.live and now - h.claim.trust.started >= interval
            }
            if not due:
                continue
            try:
                held = await self.renew(list(due.values()))
            except (psycopg.Error, OSError, TimeoutError):
                now = clock.now()
                held = {run for run, h in due.items() if h.claim.trust.remaining(now) > interval}
                pause = interval / 4  # their windows did not move: try again soon, not at once
            for r in list(self._renewals):
                r.lose(due.keys() - held)
