"""A claim whose answer was lost is given back at once, not when its leases expire (schema
version 13; docs/design.md, "A claim whose answer was lost").

A claim is one statement. When the relay's connection is cut after the server committed it (a
server restart, a failover, a network cut, the deadline), the relay never learns which runs it
took: they are leased to a live owner that does not know it holds them, which no other replica
may take over and whose own claims pass them by. Before version 13 they waited for the lease to
expire (30 s by default; the fault test `db_cut_one_replica` drained in 27 s that way in CI).
Now each claim has a name the relay draws, each run's token derives from it, and the relay gives
the runs of an unanswered claim back by that name before its next claim.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, ClassVar

import psycopg
import pytest
from psycopg import sql

from relay.delivery.pause import PauseGate
from relay.delivery.release import Releases
from relay.delivery.stats import CompleteStats
from relay.edges.store import CONNECT_KWARGS, Claim, Store, outcome_unknown
from relay.runner import Relay
from relay.tools.sink import Sink
from tests.support import LogLines, count, settings, wait_for
from tests.test_lease_sql import call, claim, enq, fn, run_row, token
from tests.test_relay import enqueue_runs


def named_claim(
    conn: psycopg.Connection[Any], schema: str, name: uuid.UUID, runs: int, owner: str = "o1"
) -> dict[str, str]:
    """Claim `runs` ordinary runs under the claim name `name`: run id -> its lease token."""
    rows = conn.execute(
        sql.SQL(
            "select run_id, lease_token from {}(%s, %s, 100, '1 hour', 'ordinary', null, null, %s)"
            " where lease_token is not null"
        ).format(fn(schema, "claim")),
        (owner, runs, name),
    ).fetchall()
    return {r[0]: str(r[1]) for r in rows}


def test_release_claims_gives_back_exactly_the_runs_of_the_named_claims_of_their_owner(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    for run in ("r1", "r2", "r3"):
        enq(conn, schema, run, f"{run}-e1")
    lost, kept = uuid.uuid4(), uuid.uuid4()
    first = named_claim(conn, schema, lost, runs=2)
    second = named_claim(conn, schema, kept, runs=1)
    assert set(first) == {"r1", "r2"} and set(second) == {"r3"}
    # Each run's token derives from its claim's name and the run: one per run, none shared.
    derived = call(conn, schema, "claim_token", lost, "r1")[0][0]
    assert first["r1"] == str(derived) and first["r1"] != first["r2"]
    before = run_row(conn, schema, "r1")

    # Another owner cannot give back o1's claim, and a name that took nothing gives back nothing.
    assert call(conn, schema, "release_claims", "o2", [lost]) == []
    assert call(conn, schema, "release_claims", "o1", [uuid.uuid4()]) == []

    given = call(conn, schema, "release_claims", "o1", [lost])
    assert sorted(r[0] for r in given) == ["r1", "r2"]
    after = run_row(conn, schema, "r1")
    assert after["lease_owner"] is None and after["lease_token"] is None
    assert after["attempts"] == before["attempts"]  # nothing was sent: no attempt ended
    assert after["epoch"] == before["epoch"]
    assert run_row(conn, schema, "r3")["lease_token"] is not None  # the other claim's run stays

    # Due at once: the next claim, this replica's or another's, takes them.
    again = claim(conn, schema, owner="o1")
    assert set(again) == {"r1", "r2"}
    # Claimed since under another name: giving back the old name leaves the new lease alone.
    assert call(conn, schema, "release_claims", "o1", [lost]) == []
    assert run_row(conn, schema, "r1")["lease_token"] is not None


def test_a_claim_without_a_name_still_works_with_random_tokens(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    """Relays of version 12 and earlier call claim with seven arguments during a rolling
    upgrade: their tokens are random, and no name gives their runs back."""
    enq(conn, schema, "r1", "e1")
    got = claim(conn, schema)  # the seven-argument call of the relays before version 13
    assert set(got) == {"r1"}
    assert token(got, "r1") != str(call(conn, schema, "claim_token", None, "r1")[0][0])


def test_only_an_answer_that_may_have_committed_is_unknown() -> None:
    from psycopg_pool import PoolTimeout

    assert outcome_unknown(psycopg.OperationalError("server closed the connection unexpectedly"))
    assert outcome_unknown(TimeoutError())
    assert not outcome_unknown(PoolTimeout("no connection"))  # never sent
    assert not outcome_unknown(psycopg.errors.LockNotAvailable())  # the server rolled it back


class _AnswerLostStore(Store):
    """A real store whose first claim that takes runs commits, then loses its answer (the
    connection cut after COMMIT)."""

    lost: ClassVar[list[str]] = []

    async def _call(self, query: Any, params: Sequence[Any]) -> list[Any]:
        rows = await super()._call(query, params)
        if query is self.statements.claim and rows and not _AnswerLostStore.lost:
            _AnswerLostStore.lost = sorted({r[0] for r in rows})
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return rows


@pytest.mark.anyio
async def test_the_runs_of_a_claim_whose_answer_was_lost_go_without_waiting_for_the_lease(
    pg_url: str,
    schema: str,
    conn: psycopg.Connection[Any],
    sink: tuple[Sink, str],
    log_lines: LogLines,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The leases are an hour long: without the give-back the runs the lost claim took would
    wait that hour, and the wait below would time out."""
    s, url = sink
    _AnswerLostStore.lost = []
    monkeypatch.setattr("relay.pools.Store", _AnswerLostStore)
    enqueue_runs(conn, schema, 3, 2, terminal=False)
    async with Relay(settings(pg_url, schema, url, lease_ttl="1h")).running():
        await wait_for(
            lambda: count(conn, schema, "state = 'delivered'") == 6,
            what="every event delivered, those of the lost claim's runs included",
        )
    assert _AnswerLostStore.lost, "no claim's answer was lost"
    given = [x for x in log_lines() if x["event"] == "leases_given_back"]
    assert given and set(_AnswerLostStore.lost) <= {r for x in given for r in x["run_ids"]}
    assert all(n == 1 for n in s.state.deliveries.values())  # none sent twice


class _UnreachableStore(Store):
    """A real store whose releases fail while `down` (the database unreachable)."""

    down = True

    async def release(self, claim: Claim, *args: Any, **kwargs: Any) -> bool:
        if self.down:
            raise psycopg.OperationalError("connection to server failed: Connection refused")
        return await super().release(claim, *args, **kwargs)


@pytest.mark.anyio
async def test_a_lease_whose_hand_back_failed_is_given_back_once_the_database_answers(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], log_lines: LogLines
) -> None:
    """A delivery that ends unsettled hands its lease back; when the database is unreachable
    then, the lease is owed, and the lane's next turn gives it back (`Store.give_back`), rather
    than leaving it to expire while its owner lives."""
    from psycopg_pool import AsyncConnectionPool

    enqueue_runs(conn, schema, 1, 2, terminal=False)
    async with AsyncConnectionPool(pg_url, kwargs=dict(CONNECT_KWARGS), open=False) as pool:
        store = _UnreachableStore(pool, schema, lease_ttl=3600.0, batch_size=10, owner="o1")
        [held] = await store.claim("ordinary", 1)
        releases = Releases(
            "ordinary", settings(pg_url, schema, "http://127.0.0.1:1"), store, CompleteStats(),
            PauseGate("ordinary", cap=1.0, on_ready_change=lambda ready: None),
        )  # fmt: skip
        await releases.hand_back(held)  # never raises
        assert run_row(conn, schema, held.run_id)["lease_owner"] == "o1"  # still leased
        assert store.owes_back and set(store.owed) == {held.run_id}

        store.down = False
        await store.give_back()
    assert not store.owes_back
    assert run_row(conn, schema, held.run_id)["lease_owner"] is None  # due again, for anyone
    given = [x for x in log_lines() if x["event"] == "leases_given_back"]
    assert [x["run_ids"] for x in given] == [[held.run_id]]
