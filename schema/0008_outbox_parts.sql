-- ledger-relay schema, version 8: the outbox in three parts that take turns (issue 28,
-- docs/storage.md "Retention by truncation").
--
-- Until version 7 retention deleted delivered events row by row: a delete writes WAL for every
-- row (~340-410 bytes an event here, as much as the leanest queue's own delete), which kept a
-- delivered event at 1.6x the WAL of the leanest queue. From this version the outbox is a table
-- partitioned by `part` into three partitions that take turns, as PgQ's event tables do:
--   * the current part takes every new event (`part` defaults to `current_outbox_part()`);
--   * every `retention / 2`, prune makes the next part current, once that part is empty;
--   * a part that stopped being current more than `retention` ago holds only events enqueued
--     more than `retention` ago: prune moves the few that are not done yet (a blocked run's
--     head and what follows it, a backlog) into the current part, then TRUNCATEs the part.
--     A truncate writes a few hundred bytes of WAL whatever the part holds.
-- An event is so removed between `retention` and 1.5 x `retention` after it was enqueued.
--
-- Each part has its own primary key (run_id, seq) and unique event_id index: a partitioned
-- table's unique indexes must include the partition key, which would only make every entry
-- bigger. What they ensure across the parts: a run's seqs are unique because enqueue numbers
-- them under the run's lock, after the run's highest event or its cursor (retention removes only
-- events at or below the cursor); an event id is looked up in all three parts by enqueue.
--
-- In place: the version-7 `outbox` becomes part 0 (a column with a constant default is added
-- without rewriting a row; a CHECK constraint proves the partition bound, one pass over the
-- table), and parts 1 and 2 start empty.

create table outbox_parts (
    part      smallint primary key check (part in (0, 1, 2)),
    current   boolean not null default false,
    opened_at timestamptz,         -- when it last became the current part
    closed_at timestamptz          -- when it stopped being current: its events are older
);
create unique index outbox_parts_one_current on outbox_parts (current) where current;
insert into outbox_parts (part, current, opened_at)
values (0, true, coalesce((select min(created_at) from outbox), clock_timestamp())),
       (1, false, null),
       (2, false, null);

-- How long retention waits for a part's exclusive lock before it tries again at its next call.
insert into settings (key, value) values ('outbox_part_lock_timeout', '200ms');

create function current_outbox_part() returns smallint
language sql stable
set search_path from current
as $$ select part from outbox_parts where current $$;

alter table outbox add column part smallint not null default 0;
alter table outbox add constraint outbox_p0_part check (part = 0);
alter table outbox rename to outbox_p0;
alter index outbox_pkey rename to outbox_p0_pkey;
alter index outbox_event_id_key rename to outbox_p0_event_id_key;
-- Retention no longer reads events by age. (Version 7 as first written built this index; 0007
-- no longer does, which takes a full build off the locked migration from version 5.)
drop index if exists outbox_created_at;

create table outbox (
    run_id      text not null,
    seq         bigint not null,
    event_id    text not null,
    event_type  text not null,
    payload     jsonb not null,
    terminal    boolean not null default false,
    wake_queue  text,
    wake_event  text,
    traceparent text,
    created_at  timestamptz not null default clock_timestamp(),
    part        smallint not null default current_outbox_part()
) partition by list (part);

alter table outbox attach partition outbox_p0 for values in (0);
alter table outbox_p0 drop constraint outbox_p0_part;  -- the partition bound says it now
alter table outbox_p0 alter column part set default current_outbox_part();

create table outbox_p1 partition of outbox (
    primary key (run_id, seq),
    unique (event_id)
) for values in (1)
with (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02,
      autovacuum_vacuum_cost_delay = 0);
create table outbox_p2 partition of outbox (
    primary key (run_id, seq),
    unique (event_id)
) for values in (2)
with (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02,
      autovacuum_vacuum_cost_delay = 0);

-- The view of version 7, now over the partitioned table (a view follows the table it was made
-- on, which is part 0 since the rename).
create or replace view events as
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
