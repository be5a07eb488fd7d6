-- ledger-relay operations: the figures behind the backlog metrics (relay/metrics.py refreshes
-- them from a background task every few seconds, never inside a scrape). Applied with the other
-- functions*.sql by `relay migrate`, search_path pinned like functions.sql.

-- Pending work per lane, and the blocked runs. One row per lane:
--   'critical'  runs with a pending terminal event (as claim() finds them through
--               events_pending_terminal)
--   'ordinary'  every other active run
--   'blocked'   runs whose head failed and wait for an operator (their pending events count in
--               neither lane, so the lanes' oldest age measures delay the relay can act on)
-- runs = runs with pending events, events = their pending events, oldest_age_seconds = age of
-- the oldest pending event on the database clock, 0 when none. For 'blocked': the blocked runs,
-- their failed events, and the age of the oldest failure.
-- Cost: one pass over the pending events (events_pending, or a scan when most events are pending)
-- joined to their runs: proportional to the pending backlog, and bounded by the caller's
-- statement_timeout. The relay spaces its refreshes by at least 20 times the last one's duration
-- (relay/health.py), so a large backlog cannot make the gauges a load of their own.
create or replace function backlog()
returns table (lane text, runs bigint, events bigint, oldest_age_seconds double precision)
language sql volatile
set search_path from current
security definer
as $$
    with per_run as (
        -- One pass over the pending events (issue 16: a probe of run_seqs and of events per
        -- active run cost ~0.4 s of a database core per refresh at 20k runs); a run is critical
        -- when its terminal event is pending, and only one event of a run can be terminal.
        select e.run_id, count(*) as n, min(e.created_at) as oldest,
               bool_or(e.terminal) as critical
        from events e
        where e.state = 'pending'
        group by e.run_id
    ), per_run_active as (
        select p.critical, p.n, p.oldest
        from per_run p join runs r on r.run_id = p.run_id
        where not r.idle and r.blocked_seq is null
    ), lanes as (
        select l.lane, count(pr.n) as runs, coalesce(sum(pr.n), 0)::bigint as events,
               min(pr.oldest) as oldest
        from (values ('critical', true), ('ordinary', false)) l (lane, critical)
        left join per_run_active pr on pr.critical = l.critical
        group by l.lane
    ), blocked as (
        select 'blocked'::text as lane, count(distinct f.run_id) as runs,
               count(*) as events, min(f.failed_at) as oldest
        from events f where f.state = 'failed'
    )
    select x.lane, x.runs, x.events,
           coalesce(extract(epoch from clock_timestamp() - x.oldest), 0)::double precision
    from (select * from lanes union all select * from blocked) x
    order by x.lane
$$;
