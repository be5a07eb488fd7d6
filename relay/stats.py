"""A lane's counters (read by relay/health.py, relay/metrics.py and the status page through
`Lane.view()`, which copies them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LaneStats:
    passes: int = 0
    claimed_runs: int = 0
    delivered: int = 0
    posts: int = 0
    acks: int = 0
    lease_lost: int = 0
    retries: int = 0
    failed: int = 0
    stale_acks: int = 0
    renewed_before_post: int = 0
    adopted: int = 0  # critical runs taken over from the ordinary lane's queue
    widened: int = 0  # events added to a claim before its first POST
    reclaimed: int = 0  # runs claimed from a dead owner before their lease expired (issue 18)
    by_type: dict[str, int] = field(default_factory=dict)
