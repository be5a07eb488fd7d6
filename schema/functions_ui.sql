-- ledger-relay status page (issue 17, relay/ui/): the replica reports behind it and its two
-- read-only queries. Applied with the other functions*.sql by `relay migrate`, search_path
-- pinned like functions.sql. `security definer` like the functions `relay run` calls, so the
-- relay role needs only EXECUTE on them (relay/roles.py).

-- A replica's own report: its counters and ingress health, into the `replicas` row its liveness
-- lock created (never a new row: see 0005_replica_reports.sql). Returns every replica's
-- cumulative delivered count per lane from reports younger than p_ttl_seconds, as
-- {"owner": {"critical": n, "ordinary": n}}: the status page's rate series are the differences
-- between two such answers, so a replica learns the fleet's rates with the one statement it
-- sends anyway. A report is a small object (at most 8 kB).
create or replace function report_replica(p_owner text, p_report jsonb, p_ttl_seconds float8)
returns jsonb
language plpgsql volatile
set search_path from current
security definer
as $$
declare
    v_now timestamptz := clock_timestamp();
begin
    if p_owner is null or p_owner = '' then
        raise exception 'relay.report_replica: owner must be a non-empty string'
            using errcode = '22023';
    end if;
    if jsonb_typeof(p_report) is distinct from 'object' or length(p_report::text) > 8192 then
        raise exception 'relay.report_replica: the report must be a JSON object under 8 kB'
            using errcode = '22023';
    end if;
    update replicas set reported_at = v_now, report = p_report where owner = p_owner;
    return coalesce((
        select jsonb_object_agg(rp.owner, jsonb_build_object(
                   'critical', coalesce((rp.report #>> '{lanes,critical,delivered}')::bigint, 0),
                   'ordinary', coalesce((rp.report #>> '{lanes,ordinary,delivered}')::bigint, 0)))
        from replicas rp
        where rp.reported_at > v_now - make_interval(secs => p_ttl_seconds)
           or rp.owner = p_owner), '{}');
end
$$;

-- The status page's refresh: `status()` (the document `relay status --json` prints) with the
-- blocked runs paged (p_blocked_offset, at most p_blocked_limit of them, oldest failure first;
-- the offset is capped at 10,000 so a page never costs more than that many index entries), and
-- each replica's last report with its age. One statement.
create or replace function ui_status(
    p_blocked_limit int, p_blocked_offset int, p_ttl_seconds float8
) returns jsonb
language plpgsql volatile
set search_path from current
security definer
as $$
declare
    v_offset int := least(greatest(coalesce(p_blocked_offset, 0), 0), 10000);
    v_limit int := least(greatest(coalesce(p_blocked_limit, 50), 0), 500);
    v_status jsonb := status(v_offset + v_limit);
begin
    return v_status || jsonb_build_object(
        'blocked_offset', v_offset,
        'blocked_runs', coalesce((
            select jsonb_agg(b.x order by b.i)
            from jsonb_array_elements(v_status -> 'blocked_runs') with ordinality b(x, i)
            where b.i > v_offset), '[]'),
        'reports', coalesce((
            select jsonb_object_agg(rp.owner, jsonb_build_object(
                       'reported_at', rp.reported_at,
                       'age_seconds',
                           extract(epoch from clock_timestamp() - rp.reported_at)::float8,
                       'stale', rp.reported_at
                                <= clock_timestamp() - make_interval(secs => p_ttl_seconds),
                       'report', rp.report))
            from replicas rp where rp.reported_at is not null), '{}'));
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
