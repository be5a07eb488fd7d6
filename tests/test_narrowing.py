"""Poison narrowing (relay/delivery/narrowing.py), pure: a scripted ingress (what each resend comes
to) and a recording completer (`Results`), no database, no HTTP.

tests/test_failures.py::test_poison_in_the_middle_of_a_100_event_batch and
test_poison_fails_the_event_and_blocks_only_its_run drive it through a real relay, database and
HTTP server."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime

import pytest

from relay.core.policy import Ack, Decision, Poison, Retry, Trust
from relay.delivery.execute import LeaseLost, Outcome
from relay.delivery.narrowing import Narrowing
from relay.edges.ingress import Answer
from relay.edges.store import Claim, ClaimedEvent, Held

pytestmark = [pytest.mark.anyio, pytest.mark.both_loops]  # issue 52: asyncio and uvloop

AT = datetime(2024, 5, 17, 12, 0, 0)
POISON = Poison(422, "bad", None)


def event(seq: int) -> ClaimedEvent:
    return ClaimedEvent(seq, f"e{seq}", "step", "{}", False, AT, None, None)


def held(n: int) -> Held:
    events = tuple(event(seq) for seq in range(1, n + 1))
    trust = Trust(started=0.0, ttl=30.0, margin=5.0)
    return Held(Claim("r", 1, uuid.uuid4(), 0, False, AT, trust, events))


class Ingress:
    """What each resend comes to: `rejects` are refused as poison, `fails` get no answer, the
    rest are accepted."""

    def __init__(
        self, rejects: frozenset[int] = frozenset(), fails: frozenset[int] = frozenset()
    ) -> None:
        self.rejects = rejects
        self.fails = fails
        self.sent: list[list[int]] = []

    async def resend(self, h: Held, events: Sequence[ClaimedEvent]) -> Outcome:
        seqs = [e.seq for e in events]
        self.sent.append(seqs)
        decision: Decision | LeaseLost
        if self.fails & set(seqs):
            decision = Retry(1.0, None, "timeout", None, quick=False)
        elif self.rejects & set(seqs):
            decision = Poison(422, "bad", None)
        else:
            decision = Ack(len(events))
        return Outcome(h, events, decision, Answer(200, b"", None, 0.01))


class Recorder:
    """The completer's side: what the narrowing asked it to write, in order."""

    def __init__(self, ack_ok: bool = True) -> None:
        self.ack_ok = ack_ok
        self.writes: list[tuple[object, ...]] = []

    def who(self, claim: Claim) -> dict[str, object]:
        return {"run_id": claim.run_id}

    async def carry_one(self, outcome: Outcome) -> bool:
        self.writes.append(("carry", type(outcome.decision).__name__, _seqs(outcome.events)))
        return True

    async def ack_resent(self, claim: Claim, resent: Outcome, *, keep: bool) -> bool:
        self.writes.append(("ack", _seqs(resent.events), keep))
        return self.ack_ok

    async def block(
        self, claim: Claim, event: ClaimedEvent, poison: Poison, *, resent: Outcome | None = None
    ) -> bool:
        self.writes.append(("block", event.seq, resent is not None))
        return True


def _seqs(events: Sequence[ClaimedEvent]) -> list[int]:
    return [e.seq for e in events]


async def narrow(
    n: int, poison: Poison, ingress: Ingress, results: Recorder | None = None
) -> Recorder:
    results = results or Recorder()
    h = held(n)
    rejected = Outcome(h, h.claim.events, poison, Answer(422, b"", None, 0.01))
    assert await Narrowing(ingress.resend, results).narrow(rejected, poison) is True
    return results


async def test_a_named_event_its_head_is_resent_whole_and_acked_then_it_is_blocked() -> None:
    ingress = Ingress()
    done = await narrow(5, Poison(422, "bad", "e4"), ingress)
    assert ingress.sent == [[1, 2, 3]]
    assert done.writes == [("ack", [1, 2, 3], True), ("block", 4, False)]


async def test_a_named_first_event_is_blocked_without_a_resend() -> None:
    ingress = Ingress()
    done = await narrow(5, Poison(422, "bad", "e1"), ingress)
    assert ingress.sent == []
    assert done.writes == [("block", 1, False)]


async def test_a_named_head_that_is_not_accepted_whole_is_carried_the_ordinary_way() -> None:
    ingress = Ingress(fails=frozenset({2}))
    done = await narrow(5, Poison(422, "bad", "e4"), ingress)
    assert done.writes == [("carry", "Retry", [1, 2, 3])]  # nothing blocked, nothing acked here


async def test_an_unknown_name_narrows_one_event_at_a_time() -> None:
    ingress = Ingress(rejects=frozenset({3}))
    done = await narrow(5, Poison(422, "bad", "e-unknown"), ingress)
    assert ingress.sent == [[1], [2], [3]]
    assert done.writes[-1] == ("block", 3, True)


async def test_a_single_event_batch_is_blocked_without_a_resend() -> None:
    ingress = Ingress()
    done = await narrow(1, POISON, ingress)
    assert ingress.sent == []
    assert done.writes == [("block", 1, False)]


async def test_one_at_a_time_acks_each_accepted_event_keeping_the_lease_and_stops_at_the_bad_one(
) -> None:  # fmt: skip
    ingress = Ingress(rejects=frozenset({3}))
    done = await narrow(5, POISON, ingress)
    assert ingress.sent == [[1], [2], [3]]  # nothing after the bad event is sent
    assert done.writes == [("ack", [1], True), ("ack", [2], True), ("block", 3, True)]


async def test_when_every_event_is_accepted_alone_the_last_ack_lets_the_lease_go() -> None:
    ingress = Ingress()
    done = await narrow(3, POISON, ingress)
    assert done.writes == [("ack", [1], True), ("ack", [2], True), ("ack", [3], False)]


async def test_a_resend_that_gets_no_answer_is_carried_the_ordinary_way_and_ends_it() -> None:
    ingress = Ingress(fails=frozenset({2}), rejects=frozenset({3}))
    done = await narrow(4, POISON, ingress)
    assert ingress.sent == [[1], [2]]
    assert done.writes == [("ack", [1], True), ("carry", "Retry", [2])]


async def test_an_ack_that_did_not_keep_the_run_ends_it() -> None:
    ingress = Ingress(rejects=frozenset({3}))
    done = await narrow(4, POISON, ingress, Recorder(ack_ok=False))
    assert ingress.sent == [[1]]
    assert done.writes == [("ack", [1], True)]
