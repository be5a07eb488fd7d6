-- ledger-relay operations: the figures behind the backlog metrics (relay/metrics.py refreshes
-- them from a background task every few seconds, never inside a scrape). Applied with the other
-- functions*.sql by `relay migrate`, search_path pinned like functions.sql.

-- Pending work per lane, and the blocked runs. One row per lane:
--   'critical'  runs with a pending terminal event (discovered through events_pending_terminal
--               in claim(); here through run_seqs.terminal_seq, a primary-key probe per run)
--   'ordinary'  every other active run
--   'blocked'   runs whose head failed and wait for an operator (their pending events count in
--               neither lane, so the lanes' oldest age measures delay the relay can act on)
-- runs = runs with pending events, events = their pending events, oldest_age_seconds = age of
-- the oldest pending event on the database clock, 0 when none. For 'blocked': the blocked runs,
-- their failed events, and the age of the oldest failure.
-- Cost: one index-backed probe per active run (runs_due) plus an index scan of each active run's
-- pending events (events_pending): proportional to the pending backlog, not to the table, and
-- bounded by the caller's statement_timeout.
create or replace function backlog()
returns table (lane text, runs bigint, events bigint, oldest_age_seconds double precision)
language sql volatile
set search_path from current
security definer
as $$
    with active as (
        select r.run_id,
               exists (select 1 from run_seqs s join events t
                         on t.run_id = s.run_id and t.seq = s.terminal_seq
                       where s.run_id = r.run_id and t.state = 'pending') as critical
        from runs r
        where not r.idle and r.blocked_seq is null
    ), per_run as (
        select a.critical, p.n, p.oldest
        from active a
        cross join lateral (
            select count(*) as n, min(e.created_at) as oldest
            from events e where e.run_id = a.run_id and e.state = 'pending'
        ) p
        where p.n > 0
    ), lanes as (
        select l.lane, count(pr.n) as runs, coalesce(sum(pr.n), 0)::bigint as events,
               min(pr.oldest) as oldest
        from (values ('critical', true), ('ordinary', false)) l (lane, critical)
        left join per_run pr on pr.critical = l.critical
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
