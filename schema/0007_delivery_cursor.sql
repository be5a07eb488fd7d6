-- ledger-relay schema, version 7: delivery state on the run, events written once (issue 28,
-- DESIGN §4.5, docs/storage.md).
--
-- Until version 6 the ack marked every delivered event row 'delivered': a new version of the
-- row, payload included, plus index entries. That was ~1,000 bytes of WAL per event, most of
-- what a delivered event cost the database. From this version:
--   * `outbox` holds the events, written once by enqueue and never updated (removed only by
--     retention). It is the version-6 `events` table, renamed, without its delivery columns.
--   * `runs.delivered_seq` is the run's cursor: every event at or below it is done (delivered,
--     or skipped by an operator). The ack advances it in the run's one row. Pending means
--     "after the cursor": `seq > delivered_seq`, one range of the primary key.
--   * the rare per-event states have small tables: `event_failures` (an event that failed:
--     status, error, attempts, and the operator's retries) and `event_skips` (who skipped an
--     event, when and why). A run is blocked at `runs.blocked_seq` as before.
--   * `pending_terminals`: one row per run whose terminal event is not done yet, written by
--     enqueue and deleted when the cursor passes it. The critical lane discovers runs there.
--   * `events` is now a view with the version-6 columns, their state derived from the cursor:
--     what relays of version 6 read during a rolling upgrade (their `events.state` reads), and
--     the one place that says what "pending", "delivered", "failed" and "skipped" mean.
--   * `run_seqs.last_seq` is no longer written per event: enqueue serialises a run's writers on
--     the run's `run_seqs` row lock and takes the next seq after the run's highest in `outbox`;
--     `last_seq` is the floor below which retention removed events (prune raises it first).
--
-- In place: this file and the new functions are applied in one transaction (relay migrate),
-- which holds `events`/`outbox` exclusively while it runs: producers wait for it. The work is
-- index-driven, one pass over the runs; docs/storage.md gives the measured time for 1M events.

-- Shims for functions of older versions, which used to sit in functions.sql (issue 27, item 6).
-- A call from a relay of the previous version must resolve to exactly one function:
-- claim's signature before p_max_bytes (six arguments), and its result before reclaimed_from
-- (a result type cannot be replaced, only dropped); hold_liveness before p_incarnation.
drop function if exists claim(text, int, int, interval, text, text);
do $$
begin
    if exists (select 1 from pg_proc p
               where p.oid = to_regprocedure('claim(text, int, int, interval, text, text, bigint)')
                 and not 'reclaimed_from' = any(p.proargnames)) then
        drop function claim(text, int, int, interval, text, text, bigint);
    end if;
end
$$;
drop function if exists hold_liveness(text);
-- A run's writers are serialised by its run_seqs row lock now, no longer by an advisory lock,
-- and this version's functions no longer call run_lock_key(text) or run_lock_keys(text[]). They
-- stay, unused, in a database migrated from version 6: a call of a version-6 function that began
-- before this migration committed (an enqueue, an ack) resumes with its old body, and that body
-- looks them up by name (tests/test_rolling_upgrade.py went red on "function run_lock_key(text)
-- does not exist" when they were dropped here). The migration after the next release drops them.

alter table events rename to outbox;
alter index events_pkey rename to outbox_pkey;
alter index events_event_id_key rename to outbox_event_id_key;
-- Retention removes delivered events by age (created_at): the delivery time is no longer kept
-- per event. Inserts come in time order, so this index only ever grows at its right edge.
create index outbox_created_at on outbox (created_at);

alter table runs
    add column delivered_seq bigint not null default 0,
    add column delivered_at  timestamptz,          -- when the cursor last moved
    add column last_status   integer;              -- the HTTP status of the last failed attempt

create table event_failures (
    run_id       text not null,
    seq          bigint not null,
    attempts     integer not null default 0,        -- failed attempts when it was failed
    last_status  integer,
    last_error   text,
    failed_at    timestamptz not null default clock_timestamp(),
    retried_by   text,
    retried_role text,
    retried_at   timestamptz,
    retries      integer not null default 0,
    primary key (run_id, seq)
);
create index event_failures_failed_at on event_failures (failed_at);

create table event_skips (
    run_id       text not null,
    seq          bigint not null,
    skipped_by   text not null,
    skipped_role text,
    skip_reason  text not null,
    skipped_at   timestamptz not null default clock_timestamp(),
    primary key (run_id, seq)
);

create table pending_terminals (
    run_id     text primary key,
    seq        bigint not null,
    created_at timestamptz not null        -- the terminal event's: the critical lane's order
);
create index pending_terminals_created_at on pending_terminals (created_at);

-- The history the version-6 rows carry, before their columns go (one pass over the events).
with history as materialized (
    select * from outbox
    where state in ('failed', 'skipped') or failed_at is not null or retries > 0
), failures as (
    insert into event_failures (run_id, seq, attempts, last_status, last_error, failed_at,
                                retried_by, retried_role, retried_at, retries)
    select run_id, seq, attempts, last_status, last_error, coalesce(failed_at, created_at),
           retried_by, retried_role, retried_at, retries
    from history
    where state = 'failed' or failed_at is not null or retries > 0
)
insert into event_skips (run_id, seq, skipped_by, skipped_role, skip_reason, skipped_at)
select run_id, seq, coalesce(skipped_by, 'unknown'), skipped_role, coalesce(skip_reason, ''),
       coalesce(done_at, created_at)
from history
where state = 'skipped';

insert into pending_terminals (run_id, seq, created_at)
select run_id, seq, created_at from outbox
where terminal and state in ('pending', 'failed');

-- The cursor: everything below the run's first event that is not done. In version 6 the done
-- events of a run are always a prefix (the ack takes a prefix, only a failed head is skipped),
-- so this is exact. A run with nothing left to do gets its seq counter (retention may have
-- removed its events). The cursor's last move is taken to be the run's last update: version 6's
-- ack wrote updated_at as it released the run.
update runs r
set delivered_seq = coalesce(least((select min(p.seq) from outbox p
                                    where p.run_id = r.run_id and p.state = 'pending'),
                                   r.blocked_seq) - 1,
                             (select s.last_seq from run_seqs s where s.run_id = r.run_id)),
    delivered_at = r.updated_at;

alter table outbox
    drop column state,
    drop column attempts,
    drop column delivered_at,
    drop column done_at,
    drop column last_status,
    drop column last_error,
    drop column failed_at,
    drop column skipped_by,
    drop column skip_reason,
    drop column retried_by,
    drop column retried_at,
    drop column retries,
    drop column retried_role,
    drop column skipped_role;

-- Version 6's readers, and the definition of each event's state under the cursor. A skipped
-- event is at or below the cursor (a skip moves it past the event); a failed one is the run's
-- blocked head. `delivered_at` is the run's last delivery: the cursor keeps no time per event,
-- so it says "delivered at or before". `done_at` is that, or the skip's time.
create view events as
select o.run_id, o.seq, o.event_id, o.event_type, o.payload, o.terminal, o.wake_queue,
       o.wake_event, o.traceparent, o.created_at,
       case when k.seq is not null then 'skipped'
            when o.seq <= r.delivered_seq then 'delivered'
            when o.seq = r.blocked_seq then 'failed'
            else 'pending' end as state,
       coalesce(f.attempts, 0) as attempts,
       case when k.seq is null and o.seq <= r.delivered_seq then r.delivered_at end
           as delivered_at,
       case when k.seq is not null then k.skipped_at
            when o.seq <= r.delivered_seq then r.delivered_at end as done_at,
       f.last_status, f.last_error, f.failed_at,
       k.skipped_by, k.skip_reason,
       f.retried_by, f.retried_at, coalesce(f.retries, 0) as retries, f.retried_role,
       k.skipped_role
from outbox o
join runs r on r.run_id = o.run_id
left join event_failures f on f.run_id = o.run_id and f.seq = o.seq
left join event_skips k on k.run_id = o.run_id and k.seq = o.seq;
