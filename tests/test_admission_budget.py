"""The retry budget (relay/admission/retry_budget.py, issue 42) on a fake clock: retries stay a
bounded share of the POSTs to a failing ingress, cost nothing against a healthy one, and a quiet
relay may still retry. The windows under it (relay/admission/windows.py) too."""

from __future__ import annotations

import random
from collections import deque

import pytest

from relay.admission.retry_budget import SPAN, Result, RetryBudget
from relay.admission.windows import WindowedMin, WindowedSum

# --- a simulated ingress ----------------------------------------------------------------------


class Outbox:
    """Runs with events to deliver, `per_second` new ones a second (first attempts); a run whose
    POST failed waits RETRY_DELAY and is retried if the budget lets it, else waits again (in the
    outbox: nothing is dropped). Answers come at once; `fails(now)` says whether one fails."""

    RETRY_DELAY = 1.0
    STEPS = 100  # a second's steps

    def __init__(self, budget: RetryBudget, *, per_second: int, seed: int = 7) -> None:
        self.budget = budget
        self.per_second = per_second
        self.rng = random.Random(seed)
        self.now = 0.0
        self.first_attempts = 0
        self.retries = 0
        self.delivered = 0
        self.waiting: deque[float] = deque()  # when each failed run is due again, in order

    def run(self, seconds: float, failure_rate: float) -> None:
        owed = 0  # first attempts owed, in STEPS-ths
        for _ in range(round(seconds * self.STEPS)):
            self.now += 1.0 / self.STEPS
            owed += self.per_second
            while owed >= self.STEPS:
                owed -= self.STEPS
                self.first_attempts += 1
                self._post(retry=False, failure_rate=failure_rate)
            self._retry_due(failure_rate)

    def _retry_due(self, failure_rate: float) -> None:
        due = 0
        while self.waiting and self.waiting[0] <= self.now:
            self.waiting.popleft()
            due += 1
        for _ in range(due):
            if self.budget.try_retry(self.now):
                self.retries += 1
                self._post(retry=True, failure_rate=failure_rate)
            else:
                self.waiting.append(self.now + self.RETRY_DELAY)

    def _post(self, *, retry: bool, failure_rate: float) -> None:
        failed = self._fails(retry, failure_rate)
        self.budget.record(Result.FAILED if failed else Result.SERVED, retry=retry, now=self.now)
        if failed:
            self.waiting.append(self.now + self.RETRY_DELAY)
        else:
            self.delivered += 1

    def _fails(self, retry: bool, failure_rate: float) -> bool:
        return self.rng.random() < failure_rate

    @property
    def posts(self) -> int:
        return self.first_attempts + self.retries


class FirstAttemptsFail(Outbox):
    """An ingress that fails every first attempt and serves every retry: half of all POSTs fail
    when retries go as often as first attempts (a strict alternation at a limit of one POST
    does this: tests/test_admission_e2e.py's first version)."""

    def _fails(self, retry: bool, failure_rate: float) -> bool:
        return not retry


def test_an_ingress_failing_half_its_posts_sees_at_most_1_2_posts_per_first_attempt() -> None:
    """Issue 42's target: a minute of 503s to half of all POSTs while producers commit a steady
    stream (100 runs a second): POSTs <= 1.2x the first attempts; the rest wait."""
    outbox = Outbox(RetryBudget(), per_second=100)
    outbox.run(60.0, failure_rate=0.5)
    assert outbox.first_attempts == 6000
    assert outbox.retries > 0
    assert outbox.posts <= 1.2 * outbox.first_attempts, outbox.posts / outbox.first_attempts
    assert outbox.waiting  # what the budget held back waits in the outbox


def test_an_ingress_failing_every_first_attempt_and_serving_every_retry_is_held_to_it() -> None:
    """Served retries are charged while the ingress fails more than HEALTHY of its POSTs: where
    only failed retries were, this ingress saw 2 POSTs per first attempt."""
    outbox = FirstAttemptsFail(RetryBudget(), per_second=100)
    outbox.run(60.0, failure_rate=1.0)
    assert outbox.retries > 0
    assert outbox.posts <= 1.2 * outbox.first_attempts, outbox.posts / outbox.first_attempts


def test_once_the_ingress_recovers_everything_that_waited_is_delivered_within_a_window() -> None:
    """Retries that are served cost nothing once the ingress is healthy again: the runs that
    waited through a minute of failures go out as soon as the failures age out of the window
    (SPAN, 10 s), not at a tenth of the new traffic's pace."""
    outbox = Outbox(RetryBudget(), per_second=100)
    outbox.run(60.0, failure_rate=0.5)
    waited = len(outbox.waiting)
    assert waited > 2000
    outbox.run(SPAN + 2.0, failure_rate=0.0)
    assert not outbox.waiting
    assert outbox.delivered == outbox.first_attempts


def test_an_ingress_that_serves_nothing_sees_first_attempts_and_the_reserve_only() -> None:
    budget = RetryBudget(per_second=1.0, span=10.0)
    outbox = Outbox(budget, per_second=100)
    outbox.run(60.0, failure_rate=1.0)
    assert outbox.retries <= 1.0 * 60 + 10  # the reserve, a window's worth at the start
    assert outbox.delivered == 0


@pytest.mark.parametrize("failure_rate", [0.05, 0.1, 0.2, 0.27, 0.35, 0.5, 0.75, 0.9])
def test_at_any_failure_rate_the_load_stays_within_a_bound(failure_rate: float) -> None:
    """Without a budget a failure rate p brings 1 / (1 - p) POSTs per first attempt (2x at
    half); with it, at most about 1.11x at any rate (docs/admission.md §3)."""
    outbox = Outbox(RetryBudget(), per_second=100)
    outbox.run(60.0, failure_rate=failure_rate)
    assert outbox.posts <= 1.2 * outbox.first_attempts


def test_a_healthy_ingress_never_refuses_a_retry() -> None:
    budget = RetryBudget(per_second=0.0)
    budget.record(Result.SERVED, retry=False, now=0.0)
    assert budget.balance(0.0) == pytest.approx(0.1)
    assert not budget.try_retry(0.0)  # a tenth of a token is not a retry
    for k in range(10):
        budget.record(Result.SERVED, retry=False, now=0.1 * k)
    for k in range(100):
        assert budget.try_retry(1.0 + k)
        budget.record(Result.SERVED, retry=True, now=1.0 + k)
        budget.record(Result.SERVED, retry=False, now=1.0 + k)


def test_a_quiet_relay_may_retry_from_the_reserve_and_it_refills() -> None:
    budget = RetryBudget(per_second=1.0, span=10.0)
    allowed = 0
    while budget.try_retry(0.0):
        allowed += 1
        budget.record(Result.FAILED, retry=True, now=0.0)
    assert allowed == 10
    assert not budget.try_retry(5.0)
    assert budget.try_retry(10.5)  # the failed retries aged out of the window


def test_a_retry_in_flight_holds_its_token_and_an_unsent_one_gives_it_back() -> None:
    budget = RetryBudget(per_second=0.1, span=10.0)  # one token
    assert budget.try_retry(0.0)
    assert budget.view(0.0).retrying == 1
    assert not budget.try_retry(0.0)
    budget.record(Result.UNSENT, retry=True, now=0.0)
    assert budget.try_retry(0.0)
    budget.record(Result.FAILED, retry=True, now=0.0)
    with pytest.raises(RuntimeError):  # recorded twice
        budget.record(Result.FAILED, retry=True, now=0.0)


# --- the windows --------------------------------------------------------------------------------


def test_a_windowed_minimum_forgets_what_is_older_than_its_span() -> None:
    window = WindowedMin(10.0, slices=10)
    assert window.value(0.0) is None
    window.add(0.040, 0.5)
    window.add(0.100, 5.0)
    assert window.value(9.9) == 0.040
    assert window.value(10.5) == 0.100  # the slice of 0.5 s left the window
    assert window.value(15.5) is None


def test_a_windowed_sum_keeps_a_bounded_number_of_slices() -> None:
    window = WindowedSum(1.0, slices=10)
    for k in range(10_000):
        window.add(1.0, k * 0.001)
    assert window.total(9.999) == pytest.approx(1000, abs=100)
    assert len(window._values) <= 10
    with pytest.raises(ValueError):
        WindowedSum(0.0)


# --- when a retry would go, and an operator's retry (issue 49 item 3) ----------------------------


def spent_budget(now: float) -> RetryBudget:
    """A budget of the default reserve (2 tokens) whose two retries failed at `now`."""
    budget = RetryBudget()
    for _ in range(2):
        assert budget.try_retry(now)
        budget.record(Result.FAILED, retry=True, now=now)
    assert budget.spent(now)
    return budget


def test_ready_in_is_when_the_charged_retries_age_out_of_the_window() -> None:
    budget = spent_budget(100.2)
    ready = budget.ready_in(100.5)
    # The charges of the slice [100, 101) leave the window once it starts at 101: at 110.
    assert ready == pytest.approx(9.5, abs=1e-3)
    assert not budget.spent(100.5 + ready) and budget.spent(100.5 + ready - 0.01)
    assert RetryBudget().ready_in(100.5) == 0.0  # a token now: no wait


def test_an_operators_retry_passes_a_spent_budget_and_is_charged_as_any_retry() -> None:
    """A claim `relay retry` waived (runs.retry_waived, which the database keeps and clears:
    tests/test_retry_waiver.py) goes whatever the balance, holds a token and is charged."""
    budget = spent_budget(100.0)
    assert not budget.try_retry(100.5)
    assert budget.try_retry(100.7, waived=True)
    assert budget.view(100.7).retrying == 1
    budget.record(Result.FAILED, retry=True, now=101.0)
    assert budget.balance(101.0) == pytest.approx(-1.0)
    assert not budget.try_retry(101.1)


def test_a_budget_awaits_answers_only_for_tokens_in_flight_at_a_healthy_ingress() -> None:
    """`awaits_answers`: spent, and only by the tokens retries in flight hold, while the window
    is healthy. Not when failed retries spent it, nor at an unhealthy ingress, nor unspent."""
    budget = RetryBudget()
    assert not budget.awaits_answers(100.0)  # a token now
    assert budget.try_retry(100.0) and budget.try_retry(100.0)
    assert budget.awaits_answers(100.0)
    budget.record(Result.SERVED, retry=True, now=100.1)  # served, healthy: its token is back
    assert not budget.spent(100.1) and not budget.awaits_answers(100.1)
    assert not spent_budget(100.0).awaits_answers(100.5)  # failed retries spent it
    sick = RetryBudget()
    for _ in range(5):
        sick.record(Result.FAILED, retry=False, now=100.0)  # first attempts: nothing charged
    assert sick.try_retry(100.0) and sick.try_retry(100.0)
    assert sick.spent(100.0) and not sick.healthy(100.0)
    assert not sick.awaits_answers(100.0)


def test_ready_in_does_not_wait_for_the_tokens_retries_in_flight_hold() -> None:
    budget = RetryBudget()
    assert budget.try_retry(100.0) and budget.try_retry(100.0)
    assert budget.spent(100.0) and budget.ready_in(100.0) == 0.0
