"""What a lane holds: the claims it took and has not settled yet, POSTing or queued for a POST
slot, and the payload bytes they hold (issue 13). The lane asks it whether it may claim again,
and its discovery (relay/delivery/discovery.py) for how many runs; it changes only when the lane
holds a claim or drops a settled one.
"""

from __future__ import annotations

from collections.abc import Callable

from relay.edges.store import Claim, Held, payload_bytes
from relay.settings import Settings


class Holdings:
    """A lane's claims by run, the superseded ones still settling, and the byte budget."""

    def __init__(
        self, settings: Settings, concurrency: int, posts: Callable[[], int] | None = None
    ) -> None:
        self.settings = settings
        self.concurrency = concurrency
        # Under the adaptive limit (relay/delivery/post_turn.py), the POSTs the lane may have in
        # flight now; None: its concurrency, always (post_limit = fixed).
        self.posts = posts
        # Claims this lane holds: POSTing, or queued for a POST slot. Holding claim_runs more
        # than the concurrency keeps the slots busy with no claim round trip between runs.
        self.inflight: dict[str, Held] = {}
        # Payload bytes those claims hold (issue 13): no claim once max_lane_bytes are held; a
        # claim asks for no more runs than fit, each counted at max_batch_bytes (its SQL's most).
        self.held_bytes = 0
        self._sizes: dict[int, int] = {}  # id(held) -> its payload bytes as claimed
        # Claims whose run this lane claimed again after their lease expired (a zombie of our
        # own, e.g. a POST that outlived its lease): still running until they settle.
        self._superseded: list[Held] = []
        # With `ingress_batch_url`, one POST slot carries up to a claim's worth of small runs:
        # the lane then holds enough runs to fill every slot, plus one claim ahead (counted in
        # runs, a claim of small runs would otherwise fill the lane with one POST in flight).
        self.fixed_capacity = (
            (concurrency + 1) * settings.claim_runs
            if settings.ingress_batch_url
            else concurrency + settings.claim_runs
        )

    @property
    def capacity(self) -> int:
        """Runs the lane may hold. Under the adaptive limit below its ceiling, what its share
        can POST now and one more round of it (at most a claim): a claim waiting for a permit
        holds its run's lease, which another replica with room could carry. At the ceiling,
        as under the fixed limit, its concurrency and a claim beyond (fewer cost a fast
        ingress 5% of its throughput, issue 42's bench)."""
        posts = self.concurrency if self.posts is None else self.posts()
        if posts >= self.concurrency:  # at its ceiling the adaptive limit is the fixed one
            return self.fixed_capacity
        if self.settings.ingress_batch_url:
            return (posts + 1) * self.settings.claim_runs
        return posts + min(self.settings.claim_runs, posts)

    def hold(self, claim: Claim) -> Held:
        held = Held(claim)
        older = self.inflight.get(claim.run_id)
        if older is not None:
            self._superseded.append(older)  # it settles on its own (its ack is fenced)
        self.inflight[claim.run_id] = held
        size = payload_bytes(claim.events)
        self._sizes[id(held)] = size
        self.held_bytes += size
        return held

    def drop(self, held: Held) -> None:
        """Forget a settled claim (and only it: the run may have been claimed again meanwhile)."""
        if self.inflight.get(held.claim.run_id) is held:
            del self.inflight[held.claim.run_id]
        else:
            self._superseded = [h for h in self._superseded if h is not held]
        self.held_bytes -= self._sizes.pop(id(held), 0)

    def size_of(self, held: Held) -> int:
        """The payload bytes of a claim held, as claimed."""
        return self._sizes.get(id(held), 0)

    def unsettled(self) -> bool:
        """Some claim, current or superseded, has not settled yet."""
        return bool(self.inflight or self._superseded)

    def room(self) -> int:
        """Runs the lane may still hold."""
        return self.capacity - len(self.inflight)

    def fits(self) -> int:
        """Runs the byte budget has room for, each at max_batch_bytes."""
        return (self.settings.max_lane_bytes - self.held_bytes) // self.settings.max_batch_bytes

    def may_target(self) -> bool:
        """Room for a targeted terminal (issue 50): the claim gate does not hold it, only the
        lane's capacity and byte budget do (a flood of targeted terminals, first come first
        claimed as room frees)."""
        return not self.inflight or (self.room() >= 1 and self.fits() >= 1)

    def may_claim(self) -> bool:
        """The byte budget has room for one more run (or nothing is held), and the lane for half
        a claim of runs (or a POST slot is idle)."""
        held = len(self.inflight)
        if held and self.fits() < 1:
            return False
        posts = self.concurrency if self.posts is None else self.posts()
        return self.room() >= max(1, self.settings.claim_runs // 2) or held < posts
