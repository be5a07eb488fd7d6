-- ahead of its migration from version 5
--
-- The work of migration 0007 that needs no table lock, done before its transaction while
-- producers and relays of the previous version go on (issue 28: "no lock that blocks enqueue
-- for more than a second"; docs/storage.md, "The migration"). `relay migrate` runs this file in
-- one short transaction, then calls `migrate_prepare_step` in transactions of their own until
-- it returns null; 0007 itself then only catches up, under its locks, with the runs that changed
-- meanwhile. On a database older than the version above, or a new one, it runs inside 0007's
-- transaction instead, just before it.
--
-- What it computes, per run, from the version-6 rows of `events`: the cursor
-- (`runs.delivered_seq`, `delivered_at`), the history (`event_failures`, `event_skips`) and the
-- pending terminal (`pending_terminals`). What it adds is invisible to the previous version's
-- functions: columns they do not name and tables they do not know.
--
-- Until 0007 commits, a trigger on `events` notes the runs whose events any statement wrote
-- (inserted, updated or deleted) in `migrate_0007_changed`. A run is caught up under 0007's
-- locks when it is noted there, or when its cursor is still null: a step passes over a run
-- whose row another transaction holds (`skip locked`: a step never waits for an ack and so can
-- never deadlock with one), and a run created after the step that would have reached it has
-- none yet.

create table if not exists event_failures (
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
create index if not exists event_failures_failed_at on event_failures (failed_at);

create table if not exists event_skips (
    run_id       text not null,
    seq          bigint not null,
    skipped_by   text not null,
    skipped_role text,
    skip_reason  text not null,
    skipped_at   timestamptz not null default clock_timestamp(),
    primary key (run_id, seq)
);

create table if not exists pending_terminals (
    run_id     text primary key,
    seq        bigint not null,
    created_at timestamptz not null        -- the terminal event's: the critical lane's order
);
create index if not exists pending_terminals_created_at on pending_terminals (created_at);

-- No key: a statement only appends, and so never waits for another transaction's note.
create table if not exists migrate_0007_changed (run_id text not null);

-- Runs as its creator: the previous version's roles may write `events` but not this table.
create or replace function migrate_0007_note_changed() returns trigger
language plpgsql security definer
set search_path from current
as $$
begin
    insert into migrate_0007_changed (run_id) select distinct run_id from changed;
    return null;
end
$$;

create or replace trigger migrate_0007_inserted after insert on events
    referencing new table as changed
    for each statement execute function migrate_0007_note_changed();
create or replace trigger migrate_0007_updated after update on events
    referencing new table as changed
    for each statement execute function migrate_0007_note_changed();
create or replace trigger migrate_0007_deleted after delete on events
    referencing old table as changed
    for each statement execute function migrate_0007_note_changed();

-- After the triggers: a producer of the previous version holds `events` and then wants `runs`,
-- so the lock on `runs` is taken once no producer can be holding `events` (the other order waits
-- in a cycle with every enqueue, again at each try).
alter table runs
    add column if not exists delivered_seq bigint,     -- null until computed; 0007: not null
    add column if not exists delivered_at  timestamptz,
    add column if not exists last_status   integer;

-- The runs' cursor, history and pending terminal from their version-6 rows, replacing whatever
-- an earlier call wrote for them.
create or replace function migrate_0007_runs(p_run_ids text[]) returns void
language plpgsql
set search_path from current
as $$
begin
    delete from event_failures where run_id = any (p_run_ids);
    delete from event_skips where run_id = any (p_run_ids);
    delete from pending_terminals where run_id = any (p_run_ids);

    insert into event_failures (run_id, seq, attempts, last_status, last_error, failed_at,
                                retried_by, retried_role, retried_at, retries)
    select run_id, seq, attempts, last_status, last_error, coalesce(failed_at, created_at),
           retried_by, retried_role, retried_at, retries
    from events
    where run_id = any (p_run_ids)
      and (state = 'failed' or failed_at is not null or retries > 0);

    insert into event_skips (run_id, seq, skipped_by, skipped_role, skip_reason, skipped_at)
    select run_id, seq, coalesce(skipped_by, 'unknown'), skipped_role, coalesce(skip_reason, ''),
           coalesce(done_at, created_at)
    from events
    where run_id = any (p_run_ids) and state = 'skipped';

    insert into pending_terminals (run_id, seq, created_at)
    select run_id, seq, created_at from events
    where run_id = any (p_run_ids) and terminal and state in ('pending', 'failed');

    -- The cursor: everything below the run's first event that is not done. In version 6 the
    -- done events of a run are always a prefix (the ack takes a prefix, only a failed head is
    -- skipped), so this is exact. A run with nothing left to do gets its seq counter (retention
    -- may have removed its events). The cursor's last move is taken to be the run's last
    -- update: version 6's ack wrote updated_at as it released the run.
    update runs r
    set delivered_seq = coalesce(least((select min(p.seq) from events p
                                        where p.run_id = r.run_id and p.state = 'pending'),
                                       r.blocked_seq) - 1,
                                 (select s.last_seq from run_seqs s where s.run_id = r.run_id)),
        delivered_at = r.updated_at
    where r.run_id = any (p_run_ids);
end
$$;

-- One step: the next runs after `p_after` in key order whose cursor is not computed yet and
-- that no other transaction holds. Returns the last run it reached, or null when there are none
-- left. (A prepare run again, by a `relay migrate` after one that stopped half-way, so computes
-- only the runs it had not reached: the trigger has noted the others' changes since.)
create or replace function migrate_prepare_step(p_after text) returns text
language plpgsql
set search_path from current
as $$
declare
    v_run_ids text[];
begin
    select array_agg(run_id order by run_id) into v_run_ids
    from (select run_id from runs
          where (p_after is null or run_id > p_after) and delivered_seq is null
          order by run_id
          limit 2000
          for update skip locked) batch;
    if v_run_ids is null then
        return null;
    end if;
    perform migrate_0007_runs(v_run_ids);
    return v_run_ids[cardinality(v_run_ids)];
end
$$;
