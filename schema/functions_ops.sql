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
    v_key text;
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
    returning r.blocked_seq, r.fairness_key into v_blocked, v_key;
    if found and v_key <> '' then
        perform note_fairness_key(v_key);  -- the run is active again (schema version 10)
    end if;
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

-- Makes runs that are backing off due now (internal): the run p_run_id, or (p_run_id null) every
-- run whose last failed attempt ended at or after p_since (null: any time). Backing off: active,
-- not blocked, no lease, after a failed attempt (attempts > 0), and not due yet. Only
-- next_attempt_at moves, to now, and the run's next attempt is let past the relays' retry
-- budget (retry_waived, which claim returns and that attempt's end clears: schema version 11),
-- and nothing else: the failed attempts stay counted (the backoff grows on if the next one fails
-- too), updated_at stays the time of the last failure (the release that scheduled the backoff
-- wrote it last: nothing writes an unleased, unblocked run until it is claimed). A run with a lease is not backing off, whoever holds it, so a live
-- owner's run is never touched (its next_attempt_at is its lease's expiry, which claim reads).
-- The update re-checks these conditions on the row it locks (the lock claim, ack and release
-- take), so a run claimed meanwhile is left alone. Each run made due notifies the terminal
-- channel with kind `run_due` (a relay's listener takes it as a wake), and who asked, so the
-- relays claim it at once rather than at the next safety-net poll. The waiver is the row's, not
-- the notification's: a relay that claims the run before the notification reaches it, or whose
-- LISTEN was down, sends it past the budget all the same (relays of version 10 and before keep
-- a waiver in memory from the notification). Through the partial index
-- of due runs (runs_due): active runs due after now, never the idle ones nor the outbox.
-- Returns the runs made due (in no order): their failed attempts, the last failure's status,
-- error and time, and when they would have been due.
create or replace function make_due(p_run_id text, p_since timestamptz, p_by text)
returns table (run_id text, attempts int, last_status int, last_error text,
               failed_at timestamptz, was_due_at timestamptz)
language plpgsql volatile
set search_path from current
as $$
declare
    v_now timestamptz := clock_timestamp();
    v_due record;
begin
    for v_due in
        update runs r
        set next_attempt_at = v_now, retry_waived = true
        from runs was
        where was.run_id = r.run_id
          and (p_run_id is null or r.run_id = p_run_id)
          and (p_since is null or r.updated_at >= p_since)
          and not r.idle and r.blocked_seq is null and r.lease_token is null
          and r.attempts > 0 and r.next_attempt_at > v_now
        returning r.run_id, r.attempts, r.last_status, r.last_error, r.updated_at,
                  was.next_attempt_at
    loop
        perform pg_notify(terminal_channel(), json_build_object(
            'kind', 'run_due', 'run_id', v_due.run_id, 'by', p_by)::text);
        run_id := v_due.run_id;
        attempts := v_due.attempts;
        last_status := v_due.last_status;
        last_error := v_due.last_error;
        failed_at := v_due.updated_at;
        was_due_at := v_due.next_attempt_at;
        return next;
    end loop;
end
$$;

-- Operator: the run p_run_id, backing off after a failed attempt, is due now (make_due): its
-- next attempt starts as soon as a relay claims it, instead of after its backoff (up to
-- max_backoff). Raises naming the run's state when it is not backing off (a blocked run's
-- failed event is retried with retry_run).
create or replace function retry_run_now(p_run_id text, p_by text)
returns table (run_id text, attempts int, last_status int, last_error text,
               failed_at timestamptz, was_due_at timestamptz)
language plpgsql volatile
set search_path from current
as $$
declare
    v_run runs%rowtype;
begin
    perform check_operator('retry_run_now', p_by);
    if p_run_id is null or p_run_id = '' then
        raise exception 'relay.retry_run_now: run_id must be a non-empty string'
            using errcode = '22023';
    end if;
    return query select * from make_due(p_run_id, null, p_by);
    if found then
        return;
    end if;
    select * into v_run from runs r where r.run_id = p_run_id;
    if not found then
        raise exception 'relay.retry_run_now: no run %', p_run_id using errcode = 'P0002';
    end if;
    raise exception 'relay.retry_run_now: run % is not backing off: %', p_run_id,
        case
            when v_run.blocked_seq is not null then
                'it is blocked at seq ' || v_run.blocked_seq || ' (retry its failed event)'
            when v_run.idle then 'it is idle (nothing pending)'
            when v_run.lease_token is not null and v_run.lease_expires_at > clock_timestamp()
                then 'a relay holds its lease (' || v_run.lease_owner || ')'
            when v_run.attempts = 0 then 'no attempt of it failed'
            else 'it is due already' end
        using errcode = '55000';
end
$$;

-- Operator: every run backing off after a failed attempt that ended at or after p_since (null:
-- any) is due now (make_due): after an ingress outage, the runs go out again at once instead
-- of each after its backoff. Returns the runs made due (none is not an error).
create or replace function retry_backing_off(p_since timestamptz, p_by text)
returns table (run_id text, attempts int, last_status int, last_error text,
               failed_at timestamptz, was_due_at timestamptz)
language plpgsql volatile
set search_path from current
as $$
begin
    perform check_operator('retry_backing_off', p_by);
    return query select * from make_due(null, p_since, p_by) d order by d.failed_at, d.run_id;
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

-- A fairness key's weight (schema version 9; docs/design.md "Scheduling: fair shares between
-- keys"): among the keys with due work, each lane shares its claims in proportion to the
-- weights, 1 to 1,000 (a key never set has 1). The default key, of runs enqueued without one, is
-- the empty string. The schema owner's: neither the producer nor the relay role may call it
-- (nothing is granted, and `relay migrate` revokes it from PUBLIC). It takes effect at the next
-- claim that shares; the key's pass is kept, so a changed weight earns no credit for the past.
-- Returns the weight it replaced (1 for a key never set).
create or replace function set_fairness_weight(p_key text, p_weight int) returns int
language plpgsql volatile
set search_path from current
as $$
declare
    v_was int;
begin
    if p_key is null or octet_length(p_key) > setting('max_id_bytes')::int then
        raise exception 'relay.set_fairness_weight: p_key must be a string of at most % bytes (the default key is the empty string)',
            setting('max_id_bytes') using errcode = '22023';
    end if;
    if p_weight is null or p_weight not between 1 and 1000 then
        raise exception 'relay.set_fairness_weight: p_weight must be between 1 and 1000, got %',
            coalesce(p_weight::text, 'NULL') using errcode = '22023';
    end if;
    select f.weight into v_was from fairness_keys f where f.key = p_key for update;
    insert into fairness_keys (key, weight) values (p_key, p_weight)
    on conflict (key) do update set weight = excluded.weight;
    return coalesce(v_was, 1);
end
$$;

-- Inspect, part 1: the run's events in seq order (from p_from_seq, at most p_limit of them;
-- null = all), with their delivery history and audit trail, read through the `events` view
-- (0007_delivery_cursor.sql), the one definition of each event's state: filtered on one run,
-- it is a range of the outbox's primary key with a probe of runs, event_failures and
-- event_skips per event. Since schema version 7 `delivered_at` is the run's last delivery (the
-- cursor keeps no time per event: "delivered at or before"), and `attempts` the failed attempts
-- of the event, the successful one not counted: those event_failures kept (a failure, retried
-- since) and, for the run's head while it is not blocked, the run's failed attempts of it
-- since (runs.attempts: counted on the run while it backs off), so the head's count is the
-- run's (inspect_run_summary) and grows with each failed attempt. Its last answer likewise:
-- once the head has failed attempts of its own since (backing off), `last_status` and
-- `last_error` are the run's, the latest answer (issue 49 item 6: inspect showed `-` for a head
-- whose last answer was a 500); else the event's failure kept, if any.
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
        select e.seq, e.event_id, e.event_type, e.terminal, e.state,
               e.attempts + case when e.seq = r.delivered_seq + 1 and r.blocked_seq is null
                                 then r.attempts else 0 end,
               case when e.seq = r.delivered_seq + 1 and r.blocked_seq is null
                         and r.attempts > 0 then r.last_status else e.last_status end,
               case when e.seq = r.delivered_seq + 1 and r.blocked_seq is null
                         and r.attempts > 0 then r.last_error else e.last_error end,
               e.created_at, e.delivered_at, e.failed_at, e.retried_by,
               e.retried_role, e.retried_at, e.retries, e.skipped_by, e.skipped_role, e.skip_reason,
               case when e.state = 'skipped' then e.done_at end, e.wake_queue, e.wake_event
        from events e
        left join runs r on r.run_id = p_run_id
        where e.run_id = p_run_id and e.seq >= coalesce(p_from_seq, 1)
        order by e.seq
        limit p_limit;
end
$$;

-- Inspect, part 2: the run's scheduling state — lease (owner, expiry, whether it is live on the
-- database clock; never the token), epoch, backoff, block — and its event counts by state.
-- A run whose rows were pruned after retention still has its seq counter: the row says so
-- (run fields null, events_total 0).
-- The counts come from the cursor, as the `events` view defines the states, not from a pass
-- over the view: the events after the cursor are never pruned and their seqs are contiguous,
-- so they are the run's highest seq less its cursor, one of them failed when the run is blocked
-- and the others pending; the skipped ones are the run's event_skips still in the outbox; the
-- rest of the outbox's events of the run are delivered. One count of the run's range of the
-- primary key (events_total), a probe for its highest seq and blocked head.
-- last_seq is the run's last seq: the highest in the outbox or, once retention removed them,
-- its terminal seq (a finished run ends there), its cursor (retention removes only events at or
-- below it, schema version 8), or the floor run_seqs.last_seq a version-7 retention left.
-- retry_waived: an operator's `relay retry` made the run due and its next attempt goes past the
-- relays' retry budget (make_due; schema version 11 added it, last).
create or replace function inspect_run_summary(p_run_id text)
returns table (
    run_id text, idle boolean, epoch bigint, lease_owner text, lease_expires_at timestamptz,
    lease_live boolean, next_attempt_at timestamptz, attempts int, last_error text,
    blocked_seq bigint, blocked_event_id text, critical boolean, updated_at timestamptz,
    last_seq bigint, terminal_seq bigint, events_total bigint, pending bigint,
    delivered bigint, failed bigint, skipped bigint, db_now timestamptz, retry_waived boolean
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
               r.next_attempt_at,
               -- the head's failed attempts, as inspect_run counts them: a blocked run's are
               -- its failed event's (the run's and the one that failed it, block_event)
               (coalesce(f.attempts, 0)
                + case when r.blocked_seq is null then r.attempts else 0 end)::int,
               r.last_error, r.blocked_seq,
               h.event_id,
               -- the terminal event is pending: after the cursor, and not the failed head
               coalesce(s.terminal_seq > r.delivered_seq
                        and s.terminal_seq is distinct from h.seq, false),
               r.updated_at, greatest(s.last_seq, s.terminal_seq, r.delivered_seq, m.last_seq),
               s.terminal_seq,
               c.total, c.after - c.failed, c.total - c.after - c.skipped, c.failed, c.skipped,
               v_now, r.retry_waived
        from (select 1) one
        left join runs r on r.run_id = p_run_id
        left join run_seqs s on s.run_id = p_run_id
        cross join lateral (select max(o.seq) as last_seq from outbox o
                            where o.run_id = p_run_id) m
        left join outbox h on h.run_id = p_run_id and h.seq = r.blocked_seq
                          and h.seq > r.delivered_seq
        left join event_failures f on f.run_id = p_run_id and f.seq = r.delivered_seq + 1
        cross join lateral (
            select t.total,
                   greatest(coalesce(m.last_seq, 0) - coalesce(r.delivered_seq, 0), 0) as after,
                   (h.seq is not null)::int::bigint as failed,
                   (select count(*) from event_skips k
                    join outbox o on o.run_id = k.run_id and o.seq = k.seq
                    where k.run_id = p_run_id) as skipped
            from (select count(*) as total from outbox o where o.run_id = p_run_id) t
        ) c;
end
$$;

-- The blocked runs, oldest failure first, from p_offset (at most p_limit; null: all): each one's
-- failed event (its blocked head: the run's event_failures row at runs.blocked_seq; the table
-- keeps earlier failures as history) and the events it holds back — the pending ones: after the
-- cursor, less the failed one (a run's seqs after its cursor are contiguous and never pruned:
-- its highest seq less its cursor, one probe of the primary key). Through event_failures, in
-- failed_at order (event_failures_failed_at), a probe of runs per failure (the `offset 0` keeps
-- the planner from turning that into a pass over runs): proportional to the failures kept, never
-- to the outbox. status() and the status page (ui_status) list them from here.
create or replace function blocked_runs(p_offset int, p_limit int)
returns table (run_id text, seq bigint, event_id text, failed_at timestamptz, last_status int,
               last_error text, attempts int, held_events bigint)
language sql stable
set search_path from current
as $$
    select f.run_id, f.seq,
           (select o.event_id from outbox o where o.run_id = f.run_id and o.seq = f.seq),
           f.failed_at, f.last_status, f.last_error, f.attempts,
           (select max(p.seq) from outbox p where p.run_id = f.run_id) - r.delivered_seq - 1
    from event_failures f
    cross join lateral (select x.delivered_seq from runs x
                        where x.run_id = f.run_id and x.blocked_seq = f.seq
                        offset 0) r
    order by f.failed_at, f.run_id, f.seq
    offset greatest(coalesce(p_offset, 0), 0)
    limit case when p_limit is not null then greatest(p_limit, 0) end
$$;

-- blocked_runs' rows as the JSON array status() and the status page show.
create or replace function blocked_runs_json(p_offset int, p_limit int, p_now timestamptz)
returns jsonb
language sql stable
set search_path from current
as $$
    select coalesce(jsonb_agg(jsonb_build_object(
               'run_id', b.run_id, 'seq', b.seq, 'event_id', b.event_id,
               'failed_at', b.failed_at,
               'failed_age_seconds', extract(epoch from p_now - b.failed_at)::float8,
               'last_status', b.last_status, 'last_error', b.last_error,
               'attempts', b.attempts, 'held_events', b.held_events)
               order by b.failed_at, b.run_id, b.seq), '[]')
    from blocked_runs(p_offset, p_limit) b
$$;

-- How many runs delivered since p_since: runs whose cursor moved after it (runs.delivered_at).
-- Not a count of events: the cursor keeps when it last moved, not when each event passed it,
-- so a run that delivered ten events counts once.
-- Index-backed, without a pass over runs: after its cursor moved at T a run is written only by
-- statements that set these columns to their own clock or later (the ack, claim, renew,
-- release, settle_run, enqueue, unblock_run, hold_liveness), so
--   idle runs                    updated_at >= T        (runs_idle)
--   active runs, not blocked     next_attempt_at >= T   (runs_due: the ack sets it to its clock,
--                                                      or keeps a live lease's expiry; later
--                                                      writes set a due time or an expiry)
--   blocked runs                 through their failure (event_failures, as blocked_runs)
-- The cost: the runs that went idle after p_since, the active runs due after it (leased,
-- backing off, just enqueued: at most every active run, as backlog() reads them), and the
-- failures kept; never the outbox, nor the idle runs' history.
create or replace function runs_delivered_since(p_since timestamptz)
returns bigint
language sql stable
set search_path from current
as $$
    select count(*) from (
        select 1 from runs r
        where r.idle and r.updated_at > p_since and r.delivered_at > p_since
        union all
        select 1 from runs r
        where not r.idle and r.blocked_seq is null and r.next_attempt_at > p_since
          and r.delivered_at > p_since
        union all
        select 1 from event_failures f
        cross join lateral (select 1 from runs x
                            where x.run_id = f.run_id and x.blocked_seq = f.seq
                              and not x.idle and x.delivered_at > p_since
                            offset 0) b
    ) d
$$;

-- How long a replica's report counts as fresh, in seconds: the status page's REPORT_TTL
-- (relay/serving/ui/data.py, which passes it to ui_reports and report_replica), for status(),
-- which is given none. tests/test_ops.py holds the two equal.
create or replace function report_ttl_seconds() returns float8
language sql immutable parallel safe
set search_path from current
as $$ select 120::float8 $$;

-- A replica's adaptive POST limit as its last report gives it (issue 42): the report's `limit`
-- (report_limit_problem, functions_ui.sql) when the report passes report_problem() and is
-- younger than report_ttl_seconds() at p_now, else null: a replica under post_limit = fixed,
-- of a release before, silent for two minutes, or whose row fails the checks. plpgsql, so
-- that report_problem (functions_ui.sql, created after this file) is looked up when called.
create or replace function replica_limit(
    p_report jsonb, p_reported_at timestamptz, p_now timestamptz
) returns jsonb
language plpgsql immutable
set search_path from current
as $$
begin
    if p_reported_at > p_now - make_interval(secs => report_ttl_seconds())
       and report_problem(p_report) is null then
        return p_report -> 'limit';
    end if;
    return null;
end
$$;

-- A replica's runs claimed by class as its last report gives them (issue 50 item 4), both
-- lanes summed: {"targeted": n, "finished": n, "due": n}, under the same conditions as
-- replica_limit, and null for a report without them (a relay of a release before).
create or replace function replica_claims(
    p_report jsonb, p_reported_at timestamptz, p_now timestamptz
) returns jsonb
language plpgsql immutable
set search_path from current
as $$
declare
    v_claims jsonb;
begin
    if p_reported_at > p_now - make_interval(secs => report_ttl_seconds())
       and report_problem(p_report) is null then
        select jsonb_object_agg(c.name, c.n) into v_claims
        from (select x.name, sum((l.value ->> ('claimed_' || x.name))::bigint) as n
              from jsonb_each(coalesce(p_report -> 'lanes', '{}')) l,
                   unnest(array['targeted', 'finished', 'due']) x(name)
              where l.value ? ('claimed_' || x.name)
              group by x.name) c;
        return v_claims;
    end if;
    return null;
end
$$;

-- The figures `relay status` and the status page (ui_figures) share, each index-backed and
-- none growing with the outbox: pending events held behind failed ones (blocked_runs: one
-- probe per blocked run), live leases per owner and expired ones (runs_leased; the expired
-- ones counted up to p_cap + 1, null: all), replicas by liveness (alive while a session holds
-- the owner's liveness lock, which the shared try-lock, released at commit, tells without
-- taking it from one) with each one's POST limit from its fresh report (replica_limit), and the
-- bytes of each table of the outbox, indexes and TOAST included
-- (`events` is a view since version 7: its rows are in outbox, event_failures, event_skips).
create or replace function status_figures(p_now timestamptz, p_cap int)
returns jsonb
language sql volatile
set search_path from current
as $$
    select jsonb_build_object(
        'held_events', (select coalesce(sum(b.held_events), 0)::bigint
                        from blocked_runs(0, null) b),
        'leases', coalesce((
            select jsonb_agg(jsonb_build_object(
                       'owner', l.lease_owner, 'runs', l.n, 'next_expiry', l.next_expiry)
                   order by l.lease_owner)
            from (select r.lease_owner, count(*) as n, min(r.lease_expires_at) as next_expiry
                  from runs r
                  where r.lease_owner is not null and r.lease_expires_at > p_now
                  group by r.lease_owner) l), '[]'),
        'expired_leases', (select count(*) from (
            select 1 from runs r
            where r.lease_owner is not null and r.lease_expires_at <= p_now
            limit p_cap + 1) x),
        'replicas', coalesce((
            select jsonb_agg(jsonb_build_object(
                       'owner', rp.owner,
                       'alive', not pg_try_advisory_xact_lock_shared(
                           liveness_key_of(rp.owner, rp.incarnation)),
                       'started_at', rp.started_at, 'seen_at', rp.seen_at,
                       'limit', replica_limit(rp.report, rp.reported_at, p_now),
                       'claimed_by_class', replica_claims(rp.report, rp.reported_at, p_now))
                   order by rp.owner)
            from replicas rp), '[]'),
        'tables', jsonb_build_object(
            -- the outbox's three parts (schema version 8): a partitioned table has no storage
            'outbox', (select sum(pg_total_relation_size(t.relid))::bigint
                       from pg_partition_tree('outbox'::regclass) t),
            'event_failures', pg_total_relation_size('event_failures'::regclass),
            'event_skips', pg_total_relation_size('event_skips'::regclass),
            'pending_terminals', pg_total_relation_size('pending_terminals'::regclass),
            'runs', pg_total_relation_size('runs'::regclass),
            'run_seqs', pg_total_relation_size('run_seqs'::regclass)))
$$;

-- `relay status` as one JSON object, on the database clock:
--   lanes            per lane (critical, ordinary): runs and pending events, and the age of the
--                    oldest pending event — from backlog() (functions_ops_metrics.sql), so these
--                    figures are the ones /metrics exports. Runs that are blocked count in no lane.
--   keys             runs with pending events that are not blocked by fairness key, the 10 keys
--                    with the most and the rest as one row whose key is null (backlog_by_key,
--                    issue 50 item 4); the default key is ''
--   blocked          blocked runs, their failed events, the oldest failure's age (backlog()), and
--                    the events held behind them (pending, waiting for an operator)
--   blocked_runs     up to p_blocked_limit of them, oldest failure first: the failed event, its
--                    status and error, and how many events it holds back (blocked_runs)
--   leases           live leases per owner (expired ones are claimable and counted apart)
--   replicas         the replicas that record their liveness, alive or dead (lock held or not);
--                    one that stopped cleanly is forgotten (replica_stopped), so is not listed;
--                    each with its adaptive POST limit as its report of the last two minutes
--                    gives it, or null (replica_limit)
--   runs_delivered_last_minute
--                    runs whose cursor moved in the last minute (runs_delivered_since): each
--                    delivered at least one event in it, however many. Since schema version 7
--                    no delivery time is kept per event, so version 6's `delivered_last_minute`
--                    (events) is gone; the fleet's events per second are the status page's rate
--                    and the delivered_events_total metric (counted by the replicas)
--   tables           bytes of each table of the outbox, indexes and TOAST included
--   outbox_part_age_seconds
--                    how long the outbox's current part has taken new events (outbox_part_age):
--                    retention rotates the parts every retention / 2 (docs/storage.md)
-- Index-backed (status_figures, blocked_runs, runs_delivered_since): no pass over the outbox,
-- whatever its history; the lanes and the last minute cost a few probes per active run.
create or replace function status(p_blocked_limit int default 100)
returns jsonb
language plpgsql volatile
set search_path from current
as $$
declare
    v_now timestamptz := clock_timestamp();
    v_lanes jsonb;
    v_blocked jsonb;
    v_figures jsonb := status_figures(v_now, null);
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
    v_blocked := v_blocked || jsonb_build_object('held_events', v_figures -> 'held_events');

    return (v_figures - 'held_events') || jsonb_build_object(
        'db_now', v_now,
        'runs_delivered_last_minute', runs_delivered_since(v_now - interval '1 minute'),
        'outbox_part_age_seconds', outbox_part_age(),
        'lanes', v_lanes,
        'keys', (select coalesce(jsonb_agg(jsonb_build_object('key', k.key, 'runs', k.runs)),
                                 '[]')
                 from backlog_by_key(10) k),
        'blocked', v_blocked,
        'blocked_runs', blocked_runs_json(0, coalesce(p_blocked_limit, 100), v_now));
end
$$;
