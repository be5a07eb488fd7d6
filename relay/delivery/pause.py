"""The lane's pause gate: how long a lane claims nothing while its ingress is misconfigured.

An answer that says the endpoint itself is wrong (401/403/404/410, a redirect: DESIGN §5) is no
fault of the events, so the whole lane backs off rather than one run: the gate closes for a
backoff that grows with each misconfigured answer (`policy.misconfigured_backoff`), and answers
to requests that were already in flight when it closed do not grow it further. The first answer
that shows the endpoint works again resets the count (the pause already set runs out on its
own). The clock is passed in.

The gate writes nothing: the completer (relay/delivery/complete.py, through its releases in
relay/delivery/release.py) hands the claim back for as long as the gate says. It tells the runner's
readiness (`on_ready_change`) when the ingress turns misconfigured or recovers; the lane and the
observers read it through `view()`, a value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from relay import logs
from relay.core.policy import misconfigured_backoff


@dataclass(frozen=True, slots=True)
class Gate:
    """The lane's pause gate as the lane and observers read it."""

    paused_until: float  # the lane claims nothing before this (monotonic clock)
    misconfigured: bool  # the ingress answered "misconfigured" and has not recovered since


class PauseGate:
    """One per lane, owned by its completer: `misconfigured(now)` on each misconfigured answer,
    `ingress_ok()` on each answer that shows the endpoint works."""

    def __init__(self, lane: str, *, cap: float, on_ready_change: Callable[[bool], None]) -> None:
        self.lane = lane
        self.cap = cap  # the longest pause (settings.max_backoff)
        self.on_ready_change = on_ready_change
        self._paused_until = 0.0  # the lane claims nothing before this (monotonic clock)
        self._misconfigured = 0  # consecutive misconfigured answers; 0 once one is accepted

    def view(self) -> Gate:
        return Gate(self._paused_until, self._misconfigured > 0)

    def misconfigured(self, now: float) -> float:
        """The ingress answered "misconfigured": the seconds from `now` that the lane stays
        paused (and the claim is handed back for)."""
        if now >= self._paused_until:
            # Requests that were already in flight when the pause began don't escalate it.
            self._misconfigured += 1
            delay = misconfigured_backoff(self._misconfigured, cap=self.cap)
            self._paused_until = now + delay
        self.on_ready_change(False)
        return self._paused_until - now

    def ingress_ok(self) -> None:
        """An answer showed the endpoint works: the ingress has recovered, the count starts
        again."""
        if self._misconfigured:
            self._misconfigured = 0
            self.on_ready_change(True)
            logs.info("ingress_recovered", lane=self.lane)
