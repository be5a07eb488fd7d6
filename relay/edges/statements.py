"""The store's statements, by name: what relay.edges.store.Store sends, each built once for its
schema. Every one calls a function of schema/functions.sql or reads its tables; the Store binds
the parameters in the order written here."""

from __future__ import annotations

from dataclasses import dataclass

from psycopg import sql


@dataclass(frozen=True, slots=True)
class Statements:
    # (owner, runs, batch size, lease ttl s, lane, run id, max batch bytes, claim name).
    # created_at in UTC without a zone: psycopg loads a timestamptz into the session's zone (a
    # ZoneInfo, ~3 us a value), a timestamp in well under 1 us.
    claim: sql.Composed
    release_claims: sql.Composed  # (owner, claim names)
    renew: sql.Composed  # (run ids, tokens, lease ttl s)
    release: sql.Composed  # (run id, token, delay s, error, status, first seq, last seq)
    fail_event: sql.Composed  # (run id, token, seq, status, error)
    ack: sql.Composed  # (items as JSON)
    widen: sql.Composed  # (run id, token, after seq, limit)
    ack_committed: sql.Composed  # (run id, upto seq)
    prune: sql.Composed  # (retention s, limit)

    @classmethod
    def of(cls, schema: str) -> Statements:
        s = sql.Identifier(schema)
        return cls(
            claim=sql.SQL(
                "select c.run_id, c.epoch, c.lease_token, c.attempts, c.critical, c.seq,"
                " c.event_id, c.event_type, c.payload, c.terminal,"
                " c.created_at at time zone 'UTC', c.traceparent, c.wake_queue, c.claimed_at,"
                " c.reclaimed_from, c.retry_waived"
                " from {}.claim(%s, %s, %s, make_interval(secs => %s), %s, %s, %s, %s) c"
            ).format(s),
            release_claims=sql.SQL("select run_id from {}.release_claims(%s, %s)").format(s),
            renew=sql.SQL(
                "select * from {}.renew(%s::text[], %s::uuid[], make_interval(secs => %s))"
            ).format(s),
            release=sql.SQL(
                "select {}.release(%s, %s, make_interval(secs => %s), %s, %s, %s, %s)"
            ).format(s),
            fail_event=sql.SQL("select {}.fail_event(%s, %s, %s, %s, %s)").format(s),
            ack=sql.SQL("select * from {}.ack(%s::jsonb)").format(s),
            widen=sql.SQL(
                "select e.seq, e.event_id, e.event_type, e.payload::text, e.terminal,"
                " e.created_at at time zone 'UTC', e.traceparent, e.wake_queue"
                " from {0}.events e join {0}.runs r on r.run_id = e.run_id"
                " where e.run_id = %s and r.lease_token = %s and e.state = 'pending'"
                " and e.seq > %s"
                " order by e.seq limit %s"
            ).format(s),
            ack_committed=sql.SQL(
                "select not exists (select 1 from {}.events"
                " where run_id = %s and seq <= %s and state = 'pending')"
            ).format(s),
            prune=sql.SQL("select {}.prune(make_interval(secs => %s), %s)").format(s),
        )


def transaction_bounds(statement_timeout: float, lock_timeout: float) -> str:
    """The text every call's message starts with: BEGIN and the transaction-local bounds
    (`set_config(..., true)`, never a session SET, so a transaction-mode pooler cannot leak
    them)."""
    return (
        "begin; select"
        f" set_config('statement_timeout', '{int(statement_timeout * 1000)}ms', true),"
        f" set_config('lock_timeout', '{int(lock_timeout * 1000)}ms', true); "
    )
