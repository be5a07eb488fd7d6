-- ledger-relay schema, version 2: the audit trail of the operator tools (`relay retry`,
-- `relay skip`; functions in functions_ops.sql).
--
-- A skip is recorded in the columns version 1 already has (skipped_by, skip_reason, and done_at,
-- which is the skip time). A retry needs its own: who retried the event last, when, and how
-- many times it was retried. They stay on the row after delivery, so `relay inspect` shows that
-- an event went through an operator. Adding nullable columns and a constant default rewrites
-- nothing (PostgreSQL ≥ 11), so this migration takes its lock only for a moment.

alter table events
    add column retried_by text,
    add column retried_at timestamptz,
    add column retries    integer not null default 0;
