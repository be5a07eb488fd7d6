"""Unit tests for the claim as a value (relay.store.Claim, issue 27 item 4) and for the line
between the lease and the HTTP layer: no database, no network, the clock passed in."""

from __future__ import annotations

import ast
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

from relay.policy import Trust
from relay.store import Claim, ClaimedEvent

PACKAGE = Path(__file__).resolve().parent.parent / "relay"
CLAIMED_AT = datetime(2024, 5, 17, 12, 0, 0, tzinfo=UTC)
# What sends a POST: the ingress client, the senders and what they share.
HTTP_LAYER = ("ingress", "transport", "http_httptools", "http_httpx", "http_aiohttp")


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
        events=list(events) or [event(1)],
    )


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
    in functions count: they run all the same)."""
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
                found += [f"{node.module}.{a.name}" for a in node.names if node.module == "relay"]
            else:
                continue
            todo += [m for m in found if m.startswith("relay") and _path(m).is_file()]
    return seen - {module}


def _path(module: str) -> Path:
    if module == "relay":
        return PACKAGE / "__init__.py"
    return PACKAGE.joinpath(*module.split(".")[1:]).with_suffix(".py")


def test_relay_imports_follows_imports_through_modules() -> None:
    """The finder itself: the lane reaches the store both directly and through its delivery."""
    assert {"relay.store", "relay.delivery", "relay.ingress"} <= _relay_imports("relay.lane")


def test_the_http_layer_imports_nothing_from_the_store() -> None:
    """The ingress client and the senders take plain request values (relay.ingress.Batch): the
    claim, its token and its trust window stay on the lease's side."""
    reached = {m: _relay_imports(f"relay.{m}") for m in HTTP_LAYER}
    assert {m: r for m, r in reached.items() if "relay.store" in r} == {}
