"""Unit tests for the claim as a value (relay.edges.store.Claim, issue 27 item 4) and for the line
between the lease and the HTTP layer: no database, no network, the clock passed in."""

from __future__ import annotations

import ast
import dataclasses
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from relay.core.policy import Trust
from relay.delivery.renewal import Renewer
from relay.edges.store import Claim, ClaimedEvent, Held

PACKAGE = Path(__file__).resolve().parent.parent / "relay"
CLAIMED_AT = datetime(2024, 5, 17, 12, 0, 0, tzinfo=UTC)
# What sends a POST: the ingress client and the one HTTP client under it.
HTTP_LAYER = ("edges.ingress", "edges.http_client")


def event(seq: int, *, terminal: bool = False) -> ClaimedEvent:
    return ClaimedEvent(seq, f"ev-{seq}", "step", "{}", terminal, CLAIMED_AT, None, None)


def claim(*events: ClaimedEvent, started: float = 100.0) -> Claim:
    return Claim(
        run_id="run-1",
        epoch=3,
        token=uuid.uuid4(),
        attempts=0,
        critical=False,
        claimed_at=CLAIMED_AT,
        trust=Trust(started=started, ttl=30.0, margin=6.0),
        events=events or (event(1),),
    )


# --- a change is a new value ------------------------------------------------------------------


def test_a_claim_cannot_be_changed_in_place() -> None:
    c = claim()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.critical = True  # type: ignore[misc]
    assert isinstance(c.events, tuple)  # and neither can its prefix


def test_renewed_is_a_new_claim_under_the_new_window_and_the_old_one_is_unchanged() -> None:
    c = claim(event(1), event(2), started=100.0)
    window = Trust(started=110.0, ttl=30.0, margin=6.0)
    renewed = c.renewed(window)
    assert renewed is not c
    assert renewed.trust == window
    assert c.trust.started == 100.0
    assert dataclasses.replace(renewed, trust=c.trust) == c  # nothing else moved


def test_promoted_is_critical_and_asks_for_a_widening_and_the_old_one_is_unchanged() -> None:
    c = claim()
    promoted = c.promoted()
    assert (promoted.critical, promoted.widen) == (True, True)
    assert (c.critical, c.widen) == (False, False)


def test_promoted_with_its_terminal_already_held_asks_for_no_widening() -> None:
    """A claim that came back after the terminal's commit holds it: a widening would be a
    statement for nothing before its POST."""
    promoted = claim(event(1), event(2, terminal=True)).promoted()
    assert (promoted.targeted, promoted.critical, promoted.widen) == (True, True, False)


def test_widened_grows_the_prefix_in_order_and_asks_for_no_more_widening() -> None:
    c = claim(event(1), event(2)).promoted()
    widened = c.widened([event(3), event(4)])
    assert [e.seq for e in widened.events] == [1, 2, 3, 4]
    assert (widened.first_seq, widened.last_seq) == (1, 4)
    assert widened.widen is False
    assert [e.seq for e in c.events] == [1, 2]
    assert c.widen is True


def test_widened_turns_critical_only_with_a_terminal_event() -> None:
    assert claim(event(1)).widened([event(2)]).critical is False
    assert claim(event(1)).widened([event(2, terminal=True)]).critical is True
    assert claim(event(1)).widened([]).critical is False


class _Store:
    """What the renewer asks of the store: which of these leases it renewed, and their new
    trust windows (here: every run but `lost`)."""

    def __init__(self, window: Trust, lost: str = "") -> None:
        self.window = window
        self.lost = lost

    async def renew(self, claims: list[Claim]) -> dict[str, Trust]:
        return {c.run_id: self.window for c in claims if c.run_id != self.lost}


@pytest.mark.anyio
async def test_the_renewer_gives_each_holder_its_claim_under_the_new_window() -> None:
    window = Trust(started=500.0, ttl=30.0, margin=6.0)
    kept, lost = claim(), dataclasses.replace(claim(), run_id="run-2")
    held = [Held(kept), Held(lost)]
    renewer = Renewer(_Store(window, lost="run-2"), lease_ttl=30.0)  # type: ignore[arg-type]
    assert await renewer.renew(held) == {"run-1"}
    assert held[0].claim == kept.renewed(window)
    assert kept.trust.started == 100.0  # the value the delivery had is as it was
    assert held[1].claim is lost  # not renewed: its holder keeps what it had
    assert renewer.renewed == 1


# --- the database's clock, as a POST's webhook-timestamp carries it ----------------------------


def test_database_time_is_the_claim_time_plus_the_time_held() -> None:
    c = claim(started=100.0)
    assert c.database_time(100.0) == CLAIMED_AT
    assert c.database_time(220.5) == CLAIMED_AT + timedelta(seconds=120.5)


def test_database_time_never_reads_before_the_claim() -> None:
    """The trust window starts when the claim was *sent*: a clock read before it (a claim built
    ahead of time, as the tests do) still says the claim's own time."""
    assert claim(started=100.0).database_time(40.0) == CLAIMED_AT


# --- the HTTP layer never sees a lease -----------------------------------------------------------


def _relay_imports(module: str) -> set[str]:
    """The relay modules `module` imports, directly or through the ones it imports (lazy imports
    in functions count: they run all the same). The package's face (`relay`, read for its
    `__version__`) is not followed: it hands on the producer helper, and `relay.Relay` only when
    asked for (as pyproject.toml's import layers say)."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = _path(name)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                found = [node.module]
                found += [
                    f"{node.module}.{a.name}" for a in node.names if node.module.startswith("relay")
                ]
            else:
                continue
            todo += [
                m for m in found if m.startswith("relay.") and m != module and _path(m).is_file()
            ]
    return seen - {module}


def _path(module: str) -> Path:
    if module == "relay":
        return PACKAGE / "__init__.py"
    return PACKAGE.joinpath(*module.split(".")[1:]).with_suffix(".py")


def test_relay_imports_follows_imports_through_modules() -> None:
    """The finder itself: the lane reaches the store both directly and through its executor."""
    assert {"relay.edges.store", "relay.delivery.execute", "relay.edges.ingress"} <= _relay_imports(
        "relay.delivery.lane"
    )


def test_the_http_layer_imports_nothing_from_the_store() -> None:
    """The ingress client and the senders take plain request values (relay.edges.ingress.Batch): the
    claim, its token and its trust window stay on the lease's side."""
    reached = {m: _relay_imports(f"relay.{m}") for m in HTTP_LAYER}
    assert {m: r for m, r in reached.items() if "relay.edges.store" in r} == {}
