-- ledger-relay SQL functions. Re-applied by `relay migrate` whenever the shipped text or the
-- bodies in the database drift. Applied with search_path = <schema>, pg_catalog, pg_temp; every
-- function pins that path (`set search_path from current`), so the schema name is configurable
-- without templating and no caller's search_path (or temporary table) can redirect it.
--
-- Least privilege (docs/security.md): the functions producers call (enqueue, enqueue_many) and
-- the ones `relay run` calls (claim, renew, release, fail_event, ack, prune, backlog) are
-- `security definer`: they run as the schema's owner, so the producer and relay roles need
-- EXECUTE on them and no privilege on any table. That is safe only because every one of them
-- pins search_path with pg_temp last and builds no SQL from its arguments. `relay migrate`
-- revokes EXECUTE on every function here from PUBLIC each time it (re-)applies them.
--
-- Error messages start with "relay." and name the offending argument; SQLSTATEs:
--   22023 invalid_parameter_value   bad input (nothing inserted)
--   23505 unique_violation          same event_id, different content or another run
--   55000 object_not_in_prerequisite_state  event after the terminal event / not failed
--   55P03 lock_not_available        waited too long for another writer of the same run (retry)

-- The advisory-lock key of a run: namespaced by schema so two relay schemas never contend.
create or replace function run_lock_key(p_run_id text) returns bigint
language sql immutable parallel safe
set search_path from current
as $$ select hashtextextended(current_schema() || chr(31) || p_run_id, 0) $$;

-- run_lock_key of each run id, in order, in one call: a call of a function that pins its
-- search_path costs ~5 us (it is never inlined), once per run in a 64-run ack. Same key as
-- run_lock_key (tests/test_lease_sql.py checks they agree).
create or replace function run_lock_keys(p_run_ids text[]) returns bigint[]
language sql immutable parallel safe
set search_path from current
as $$
    select array(select hashtextextended(current_schema() || chr(31) || u.run_id, 0)
                 from unnest(p_run_ids) with ordinality as u(run_id, i) order by u.i)
$$;

-- The advisory-lock key of a replica's liveness (issue 18): held as a session lock by the
-- replica's LISTEN connection for as long as its process lives. Namespaced by schema too.
create or replace function liveness_key(p_owner text) returns bigint
language sql immutable parallel safe
set search_path from current
as $$ select hashtextextended('ledger-relay:live:' || current_schema() || ':' || p_owner, 0) $$;

create or replace function terminal_channel() returns text
language sql stable parallel safe
set search_path from current
as $$ select current_schema() || '_terminal' $$;

create or replace function setting(p_key text) returns text
language sql stable
set search_path from current
as $$ select value from settings where key = p_key $$;

-- Producer API -----------------------------------------------------------------------------

create or replace function enqueue(
    p_run_id text,
    p_event_id text,
    p_event_type text,
    p_payload jsonb,
    p_terminal boolean default false,
    p_wake_queue text default null,
    p_wake_event text default null,
    p_traceparent text default null
) returns bigint
language plpgsql volatile
set search_path from current
security definer
as $$
declare
    v_max_id int := setting('max_id_bytes')::int;
    v_max_payload int := setting('max_payload_bytes')::int;
    v_old_timeout text;
    v_existing events%rowtype;
    v_seq bigint;
    v_terminal_seq bigint;
    v_notify text;
begin
    -- Validation first: bad input raises before anything is written.
    if p_run_id is null or p_run_id = '' then
        raise exception 'relay.enqueue: run_id must be a non-empty string' using errcode = '22023';
    end if;
    if p_event_id is null or p_event_id = '' then
        raise exception 'relay.enqueue: event_id must be a non-empty string' using errcode = '22023';
    end if;
    if p_event_type is null or p_event_type = '' then
        raise exception 'relay.enqueue: event_type must be a non-empty string' using errcode = '22023';
    end if;
    if octet_length(p_run_id) > v_max_id or octet_length(p_event_id) > v_max_id
            or octet_length(p_event_type) > v_max_id then
        raise exception 'relay.enqueue: run_id, event_id and event_type must be at most % bytes', v_max_id
            using errcode = '22023';
    end if;
    if p_payload is null or jsonb_typeof(p_payload) <> 'object' then
        raise exception 'relay.enqueue: payload must be a JSON object, got %',
            coalesce(jsonb_typeof(p_payload), 'NULL') using errcode = '22023';
    end if;
    if octet_length(p_payload::text) > v_max_payload then
        raise exception 'relay.enqueue: payload of event % is % bytes, over the limit of % bytes',
            p_event_id, octet_length(p_payload::text), v_max_payload using errcode = '22023';
    end if;
    if p_terminal is null then
        raise exception 'relay.enqueue: terminal must be true or false, not NULL' using errcode = '22023';
    end if;
    if (p_wake_queue is null) <> (p_wake_event is null) then
        raise exception 'relay.enqueue: wake_queue and wake_event must be given together (got only %)',
            case when p_wake_queue is null then 'wake_event' else 'wake_queue' end
            using errcode = '22023';
    end if;
    if p_wake_queue = '' or p_wake_event = '' then
        raise exception 'relay.enqueue: wake_queue and wake_event must be non-empty' using errcode = '22023';
    end if;
    -- Bounded like the ids: Absurd keys its events by name (a btree entry), so an oversized
    -- wake_event would commit here and then fail every ack of its run. Messages quote nothing
    -- of the oversized value.
    if octet_length(p_wake_queue) > 57 then
        raise exception 'relay.enqueue: wake_queue of event % is % bytes, over Absurd''s limit of 57',
            left(p_event_id, 200), octet_length(p_wake_queue) using errcode = '22023';
    end if;
    if octet_length(p_wake_event) > 1024 then  -- room for `run-created:<a 200-byte run id>`
        raise exception 'relay.enqueue: wake_event of event % is % bytes, over the limit of 1024 bytes',
            left(p_event_id, 200), octet_length(p_wake_event) using errcode = '22023';
    end if;
    if octet_length(p_traceparent) > 55 then
        raise exception 'relay.enqueue: traceparent of event % is % bytes; a W3C trace context is 55',
            left(p_event_id, 200), octet_length(p_traceparent) using errcode = '22023';
    end if;
    if p_traceparent is not null and p_traceparent !~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$' then
        raise exception 'relay.enqueue: traceparent % is not a W3C trace context', left(p_traceparent, 55)
            using errcode = '22023';
    end if;
    if p_wake_queue is not null then
        if to_regclass('absurd.queues') is null then
            raise exception 'relay.enqueue: event % has a wake for queue % but the Absurd schema is not installed',
                p_event_id, p_wake_queue using errcode = '22023';
        end if;
        if not exists_absurd_queue(p_wake_queue) then
            raise exception 'relay.enqueue: event % wakes Absurd queue % which does not exist',
                p_event_id, p_wake_queue using errcode = '22023';
        end if;
    end if;

    -- Serialise writers of this run so seq order is commit order. The wait is bounded by a
    -- transaction-local lock_timeout that is put back afterwards: nothing leaks into the
    -- caller's transaction or through a transaction-mode pooler.
    v_old_timeout := current_setting('lock_timeout');
    perform set_config('lock_timeout', setting('enqueue_lock_timeout'), true);
    begin
        perform pg_advisory_xact_lock(run_lock_key(p_run_id));
    exception when lock_not_available then
        raise exception 'relay.enqueue: timed out after % waiting for another transaction writing run %; retry',
            setting('enqueue_lock_timeout'), p_run_id using errcode = '55P03';
    end;
    perform set_config('lock_timeout', v_old_timeout, true);

    select * into v_existing from events where event_id = p_event_id;
    if found then
        -- An event id another run holds says nothing of that run (its id, its type, its seq):
        -- otherwise a producer could learn other runs' ids, or confirm a guessed payload
        -- through the idempotent answer below (security pass 3, item 9).
        if v_existing.run_id <> p_run_id then
            raise exception 'relay.enqueue: event_id % is already taken by another run',
                p_event_id using errcode = '23505';
        end if;
        if v_existing.event_type = p_event_type
                and v_existing.payload = p_payload and v_existing.terminal = p_terminal
                and v_existing.wake_queue is not distinct from p_wake_queue
                and v_existing.wake_event is not distinct from p_wake_event then
            return v_existing.seq;   -- idempotent re-enqueue into the run that holds it
        end if;
        raise exception 'relay.enqueue: event_id % already exists in run % with different content',
            p_event_id, p_run_id using errcode = '23505';
    end if;

    select terminal_seq into v_terminal_seq from run_seqs where run_id = p_run_id;
    if v_terminal_seq is not null then
        raise exception 'relay.enqueue: run % already has its terminal event (seq %); no event may follow it',
            p_run_id, v_terminal_seq using errcode = '55000';
    end if;

    insert into run_seqs as s (run_id, last_seq, terminal_seq)
    values (p_run_id, 1, case when p_terminal then 1 end)
    on conflict (run_id) do update
        set last_seq = s.last_seq + 1,
            terminal_seq = case when p_terminal then s.last_seq + 1 end
    returning last_seq into v_seq;

    insert into events (run_id, seq, event_id, event_type, payload, terminal, wake_queue,
                        wake_event, traceparent)
    values (p_run_id, v_seq, p_event_id, p_event_type, p_payload, p_terminal, p_wake_queue,
            p_wake_event, p_traceparent);

    -- Make the run discoverable without touching a row the relay may be working on: a new run
    -- is inserted; an idle one is flipped (the WHERE matches nothing while it is active).
    insert into runs (run_id, next_attempt_at) values (p_run_id, clock_timestamp())
    on conflict (run_id) do nothing;
    if not found then
        update runs set idle = false, next_attempt_at = clock_timestamp(), updated_at = clock_timestamp()
        where run_id = p_run_id and idle;
    end if;

    if p_terminal then
        perform pg_notify(terminal_channel(),
            json_build_object('kind', 'terminal_committed', 'run_id', p_run_id)::text);
    else
        v_notify := coalesce(nullif(current_setting('relay.notify_ordinary', true), ''),
                             setting('notify_ordinary'));
        if v_notify in ('on', 'true', '1', 'yes') then
            -- A constant payload: the transaction sends one notification however many it enqueues.
            perform pg_notify('absurd_wake', 'outbox:' || current_schema());
        end if;
    end if;
    return v_seq;
end
$$;

create or replace function exists_absurd_queue(p_queue text) returns boolean
language plpgsql stable
set search_path from current
as $$
declare v boolean;
begin
    -- Dynamic so this schema does not depend on Absurd being installed.
    execute 'select exists (select 1 from absurd.queues where queue_name = $1)' into v using p_queue;
    return v;
end
$$;

-- Batch form: events is a JSON array of objects with the keys event_id, event_type, payload and
-- optionally terminal, wake_queue, wake_event, traceparent. Same checks; all or nothing.
create or replace function enqueue_many(p_run_id text, p_events jsonb) returns bigint[]
language plpgsql volatile
set search_path from current
security definer
as $$
declare
    v_item jsonb;
    v_seqs bigint[] := '{}';
    v_i int := 0;
    v_unknown text;
begin
    if p_events is null or jsonb_typeof(p_events) <> 'array' then
        raise exception 'relay.enqueue_many: events must be a JSON array, got %',
            coalesce(jsonb_typeof(p_events), 'NULL') using errcode = '22023';
    end if;
    for v_item in select value from jsonb_array_elements(p_events) loop
        if jsonb_typeof(v_item) <> 'object' then
            raise exception 'relay.enqueue_many: element % must be a JSON object', v_i using errcode = '22023';
        end if;
        select k into v_unknown from jsonb_object_keys(v_item) k
        where k not in ('event_id', 'event_type', 'payload', 'terminal', 'wake_queue', 'wake_event',
                        'traceparent') limit 1;
        if v_unknown is not null then
            raise exception 'relay.enqueue_many: element % has unknown key %', v_i, v_unknown
                using errcode = '22023';
        end if;
        if v_item ? 'terminal' and jsonb_typeof(v_item -> 'terminal') <> 'boolean' then
            raise exception 'relay.enqueue_many: element % terminal must be a boolean', v_i
                using errcode = '22023';
        end if;
        v_seqs := v_seqs || enqueue(
            p_run_id,
            v_item ->> 'event_id',
            v_item ->> 'event_type',
            v_item -> 'payload',
            coalesce((v_item ->> 'terminal')::boolean, false),
            v_item ->> 'wake_queue',
            v_item ->> 'wake_event',
            v_item ->> 'traceparent');
        v_i := v_i + 1;
    end loop;
    return v_seqs;
end
$$;

-- Relay API --------------------------------------------------------------------------------

-- Marks a run idle when it has no pending event. Only while holding the run's advisory lock:
-- then no producer is between its insert and its commit, and because this is a new statement
-- (fresh snapshot) every committed event is seen. If a producer holds the lock the run stays
-- active and is looked at again shortly.
create or replace function settle_run(p_run_id text) returns boolean
language plpgsql volatile
set search_path from current
as $$
begin
    if not pg_try_advisory_xact_lock(run_lock_key(p_run_id)) then
        update runs set next_attempt_at = clock_timestamp() + interval '200 milliseconds'
        where run_id = p_run_id;
        return false;
    end if;
    if exists (select 1 from events where run_id = p_run_id and state = 'pending') then
        return false;
    end if;
    update runs set idle = true, updated_at = clock_timestamp() where run_id = p_run_id;
    return true;
end
$$;

-- Takes the liveness lock of p_owner for the calling session (a session lock: it lives as long
-- as the connection, and the database drops it when the process dies) and records the owner in
-- `replicas`, which makes its leases claimable at once after its death (see claim). Call it on a
-- connection that lives as long as the process, never through a transaction-mode pooler.
-- Returns false, and records nothing, when another session holds the lock: a process with the
-- same owner id, or this process's previous session that the server has not dropped yet (the
-- caller tries again later). Call it once per session: the lock is re-entrant.
-- p_incarnation names the calling process (random at each start; null from a relay of schema
-- version 3). A replica restarted under the same owner id (a fixed replica_id, or host:pid in a
-- container, where the pid is always 1) would otherwise be taken for its dead predecessor, whose
-- leases then wait out their TTL: when the lock is free and the row names another incarnation,
-- the predecessor is dead, so its unexpired leases end now (claimable at once; the fence as
-- ever: a new token and epoch at the next claim). The same process reconnecting keeps them.
-- (Version 3 took only p_owner; dropped so that such a call resolves to this one.)
drop function if exists hold_liveness(text);
create or replace function hold_liveness(p_owner text, p_incarnation text default null)
returns boolean
language plpgsql volatile
set search_path from current
security definer
as $$
declare
    v_prev text;
begin
    if p_owner is null or p_owner = '' then
        raise exception 'relay.hold_liveness: owner must be a non-empty string' using errcode = '22023';
    end if;
    if char_length(p_incarnation) > 200 then
        raise exception 'relay.hold_liveness: p_incarnation is over 200 characters'
            using errcode = '22023';
    end if;
    if not pg_try_advisory_lock(liveness_key(p_owner)) then
        return false;
    end if;
    select rp.incarnation into v_prev from replicas rp where rp.owner = p_owner;
    if found and p_incarnation is not null and v_prev is distinct from p_incarnation then
        update runs r
        set lease_expires_at = clock_timestamp(), updated_at = clock_timestamp(),
            next_attempt_at = least(r.next_attempt_at, clock_timestamp())
        where r.lease_owner = p_owner and r.lease_expires_at > clock_timestamp();
    end if;
    -- The server's lifetime with it: the lock lives no longer than the server (see claim).
    insert into replicas as rp (owner, incarnation, server_started_at)
    values (p_owner, p_incarnation, pg_postmaster_start_time())
    on conflict (owner) do update set seen_at = clock_timestamp(),
        incarnation = coalesce(excluded.incarnation, rp.incarnation),
        server_started_at = excluded.server_started_at;
    -- Forget dead replicas that hold no unexpired lease, as prune does: every claim looks at
    -- each row, so the table stays as small as the set of replicas that matter, even when
    -- retention is off and prune never runs (each restart brings a new owner id).
    delete from replicas d
    where d.owner <> p_owner
      and not exists (select 1 from runs w
                      where w.lease_owner = d.owner and w.lease_expires_at > clock_timestamp())
      and pg_try_advisory_xact_lock(liveness_key(d.owner));
    return true;
end
$$;

-- Claims up to p_runs whole runs: each run's lease is taken (owner, fresh token, expiry on the
-- database clock, epoch bumped) and its pending prefix (up to p_batch events) returned, one row
-- per event, in seq order, each run's rows together; the run's own columns (epoch, lease_token,
-- lease_expires_at, attempts, critical, claimed_at, reclaimed_from) on its first row only,
-- NULL on the others (every relay version reads them there). p_lane 'critical' takes only
-- runs with a pending terminal event; 'ordinary' takes any due run (work-conserving). p_run_id
-- targets one run (terminal drain), which ignores next_attempt_at unless the run is backing off
-- after a failure.
-- A lease is also claimable before its expiry when its owner is dead (issue 18): the owner has a
-- `replicas` row (so it holds a liveness lock while it lives: a relay of the previous version
-- has none and is never judged dead), recorded in the server's current lifetime (issue 29: a
-- restart or failover frees every lock), and its liveness lock is free. The dead owners are found
-- once per claim in the small `replicas` table, with a shared transaction-level try-lock (it
-- succeeds only while no session holds the key exclusively, takes nothing from a live owner,
-- and several claimers may hold it at once); their runs through the `runs_leased` index. The
-- fence does not change: a new token, the epoch bumped, acks/renewals/releases fenced as ever.
-- `reclaimed_from` names the dead owner of a run whose unexpired lease was taken, else null.
-- The signature before p_max_bytes: dropped so that a call with six arguments (a relay of the
-- previous version, during a rolling upgrade) resolves to this one, not to two candidates.
drop function if exists claim(text, int, int, interval, text, text);
-- The result before reclaimed_from: a result type cannot be replaced, only dropped (once; the
-- same arguments, so a relay of the previous version calls the new one and ignores the column).
do $$
begin
    if exists (select 1 from pg_proc p
               where p.oid = to_regprocedure('claim(text, int, int, interval, text, text, bigint)')
                 and not 'reclaimed_from' = any(p.proargnames)) then
        drop function claim(text, int, int, interval, text, text, bigint);
    end if;
end
$$;
create or replace function claim(
    p_owner text, p_runs int, p_batch int, p_ttl interval, p_lane text, p_run_id text default null,
    p_max_bytes bigint default null
) returns table (
    run_id text, epoch bigint, lease_token uuid, lease_expires_at timestamptz, attempts int,
    critical boolean, seq bigint, event_id text, event_type text, payload text, terminal boolean,
    created_at timestamptz, traceparent text, wake_queue text, claimed_at timestamptz,
    reclaimed_from text
)
language plpgsql volatile
set search_path from current
set plan_cache_mode = force_generic_plan
security definer
as $$
declare
    v_dead text[];
    v_now timestamptz;
    v_runs text[];
    v_epochs bigint[];
    v_tokens uuid[];
    v_expires timestamptz[];
    v_attempts int[];
    v_reclaimed text[];
    v_empty text[];
begin
    -- A caller that claims is alive, whatever its lock says: when its own lock is free (its
    -- LISTEN session is gone while the process works on, e.g. a network cut that its pool
    -- survived), forget its row, so no replica takes its leases early while its LISTEN
    -- connection is down (they expire as before); hold_liveness records it again on reconnect.
    -- Without this, replicas whose LISTEN connections lag their pools take each other's runs
    -- back and forth, a duplicate each time. A plain index probe while the lock is held.
    delete from replicas me
    where me.owner = p_owner and pg_try_advisory_xact_lock_shared(liveness_key(me.owner));
    -- Dead owners: a replicas row whose liveness lock no session holds (this claim's own
    -- owner is never among them), recorded in this server's lifetime: a restart or a failover
    -- drops every lock, so an older row's free lock proves nothing (its owner may be about to
    -- take it again); its leases run to their expiry.
    v_dead := array(select rp.owner from replicas rp
                    where rp.owner <> p_owner
                      and rp.server_started_at = pg_postmaster_start_time()
                      and pg_try_advisory_xact_lock_shared(liveness_key(rp.owner)));
    -- One statement takes the leases, one returns every run's prefix, one releases the runs
    -- found empty (issue 16: a plpgsql round per run made the claim cost ~105 us per run).
    with picked as (
        select r.run_id, r.lease_owner as prev_owner, r.lease_expires_at as prev_expires
        from runs r
        where p_run_id is not null and r.run_id = p_run_id and not r.idle
          and r.blocked_seq is null
          and (r.lease_expires_at is null or r.lease_expires_at <= clock_timestamp()
               or r.lease_owner = any(v_dead))
          and (r.attempts = 0 or r.next_attempt_at <= clock_timestamp()
               or r.lease_owner = any(v_dead))
        for update skip locked
    ), critical_picked as (
        select r.run_id, r.lease_owner as prev_owner, r.lease_expires_at as prev_expires
        from events e join runs r on r.run_id = e.run_id
        where p_run_id is null and p_lane = 'critical' and e.terminal and e.state = 'pending'
          and not r.idle and r.blocked_seq is null
          and (r.next_attempt_at <= clock_timestamp() or r.lease_owner = any(v_dead))
        order by e.created_at
        limit p_runs
        for update of r skip locked
    ), dead_picked as (
        -- A dead owner's runs first, through runs_leased (nothing to do while none died). The
        -- order is by an expression runs_due cannot give: walking runs_due in order to its
        -- leased runs (due an hour on) read every due run first, a claim O(backlog).
        select r.run_id, r.lease_owner as prev_owner, r.lease_expires_at as prev_expires
        from runs r
        where p_run_id is null and p_lane = 'ordinary' and cardinality(v_dead) > 0
          and r.lease_owner = any(v_dead) and not r.idle and r.blocked_seq is null
        order by r.next_attempt_at + interval '0'
        limit p_runs
        for update skip locked
    ), ordinary_picked as (
        select r.run_id, r.lease_owner as prev_owner, r.lease_expires_at as prev_expires
        from runs r
        where p_run_id is null and p_lane = 'ordinary'
          and not r.idle and r.blocked_seq is null and r.next_attempt_at <= clock_timestamp()
        order by r.next_attempt_at
        limit p_runs
        for update skip locked
    ), ordinary_all as (
        -- Both ordinary sources, a run once, dead owners' first, at most p_runs in all.
        select d.run_id, d.prev_owner, d.prev_expires
        from (select o.*, 0 as pri from dead_picked o
              union all select o.*, 1 from ordinary_picked o) d
        order by d.pri
        limit p_runs
    ), all_picked as (
        select distinct on (u.run_id) u.run_id, u.prev_owner, u.prev_expires,
               clock_timestamp() + p_ttl as expires
        from (select * from picked union all select * from critical_picked
              union all select * from ordinary_all) u
    ), taken as (
        update runs u
        set epoch = u.epoch + 1,
            lease_owner = p_owner,
            lease_token = gen_random_uuid(),
            -- One reading of the clock: while leased, next_attempt_at is exactly the expiry.
            lease_expires_at = all_picked.expires,
            next_attempt_at = all_picked.expires,
            updated_at = clock_timestamp()
        from all_picked
        where u.run_id = all_picked.run_id
        returning u.run_id, u.epoch, u.lease_token, u.lease_expires_at, u.attempts,
            case when all_picked.prev_owner = any(v_dead)
                      and all_picked.prev_expires > clock_timestamp()
                 then all_picked.prev_owner end as reclaimed_from
    )
    select array_agg(t.run_id), array_agg(t.epoch), array_agg(t.lease_token),
           array_agg(t.lease_expires_at), array_agg(t.attempts), array_agg(t.reclaimed_from)
    into v_runs, v_epochs, v_tokens, v_expires, v_attempts, v_reclaimed
    from taken t;
    if v_runs is null then
        return;
    end if;
    -- Runs with nothing pending after all (delivered meanwhile): give the lease back. Their
    -- rows are locked by the update above, so the next statement returns exactly the others.
    v_empty := array(select x from unnest(v_runs) as x
                     where not exists (select 1 from events e
                                       where e.run_id = x and e.state = 'pending'));
    if cardinality(v_empty) > 0 then
        update runs set lease_owner = null, lease_token = null, lease_expires_at = null,
                        next_attempt_at = clock_timestamp()
        where runs.run_id = any(v_empty);
        perform settle_run(x) from unnest(v_empty) as x;
    end if;
    v_now := clock_timestamp();
    -- The prefix stops early at p_max_bytes of payload (a bound on the relay's memory and
    -- on the POST's size, whatever the payload sizes); its first event always goes, alone
    -- if it is larger than the bound.
    -- The run's own columns (epoch .. critical, claimed_at, reclaimed_from) are on its first
    -- row only, NULL on the others: the caller reads them there, and each timestamptz, uuid
    -- and int it would read again costs it microseconds per event (issue 16: ~5 us a row).
    return query
        select u.run_id,
               case when p.n = 1 then u.epoch end,
               case when p.n = 1 then u.token end,
               case when p.n = 1 then u.expires end,
               case when p.n = 1 then u.attempts end,
               case when p.n = 1 then exists (select 1 from events t where t.run_id = u.run_id
                                              and t.terminal and t.state = 'pending') end,
               p.seq, p.event_id, p.event_type, p.payload, p.terminal, p.created_at,
               p.traceparent, p.wake_queue,
               case when p.n = 1 then v_now end,
               case when p.n = 1 then u.reclaimed end
        from unnest(v_runs, v_epochs, v_tokens, v_expires, v_attempts, v_reclaimed)
                 with ordinality as u(run_id, epoch, token, expires, attempts, reclaimed, i)
        cross join lateral (
            select e.seq, e.event_id, e.event_type, t.payload, e.terminal, e.created_at,
                   e.traceparent, e.wake_queue,
                   sum(octet_length(t.payload)) over (order by e.seq) as upto_bytes,
                   row_number() over (order by e.seq) as n
            from (select * from events
                  where events.run_id = u.run_id and events.state = 'pending'
                  order by events.seq
                  limit p_batch) e
            cross join lateral (select e.payload::text as payload) t
        ) p
        where not (u.run_id = any(v_empty))
          and (p.n = 1 or p_max_bytes is null or p.upto_bytes <= p_max_bytes)
        order by u.i, p.seq;
end
$$;

-- Extends leases, fenced by token: a lease that was replaced or has expired is not renewed.
-- Returns the runs renewed and their new expiry.
create or replace function renew(p_run_ids text[], p_tokens uuid[], p_ttl interval)
returns table (run_id text, lease_expires_at timestamptz)
language sql volatile
set search_path from current
security definer
as $$
    update runs r
    set lease_expires_at = t.expires,
        next_attempt_at = t.expires
    from (select u.run_id, u.token, clock_timestamp() + p_ttl as expires
          from unnest(p_run_ids, p_tokens) as u(run_id, token)) as t
    where r.run_id = t.run_id and r.lease_token = t.token
      and r.lease_expires_at > clock_timestamp()
    returning r.run_id, r.lease_expires_at
$$;

-- Gives a lease back without delivering, fenced by token. p_delay schedules the next attempt
-- (backoff); p_error, when given, counts a failed attempt on the run and on events
-- p_first_seq..p_last_seq. Returns whether the token matched.
create or replace function release(
    p_run_id text, p_token uuid, p_delay interval default '0',
    p_error text default null, p_status int default null,
    p_first_seq bigint default null, p_last_seq bigint default null
) returns boolean
language plpgsql volatile
set search_path from current
security definer
as $$
begin
    update runs
    set lease_owner = null, lease_token = null, lease_expires_at = null,
        next_attempt_at = clock_timestamp() + p_delay,
        attempts = attempts + case when p_error is null then 0 else 1 end,
        last_error = coalesce(left(p_error, 2000), last_error),
        updated_at = clock_timestamp()
    where runs.run_id = p_run_id and lease_token = p_token;
    if not found then
        return false;
    end if;
    if p_error is not null and p_first_seq is not null then
        update events
        set attempts = attempts + 1, last_error = left(p_error, 2000), last_status = p_status
        where events.run_id = p_run_id and seq between p_first_seq and p_last_seq
          and state = 'pending';
    end if;
    return true;
end
$$;

-- Marks one event failed and blocks its run: what the relay does for a poison answer. Fenced like
-- an ack: only the holder of the run's live lease (its token, not expired on the statement clock)
-- may fail an event, so a relay role cannot block another replica's run or clear its lease.
-- Events before it are left as they are; nothing after it is delivered until an operator
-- retries or skips it. Returns whether the lease held.
create or replace function fail_event(
    p_run_id text, p_token uuid, p_seq bigint, p_status int, p_error text
) returns boolean
language plpgsql volatile
set search_path from current
security definer
as $$
begin
    if p_token is null then
        raise exception 'relay.fail_event: a lease token is required (only the lease holder may fail an event)'
            using errcode = '22023';
    end if;
    perform 1 from runs r
    where r.run_id = p_run_id and r.lease_token = p_token and r.lease_expires_at > clock_timestamp()
    for update;
    if not found then
        return false;
    end if;
    perform block_event(p_run_id, p_seq, p_status, p_error);
    return true;
end
$$;

-- The unfenced part of fail_event, for callers that already hold the run (ack, inside its own
-- fence). Not granted to any role: only functions of this schema call it.
create or replace function block_event(
    p_run_id text, p_seq bigint, p_status int, p_error text
) returns void
language plpgsql volatile
set search_path from current
security definer
as $$
begin
    update runs
    set lease_owner = null, lease_token = null, lease_expires_at = null,
        blocked_seq = p_seq, last_error = left(p_error, 2000), updated_at = clock_timestamp()
    where runs.run_id = p_run_id;
    update events
    set state = 'failed', failed_at = clock_timestamp(), attempts = attempts + 1,
        last_status = p_status, last_error = left(p_error, 2000)
    where events.run_id = p_run_id and seq = p_seq and state = 'pending';
end
$$;

-- Acknowledges delivered batches in one transaction (DESIGN §6). p_batches is a JSON array of
-- {"run_id", "token", "upto", "keep"?}: events of the run up to seq `upto` that are still pending are
-- marked delivered, only if the token still holds an unexpired lease. For each batch acked:
-- one outbox_delivered notification on the terminal channel, an absurd.emit_event for every
-- event with a wake, and after all batches one pg_notify('absurd_wake', queue) per queue.
-- A stale batch changes nothing and does not stop the others. An engine that rejects a wake
-- marks that event failed and blocks its run, and nothing of that batch from it on is acked.
-- The lease is released unless "keep" is true.
-- Returns one row per input batch: status 'acked' | 'stale' | 'failed', the number of events
-- acked, the seq acked up to, the commit-to-ack lag of the oldest event, and whether the run
-- has more pending events.
create or replace function ack(p_batches jsonb)
returns table (run_id text, status text, acked int, last_seq bigint, lag_seconds double precision,
               error text)
language plpgsql volatile
set search_path from current
set plan_cache_mode = force_generic_plan
security definer
as $$
declare
    v_b jsonb;
    v_run text;
    v_token uuid;
    v_upto bigint;
    v_now timestamptz;
    v_ids text[];
    v_seqs bigint[];
    v_first_created timestamptz;
    v_wake record;
    v_queues text[] := '{}';
    v_failed_seq bigint;
    v_err text;
    v_note text;
    v_q text;
    v_i bigint;
    v_channel text := terminal_channel();
    v_fast_i bigint[];
    v_fast_runs text[];
    v_fast_upto bigint[];
    v_locked text[];
    v_done_n int[];
    v_done_last bigint[];
    v_done_lag double precision[];
    v_notes text[];
    -- the results of the batches the loop handles, by input position (r_i)
    r_i bigint[] := '{}';
    r_run text[] := '{}';
    r_status text[] := '{}';
    r_n int[] := '{}';
    r_last bigint[] := '{}';
    r_lag double precision[] := '{}';
    r_err text[] := '{}';
begin
    -- The common case, set-based (issue 16: a plpgsql round per run made the ack cost ~230 us
    -- per run): batches that release their lease, whose run appears once in the call and
    -- whose acked events wake nothing. Fenced and locked like the loop below does one by one;
    -- every other batch (keep, a repeated run, an engine wake, a stale token) goes through the
    -- loop, unchanged. The result stays one row per input batch, in input order.
    v_now := clock_timestamp();
    select array_agg(f.i order by f.i), array_agg(f.run_id order by f.i),
           array_agg(f.upto order by f.i)
    into v_fast_i, v_fast_runs, v_fast_upto
    from (
        select b.i, b.run_id, b.upto
        from (select x.*, count(*) over (partition by x.run_id) as times
              from rows from (jsonb_to_recordset(p_batches)
                              as (run_id text, token uuid, upto bigint, keep boolean))
                   with ordinality as x(run_id, token, upto, keep, i)) b
        join runs r on r.run_id = b.run_id
        where r.lease_token = b.token and r.lease_expires_at > v_now
          and not coalesce(b.keep, false) and b.times = 1
          and not exists (select 1 from events w
                          where w.run_id = b.run_id and w.seq <= b.upto
                            and w.state = 'pending' and w.wake_queue is not null)
        order by b.run_id
        for update of r
    ) f;
    if v_fast_i is not null then
        with acked as (
            update events e
            set state = 'delivered', delivered_at = v_now, done_at = v_now,
                attempts = e.attempts + 1, last_error = null
            from unnest(v_fast_runs, v_fast_upto) as f(run_id, upto)
            where e.run_id = f.run_id and e.seq <= f.upto and e.state = 'pending'
            returning e.run_id, e.seq, e.event_id, e.created_at
        ), per_run as (
            select a.run_id, count(*)::int as n, max(a.seq) as last_seq,
                   min(a.created_at) as first_created,
                   json_build_object('kind', 'outbox_delivered', 'run_id', a.run_id,
                                     'last_seq', max(a.seq),
                                     'event_ids', array_agg(a.event_id order by a.seq))::text
                       as note
            from acked a group by a.run_id
        ), noted as (
            select f.i, coalesce(p.n, 0) as n, p.last_seq,
                   extract(epoch from v_now - p.first_created)::double precision as lag,
                   case when p.run_id is null then null
                        when octet_length(p.note) <= 7900 then p.note
                        else json_build_object('kind', 'outbox_delivered', 'run_id', p.run_id,
                                               'last_seq', p.last_seq)::text end as note
            from unnest(v_fast_i, v_fast_runs) as f(i, run_id)
            left join per_run p on p.run_id = f.run_id
        )
        -- in v_fast_i's order (the input order), so each lines up with v_fast_i and v_fast_runs
        select array_agg(x.n order by x.i), array_agg(x.last_seq order by x.i),
               array_agg(x.lag order by x.i), array_remove(array_agg(x.note order by x.i), null)
        into v_done_n, v_done_last, v_done_lag, v_notes
        from noted x;
        -- one outbox_delivered notification per batch that acked something, in input order
        perform pg_notify(v_channel, n.note)
        from unnest(v_notes) with ordinality as n(note, i) order by n.i;
        -- Release, and settle as settle_run does: the advisory locks first, in a statement of
        -- their own, so the pending check after them (a new statement: a fresh snapshot) sees
        -- every event a producer committed before letting go of its lock.
        v_locked := array(select f.run_id
                          from unnest(v_fast_runs, run_lock_keys(v_fast_runs)) as f(run_id, k)
                          where pg_try_advisory_xact_lock(f.k));
        update runs r
        set lease_owner = null, lease_token = null, lease_expires_at = null, attempts = 0,
            last_error = null, updated_at = clock_timestamp(),
            -- a run whose lock a producer holds is looked at again shortly (as settle_run)
            next_attempt_at = case when r.run_id = any(v_locked) then v_now
                                   else clock_timestamp() + interval '200 milliseconds' end,
            idle = r.run_id = any(v_locked)
                   and not exists (select 1 from events e
                                   where e.run_id = r.run_id and e.state = 'pending')
        where r.run_id = any(v_fast_runs);
    end if;

    -- Every other batch, one by one. Results are collected and returned once at the end, in
    -- input order (a `return query` per batch cost an executor start per run).
    for v_b, v_i in select x.value, x.i from jsonb_array_elements(p_batches)
                                              with ordinality as x(value, i)
                    where not (x.i = any(coalesce(v_fast_i, '{}'))) loop
        v_run := v_b ->> 'run_id';
        v_token := (v_b ->> 'token')::uuid;
        v_upto := (v_b ->> 'upto')::bigint;
        v_now := clock_timestamp();
        perform 1 from runs r
        where r.run_id = v_run and r.lease_token = v_token and r.lease_expires_at > v_now
        for update;
        if not found then
            r_i := r_i || v_i::bigint;
            r_run := r_run || v_run;
            r_status := r_status || 'stale'::text;
            r_n := r_n || 0;
            r_last := r_last || null::bigint;
            r_lag := r_lag || null::double precision;
            r_err := r_err || null::text;
            continue;
        end if;

        -- Only rows this statement marks delivered can wake the engine: a redelivered event
        -- whose first ack committed is not pending any more and emits nothing.
        with acked as (
            update events e
            set state = 'delivered', delivered_at = v_now, done_at = v_now,
                attempts = e.attempts + 1, last_error = null
            where e.run_id = v_run and e.seq <= v_upto and e.state = 'pending'
            returning e.seq, e.event_id, e.created_at
        )
        select array_agg(a.event_id order by a.seq), array_agg(a.seq order by a.seq), min(a.created_at)
        into v_ids, v_seqs, v_first_created from acked a;

        v_failed_seq := null;
        for v_wake in
            select e.seq, e.event_id, e.wake_queue, e.wake_event from events e
            where e.run_id = v_run and e.seq = any(v_seqs) and e.wake_queue is not null
            order by e.seq
        loop
            begin
                perform absurd.emit_event(v_wake.wake_queue, v_wake.wake_event,
                    jsonb_build_object('event_id', v_wake.event_id, 'run_id', v_run,
                                       'delivered_at', v_now));
                if not v_wake.wake_queue = any(v_queues) then
                    v_queues := v_queues || v_wake.wake_queue;
                end if;
            exception
                when lock_not_available or transaction_rollback or insufficient_resources then
                    -- Transient (a lock wait under the caller's lock_timeout, a deadlock, ...):
                    -- not a rejection. Fail the whole ack; the batch is delivered again later.
                    raise;
                when others then
                v_failed_seq := v_wake.seq;
                v_err := 'engine wake failed: ' || sqlerrm;
                exit;
            end;
        end loop;

        if v_failed_seq is not null then
            -- Undo the ack from the failed event on, then fail it and block the run.
            update events e
            set state = 'pending', delivered_at = null, done_at = null, attempts = e.attempts - 1
            where e.run_id = v_run and e.seq >= v_failed_seq and e.seq = any(v_seqs);
            perform block_event(v_run, v_failed_seq, null, v_err);
            v_ids := array(select x from unnest(v_ids, v_seqs) as u(x, s) where s < v_failed_seq);
            v_seqs := array(select s from unnest(v_seqs) as s where s < v_failed_seq);
        elsif coalesce((v_b ->> 'keep')::boolean, false) then
            -- The caller goes on delivering this run under the same lease (poison narrowing).
            update runs r set attempts = 0, last_error = null, updated_at = v_now
            where r.run_id = v_run;
        else
            update runs r
            set lease_owner = null, lease_token = null, lease_expires_at = null,
                next_attempt_at = v_now, attempts = 0, last_error = null, updated_at = v_now
            where r.run_id = v_run;
        end if;

        if coalesce(array_length(v_seqs, 1), 0) > 0 then
            v_note := json_build_object('kind', 'outbox_delivered', 'run_id', v_run,
                                        'last_seq', v_seqs[array_length(v_seqs, 1)],
                                        'event_ids', v_ids)::text;
            if octet_length(v_note) > 7900 then
                v_note := json_build_object('kind', 'outbox_delivered', 'run_id', v_run,
                                            'last_seq', v_seqs[array_length(v_seqs, 1)])::text;
            end if;
            perform pg_notify(v_channel, v_note);
        end if;
        if v_failed_seq is null and not coalesce((v_b ->> 'keep')::boolean, false) then
            perform settle_run(v_run);
        end if;

        r_i := r_i || v_i::bigint;
        r_run := r_run || v_run;
        r_status := r_status || case when v_failed_seq is null then 'acked' else 'failed' end;
        r_n := r_n || coalesce(array_length(v_seqs, 1), 0);
        r_last := r_last || v_seqs[array_length(v_seqs, 1)];
        r_lag := r_lag || extract(epoch from v_now - v_first_created)::double precision;
        r_err := r_err || case when v_failed_seq is null then null else v_err end;
    end loop;

    foreach v_q in array v_queues loop
        perform pg_notify('absurd_wake', v_q);
    end loop;

    return query
        select u.run_id, u.status, u.acked, u.last_seq, u.lag, u.error
        from (select f.i, f.run_id, 'acked'::text as status, f.n as acked, f.last_seq, f.lag,
                     null::text as error
              from unnest(v_fast_i, v_fast_runs, v_done_n, v_done_last, v_done_lag)
                   as f(i, run_id, n, last_seq, lag)
              union all
              select r.* from unnest(r_i, r_run, r_status, r_n, r_last, r_lag, r_err)
                              as r(i, run_id, status, n, last_seq, lag, error)) u
        order by u.i;
end
$$;

-- Deletes delivered and skipped events older than p_retention, at most p_limit per call
-- (small, index-backed batches that never hold many locks). Returns the number deleted.
create or replace function prune(p_retention interval, p_limit int) returns int
language plpgsql volatile
set search_path from current
security definer
as $$
declare
    v_n int;
    v_run text;
begin
    delete from events e
    using (select x.run_id, x.seq from events x
           where x.done_at < clock_timestamp() - p_retention
           order by x.done_at limit p_limit
           for update skip locked) d
    where e.run_id = d.run_id and e.seq = d.seq;
    get diagnostics v_n = row_count;
    -- Forget idle runs with no events left (their seq counter stays in run_seqs). One run at a
    -- time under its advisory lock, checked in a fresh statement, so a producer that is
    -- enqueueing into it can never find its runs row gone. Only finished runs (terminal event
    -- enqueued): a recreated row would restart the epoch, which the ingress takes as a fencing
    -- token, while a finished run can never be claimed again.
    for v_run in
        select y.run_id from runs y
        where y.idle and y.updated_at < clock_timestamp() - p_retention
          and exists (select 1 from run_seqs f
                      where f.run_id = y.run_id and f.terminal_seq is not null)
        order by y.updated_at
        limit p_limit
    loop
        continue when not pg_try_advisory_xact_lock(run_lock_key(v_run));
        delete from runs r
        where r.run_id = v_run and r.idle
          and not exists (select 1 from events z where z.run_id = v_run);
    end loop;
    -- Forget dead replicas (liveness lock free) that hold no unexpired lease: nothing of theirs
    -- is left to reclaim. The exclusive try-lock keeps a replica from taking its lock (and
    -- recording itself again) between the check and the delete.
    delete from replicas rp
    where not exists (select 1 from runs w
                      where w.lease_owner = rp.owner and w.lease_expires_at > clock_timestamp())
      and pg_try_advisory_xact_lock(liveness_key(rp.owner));
    return v_n;
end
$$;
