"""A Hypothesis stateful model of the lease and ack rules (docs/state_machine.md) run against
the real SQL functions of a fresh schema: claim, renew, expire (by moving `lease_expires_at`
into the past), ack with a stale or the current token, release, and producers enqueueing
meanwhile. After every step the database must match the model: lease token and epoch per run,
the state of every event, and exactly one engine wake per acknowledged event, none for others
(DESIGN §9 invariants 1, 3 and 4)."""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson
import psycopg
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from psycopg import sql

import relay
from tests.faults.harness import FAULTS_SCHEMA, install_faults_schema
from tests.support import q

RUNS = 2
BATCH = 3
TTL_SECONDS = 60  # leases only expire when the model says so


@dataclass
class RunModel:
    run_id: str
    next_seq: int = 1
    pending: list[int] = field(default_factory=list)
    delivered: set[int] = field(default_factory=set)
    token: uuid.UUID | None = None
    expired: bool = False
    epoch: int = 0
    claimed_upto: int = 0
    old_tokens: list[uuid.UUID] = field(default_factory=list)

    @property
    def claimable(self) -> bool:
        return bool(self.pending) and (self.token is None or self.expired)

    @property
    def live(self) -> bool:
        """Renew and ack accept only the current, unexpired token."""
        return self.token is not None and not self.expired


class LeaseModel(RuleBasedStateMachine):
    conn: ClassVar[psycopg.Connection[Any]]
    schema: ClassVar[str]
    queue: ClassVar[str]

    def __init__(self) -> None:
        super().__init__()
        tag = uuid.uuid4().hex[:8]
        self.runs = [RunModel(f"m{tag}-{i}") for i in range(RUNS)]

    # -- helpers ----------------------------------------------------------------------------

    def call(self, text: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        cur = self.conn.execute(q(self.schema, text), params)
        return cur.fetchall() if cur.description else []

    def token_for(self, run: RunModel, current: bool, pick: int) -> uuid.UUID:
        if current and run.token is not None:
            return run.token
        if run.old_tokens:
            return run.old_tokens[pick % len(run.old_tokens)]
        return uuid.uuid4()  # never issued

    def enqueue(self, run: RunModel) -> None:
        event_id = f"{run.run_id}-{run.next_seq}"
        with self.conn.transaction():
            seq = relay.enqueue(
                self.conn, run.run_id, event_id, "step", {"n": run.next_seq},
                wake=(self.queue, f"w:{event_id}"), schema=self.schema,
            )  # fmt: skip
        assert seq == run.next_seq
        run.pending.append(seq)
        run.next_seq += 1

    def replace_token(self, run: RunModel, token: uuid.UUID | None) -> None:
        if run.token is not None:
            run.old_tokens.append(run.token)
        run.token = token
        run.expired = False

    # -- rules ------------------------------------------------------------------------------

    @initialize()
    def seed(self) -> None:
        for run in self.runs:
            self.enqueue(run)
            self.enqueue(run)

    @rule(i=st.integers(0, RUNS - 1))
    def produce(self, i: int) -> None:
        self.enqueue(self.runs[i])

    @rule(i=st.integers(0, RUNS - 1))
    def claim(self, i: int) -> None:
        run = self.runs[i]
        rows = self.call(
            "select run_id, epoch, lease_token, seq from {s}.claim(%s, 1, %s,"
            " make_interval(secs => %s), 'ordinary', %s)",
            ("model", BATCH, TTL_SECONDS, run.run_id),
        )
        if not run.claimable:
            assert rows == [], f"claimed {run.run_id} while it was not claimable"
            return
        assert [r[3] for r in rows] == run.pending[:BATCH], "claim returns the pending prefix"
        token = rows[0][2]
        assert token != run.token and token not in run.old_tokens, "a fresh token"
        assert rows[0][1] == run.epoch + 1, "every claim bumps the epoch"
        run.epoch += 1
        self.replace_token(run, token)
        run.claimed_upto = rows[-1][3]

    @rule(i=st.integers(0, RUNS - 1), current=st.booleans(), pick=st.integers(0, 5))
    def renew(self, i: int, current: bool, pick: int) -> None:
        run = self.runs[i]
        token = self.token_for(run, current, pick)
        rows = self.call(
            "select run_id from {s}.renew(%s::text[], %s::uuid[], make_interval(secs => %s))",
            ([run.run_id], [token], TTL_SECONDS),
        )
        expect = run.live and token == run.token
        assert bool(rows) == expect, f"renew with {'current' if current else 'stale'} token"

    @rule(i=st.integers(0, RUNS - 1))
    def expire(self, i: int) -> None:
        run = self.runs[i]
        self.call(
            "update {s}.runs set lease_expires_at = clock_timestamp() - interval '1 second',"
            " next_attempt_at = clock_timestamp() - interval '1 second'"
            " where run_id = %s and lease_token is not null",
            (run.run_id,),
        )
        if run.token is not None:
            run.expired = True

    @rule(i=st.integers(0, RUNS - 1), current=st.booleans(), pick=st.integers(0, 5))
    def ack(self, i: int, current: bool, pick: int) -> None:
        run = self.runs[i]
        token = self.token_for(run, current, pick)
        upto = run.claimed_upto if run.claimed_upto else max(run.next_seq - 1, 1)
        batch = orjson.dumps([{"run_id": run.run_id, "token": str(token), "upto": upto}])
        rows = self.call("select status, acked from {s}.ack(%s::jsonb)", (batch.decode(),))
        if run.live and token == run.token:
            acked = [s for s in run.pending if s <= upto]
            assert rows == [("acked", len(acked))]
            run.delivered.update(acked)
            run.pending = [s for s in run.pending if s > upto]
            self.replace_token(run, None)
            run.claimed_upto = 0
        else:
            assert rows == [("stale", 0)], "a stale or expired token changes nothing"

    @rule(i=st.integers(0, RUNS - 1), current=st.booleans(), pick=st.integers(0, 5))
    def release(self, i: int, current: bool, pick: int) -> None:
        run = self.runs[i]
        token = self.token_for(run, current, pick)
        rows = self.call("select {s}.release(%s, %s)", (run.run_id, token))
        # Release matches the token only (an expired lease may be handed back).
        expect = run.token is not None and token == run.token
        assert rows == [(expect,)]
        if expect:
            self.replace_token(run, None)
            run.claimed_upto = 0

    # -- the database matches the model -----------------------------------------------------

    @invariant()
    def database_matches_model(self) -> None:
        for run in self.runs:
            rows = self.call(
                "select lease_token, epoch, lease_expires_at > clock_timestamp()"
                " from {s}.runs where run_id = %s",
                (run.run_id,),
            )
            if not rows:
                continue  # before seeding
            token, epoch, unexpired = rows[0]
            assert token == run.token
            assert epoch == run.epoch
            if token is not None:
                assert unexpired == (not run.expired)
            states = dict(
                self.call(
                    "select seq, state::text from {s}.events where run_id = %s", (run.run_id,)
                )
            )
            assert {s for s, v in states.items() if v == "delivered"} == run.delivered
            assert sorted(s for s, v in states.items() if v == "pending") == run.pending
            emits = Counter(
                r[0]
                for r in self.conn.execute(
                    sql.SQL(
                        "select event_name from {}.emit_attempts where queue = %s"
                        " and event_name like %s"
                    ).format(sql.Identifier(FAULTS_SCHEMA)),
                    (self.queue, f"w:{run.run_id}-%"),
                ).fetchall()
            )
            # Wake iff ack: exactly one engine emit per acknowledged event, none for any other.
            assert emits == Counter(f"w:{run.run_id}-{s}" for s in run.delivered)


def test_lease_and_ack_rules_against_the_real_sql(
    pg_url: str, schema: str, queue: str, conn: psycopg.Connection[Any]
) -> None:
    install_faults_schema(pg_url)
    conn.execute(
        sql.SQL(
            "create trigger count_emit before insert on absurd.{} for each row"
            " execute function {}.count_emit({})"
        ).format(sql.Identifier(f"e_{queue}"), sql.Identifier(FAULTS_SCHEMA), sql.Literal(queue))
    )
    LeaseModel.conn, LeaseModel.schema, LeaseModel.queue = conn, schema, queue
    run_state_machine_as_test(
        LeaseModel,
        settings=settings(
            max_examples=40,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
