"""The retry budget: retries of POSTs, quick and scheduled, stay a bounded share of the
ingress's load, so an ingress failing half its requests does not see its load double (issue 42).

Tokens, in the manner of Finagle's RetryBudget and gRPC's retry throttling, over a window of
SPAN seconds (relay/admission/windows.py):

- every POST the ingress served (an answer other than a transient failure) deposits `ratio`;
- a retry takes one token while it is in flight. One that fails keeps it; one that is served
  gives it back **only while the ingress is healthy**: at most HEALTHY of the window's POSTs
  failed. While it is not, a served retry keeps its token too, as every retry does in Finagle;
- a standing reserve of `per_second * span` tokens lets a quiet relay retry at all.

So while the ingress fails more than HEALTHY of its POSTs, retries in any window stay at most
`ratio` times the POSTs served in it, plus the reserve: about 1.11 POSTs per first attempt
whatever the failure rate and however the failures fall (an ingress that fails every first
attempt and serves every retry included, which a rule charging only failed retries let double
its load: tests/test_admission_e2e.py found it). Against one that serves nothing, first
attempts plus the reserve. Against a healthy one, retries cost nothing, and the runs that
waited in the outbox through an outage drain at the pace the limit allows once the outage's
failures have aged out of the window (within SPAN seconds), not at `ratio` times the new
traffic (Finagle's budget, which charges every retry always, would trickle them out). A retry
refused here waits in the outbox (the caller hands its claim back with a delay): no event is
ever dropped for want of a token.

An operator's explicit retry is not one the budget holds back (issue 49 item 3): `relay retry`
makes a run due and marks its row (`runs.retry_waived`, schema version 11), the claim returns the
mark, and a retry of a `waived` claim goes whatever the balance (it still holds a token while in
flight and is charged as any retry is, so the budget's accounts stay whole). The mark is the
database's, so whichever replica claims the run honours it, whether or not it heard the
notification that wakes it; the end of that attempt clears it (schema/0011_retry_waiver.sql).

Pure: no I/O; `now` is the monotonic clock, passed in.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from relay.admission.windows import SLICES, WindowedSum

RATIO = 0.1  # tokens per POST served (gRPC's example token_ratio)
# The reserve, in retries per second per replica (Finagle's minRetriesPerSec, scaled down): at
# 1.0 it was as large as the deposits of a relay committing 13 runs a second to a half-failing
# ingress (1.48 POSTs per first attempt in issue 42's bench); a quiet relay still retries.
PER_SECOND = 0.2
SPAN = 10.0  # seconds a deposit or a charged retry counts (Finagle's ttl)
HEALTHY = 0.1  # at most this share of the window's POSTs failed: a served retry costs nothing
# A retry held back waits at least this long in the outbox: half the window
# (relay/admission/windows.py), over which the failed retries that spent the budget age out. Sooner,
# a spent budget only sees the same runs claimed and handed back again (19,253 deferrals in a minute
# at a 1 s floor in issue 42's bench, a claim and a release each).
DEFER_AT_LEAST = SPAN / 2
SLICE = SPAN / SLICES  # seconds: what the budget's window ages out at a time


class Result(enum.Enum):
    """What one POST's answer means to the budget."""

    SERVED = "served"  # the ingress answered and it is not a transient failure (2xx, 409, 4xx)
    FAILED = "failed"  # a transient failure (DESIGN §5: 429, 5xx, timeout, connection error)
    UNSENT = "unsent"  # it never went out (lease lost, cancelled): nothing to count


@dataclass(frozen=True, slots=True)
class BudgetView:
    """What observers read."""

    balance: float  # tokens a retry may take now (it needs one)
    retrying: int  # retries in flight, each holding a token


class RetryBudget:
    """One per replica: `try_retry()` before each retry, `record()` after each POST."""

    def __init__(
        self, *, ratio: float = RATIO, per_second: float = PER_SECOND, span: float = SPAN
    ) -> None:
        if ratio < 0 or per_second < 0:
            raise ValueError("a retry budget's ratio and reserve are not negative")
        self.ratio = ratio
        self.span = span
        self.reserve = per_second * span
        self._served = WindowedSum(span)
        self._failed = WindowedSum(span)  # POSTs that failed, first attempts and retries
        self._charged = WindowedSum(span)  # retries that kept their token
        self._retrying = 0

    def balance(self, now: float) -> float:
        """Tokens left: deposits and the reserve, less charged retries and retries in flight."""
        deposits = self.ratio * self._served.total(now) + self.reserve
        return deposits - self._charged.total(now) - self._retrying

    def healthy(self, now: float) -> bool:
        """At most HEALTHY of the window's POSTs failed (or it saw none)."""
        failed = self._failed.total(now)
        return failed <= HEALTHY * (failed + self._served.total(now))

    def view(self, now: float) -> BudgetView:
        return BudgetView(self.balance(now), self._retrying)

    def spent(self, now: float) -> bool:
        """A retry asking now would be held back (no operator's waiver counted)."""
        return self.balance(now) < 1.0

    def awaits_answers(self, now: float) -> bool:
        """A retry asking now would be held back only for the tokens retries in flight hold,
        while the ingress is healthy. Those come back with their answers (a served retry gives
        its token back while it is healthy), so a retry held back for them waits a moment, not
        the budget's window: after an outage, once its failures have aged out, the runs that
        waited are all retries, and a 5 s wait for each one the reserve could not cover at
        once drained 150 of them in 40-120 s (tests/test_relay.py, the pools' test)."""
        return self.spent(now) and self.healthy(now) and self.balance(now) + self._retrying >= 1.0

    def ready_in(self, now: float) -> float:
        """Seconds until a retry asking would get a token if nothing more happened: the charged
        retries age out of the window slice by slice (the deposits too). The tokens retries in
        flight hold are not waited for: they come back with their answers, within a request's
        timeout, or are charged. 0 when one would now; at most the window's span (the reserve
        alone, once everything aged out)."""
        width = self.span / SLICES
        when = now
        for _ in range(SLICES + 1):
            if self.balance(when) + self._retrying >= 1.0:
                return when - now
            when = (math.floor(when / width) + 1) * width + width * 1e-6  # the next slice's
        return self.span

    def try_retry(self, now: float, waived: bool = False) -> bool:
        """May a retry go out now? If so it holds a token until `record(retry=True, ...)`. One an
        operator `waived` the budget for (`relay retry`: its claim says so) goes whatever the
        balance."""
        if not waived and self.balance(now) < 1.0:
            return False
        self._retrying += 1
        return True

    def record(self, result: Result, *, retry: bool, now: float) -> None:
        """A POST is done (`retry`: one that `try_retry` let go; each is recorded once)."""
        if retry:
            if self._retrying == 0:
                raise RuntimeError("a retry recorded that the budget did not let go")
            self._retrying -= 1
        if result is Result.UNSENT:
            return
        charged = retry and (result is Result.FAILED or not self.healthy(now))
        if result is Result.SERVED:
            self._served.add(1.0, now)
        else:
            self._failed.add(1.0, now)
        if charged:
            self._charged.add(1.0, now)
