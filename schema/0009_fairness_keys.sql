-- ledger-relay schema, version 9: fair shares between tenants (issue 50 item 3; docs/design.md
-- "Scheduling: fair shares between keys").
--
-- A run has one fairness key, set by its first event (`enqueue(..., p_fairness_key)`; a run
-- enqueued without one has the default key ''). Among keys with due work the claim shares runs
-- in proportion to each key's weight (stride scheduling), within each lane.
--   * `runs.fairness_key`: written once, by the enqueue that creates the run; never updated.
--   * `pending_terminals.fairness_key`: the same key, so the critical lane finds a key's runs
--     with a pending terminal, oldest terminal first, through an index of its own.
--   * `fairness_keys`: a key's weight (`set_fairness_weight`, the schema owner's) and its pass
--     in each lane (stride scheduling's virtual time), advanced by the claim only. Producers
--     never write it: one busy key's producers share no row. A key without a row has weight 1.
--   * `fairness_clock`: each lane's virtual time, the least pass of the keys that had due work
--     at the lane's last claim over more than one key: a key that comes back from idle starts
--     there (no credit banked while it had nothing to send).
--
-- In place: the columns have constant defaults (no row is rewritten). The two indexes are built
-- under this migration's locks: `runs_due_by_key` reads `runs` once (its partial predicate keeps
-- only the active runs), `pending_terminals_by_key` the pending terminals.
--
-- Rolling upgrade: claim keeps its signature and result; only the pick functions it calls
-- change. enqueue and enqueue_many gain a last parameter with a default, so calls of the previous
-- release resolve to them unchanged; their previous signatures are dropped here, or each such
-- call would find two candidates.

drop function if exists enqueue(text, text, text, jsonb, boolean, text, text, text);
drop function if exists enqueue_many(text, jsonb);

alter table runs add column fairness_key text not null default '';
alter table pending_terminals add column fairness_key text not null default '';

-- A key's runs that may be due, in today's order (next_attempt_at); its first entry is the key's
-- earliest due time, so one descent per key lists the keys with due work (pick_fair_keys).
create index runs_due_by_key on runs (fairness_key, next_attempt_at)
    where not idle and blocked_seq is null;
create index pending_terminals_by_key on pending_terminals (fairness_key, created_at);

create table fairness_keys (
    key           text primary key,
    weight        integer not null default 1 check (weight between 1 and 1000),
    pass_critical bigint not null default 0,
    pass_ordinary bigint not null default 0
);

create table fairness_clock (
    lane  text primary key check (lane in ('critical', 'ordinary')),
    vtime bigint not null default 0
);
insert into fairness_clock (lane) values ('critical'), ('ordinary');
