"""The lane's pause gate (relay/delivery/pause.py), pure: the clock passed in, no database, no
ingress.

tests/test_failures.py::test_misconfigured_endpoint_pauses_the_lane_and_recovers drives it
through a real relay and HTTP server."""

from __future__ import annotations

from relay.core.policy import misconfigured_backoff
from relay.delivery.pause import Gate, PauseGate

CAP = 60.0


def gate() -> tuple[PauseGate, list[bool]]:
    ready: list[bool] = []
    return PauseGate("ordinary", cap=CAP, on_ready_change=ready.append), ready


def test_an_open_gate_pauses_nothing() -> None:
    g, ready = gate()
    assert g.view() == Gate(paused_until=0.0, misconfigured=False)
    g.ingress_ok()  # nothing to recover from: readiness is not touched
    assert ready == []


def test_a_misconfigured_answer_closes_the_gate_for_the_first_backoff() -> None:
    g, ready = gate()
    delay = g.misconfigured(100.0)
    assert delay == misconfigured_backoff(1, cap=CAP)
    assert g.view() == Gate(paused_until=100.0 + delay, misconfigured=True)
    assert ready == [False]


def test_answers_in_flight_when_it_closed_do_not_grow_the_pause() -> None:
    g, ready = gate()
    first = g.misconfigured(100.0)
    assert g.misconfigured(100.5) == first - 0.5  # what is left of the same pause
    assert g.view().paused_until == 100.0 + first
    assert ready == [False, False]


def test_each_pause_that_ran_out_grows_the_next_up_to_the_cap() -> None:
    g, _ = gate()
    now, delays = 0.0, []
    for _ in range(10):
        delays.append(g.misconfigured(now))
        now += delays[-1]  # the next answer comes when the pause has run out
    assert delays == [misconfigured_backoff(n, cap=CAP) for n in range(1, 11)]
    assert delays[0] < delays[1] < delays[2] and delays[-1] == CAP


def test_an_accepted_answer_recovers_the_ingress_once_and_starts_the_count_again() -> None:
    g, ready = gate()
    first = g.misconfigured(0.0)
    g.misconfigured(first)  # grown once
    g.ingress_ok()
    g.ingress_ok()
    assert ready == [False, False, True]
    assert g.view().misconfigured is False
    later = 1000.0
    assert g.misconfigured(later) == first  # from the first backoff again
