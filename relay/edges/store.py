"""The store: the relay's only way to its database tables (psycopg async pools).

Each call is one round trip: a single simple-protocol message `BEGIN; <transaction-local
bounds: statement and lock timeouts>; <the call>; COMMIT`, parameters bound
client-side by psycopg's own quoting. Measured here: 0.2 ms, against 0.38 ms for the same four
statements in pipeline mode and 0.42 ms as four round trips. The bounds are
`set_config(..., true)`, never a session SET, so a transaction-mode pooler cannot leak them.
An application deadline wraps every round trip, because a silent network blackhole is not
noticed by the socket for many seconds; a connection whose round trip timed out is closed (its
state is unknown) and the pool replaces it.
"""

from __future__ import annotations

import sys
import time
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, NamedTuple

import anyio
import orjson
import psycopg
from psycopg import AsyncClientCursor, sql
from psycopg.pq import TransactionStatus
from psycopg.rows import TupleRow
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from relay import logs
from relay.core import clock
from relay.core.policy import Trust, lease_margin
from relay.edges.statements import Statements, transaction_bounds

Pool = AsyncConnectionPool[psycopg.AsyncConnection[TupleRow]]

CONNECT_KWARGS: dict[str, Any] = {
    "autocommit": True,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 3,
    "keepalives_count": 3,
    "tcp_user_timeout": 15000,
    "application_name": "ledger-relay",
}


class IdleCheck:
    """The pool's check before handing out a connection: a round trip (psycopg_pool's
    `check_connection`), but only for a connection that sat idle longer than `idle` seconds.
    A busy connection proved itself moments ago, and checking it anyway doubled the round
    trips of every store call (docs/performance.md). One that broke since fails its call, is
    closed by `Store._call`, and the call's caller retries: the same path as a connection
    that breaks mid-call."""

    def __init__(self, idle: float) -> None:
        self.idle = idle
        self._used: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], float] = (
            weakref.WeakKeyDictionary()
        )

    async def __call__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        now = time.monotonic()
        last = self._used.get(conn)
        if last is None or now - last > self.idle:
            await AsyncConnectionPool.check_connection(conn)
        self._used[conn] = now


class ClaimedEvent(NamedTuple):
    """One claimed event (a tuple: a claim of 64 runs builds hundreds of these per round trip,
    and a frozen dataclass cost several times as much to construct)."""

    seq: int
    event_id: str
    event_type: str
    payload: str  # jsonb as text: embedded in the POST body with orjson.Fragment, never decoded
    terminal: bool
    created_at: datetime  # the database's clock, in UTC, naive (the body says +00:00)
    traceparent: str | None
    wake_queue: str | None


def payload_bytes(events: Sequence[ClaimedEvent]) -> int:
    """The memory the events' payload texts take in this process (`sys.getsizeof`, O(1) per
    string). A character takes at most as many bytes here as in UTF-8, so the claim's SQL
    bound, which counts UTF-8 bytes, bounds this too (plus a string header per event)."""
    return sum(sys.getsizeof(e.payload) for e in events)


@dataclass(frozen=True, slots=True)
class Claim:
    """A run's prefix under this replica's lease: a value. A renewal, a widening or a promotion
    returns a new one, and whoever holds the claim keeps that (`Held`)."""

    run_id: str
    epoch: int
    token: uuid.UUID
    attempts: int
    critical: bool
    claimed_at: datetime  # database clock
    trust: Trust
    events: tuple[ClaimedEvent, ...]
    # A terminal event was committed after the claim: widen the prefix before the first POST.
    widen: bool = False
    # The dead owner whose unexpired lease this claim took (issue 18), else None.
    reclaimed_from: str | None = None
    # A targeted terminal (issue 50): claimed for the terminal event committed while the relay
    # runs (a drain on `terminal`), or promoted by one. Control traffic: its claim, slot and
    # permit go ahead of everything held, and only it may use the critical reserve. A run that
    # discovery found with a pending terminal is `critical` but not targeted.
    targeted: bool = False
    # An operator's `relay retry` made the run due and no attempt of it has ended since (schema
    # version 11, runs.retry_waived): this claim's retry goes past the retry budget.
    retry_waived: bool = False

    def renewed(self, trust: Trust) -> Claim:
        """The claim once its lease was renewed: the same prefix under a new trust window."""
        return replace(self, trust=trust)

    def promoted(self) -> Claim:
        """A terminal event was committed for the run: it is a targeted terminal now, and its
        prefix is widened before its first POST, unless it holds a terminal event already (a
        claim that came back after the commit: relay/delivery/lane.py, `foretold`)."""
        holds_terminal = any(e.terminal for e in self.events)
        return replace(self, critical=True, widen=not holds_terminal, targeted=True)

    def widened(self, more: Sequence[ClaimedEvent]) -> Claim:
        """The prefix grown by `more` (the run's events committed since,
        relay.edges.store.Store.widen); critical once it holds a terminal event."""
        events = (*self.events, *more)
        critical = self.critical or any(e.terminal for e in events)
        return replace(self, events=events, widen=False, critical=critical)

    @property
    def first_seq(self) -> int:
        return self.events[0].seq

    @property
    def last_seq(self) -> int:
        return self.events[-1].seq

    def database_time(self, now: float) -> datetime:
        """The database's clock at `now` (this process's monotonic clock), as a POST's
        `webhook-timestamp` carries it: the claim's timestamp plus the time held since its trust
        window started. That start moves with each renewal and `claimed_at` does not, so after
        a renewal this lags the database's clock by the time held before it (never ahead)."""
        return self.claimed_at + timedelta(seconds=max(0.0, now - self.trust.started))


class Held:
    """A claim its lane holds, as its current value: the one mutable thing about a claim. Each
    change is a new Claim, put here by the part that makes it: the lane promotes a queued claim
    (relay/delivery/lane.py), the executor widens it before the first POST and renews it when it
    waited too long (relay/delivery/execute.py), the renewer moves its trust window while it is on
    the wire (relay/delivery/renewal.py). Whoever reads it later (a quick retry's trust check, the
    signature's timestamp, the hand-back of the lease) reads the current value here."""

    __slots__ = ("claim",)

    def __init__(self, claim: Claim) -> None:
        self.claim = claim

    @property
    def events(self) -> tuple[ClaimedEvent, ...]:
        """What planning counts (relay.core.policy.plan_groups)."""
        return self.claim.events


@dataclass(frozen=True, slots=True)
class AckResult:
    run_id: str
    status: str  # acked | stale | failed
    acked: int
    last_seq: int | None
    lag_seconds: float | None
    error: str | None


def outcome_unknown(exc: BaseException) -> bool:
    """Whether a statement that raised `exc` may have committed: not when the server answered
    with an error (its transaction is rolled back) or the pool had no connection to send it on;
    any other way (a connection cut, the deadline, a cancellation) it may have."""
    if isinstance(exc, PoolTimeout):
        return False
    return not (isinstance(exc, psycopg.Error) and exc.sqlstate is not None)


class Store:
    def __init__(
        self,
        pool: Pool,
        schema: str,
        *,
        lease_ttl: float,
        batch_size: int,
        owner: str,
        max_batch_bytes: int | None = None,
        statement_timeout: float = 10.0,
        lock_timeout: float = 2.0,
    ) -> None:
        self.pool = pool
        self.schema = schema
        self.lease_ttl = lease_ttl
        self.batch_size = batch_size
        self.max_batch_bytes = max_batch_bytes
        self.owner = owner
        self.statement_timeout = statement_timeout
        self.deadline = statement_timeout + 2.0
        # What this replica holds without knowing it, given back by `give_back` (the lane's
        # loop calls it before its next claim): the claims whose answer never came (the
        # connection cut, the deadline passed), each name -> when it can no longer commit, and
        # the leases whose hand-back failed (`owe`), run id -> claim.
        self.unanswered: dict[uuid.UUID, float] = {}
        self.owed: dict[str, Claim] = {}
        # Generic plans are set where they pay, in the definitions of claim() and ack()
        # (`plan_cache_mode`, function-local), never on the session: docs/performance.md.
        self.statements = Statements.of(schema)
        self._begin = transaction_bounds(statement_timeout, lock_timeout)

    async def query(self, query: sql.Composed, params: Sequence[Any]) -> list[TupleRow]:
        """One statement in its own transaction, bounded like every other (the status page's
        reads, relay/serving/ui/data.py): BEGIN, the bounds, the statement and COMMIT in one
        message."""
        return await self._call(query, params)

    async def _call(self, query: sql.Composed, params: Sequence[Any]) -> list[TupleRow]:
        async with self.pool.connection() as conn:
            try:
                text = self._begin + AsyncClientCursor(conn).mogrify(query, params) + "; commit"
                with anyio.fail_after(self.deadline):
                    cur = await conn.execute(text.encode())
                    cur.nextset()  # past BEGIN
                    cur.nextset()  # past the bounds
                    rows: list[TupleRow] = await cur.fetchall()
                    return rows
            except BaseException:
                # Unknown connection state (deadline, cancellation mid-protocol, broken socket):
                # close it so the pool replaces it rather than hand it out again.
                status = conn.info.transaction_status
                if status == TransactionStatus.INERROR and not conn.closed:
                    # A statement failed: the rest of the message was skipped. Roll back and
                    # keep the connection (bounded, like everything else here).
                    with anyio.move_on_after(2.0) as scope:
                        await conn.execute("rollback")
                    if scope.cancelled_caught:
                        await conn.close()
                elif status != TransactionStatus.IDLE and not conn.closed:
                    await conn.close()
                raise

    async def claim(self, lane: str, n_runs: int, run_id: str | None = None) -> list[Claim]:
        """Up to `n_runs` runs of `lane` (or the run `run_id`), leased to this replica. A claim
        whose answer may have committed but never came is remembered by its name, for
        `give_back`."""
        name = uuid.uuid4()  # the claim's name: its runs' tokens derive from it (claim_token)
        sent = clock.now()
        try:
            rows = await self._call(
                self.statements.claim,
                (
                    self.owner,
                    n_runs,
                    self.batch_size,
                    self.lease_ttl,
                    lane,
                    run_id,
                    self.max_batch_bytes,
                    name,
                ),
            )
        except BaseException as exc:
            if outcome_unknown(exc):
                self.unanswered[name] = sent + self.deadline
            raise
        trust = Trust(started=sent, ttl=self.lease_ttl, margin=lease_margin(self.lease_ttl))
        # One row per event, each run's in seq order; the lease's columns repeat on each row.
        runs: dict[str, tuple[TupleRow, list[ClaimedEvent]]] = {}
        for r in rows:
            run = runs.get(r[0])
            if run is None:
                run = runs[r[0]] = (r, [])
            run[1].append(ClaimedEvent._make(r[5:13]))
        return [
            Claim(
                run_id=r[0],
                epoch=r[1],
                token=r[2],
                attempts=r[3],
                critical=r[4],
                claimed_at=r[13],
                trust=trust,
                events=tuple(events),
                reclaimed_from=r[14],
                targeted=run_id is not None,
                retry_waived=r[15],
            )
            for r, events in runs.values()
        ]

    @property
    def owes_back(self) -> bool:
        """Whether leases this replica holds without knowing it wait for `give_back`."""
        return bool(self.unanswered or self.owed)

    def owe(self, claim: Claim) -> None:
        """A lease whose hand-back failed (the database unreachable meanwhile): given back by
        the next `give_back` rather than left to expire while this replica lives."""
        self.owed[claim.run_id] = claim

    async def give_back(self) -> None:
        """Gives back what this replica holds without knowing it: the runs of the claims whose
        answer never came (release_claims) and the leases whose hand-back failed (release,
        fenced by token). Left alone, they would wait for their leases to expire: no other
        replica takes a live owner's lease. A claim is forgotten once a give-back ran after it
        could last commit, a lease once given back or expired. Raises what the database raises;
        what is left stays for the next call."""
        given: list[str] = []
        if self.unanswered:
            names = list(self.unanswered)
            asked = clock.now()
            rows = await self._call(self.statements.release_claims, (self.owner, names))
            given += [r[0] for r in rows]
            for name in names:
                if self.unanswered[name] <= asked:
                    del self.unanswered[name]
        for run_id, claim in list(self.owed.items()):
            if clock.now() < claim.trust.started + claim.trust.ttl and await self.release(claim):
                given.append(run_id)
            del self.owed[run_id]
        if given:
            logs.info("leases_given_back", lease_owner=self.owner, runs=len(given), run_ids=given)

    async def renew(self, claims: Sequence[Claim]) -> dict[str, Trust]:
        """Extends the leases of `claims` (fenced by token). Returns the new trust window of
        each run renewed; a run missing from it was not (its lease is lost)."""
        if not claims:
            return {}
        sent = clock.now()
        rows = await self._call(
            self.statements.renew,
            ([c.run_id for c in claims], [c.token for c in claims], self.lease_ttl),
        )
        trust = Trust(started=sent, ttl=self.lease_ttl, margin=lease_margin(self.lease_ttl))
        return {r[0]: trust for r in rows}

    async def release(
        self,
        claim: Claim,
        delay: float = 0.0,
        *,
        error: str | None = None,
        status: int | None = None,
    ) -> bool:
        rows = await self._call(
            self.statements.release,
            (
                claim.run_id,
                claim.token,
                delay,
                error,
                status,
                claim.first_seq if claim.events else None,
                claim.last_seq if claim.events else None,
            ),
        )
        return bool(rows and rows[0][0])

    async def fail_event(self, claim: Claim, seq: int, status: int | None, error: str) -> bool:
        rows = await self._call(
            self.statements.fail_event, (claim.run_id, claim.token, seq, status, error)
        )
        return bool(rows and rows[0][0])

    async def ack(self, items: Sequence[tuple[Claim, int, bool]]) -> list[AckResult]:
        """Acknowledges each (claim, upto_seq, keep_lease) in one transaction (grouped ack,
        DESIGN §6)."""
        payload = orjson.dumps(
            [
                {"run_id": c.run_id, "token": str(c.token), "upto": upto, "keep": keep}
                for c, upto, keep in items
            ]
        ).decode()
        rows = await self._call(self.statements.ack, (payload,))
        return [AckResult(*r) for r in rows]

    async def widen(self, claim: Claim) -> list[ClaimedEvent]:
        """Events of the claim's run committed since the claim, after its last one (up to the
        batch size), while the lease is still ours. The caller keeps `claim.widened(more)`."""
        room = self.batch_size - len(claim.events)
        if room <= 0 or not claim.events:
            return []
        rows = await self._call(
            self.statements.widen, (claim.run_id, claim.token, claim.last_seq, room)
        )
        more = [ClaimedEvent(*r) for r in rows]
        if self.max_batch_bytes is None:
            return more
        # The byte bound of the claim holds for the widened prefix too (a prefix of `more`).
        size = payload_bytes(claim.events)
        for i, event in enumerate(more):
            size += sys.getsizeof(event.payload)
            if size > self.max_batch_bytes:
                return more[:i]
        return more

    async def ack_committed(self, run_id: str, upto: int) -> bool:
        """After an ack whose COMMIT outcome is unknown (connection lost): did it commit? It did
        iff no event of the run up to `upto` is still pending (the ack marks them all, or none)."""
        rows = await self._call(self.statements.ack_committed, (run_id, upto))
        return bool(rows and rows[0][0])

    async def prune(self, retention: float, limit: int) -> int:
        rows = await self._call(self.statements.prune, (retention, limit))
        return int(rows[0][0]) if rows else 0
