"""Which class of discovered work the ordinary lane claims next (issue 50; docs/design.md,
"Scheduling: which run goes next").

Three classes, in this order:

(a) **a targeted terminal**: a terminal event committed while the relay runs, announced on the
    `terminal` channel. The critical lane claims it at once and it goes ahead of every claim
    held, for its slot and its permit; the critical reserve is for these alone. It is not
    discovered: it is drained by id, so it has no part here.
(b) **finished runs**: runs whose pending prefix ends in a terminal event, found by discovery
    (`pick_critical`: the oldest terminal first). After an outage the backlog is mostly these.
(c) **any due run** (`pick_ordinary`, the database's order: due first, a dead owner's first).

(b) and (c) share the ordinary lane's claims by stride scheduling over the runs each claimed:
(b) weighs FINISHED_WEIGHT, (c) DUE_WEIGHT. The class with the smaller pass goes next (ties to
(b)), and each run it claims moves its pass on by 1 / its weight: with both at work, (b) gets
three runs of every four. Neither starves: a class's pass only grows while it claims, so the
other's turn comes after at most FINISHED_WEIGHT / DUE_WEIGHT + 1 claims of equal size. A
class that comes back with fewer runs than asked has no more due work: its pass is levelled
with the other's (no credit banked while idle, which would let it take every claim once it is
back), and (b) is not asked first again for `recheck` seconds (its empty query would otherwise
precede every claim of a backlog without terminals), after which it is levelled again. The
lane's discovery fills a short (b) claim from (c) in the same pass, so the lane never idles
while either class has work.

Pure: the lane's discovery (relay/delivery/discovery.py) asks `first()` and reports each claim
to `claimed()`.
"""

from __future__ import annotations

import enum

FINISHED_WEIGHT = 3
DUE_WEIGHT = 1

# The backlog by class (issue 50 item 4): `backlog()` (schema/functions_ops_metrics.sql) names its
# two rows of pending work by the lanes of before issue 50, and keeps those names so that a relay
# of an earlier release reading the same database keeps its series. Each row counts one class of
# the runs: 'critical' the runs whose terminal event is pending (pending_terminals), the finished
# runs discovery finds (b); 'ordinary' every other run with pending events, class (c), due now or
# after its backoff. A targeted terminal (a) is in the 'critical' row only for the moment before
# the critical lane claims it: the lanes' claim counters by class show those.
BACKLOG_CLASSES = {"critical": "finished", "ordinary": "due"}


def backlog_class(row: str) -> str:
    """The class a row of `backlog()` counts: `finished` or `due` (an unknown row keeps its
    name)."""
    return BACKLOG_CLASSES.get(row, row)


class Discovered(enum.Enum):
    """A class of work discovery finds; its value is the claim's `p_lane` (schema/functions.sql
    `claim`: 'critical' picks finished runs, 'ordinary' any due run)."""

    FINISHED = "critical"
    DUE = "ordinary"


class Shares:
    """The ordinary lane's share between finished runs and any due run."""

    def __init__(self, recheck: float) -> None:
        self.recheck = recheck  # seconds finished runs are not asked first after none were due
        self._weights = {Discovered.FINISHED: FINISHED_WEIGHT, Discovered.DUE: DUE_WEIGHT}
        self._pass = {Discovered.FINISHED: 0.0, Discovered.DUE: 0.0}
        self._dry_until = float("-inf")  # finished runs came back short: asked again after it

    def first(self, now: float) -> Discovered:
        """The class the next claim asks first."""
        if now < self._dry_until:
            return Discovered.DUE
        if self._dry_until != float("-inf"):  # back from its recheck: level, as one that idled
            self._dry_until = float("-inf")
            self._level(Discovered.FINISHED)
        finished, due = self._pass[Discovered.FINISHED], self._pass[Discovered.DUE]
        return Discovered.FINISHED if finished <= due else Discovered.DUE

    def claimed(self, kind: Discovered, got: int, asked: int, now: float) -> None:
        """A claim of `kind` asked for `asked` runs and took `got`."""
        self._pass[kind] += got / self._weights[kind]
        if got < asked:  # no more due work of this kind: it banks no credit while idle
            self._level(kind)
            if kind is Discovered.FINISHED:
                self._dry_until = now + self.recheck

    def _level(self, kind: Discovered) -> None:
        other = Discovered.DUE if kind is Discovered.FINISHED else Discovered.FINISHED
        self._pass[kind] = max(self._pass[kind], self._pass[other])
