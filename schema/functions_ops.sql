-- ledger-relay operator functions (DESIGN §3 "Operator functions", §8.1): retry or skip a failed
-- event, inspect a run, and the figures behind `relay status`. Applied with the other
-- functions*.sql by `relay migrate`, search_path pinned like functions.sql. `relay retry`,
-- `relay skip`, `relay inspect` and `relay status` (relay/ops/) call them; so can psql.
--
-- Safe while relays run: retry and skip change only a failed event and its blocked run, and no
-- relay holds or takes a lease on a blocked run (fail_event cleared the lease, claim skips
-- blocked runs). They lock the run row first and then the event, the order ack and fail_event
-- use, so they cannot deadlock with a relay. After unblocking they notify the terminal channel
-- with kind `run_unblocked`, which a relay's listener takes as a wake (a discovery pass), so the
-- rest of the run goes out at once rather than at the next safety-net poll.
--
-- Errors start with "relay.<function>:" and name what is wrong; they change nothing. SQLSTATEs:
--   22023 invalid_parameter_value           missing or over-long id, who or reason
--   P0002 no_data_found                     no such event / run
--   55000 object_not_in_prerequisite_state  the event is not failed / the run is not blocked

-- Lifts a run's block after its failed event was retried or skipped (internal): a run has one
-- failed event, its blocked head (schema version 7), so the block goes. The backoff of the failed head is forgotten (attempts 0, due now), and `idle`
-- goes false, which is always safe: a run with nothing pending is settled by the next claim.
-- A live lease (none should exist on a blocked run) keeps its expiry as the due time, because
-- claim relies on next_attempt_at = lease_expires_at while leased.
create or replace function unblock_run(p_run_id text) returns bigint
language plpgsql volatile
set search_path from current
as $$
declare
    v_blocked bigint;
begin
    update runs r
    set blocked_seq = null,
        attempts = 0,
        last_error = null,
        idle = false,
        next_attempt_at = case
            when r.lease_token is not null and r.lease_expires_at > clock_timestamp()
                then r.lease_expires_at
            else clock_timestamp() end,
        updated_at = clock_timestamp()
    where r.run_id = p_run_id
    returning r.blocked_seq into v_blocked;
    if v_blocked is null then
        perform pg_notify(terminal_channel(),
            json_build_object('kind', 'run_unblocked', 'run_id', p_run_id)::text);
    end if;
    return v_blocked;
end
$$;

-- Validation shared by retry and skip: who acts is required (the audit trail names them).
create or replace function check_operator(p_fn text, p_by text) returns void
language plpgsql immutable
set search_path from current
as $$
begin
    if p_by is null or btrim(p_by) = '' then
        raise exception 'relay.%: who acts must be given (p_by is empty)', p_fn
            using errcode = '22023';
    end if;
    if char_length(p_by) > 200 then
        raise exception 'relay.%: p_by is % characters, over the limit of 200', p_fn,
            char_length(p_by) using errcode = '22023';
    end if;
end
$$;

-- Locks the failed event `p_event_id` (run row first) and returns its run and seq, or raises
-- naming why it cannot be acted on (internal). Returns plain columns, not the `events` row type:
-- pg_get_functiondef prints a table type schema-qualified or not depending on the caller's
-- search_path, which would make `relay migrate` see drift that is not there.
create or replace function lock_failed_event(
    p_fn text, p_verb text, p_event_id text, out o_run_id text, out o_seq bigint
)
language plpgsql volatile
set search_path from current
as $$
declare
    v_run text;
    v_ev events%rowtype;
begin
    if p_event_id is null or p_event_id = '' then
        raise exception 'relay.%: event_id must be a non-empty string', p_fn using errcode = '22023';
    end if;
    select e.run_id into v_run from events e where e.event_id = p_event_id;
    if not found then
        raise exception 'relay.%: no event with event_id % (unknown, or delivered and pruned)',
            p_fn, p_event_id using errcode = 'P0002';
    end if;
    -- The run row's lock is the one ack and fail_event take: it holds the event's state still.
    perform 1 from runs r where r.run_id = v_run for update;
    select * into v_ev from events e where e.event_id = p_event_id;
    if not found then
        raise exception 'relay.%: no event with event_id % (pruned meanwhile)', p_fn, p_event_id
            using errcode = 'P0002';
    end if;
    if v_ev.state <> 'failed' then
        raise exception 'relay.%: event % (run %, seq %) is %, not failed: only a failed event can be %',
            p_fn, p_event_id, v_ev.run_id, v_ev.seq, v_ev.state, p_verb
            using errcode = '55000',
                  hint = case v_ev.state
                      when 'pending' then 'it is waiting for delivery'
                      when 'delivered' then 'it was delivered at ' || v_ev.delivered_at::text
                      else 'it was skipped by ' || coalesce(v_ev.skipped_by, '?') || ': '
                           || coalesce(v_ev.skip_reason, '') end;
    end if;
    o_run_id := v_ev.run_id;
    o_seq := v_ev.seq;
end
$$;

-- The result of these four gained the operator's database role (version 4): a result type
-- cannot change in place, so they are dropped and re-created here, in the one transaction that
-- re-applies the functions (callers see the old ones or the new, never none).
drop function if exists retry_run(text, text);
drop function if exists retry_event(text, text);
drop function if exists skip_event(text, text, text);
drop function if exists inspect_run(text, bigint, int);

-- Operator: a failed event goes back to pending (its attempts, last error and failure time are
-- kept as history; who retried it and when is recorded), and its run is unblocked, so the relay
-- delivers it and then the rest of the run, in seq order. Returns the event after the change
-- and the run's blocked_seq (null: unblocked).
create or replace function retry_event(p_event_id text, p_by text)
returns table (run_id text, seq bigint, event_id text, state text, attempts int, retries int,
               retried_by text, retried_role text, retried_at timestamptz, blocked_seq bigint)
language plpgsql volatile
set search_path from current
as $$
declare
    v_run text;
    v_seq bigint;
    v_blocked bigint;
begin
    perform check_operator('retry_event', p_by);
    select l.o_run_id, l.o_seq into v_run, v_seq
    from lock_failed_event('retry_event', 'retried', p_event_id) l;
    update event_failures f
    set retried_by = p_by, retried_role = session_user, retried_at = clock_timestamp(),
        retries = f.retries + 1
    where f.run_id = v_run and f.seq = v_seq;
    v_blocked := unblock_run(v_run);
    return query
        select e.run_id, e.seq, e.event_id, e.state, e.attempts, e.retries, e.retried_by,
               e.retried_role, e.retried_at, v_blocked
        from events e where e.run_id = v_run and e.seq = v_seq;
end
$$;

-- Operator: retries the failed event that blocks run `p_run_id` (see retry_event).
create or replace function retry_run(p_run_id text, p_by text)
returns table (run_id text, seq bigint, event_id text, state text, attempts int, retries int,
               retried_by text, retried_role text, retried_at timestamptz, blocked_seq bigint)
language plpgsql volatile
set search_path from current
as $$
declare
    v_seq bigint;
    v_event text;
begin
    perform check_operator('retry_run', p_by);
    if p_run_id is null or p_run_id = '' then
        raise exception 'relay.retry_run: run_id must be a non-empty string' using errcode = '22023';
    end if;
    select r.blocked_seq into v_seq from runs r where r.run_id = p_run_id for update;
    if not found then
        raise exception 'relay.retry_run: no run %', p_run_id using errcode = 'P0002';
    end if;
    if v_seq is null then
        raise exception 'relay.retry_run: run % is not blocked: nothing to retry', p_run_id
            using errcode = '55000';
    end if;
    select e.event_id into v_event from events e
    where e.run_id = p_run_id and e.seq = v_seq and e.state = 'failed';
    if not found then
        raise exception 'relay.retry_run: run % is blocked at seq %, which is not a failed event',
            p_run_id, v_seq using errcode = '55000';
    end if;
    return query select * from retry_event(v_event, p_by);
end
$$;

-- Operator: a failed event is skipped — never sent — with who, why and when (event_skips), the
-- run's cursor moves past it (it is done, like a delivered event), and its run is unblocked so
-- the rest is delivered in order.
create or replace function skip_event(p_event_id text, p_by text, p_reason text)
returns table (run_id text, seq bigint, event_id text, state text, skipped_by text,
               skipped_role text, skip_reason text, skipped_at timestamptz, blocked_seq bigint)
language plpgsql volatile
set search_path from current
as $$
declare
    v_run text;
    v_seq bigint;
    v_blocked bigint;
begin
    perform check_operator('skip_event', p_by);
    if p_reason is null or btrim(p_reason) = '' then
        raise exception 'relay.skip_event: a reason is required (p_reason is empty)'
            using errcode = '22023';
    end if;
    if char_length(p_reason) > 2000 then
        raise exception 'relay.skip_event: p_reason is % characters, over the limit of 2000',
            char_length(p_reason) using errcode = '22023';
    end if;
    select l.o_run_id, l.o_seq into v_run, v_seq
    from lock_failed_event('skip_event', 'skipped', p_event_id) l;
    insert into event_skips (run_id, seq, skipped_by, skipped_role, skip_reason)
    values (v_run, v_seq, p_by, session_user, p_reason);
    update runs r set delivered_seq = greatest(r.delivered_seq, v_seq)
    where r.run_id = v_run;
    delete from pending_terminals t where t.run_id = v_run and t.seq <= v_seq;
    v_blocked := unblock_run(v_run);
    return query
        select e.run_id, e.seq, e.event_id, e.state, e.skipped_by, e.skipped_role, e.skip_reason,
               e.done_at, v_blocked
        from events e where e.run_id = v_run and e.seq = v_seq;
end
$$;

-- Inspect, part 1: the run's events in seq order (from p_from_seq, at most p_limit of them;
-- null = all), with their delivery history and audit trail. Primary-key range scan.
create or replace function inspect_run(
    p_run_id text, p_from_seq bigint default 1, p_limit int default null
) returns table (
    seq bigint, event_id text, event_type text, terminal boolean, state text, attempts int,
    last_status int, last_error text, created_at timestamptz, delivered_at timestamptz,
    failed_at timestamptz, retried_by text, retried_role text, retried_at timestamptz, retries int,
    skipped_by text, skipped_role text, skip_reason text, skipped_at timestamptz, wake_queue text,
    wake_event text
)
language plpgsql stable
set search_path from current
as $$
begin
    if not exists (select 1 from runs r where r.run_id = p_run_id)
       and not exists (select 1 from run_seqs s where s.run_id = p_run_id) then
        raise exception 'relay.inspect_run: no run %', p_run_id using errcode = 'P0002';
    end if;
    return query
        select e.seq, e.event_id, e.event_type, e.terminal, e.state, e.attempts, e.last_status,
               e.last_error, e.created_at, e.delivered_at, e.failed_at, e.retried_by,
               e.retried_role, e.retried_at, e.retries, e.skipped_by, e.skipped_role, e.skip_reason,
               case when e.state = 'skipped' then e.done_at end, e.wake_queue, e.wake_event
        from events e
        where e.run_id = p_run_id and e.seq >= coalesce(p_from_seq, 1)
        order by e.seq
        limit p_limit;
end
$$;

-- Inspect, part 2: the run's scheduling state — lease (owner, expiry, whether it is live on the
-- database clock; never the token), epoch, backoff, block — and its event counts by state.
-- A run whose rows were pruned after retention still has its seq counter: the row says so
-- (run fields null, events_total 0).
create or replace function inspect_run_summary(p_run_id text)
returns table (
    run_id text, idle boolean, epoch bigint, lease_owner text, lease_expires_at timestamptz,
    lease_live boolean, next_attempt_at timestamptz, attempts int, last_error text,
    blocked_seq bigint, blocked_event_id text, critical boolean, updated_at timestamptz,
    last_seq bigint, terminal_seq bigint, events_total bigint, pending bigint,
    delivered bigint, failed bigint, skipped bigint, db_now timestamptz
)
language plpgsql stable
set search_path from current
as $$
declare
    v_now timestamptz := clock_timestamp();
begin
    if not exists (select 1 from runs r where r.run_id = p_run_id)
       and not exists (select 1 from run_seqs s where s.run_id = p_run_id) then
        raise exception 'relay.inspect_run_summary: no run %', p_run_id using errcode = 'P0002';
    end if;
    return query
        select p_run_id, r.idle, r.epoch, r.lease_owner, r.lease_expires_at,
               coalesce(r.lease_token is not null and r.lease_expires_at > v_now, false),
               r.next_attempt_at, r.attempts, r.last_error, r.blocked_seq,
               (select b.event_id from events b
                where b.run_id = p_run_id and b.seq = r.blocked_seq),
               coalesce((select t.state = 'pending' from events t
                         where t.run_id = p_run_id and t.seq = s.terminal_seq), false),
               r.updated_at, s.last_seq, s.terminal_seq,
               c.total, c.pending, c.delivered, c.failed, c.skipped, v_now
        from (select 1) one
        left join runs r on r.run_id = p_run_id
        left join run_seqs s on s.run_id = p_run_id
        cross join lateral (
            select count(*) as total,
                   count(*) filter (where e.state = 'pending') as pending,
                   count(*) filter (where e.state = 'delivered') as delivered,
                   count(*) filter (where e.state = 'failed') as failed,
                   count(*) filter (where e.state = 'skipped') as skipped
            from events e where e.run_id = p_run_id
        ) c;
end
$$;

-- `relay status` as one JSON object, on the database clock:
--   lanes            per lane (critical, ordinary): runs and pending events, and the age of the
--                    oldest pending event — from backlog() (functions_ops_metrics.sql), so these
--                    figures are the ones /metrics exports. Runs that are blocked count in no lane.
--   blocked          blocked runs, their failed events, the oldest failure's age, and the events
--                    held behind them (pending, waiting for an operator)
--   blocked_runs     up to p_blocked_limit of them, oldest failure first: the failed event, its
--                    status and error, and how many events it holds back
--   leases           live leases per owner (expired ones are claimable and counted apart)
--   replicas         the replicas that record their liveness, alive or dead (lock held or not)
--   delivered_last_minute, tables (bytes of each outbox table, indexes and TOAST included)
-- Index-backed: failed events through events_failed, leases through runs_leased, recent
-- deliveries through events_done, held events through events_pending.
create or replace function status(p_blocked_limit int default 100)
returns jsonb
language plpgsql volatile
set search_path from current
as $$
declare
    v_now timestamptz := clock_timestamp();
    v_lanes jsonb;
    v_blocked jsonb;
begin
    select coalesce(jsonb_agg(jsonb_build_object(
               'lane', b.lane, 'runs', b.runs, 'events', b.events,
               'oldest_pending_age_seconds', b.oldest_age_seconds) order by b.lane)
               filter (where b.lane <> 'blocked'), '[]'),
           (jsonb_agg(jsonb_build_object(
               'runs', b.runs, 'events', b.events,
               'oldest_failure_age_seconds', b.oldest_age_seconds))
               filter (where b.lane = 'blocked')) -> 0
    into v_lanes, v_blocked
    from backlog() b;
    v_blocked := coalesce(v_blocked, jsonb_build_object(
        'runs', 0, 'events', 0, 'oldest_failure_age_seconds', 0));
    v_blocked := v_blocked || jsonb_build_object('held_events',
        (select count(*) from events f
         join events p on p.run_id = f.run_id and p.state = 'pending'
         where f.state = 'failed'));

    return jsonb_build_object(
        'db_now', v_now,
        'lanes', v_lanes,
        'blocked', v_blocked,
        'blocked_runs', coalesce((
            select jsonb_agg(jsonb_build_object(
                       'run_id', x.run_id, 'seq', x.seq, 'event_id', x.event_id,
                       'failed_at', x.failed_at,
                       'failed_age_seconds', extract(epoch from v_now - x.failed_at)::float8,
                       'last_status', x.last_status, 'last_error', x.last_error,
                       'attempts', x.attempts, 'held_events', x.held)
                   order by x.failed_at, x.run_id, x.seq)
            from (
                select f.run_id, f.seq, f.event_id, f.failed_at, f.last_status, f.last_error,
                       f.attempts,
                       (select count(*) from events p
                        where p.run_id = f.run_id and p.state = 'pending') as held
                from events f
                where f.state = 'failed'
                order by f.failed_at, f.run_id, f.seq
                limit greatest(coalesce(p_blocked_limit, 100), 0)
            ) x), '[]'),
        'leases', coalesce((
            select jsonb_agg(jsonb_build_object(
                       'owner', l.lease_owner, 'runs', l.n,
                       'next_expiry', l.next_expiry) order by l.lease_owner)
            from (
                select r.lease_owner, count(*) as n, min(r.lease_expires_at) as next_expiry
                from runs r
                where r.lease_owner is not null and r.lease_expires_at > v_now
                group by r.lease_owner
            ) l), '[]'),
        -- Replicas by liveness (issue 18): alive while a session holds the owner's liveness
        -- lock, which the shared try-lock (released at commit) tells without taking it from one.
        'replicas', coalesce((
            select jsonb_agg(jsonb_build_object(
                       'owner', rp.owner,
                       'alive', not pg_try_advisory_xact_lock_shared(liveness_key(rp.owner)),
                       'started_at', rp.started_at, 'seen_at', rp.seen_at)
                   order by rp.owner)
            from replicas rp), '[]'),
        'expired_leases', (select count(*) from runs r
                           where r.lease_owner is not null and r.lease_expires_at <= v_now),
        'delivered_last_minute', (select count(*) from events d
                                  where d.done_at > v_now - interval '1 minute'
                                    and d.state = 'delivered'),
        'tables', jsonb_build_object(
            'events', pg_total_relation_size('events'::regclass),
            'runs', pg_total_relation_size('runs'::regclass),
            'run_seqs', pg_total_relation_size('run_seqs'::regclass))
    );
end
$$;
