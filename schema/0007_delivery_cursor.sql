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
-- which holds `events`/`outbox` and `runs` exclusively while it runs: producers wait for it. So
-- the work that reads every event (each run's cursor, history and pending terminal) is done
-- before it, without those locks, by 0007_delivery_cursor.prepare.sql; here only the runs that
-- changed since are done again. docs/storage.md gives the measured wait for 1M events.

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

-- The prepare (0007_delivery_cursor.prepare.sql) computed every run's cursor, history and
-- pending terminal while the previous version ran on. Under the locks, every transaction
-- that wrote an event has ended: catch up with the runs that changed since it read
-- them, or that it did not reach.
lock table events, runs in access exclusive mode;
select migrate_0007_runs(array(select run_id from runs where delivered_seq is null
                               union
                               select run_id from migrate_0007_changed));
drop function migrate_prepare_step(text);
drop function migrate_0007_runs(text[]);
drop function migrate_0007_note_changed() cascade;   -- and its triggers
drop table migrate_0007_changed;

alter table runs
    alter column delivered_seq set default 0,
    alter column delivered_seq set not null;

alter table events rename to outbox;
alter index events_pkey rename to outbox_pkey;
alter index events_event_id_key rename to outbox_event_id_key;

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
