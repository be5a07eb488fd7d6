-- ledger-relay status page (issue 17, relay/serving/ui/): the replica reports behind it and its
-- two read-only queries. Applied with the other functions*.sql by `relay migrate`, search_path
-- pinned like functions.sql. `security definer` like the functions `relay run` calls, so the
-- relay role needs only EXECUTE on them (relay/maintenance/roles.py).

-- What is wrong with one value of a report, or null, by the kind its field has (null: no
-- field of that name is known): 'count' a non-negative integer, 'count or null', 'seconds or
-- null' non-negative seconds, 'number or null' any number (JSON has no infinities), 'boolean'.
-- Says the JSON type it got (or the number), never the text: the message reaches logs.
create or replace function report_value_problem(p_path text, p_kind text, p_value jsonb)
returns text
language plpgsql immutable
set search_path from current
as $$
declare
    v_type text := jsonb_typeof(p_value);
    v_got text := case when v_type = 'number' then left(p_value::text, 30) else v_type end;
begin
    if p_kind is null then
        return format('%s is not a known field', p_path);
    elsif v_type = 'null' and p_kind like '% or null' then
        return null;
    elsif p_kind = 'boolean' then
        if v_type = 'boolean' then
            return null;
        end if;
        return format('%s must be true or false (got %s)', p_path, v_got);
    elsif p_kind = 'number or null' then
        if v_type = 'number' then
            return null;
        end if;
        return format('%s must be a number or null (got %s)', p_path, v_got);
    elsif p_kind = 'seconds or null' then
        if v_type = 'number' then  -- (nested: the cast only ever sees a number)
            if p_value::numeric >= 0 then
                return null;
            end if;
        end if;
        return format('%s must be a non-negative number of seconds or null (got %s)', p_path, v_got);
    end if;
    -- 'count', 'count or null'
    if v_type = 'number' then
        if p_value::numeric between 0 and 9223372036854775807
           and p_value::numeric = trunc(p_value::numeric) then
            return null;
        end if;
    end if;
    return format('%s must be a non-negative integer%s (got %s)', p_path,
                  case when p_kind = 'count or null' then ' or null' else '' end, v_got);
end
$$;

-- What is wrong with one part of a report (an object of figures), or null: each field has the
-- kind p_kinds gives it ({field: kind}, report_value_problem), and no other field is known.
-- The first problem in field order, named by its path under p_path.
create or replace function report_object_problem(p_path text, p_fields jsonb, p_kinds jsonb)
returns text
language sql immutable
set search_path from current
as $$
    select case
        when jsonb_typeof(p_fields) <> 'object' then format('%s must be an object', p_path)
        else (select x.problem
              from (select f.key, report_value_problem(
                               format('%s.%s', p_path, left(f.key, 40)), p_kinds ->> f.key,
                               f.value) as problem
                    from jsonb_each(p_fields) f) x
              where x.problem is not null
              order by x.key limit 1)
    end
$$;

-- What is wrong with one lane's part of a report, or null: its cumulative counters and in
-- flight, and its lag quantiles (build_report, relay/serving/ui/data.py).
create or replace function report_lane_problem(p_lane text, p_counters jsonb) returns text
language sql immutable
set search_path from current
as $$
    select case
        when p_lane not in ('critical', 'ordinary') then
            format('lanes.%s is not a lane (critical, ordinary)', left(p_lane, 40))
        else report_object_problem(format('lanes.%s', p_lane), p_counters, jsonb_build_object(
            'delivered', 'count', 'claimed', 'count', 'renewals', 'count', 'retries', 'count',
            'blocked', 'count', 'leases_lost', 'count', 'inflight', 'count',
            'lag_p50', 'seconds or null', 'lag_p99', 'seconds or null',
            -- runs claimed by class (issue 50 item 4), since the release that counts them
            'claimed_targeted', 'count', 'claimed_finished', 'count', 'claimed_due', 'count'))
    end
$$;

-- What is wrong with the `limit` part of a report, or null: the replica's adaptive POST limit
-- (issue 42; report_limit, relay/serving/ui/data.py), absent under post_limit = fixed. The POSTs
-- it allows, its ceiling and the critical reserve, the POSTs in flight and waiting per lane
-- class, the minimum round trip in whole milliseconds (null before any answer), whether it fell
-- sharply and has not recovered, and the retry budget's tokens: a number that goes below zero
-- when failed retries outlive the deposits that paid for them
-- (relay/admission/retry_budget.py), null without a budget.
create or replace function report_limit_problem(p_limit jsonb) returns text
language sql immutable
set search_path from current
as $$
    select report_object_problem('limit', p_limit, jsonb_build_object(
        'limit', 'count', 'ceiling', 'count', 'reserve', 'count',
        'in_flight_critical', 'count', 'in_flight_ordinary', 'count',
        'waiting_critical', 'count', 'waiting_ordinary', 'count',
        'min_rtt_ms', 'count or null', 'fallen', 'boolean', 'retry_tokens', 'number or null'))
$$;

-- Replaced by report_value_problem (a kind per field, so the lanes and the limit share it).
drop function if exists report_field_problem(text, text, jsonb);

-- What is wrong with a replica's report, or null when nothing is. A report is what
-- relay/serving/ui/data.py `build_report` makes: {"lanes": {lane: {figure: n}}, "ingress":
-- state, "limit": {figure: n}} ("limit" since issue 42, optional), at most 8 kB; its fixed shape
-- bounds its depth. Checked when it is written and again when
-- it is read (a row written before these checks is shown as its problem, never its figures).
create or replace function report_problem(p_report jsonb) returns text
language sql immutable
set search_path from current
as $$
    select case
        when jsonb_typeof(p_report) is distinct from 'object' then 'the report must be a JSON object'
        when length(p_report::text) > 8192 then 'the report is over 8 kB'
        when exists (select 1 from jsonb_object_keys(p_report) k
                     where k not in ('lanes', 'ingress', 'limit'))
            then 'only "lanes", "ingress" and "limit" are known keys'
        when coalesce(p_report ->> 'ingress', 'ok') not in ('ok', 'recovering', 'misconfigured')
          or jsonb_typeof(p_report -> 'ingress') not in ('string', 'null') then
            'ingress must be one of ok, recovering, misconfigured'
        when jsonb_typeof(coalesce(p_report -> 'lanes', '{}')) <> 'object' then
            'lanes must be an object'
        else coalesce(
            (select x.problem
             from (select l.key, report_lane_problem(l.key, l.value) as problem
                   from jsonb_each(coalesce(p_report -> 'lanes', '{}')) l) x
             where x.problem is not null
             order by x.key limit 1),
            case when p_report ? 'limit' then report_limit_problem(p_report -> 'limit') end)
    end
$$;

-- A replica's own report: its counters and ingress health, into the `replicas` row its liveness
-- lock created (never a new row: see 0005_replica_reports.sql). Only the session that holds the
-- owner's liveness lock may report for it (the replica's LISTEN connection:
-- relay/edges/listener.py), so a role holder cannot write another replica's figures; the
-- report's shape is checked (report_problem). Returns every replica's cumulative delivered
-- count per lane from valid reports younger than p_ttl_seconds, as {"owner": {"critical": n,
-- "ordinary": n}}: the status page's rate series are the differences between two such answers,
-- so a replica learns the fleet's rates with the one statement it sends anyway.
create or replace function report_replica(p_owner text, p_report jsonb, p_ttl_seconds float8)
returns jsonb
language plpgsql volatile
set search_path from current
security definer
as $$
declare
    v_now timestamptz := clock_timestamp();
    v_problem text := report_problem(p_report);
begin
    perform require_liveness_holder(p_owner, 'report_replica');
    if v_problem is not null then
        raise exception 'relay.report_replica: %', v_problem using errcode = '22023';
    end if;
    update replicas set reported_at = v_now, report = p_report where owner = p_owner;
    return coalesce((
        select jsonb_object_agg(rp.owner, jsonb_build_object(
                   'critical', coalesce((rp.report #>> '{lanes,critical,delivered}')::bigint, 0),
                   'ordinary', coalesce((rp.report #>> '{lanes,ordinary,delivered}')::bigint, 0)))
        from replicas rp
        where (rp.reported_at > v_now - make_interval(secs => p_ttl_seconds)
               or rp.owner = p_owner)
          and report_problem(rp.report) is null), '{}');
end
$$;

-- Each replica's last report with its age, by owner: the report itself only when it passes
-- report_problem, else its problem instead (a row written before the checks, or by hand), so
-- what the page reads of a report always has the shape it renders.
create or replace function ui_reports(p_ttl_seconds float8) returns jsonb
language sql volatile
set search_path from current
as $$
    select coalesce(jsonb_object_agg(x.owner, jsonb_build_object(
               'reported_at', x.reported_at,
               'age_seconds', extract(epoch from clock_timestamp() - x.reported_at)::float8,
               'stale', x.reported_at <= clock_timestamp() - make_interval(secs => p_ttl_seconds),
               'report', case when x.problem is null then x.report end,
               'problem', x.problem)), '{}')
    from (select rp.owner, rp.reported_at, rp.report, report_problem(rp.report) as problem
          from replicas rp where rp.reported_at is not null) x
$$;

-- The status page's counts that could grow with the fleet stop here (expired leases): the page
-- shows "100,000+" rather than counting on. A count it is given exact (the events held behind
-- failures) shows so above it too.
create or replace function ui_count_cap() returns int
language sql immutable parallel safe
set search_path from current
as $$ select 100000 $$;

-- The figures of the page that stay cheap at any backlog: status()'s own (status_figures,
-- functions_ops.sql), the count among them that could grow stopped at the cap. Not status()'s
-- runs_delivered_last_minute, which reads every active run due later than a minute ago (at
-- millions of runs backing off, too much for each refresh): the page shows the fleet's rate.
create or replace function ui_figures(p_now timestamptz) returns jsonb
language sql volatile
set search_path from current
as $$
    select status_figures(p_now, ui_count_cap())
$$;

-- The page lists the blocked runs through blocked_runs_json (functions_ops.sql), as status().
drop function if exists ui_blocked_runs(int, int, timestamptz);

-- The status page's refresh (issue 32, item 3: it must cost little at millions of pending
-- events). Not `status()`, whose lanes and blocked totals (backlog()) cost a probe of the
-- outbox per active run: the page takes those totals from the backlog gauges the health loop
-- already refreshes (spaced by their own cost) and says how old they are; here are status()'s
-- other figures (ui_figures), the blocked runs paged (blocked_runs_json: p_blocked_offset,
-- capped at 10,000, at most p_blocked_limit, oldest failure first), how long the outbox's
-- current part has taken new events (outbox_part_age) and each replica's last report
-- (ui_reports). One statement; the page keeps its answer a second or two.
create or replace function ui_status(
    p_blocked_limit int, p_blocked_offset int, p_ttl_seconds float8
) returns jsonb
language plpgsql volatile
set search_path from current
security definer
as $$
declare
    v_now timestamptz := clock_timestamp();
    v_offset int := least(greatest(coalesce(p_blocked_offset, 0), 0), 10000);
    v_limit int := least(greatest(coalesce(p_blocked_limit, 50), 0), 500);
begin
    return ui_figures(v_now) || jsonb_build_object(
        'db_now', v_now,
        'count_cap', ui_count_cap(),
        'blocked_offset', v_offset,
        'blocked_runs', blocked_runs_json(v_offset, v_limit, v_now),
        'outbox_part_age_seconds', outbox_part_age(),
        'reports', ui_reports(p_ttl_seconds));
end
$$;

-- The run page: the run's scheduling state (inspect_run_summary) and its events in seq order
-- from p_from_seq, at most p_limit (inspect_run: a primary-key range scan), as one document —
-- never a payload. Raises P0002 for an unknown run. One statement.
create or replace function ui_run(p_run_id text, p_from_seq bigint, p_limit int)
returns jsonb
language plpgsql stable
set search_path from current
security definer
as $$
begin
    return jsonb_build_object(
        'run', (select to_jsonb(s) from inspect_run_summary(p_run_id) s),
        'events', coalesce((
            select jsonb_agg(to_jsonb(e) order by e.seq)
            from inspect_run(p_run_id, p_from_seq,
                             least(greatest(coalesce(p_limit, 200), 1), 1000)) e), '[]'));
end
$$;
