-- ledger-relay operations: the figures behind the backlog metrics (relay/serving/health.py
-- refreshes them from a background task every few seconds, never inside a scrape). Applied with
-- the other functions*.sql by `relay migrate`, search_path pinned like functions.sql.

-- Pending work per lane, and the blocked runs. One row per lane:
--   'critical'  runs whose terminal event is not delivered yet (pending_terminals, where claim()
--               finds them)
--   'ordinary'  every other active run
--   'blocked'   runs whose head failed and wait for an operator (their pending events count in
--               neither lane, so the lanes' oldest age measures delay the relay can act on)
-- runs = runs with pending events, events = their pending events, oldest_age_seconds = age of
-- the oldest pending event on the database clock, 0 when none. For 'blocked': the blocked runs,
-- their failed events, and the age of the oldest failure.
-- Cost: two probes of the outbox's primary key per active run (a run's seqs are contiguous, so
-- its pending events are its last seq less its cursor, and the oldest is the one after the
-- cursor), through runs_due: proportional to the active runs, not to their events, and bounded
-- by the caller's statement_timeout. The relay spaces its refreshes by at least 20 times the
-- last one's duration (relay/serving/health.py), so a large backlog cannot make the gauges a
-- load of their own. The blocked runs are found through their failures (event_failures).
create or replace function backlog()
returns table (lane text, runs bigint, events bigint, oldest_age_seconds double precision)
language sql volatile
set search_path from current
security definer
as $$
    with per_run_active as (
        select t.run_id is not null as critical, last.seq - r.delivered_seq as n,
               head.created_at as oldest
        from runs r
        -- probes, not a join the planner may turn into a pass over the outbox's history
        cross join lateral (select h.created_at from outbox h
                            where h.run_id = r.run_id and h.seq > r.delivered_seq
                            order by h.seq limit 1) head
        cross join lateral (select l.seq from outbox l
                            where l.run_id = r.run_id order by l.seq desc limit 1) last
        left join pending_terminals t on t.run_id = r.run_id
        where not r.idle and r.blocked_seq is null
    ), lanes as (
        select l.lane, count(pr.n) as runs, coalesce(sum(pr.n), 0)::bigint as events,
               min(pr.oldest) as oldest
        from (values ('critical', true), ('ordinary', false)) l (lane, critical)
        left join per_run_active pr on pr.critical = l.critical
        group by l.lane
    ), blocked as (
        -- a probe of runs per failure on record (few), not a join the planner may hash
        select 'blocked'::text as lane, count(*) as runs, count(*) as events,
               min(f.failed_at) as oldest
        from event_failures f
        cross join lateral (select 1 from runs r
                            where r.run_id = f.run_id and r.blocked_seq = f.seq limit 1) b
    )
    select x.lane, x.runs, x.events,
           coalesce(extract(epoch from clock_timestamp() - x.oldest), 0)::double precision
    from (select * from lanes union all select * from blocked) x
    order by x.lane
$$;

-- The backlog by fairness key (issue 50 item 4, schema version 9): the runs with pending events
-- that are not blocked, per key, for the p_top keys with the most, the rest summed as one row
-- whose key is null (the metric's `(other)`); the default key is ''. Bounded for a label set:
-- at most p_top + 1 rows however many keys there are. Cost: one pass over the active runs
-- (runs_due_by_key), cheaper than backlog()'s probes, and spaced with it.
create or replace function backlog_by_key(p_top int)
returns table (key text, runs bigint)
language sql volatile
set search_path from current
security definer
as $$
    with per_key as (
        select r.fairness_key as key, count(*) as runs
        from runs r
        where not r.idle and r.blocked_seq is null
        group by r.fairness_key
    ), ranked as (
        select p.key, p.runs, row_number() over (order by p.runs desc, p.key) as n from per_key p
    )
    select case when x.n <= p_top then x.key end as key, sum(x.runs)::bigint as runs
    from ranked x
    group by 1
    order by 2 desc, 1
$$;

-- How long the outbox's current part has been taking new events, in seconds on the database
-- clock (schema version 8, docs/storage.md). Retention makes the next part current every
-- retention / 2; an age past the retention says rotations are held back: producer transactions
-- that stay open longer than `outbox_part_lock_timeout` at every try, or no replica pruning.
-- One row of a three-row table: refreshed with the backlog gauges (relay/serving/health.py).
create or replace function outbox_part_age() returns double precision
language sql stable
set search_path from current
security definer
as $$
    select extract(epoch from clock_timestamp() - opened_at)::double precision
    from outbox_parts where current
$$;
