"""Run ids a terminal notification named, remembered only as long as they can still matter
(issue 50; docs/design.md, "Scheduling").

A terminal event's notification names its run once. What the lanes do with that name may have
to wait: the ordinary lane's claim of the run may be on the wire when the notification comes, or
the critical lane may find the run leased elsewhere and want it again once it is delivered. A
plain set of such names grows by one for each name nothing comes back for (a run delivered by
another replica, a claim that never returns the run), so these sets forget: a name is kept for
`ttl` seconds after it was last added, and no more than `limit` names are kept, the oldest
forgotten first. A forgotten name costs a run its place as a targeted terminal, never its
delivery: discovery still finds it, a finished run, ahead of due work.
"""

from __future__ import annotations

LIMIT = 65_536  # names kept at most: a few MB, whatever the rate of terminals


class Recent:
    """A set of run ids, each kept `ttl` seconds after it was last added (times in seconds, on
    whatever clock the caller reads, as long as it reads the same one each time)."""

    def __init__(self, ttl: float, limit: int = LIMIT) -> None:
        self.ttl = ttl
        self.limit = limit
        # name -> when it is forgotten; the same ttl for each, so insertion order is expiry order
        self.until: dict[str, float] = {}

    def add(self, run_id: str, now: float) -> None:
        self.until.pop(run_id, None)  # added again: kept from now, and last in the order
        self.until[run_id] = now + self.ttl
        self.forget(now)

    def take(self, run_id: str, now: float) -> bool:
        """Whether `run_id` is kept; it is not after this."""
        until = self.until.pop(run_id, None)
        return until is not None and until > now

    def discard(self, run_id: str) -> None:
        self.until.pop(run_id, None)

    def forget(self, now: float) -> None:
        """Forget the names whose time is up, and the oldest beyond `limit`."""
        until = self.until
        while until:
            run_id, expires = next(iter(until.items()))  # the oldest: forgotten first
            if expires > now and len(until) <= self.limit:
                return  # the rest are kept longer than this one
            del until[run_id]

    def names(self, now: float) -> set[str]:
        """The names kept at `now` (for views and tests)."""
        return {run_id for run_id, expires in self.until.items() if expires > now}

    def __len__(self) -> int:
        return len(self.until)
