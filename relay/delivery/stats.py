"""A lane's counters: each part of the lane (fetch, execute, complete) counts its own, and
`LaneStats` is their sum as observers see it (relay/serving/health.py, relay/serving/metrics.py and
the status page read it through `Lane.view()`, a copy)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FetchStats:
    """The lane's own (relay/delivery/lane.py, its discovery relay/delivery/discovery.py):
    discovery and hand-over."""

    passes: int = 0
    claims: int = 0  # claim statements run, targeted ones included
    claimed_runs: int = 0
    adopted: int = 0  # critical runs taken over from the ordinary lane's queue
    reclaimed: int = 0  # runs claimed from a dead owner before their lease expired (issue 18)
    # Runs claimed by class (issue 50): "targeted" terminals, "finished" runs (a pending
    # terminal found by discovery), "due" (the rest).
    by_class: dict[str, int] = field(
        default_factory=lambda: {"targeted": 0, "finished": 0, "due": 0}
    )


@dataclass
class ExecuteStats:
    """The executor's (relay/delivery/execute.py): requests and what came before them."""

    posts: int = 0
    renewed_before_post: int = 0
    widened: int = 0  # events added to a claim before its first POST
    renewals: int = 0  # leases renewed (the renewer's count, filled in by the executor's view)
    deferred: int = (
        0  # retries the retry budget held back in the outbox (relay/admission/retry_budget.py)
    )


@dataclass
class CompleteStats:
    """The completer's (relay/delivery/complete.py): the results written."""

    delivered: int = 0
    acks: int = 0
    ack_groups: int = 0  # ack statements committed (the ack group's count, filled in by the view)
    lease_lost: int = 0
    retries: int = 0
    failed: int = 0
    stale_acks: int = 0
    by_type: dict[str, int] = field(default_factory=dict)


@dataclass
class LaneStats:
    passes: int = 0
    claims: int = 0  # claim statements run: claimed_runs / claims is the runs per claim
    claimed_runs: int = 0
    delivered: int = 0
    posts: int = 0
    acks: int = 0
    ack_groups: int = 0  # ack statements: acks / ack_groups is the runs per group
    lease_lost: int = 0
    retries: int = 0
    failed: int = 0
    stale_acks: int = 0
    renewed_before_post: int = 0
    adopted: int = 0  # critical runs taken over from the ordinary lane's queue
    widened: int = 0  # events added to a claim before its first POST
    reclaimed: int = 0  # runs claimed from a dead owner before their lease expired (issue 18)
    by_type: dict[str, int] = field(default_factory=dict)
    renewals: int = 0  # leases renewed while their POST was on the wire
    deferred: int = 0  # retries the retry budget held back in the outbox
    by_class: dict[str, int] = field(default_factory=dict)  # runs claimed by class (issue 50)

    @classmethod
    def of(cls, fetch: FetchStats, execute: ExecuteStats, complete: CompleteStats) -> LaneStats:
        """The three parts' counters (each a copy its part gave), as one value."""
        return cls(
            passes=fetch.passes,
            claims=fetch.claims,
            claimed_runs=fetch.claimed_runs,
            delivered=complete.delivered,
            posts=execute.posts,
            acks=complete.acks,
            ack_groups=complete.ack_groups,
            lease_lost=complete.lease_lost,
            retries=complete.retries,
            failed=complete.failed,
            stale_acks=complete.stale_acks,
            renewed_before_post=execute.renewed_before_post,
            adopted=fetch.adopted,
            widened=execute.widened,
            reclaimed=fetch.reclaimed,
            by_class=fetch.by_class,
            by_type=complete.by_type,
            renewals=execute.renewals,
            deferred=execute.deferred,
        )
