"""The executor's bookkeeping of its tries (relay/delivery/bookkeeping.py), without a database or an
ingress: what each answer tells the adaptive limit (its `Sample`) and the retry budget (served,
failed or unsent; a retry holding a token), and that a failing limit never undoes an answered
POST. The budget here is the real one; the limit is a list the samples go to."""

from __future__ import annotations

from dataclasses import replace

from relay.admission.limit import Sample, Signal
from relay.admission.retry_budget import DEFER_AT_LEAST, SLICE, Result, RetryBudget
from relay.core import clock
from relay.core.policy import Ack, Retry
from relay.delivery.bookkeeping import Bookkeeping
from relay.delivery.execute import retried
from relay.delivery.stats import ExecuteStats
from relay.edges.http_client import TransportFailure
from relay.edges.ingress import Answer
from relay.edges.store import Held
from relay.settings import load
from tests.support import Decisions, one_event_claim, relay_logs

SETTINGS = load(
    {"database_url": "postgresql://relay@db/relay", "ingress_url": "http://ingress/runs/{run_id}"},
    environ={},
)
RETRY = Retry(1.0, 503, "busy", 2.5, quick=False)


class Spied(RetryBudget):
    """The real budget, which also remembers each record (result, retry)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[Result, bool]] = []

    def record(self, result: Result, *, retry: bool, now: float) -> None:
        super().record(result, retry=retry, now=now)
        self.records.append((result, retry))


def books(budget: RetryBudget | None = None) -> Bookkeeping:
    return Bookkeeping(SETTINGS, ExecuteStats(), lane="ordinary", budget=budget)


def answer(status: int) -> Answer:
    return Answer(status, b"", None, 0.01)


def recorded(
    first: Answer | TransportFailure, decision: Ack | Retry, *, whole: bool = True
) -> tuple[list[Sample], list[tuple[Result, bool]]]:
    """The samples the limit got and the records the budget got from one answered try."""
    budget = Spied()
    samples: list[Sample] = []
    books(budget).record(
        first, decision, whole=whole, started=0.0, retry=False, answered=samples.append
    )
    return samples, budget.records


def test_an_overloaded_answer_tells_the_limit_so_with_its_retry_after() -> None:
    (sample,), records = recorded(answer(503), RETRY)
    assert sample.signal is Signal.OVERLOADED
    assert sample.retry_after == 2.5
    assert records == [(Result.FAILED, False)]


def test_a_timeout_is_overload_and_a_refused_connection_says_nothing_of_load() -> None:
    (timed_out,), _ = recorded(TransportFailure("read timeout", timed_out=True), RETRY)
    (refused,), records = recorded(TransportFailure("connection refused"), RETRY)
    assert timed_out.signal is Signal.OVERLOADED
    assert refused.signal is Signal.SILENT
    assert records == [(Result.FAILED, False)]  # a failure all the same, for the budget


def test_an_accepted_answer_is_served_and_its_round_trip_goes_to_the_limit() -> None:
    (sample,), records = recorded(answer(200), Ack(1))
    assert sample.signal is Signal.ANSWERED
    assert sample.rtt >= 0.0
    assert records == [(Result.SERVED, False)]


def test_a_multi_run_reply_with_results_per_run_is_served_whatever_one_run_says() -> None:
    """Per-run results (not one answer for the whole request): the ingress answered, so the
    limit reads an answer and the budget a POST served, even when the first run's result is a
    retry."""
    (sample,), records = recorded(answer(200), RETRY, whole=False)
    assert sample.signal is Signal.ANSWERED
    assert records == [(Result.SERVED, False)]


def test_a_try_holds_a_token_as_a_retry_only_when_it_is_one() -> None:
    """A first try is a retry when a run has earlier attempts (`deferrals` took its token); a
    quick try always is; without a budget nothing is held."""
    b = books(RetryBudget())
    first = retried([Held(one_event_claim("r1"))])
    again = retried([Held(one_event_claim("r1")), Held(replace(one_event_claim("r2"), attempts=2))])
    assert (first, again) == (False, True)  # a multi-run POST is a retry if any run is one
    assert not b.retrying(1, first)
    assert b.retrying(1, again)
    assert b.retrying(2, first)
    assert not books(None).retrying(2, again)


def test_a_failing_limit_is_logged_and_the_budget_still_records() -> None:
    budget = Spied()

    def broken(sample: Sample) -> None:
        raise RuntimeError("the limit's own bug")

    with relay_logs(Decisions()) as seen:
        books(budget).record(
            answer(200), Ack(1), whole=True, started=0.0, retry=False, answered=broken
        )
    assert budget.records == [(Result.SERVED, False)]
    (logged,) = seen.named("limit_sample_failed")
    assert "the limit's own bug" in logged["error"]


def test_a_retry_the_budget_refused_waits_at_least_its_floor_and_is_counted() -> None:
    """One question before a POST, one answer: no wait (it goes), or a wait per run; a retry an
    operator waived (`relay retry`, its claim's `retry_waived`) goes past a spent budget. Spent
    by retries that failed, a retry held back waits at least DEFER_AT_LEAST."""
    budget = RetryBudget()
    b = books(budget)
    attempts = [1, 1]
    assert b.deferrals(False, False, attempts) == []  # a first attempt goes, without a token
    assert b.deferrals(True, False, attempts) == []  # a retry the budget has a token for
    budget.record(Result.FAILED, retry=True, now=clock.now())
    for _ in range(1000):
        if not budget.try_retry(clock.now()):
            break
        budget.record(Result.FAILED, retry=True, now=clock.now())
    assert b.deferrals(True, True, attempts) == []  # waived: it goes
    delays = b.deferrals(True, False, attempts)
    assert len(delays) == 2
    assert min(delays) >= DEFER_AT_LEAST
    assert b.stats.deferred == 2


def test_a_retry_held_back_only_for_the_tokens_in_flight_waits_a_moment() -> None:
    """A healthy ingress, the reserve's tokens held by retries in flight: a retry asking now is
    held back only until their answers give them back, so it waits half a slice to a slice, not
    DEFER_AT_LEAST and its backoff (after an outage every run waiting is a retry: 150 of them
    took 40-120 s to drain at 5 s a wait). A failed attempt then keeps its own backoff."""
    budget = RetryBudget()
    b = books(budget)
    while budget.try_retry(clock.now()):
        pass
    assert budget.awaits_answers(clock.now())
    delays = b.deferrals(True, False, [30, 30])
    assert len(delays) == 2 and b.stats.deferred == 2
    assert all(SLICE / 2 <= d <= SLICE for d in delays)
    assert b.scheduled(RETRY, 30) == RETRY


def test_an_unsent_try_gives_its_token_back() -> None:
    budget = Spied()
    b = books(budget)
    assert b.quick_retry_allowed()
    assert budget.view(0.0).retrying == 1
    b.record_unsent(retry=True)
    assert budget.records == [(Result.UNSENT, True)]
    assert budget.view(0.0).retrying == 0
