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
--   40001 serialization_failure     repeatable read / serializable: the transaction's snapshot
--                                   predates a rotation of the outbox's parts (retry)

-- The advisory-lock key of a replica's liveness as schema version 8 and older took it (issue
-- 18): derived from the owner id alone, so any role could compute it and take it first (issue
-- 48 item 6). Kept for the `replicas` rows such a hold recorded (liveness_key_of) and for
-- their calls in flight across an upgrade.
create or replace function liveness_key(p_owner text) returns bigint
language sql immutable parallel safe
set search_path from current
as $$ select hashtextextended('ledger-relay:live:' || current_schema() || ':' || p_owner, 0) $$;

-- The advisory-lock key of the liveness a `replicas` row records (issue 48 item 6): a hold
-- records `<process incarnation>/<hold secret>`, the secret random at each hold_liveness
-- (gen_random_uuid) and in no other place than the row, which no role but the schema's owner
-- reads, so no other role can compute the key before the replica takes it. A new key at each
-- hold: one that was seen in pg_locks (which every role reads) is worth nothing once its
-- session is gone. A row without the `/` was recorded by a hold of schema version 8 or older,
-- whose session (still running across an upgrade) holds the owner's old key.
create or replace function liveness_key_of(p_owner text, p_incarnation text) returns bigint
language sql immutable parallel safe
set search_path from current
as $$
    select case when strpos(p_incarnation, '/') > 0
                then hashtextextended('ledger-relay:live:' || current_schema() || ':' || p_owner
                                      || ':' || p_incarnation, 0)
                else liveness_key(p_owner) end
$$;

-- Whether the calling session holds the advisory lock `p_key` (exclusive, as hold_liveness
-- takes a liveness lock). pg_locks shows a bigint advisory key as classid (its high 32 bits)
-- and objid (its low 32 bits) with objsubid 1.
create or replace function session_holds_key(p_key bigint) returns boolean
language sql stable
set search_path from current
as $$
    select exists (
        select 1 from pg_locks l
        where l.locktype = 'advisory' and l.objsubid = 1 and l.mode = 'ExclusiveLock'
          and l.granted and l.pid = pg_backend_pid()
          and l.database = (select d.oid from pg_database d where d.datname = current_database())
          and ((l.classid::int8 << 32) | l.objid::int8) = p_key)
$$;

-- Whether the calling session holds p_owner's liveness lock: the key its `replicas` row
-- records, which hold_liveness took on the replica's LISTEN connection (false without a row).
create or replace function session_holds_liveness(p_owner text) returns boolean
language sql stable
set search_path from current
as $$
    select coalesce((select session_holds_key(liveness_key_of(rp.owner, rp.incarnation))
                     from replicas rp where rp.owner = p_owner), false)
$$;

-- Whether a session that may hold a liveness (a role with EXECUTE on hold_liveness: a relay's,
-- the schema's owner) holds the advisory lock `p_key`. A key held by any other role (one read
-- from pg_locks and taken after its replica's session ended) proves no replica alive.
create or replace function key_held_by_a_replica(p_key bigint) returns boolean
language sql stable
set search_path from current
as $$
    select exists (
        select 1 from pg_locks l join pg_stat_activity a on a.pid = l.pid
        where l.locktype = 'advisory' and l.objsubid = 1 and l.mode = 'ExclusiveLock'
          and l.granted
          and l.database = (select d.oid from pg_database d where d.datname = current_database())
          and ((l.classid::int8 << 32) | l.objid::int8) = p_key
          and has_function_privilege(a.usesysid, 'hold_liveness(text, text)', 'execute'))
$$;

-- A replica's own acts (its report, its clean stop) come from the session that holds its
-- liveness lock: no other session can speak for it. Raises naming the caller otherwise.
create or replace function require_liveness_holder(p_owner text, p_caller text) returns void
language plpgsql stable
set search_path from current
as $$
begin
    if p_owner is null or p_owner = '' then
        raise exception 'relay.%: owner must be a non-empty string', p_caller
            using errcode = '22023';
    end if;
    if not session_holds_liveness(p_owner) then
        raise exception 'relay.%: this session does not hold the liveness lock of that owner '
                        '(a replica acts on the connection that holds it)', p_caller
            using errcode = '55000';
    end if;
end
$$;

create or replace function terminal_channel() returns text
language sql stable parallel safe
set search_path from current
as $$ select current_schema() || '_terminal' $$;

create or replace function setting(p_key text) returns text
language sql stable
set search_path from current
as $$ select value from settings where key = p_key $$;

-- Producer API -----------------------------------------------------------------------------

-- Serialises the writers of one run, so that seq order is commit order, and returns the seq
-- the caller's next event of that run takes. The lock is the run's `run_seqs` row: a row lock
-- lives in the tuple, not in the server's shared lock table, so one transaction can enqueue into
-- any number of runs (issue 28; a transaction advisory lock per run ran out of shared memory past
-- ~6,000 runs). A new run's row is inserted (nobody else sees it before commit); an existing
-- one is locked, and locked again by the same transaction for free: the row is written once per
-- run and transaction, not once per event.
-- The next seq follows the run's highest event (a probe at the end of its primary-key range, in
-- a new statement: after the lock, so every earlier writer's commit is seen), or, once retention
-- removed them all, the run's cursor (schema version 8), or `last_seq`, the floor a version-7
-- retention left.
-- Under repeatable read or serializable the caller's snapshot predates the lock, so the row is
-- written as before (`last_seq`), and a concurrent writer of the run fails the transaction with
-- a serialization error rather than with a duplicate seq.
-- Only a contended lock waits, bounded by a transaction-local lock_timeout put back afterwards
-- (nothing leaks into the caller's transaction or through a transaction-mode pooler). The
-- uncontended path has no exception block: a row written or locked inside one would give every
-- enqueue a subtransaction id. So the wait for a run that another open transaction is creating
-- (its first event) ends in PostgreSQL's own lock-timeout error; the wait for a run another
-- transaction is writing, in this function's message. Both are SQLSTATE 55P03: retry.
-- Every statement here reads or writes one run's rows by its primary key, and runs (and is
-- planned) only under enqueue's `enable_seqscan = off`, which says why.
create or replace function lock_run_for_enqueue(p_run_id text) returns bigint
language plpgsql volatile
set search_path from current
as $$
declare
    v_old_timeout text;
    v_seq bigint;
begin
    perform 1 from run_seqs s where s.run_id = p_run_id for update skip locked;
    if not found then
        -- A new run, or one another transaction holds (or is creating).
        v_old_timeout := current_setting('lock_timeout');
        perform set_config('lock_timeout', setting('enqueue_lock_timeout'), true);
        insert into run_seqs (run_id, last_seq) values (p_run_id, 0)
        on conflict (run_id) do nothing;
        if not found then
            begin
                perform 1 from run_seqs s where s.run_id = p_run_id for update;
            exception when lock_not_available then
                raise exception 'relay.enqueue: timed out after % waiting for another transaction writing run %; retry',
                    setting('enqueue_lock_timeout'), p_run_id using errcode = '55P03';
            end;
        end if;
        perform set_config('lock_timeout', v_old_timeout, true);
    end if;
    -- Retention removes the oldest of a run's events, and only events at or below its cursor:
    -- the highest left is the run's highest; with none left, the cursor is (read only then).
    select greatest(s.last_seq,
                    coalesce((select max(o.seq) from outbox o where o.run_id = p_run_id),
                             (select r.delivered_seq from runs r where r.run_id = p_run_id),
                             0))
           + 1
    into v_seq
    from run_seqs s where s.run_id = p_run_id;
    if current_setting('transaction_isolation') <> 'read committed' then
        update run_seqs set last_seq = v_seq where run_id = p_run_id;
    end if;
    return v_seq;
end
$$;

create or replace function enqueue(
    p_run_id text,
    p_event_id text,
    p_event_type text,
    p_payload jsonb,
    p_terminal boolean default false,
    p_wake_queue text default null,
    p_wake_event text default null,
    p_traceparent text default null,
    p_fairness_key text default null
) returns bigint
language plpgsql volatile
set search_path from current
-- The run's rows and the event id are looked up by key (`run_seqs`, `runs`, each part of
-- `outbox`), and each lookup must stay a point lookup however many runs the transaction has
-- written: with the statistics of a small table (ANALYZE while `runs` held a few rows, or an
-- empty part) the planner prefers a sequential scan, plpgsql keeps that plan for the
-- session, and the rows this transaction adds are read again by every later call, so one
-- transaction's cost grows with the square of its runs (issue 52 item 4: 4,000 new runs after
-- such an ANALYZE read 72 million tuples in 8.3 s; 1.5 s and none read with this). Statistics
-- cannot catch up inside the transaction (ANALYZE does not count its uncommitted rows), so no
-- estimate of these tables' size is to be trusted here, and every lookup has its index. A
-- setting of this function, not a rewritten statement: PostgreSQL has no syntax that demands
-- an index. It holds for what enqueue calls (lock_run_for_enqueue, setting) and is put back on
-- return, like the search_path: ~0.6 us a call, measured on an empty function, against ~56 us
-- an event for enqueue. It is a cost, not a ban: a statement with no index to use still runs. tests/test_enqueue_scaling.py counts the tuples
-- these calls read.
set enable_seqscan = off
security definer
as $$
declare
    v_max_id int := setting('max_id_bytes')::int;
    v_max_payload int := setting('max_payload_bytes')::int;
    v_existing outbox%rowtype;
    v_seq bigint;
    v_terminal_seq bigint;
    v_notify text;
    v_key text;
begin
    -- Validation first: bad input raises before anything is written.
    if p_run_id is null or p_run_id = '' then
        raise exception 'relay.enqueue: run_id must be a non-empty string' using errcode = '22023';
    end if;
    if p_run_id in ('.', '..') then
        -- A dot segment: URL normalisation (RFC 3986 §6.2.2.3; nginx, and aiohttp's yarl under
        -- the default transport) removes it from a path, percent-encoded or not, so no ingress
        -- URL could carry this run to its own place (issue 40).
        raise exception 'relay.enqueue: run_id must not be "." or "..": a URL path cannot carry it'
            using errcode = '22023';
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
    if p_fairness_key = '' or octet_length(p_fairness_key) > v_max_id then
        raise exception 'relay.enqueue: fairness_key must be NULL or a non-empty string of at most % bytes',
            v_max_id using errcode = '22023';
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

    -- Hold the outbox's current part until this transaction commits, so that no two
    -- transactions write two different parts at once (schema version 8: the parts take turns).
    -- An event id is unique in each part by its index, and across the parts by the lookup of
    -- all three below; that lookup cannot see an uncommitted event, so a writer of the next part
    -- must start after every writer of the previous one has committed. The hold is a table lock
    -- on `outbox_parts` in row exclusive mode: producers share it (a transaction takes it once,
    -- again for free, in the backend's fast-path slots), and a rotation's share row exclusive
    -- mode waits for every holder and holds new ones back until it commits (prune,
    -- hold_back_producers). After a wait, the next statement's snapshot sees the new part.
    -- Under repeatable read or serializable the snapshot may predate a rotation this
    -- transaction never waited for (it began before, and enqueues after): locking the current
    -- part's row, as that snapshot sees it, then fails with a serialization error (40001:
    -- retry) instead of writing a part that is no longer current. That row lock is written
    -- only at those levels. Inline: these statements cost ~0.8 us an event (enqueue_scaling,
    -- docs/storage.md), and ~2.8 us more as a function of their own.
    lock table outbox_parts in row exclusive mode;
    if current_setting('transaction_isolation') <> 'read committed' then
        perform 1 from outbox_parts where current for share;
    end if;
    v_seq := lock_run_for_enqueue(p_run_id);

    select * into v_existing from outbox where event_id = p_event_id;
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

    -- The run's fairness key is its first event's (schema version 9): read only when this
    -- event names one (to refuse another) or is the terminal (pending_terminals carries it).
    -- Under the run's lock, so the first event's key is seen once it committed. An event
    -- without a key keeps the run's.
    v_key := coalesce(p_fairness_key, '');
    if p_fairness_key is not null or p_terminal then
        select r.fairness_key into v_key from runs r where r.run_id = p_run_id;
        if not found then
            v_key := coalesce(p_fairness_key, '');
        elsif p_fairness_key is not null and p_fairness_key <> v_key then
            raise exception 'relay.enqueue: run % has fairness_key %, set by its first event; event % names fairness_key %',
                p_run_id, case when v_key = '' then '(none)' else v_key end, p_event_id,
                p_fairness_key using errcode = '22023';
        end if;
    end if;

    insert into outbox (run_id, seq, event_id, event_type, payload, terminal, wake_queue,
                        wake_event, traceparent)
    values (p_run_id, v_seq, p_event_id, p_event_type, p_payload, p_terminal, p_wake_queue,
            p_wake_event, p_traceparent);
    if p_terminal then
        update run_seqs set terminal_seq = v_seq where run_id = p_run_id;
        insert into pending_terminals (run_id, seq, created_at, fairness_key)
        values (p_run_id, v_seq, clock_timestamp(), v_key);
    end if;

    -- Make the run discoverable without touching a row the relay may be working on: a new run
    -- is inserted; an idle one is flipped (the WHERE matches nothing while it is active).
    -- A run that becomes active makes its key known to the shared claim (note_fairness_key).
    insert into runs (run_id, next_attempt_at, fairness_key)
    values (p_run_id, clock_timestamp(), v_key)
    on conflict (run_id) do nothing;
    if found then
        if v_key <> '' then
            -- note_fairness_key, inline: a call of a function that pins its search_path costs
            -- about as much as the rest of this (the lock is fairness_key_lock's)
            perform pg_advisory_xact_lock_shared(
                (hashtext('ledger-relay:fairness-key:' || current_schema())::bigint << 8)
                | (hashtext(v_key) & 255)::bigint);
            if not exists (select 1 from fairness_keys f where f.key = v_key) then
                insert into fairness_keys (key) values (v_key) on conflict do nothing;
            end if;
        end if;
    else
        update runs set idle = false, next_attempt_at = clock_timestamp(), updated_at = clock_timestamp()
        where run_id = p_run_id and idle
        returning fairness_key into v_key;
        if found and v_key <> '' then
            perform note_fairness_key(v_key);
        end if;
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
-- optionally terminal, wake_queue, wake_event, traceparent; p_fairness_key for every one of them.
-- Same checks; all or nothing.
create or replace function enqueue_many(p_run_id text, p_events jsonb,
                                        p_fairness_key text default null) returns bigint[]
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
            v_item ->> 'traceparent',
            p_fairness_key);
        v_i := v_i + 1;
    end loop;
    return v_seqs;
end
$$;

-- Inserts into the `events` view (schema version 7, migration 0007) go to the outbox. For a
-- producer whose call of the previous release's enqueue was waiting for that migration's lock
-- and resumed after the commit with `events` meaning this view: its insert goes to the outbox (the
-- seq it took under its run's lock is right: its run_seqs update holds the row until it
-- commits), and a terminal event enters pending_terminals, as enqueue does now. Nothing else
-- inserts into the view.
create or replace function events_insert() returns trigger
language plpgsql
set search_path from current
as $$
begin
    insert into outbox (run_id, seq, event_id, event_type, payload, terminal, wake_queue,
                        wake_event, traceparent, created_at)
    values (new.run_id, new.seq, new.event_id, new.event_type, new.payload,
            coalesce(new.terminal, false), new.wake_queue, new.wake_event, new.traceparent,
            coalesce(new.created_at, clock_timestamp()));
    if coalesce(new.terminal, false) then
        insert into pending_terminals (run_id, seq, created_at, fairness_key)
        values (new.run_id, new.seq, coalesce(new.created_at, clock_timestamp()),
                coalesce((select r.fairness_key from runs r where r.run_id = new.run_id), ''));
    end if;
    return new;
end
$$;
drop trigger if exists events_insert on events;
create trigger events_insert instead of insert on events
    for each row execute function events_insert();

-- Updates of the `events` view: what a function of the previous release (schema version 6) that
-- was waiting for migration 0007's lock does when it resumes after the commit, in the new
-- layout. A relay's ack in flight then marks events delivered (the cursor moves up to them) and,
-- when the engine refused a wake, undoes it from the refused event on (the cursor goes back
-- below it) and fails that one (event_failures); an operator's skip or retry records itself.
-- Other columns (the per-event attempts of a release) are no longer kept and are ignored.
create or replace function events_update() returns trigger
language plpgsql
set search_path from current
as $$
begin
    if new.state = 'delivered' and old.state <> 'delivered' then
        update runs set delivered_seq = greatest(delivered_seq, new.seq),
                        delivered_at = clock_timestamp()
        where run_id = new.run_id;
        delete from pending_terminals where run_id = new.run_id and seq <= new.seq;
    elsif new.state = 'pending' and old.state = 'delivered' then
        update runs set delivered_seq = least(delivered_seq, new.seq - 1)
        where run_id = new.run_id;
        if new.terminal then
            insert into pending_terminals (run_id, seq, created_at, fairness_key)
            values (new.run_id, new.seq, new.created_at,
                    (select r.fairness_key from runs r where r.run_id = new.run_id))
            on conflict (run_id) do nothing;
        end if;
    elsif new.state = 'failed' and old.state <> 'failed' then
        insert into event_failures as f (run_id, seq, attempts, last_status, last_error, failed_at)
        values (new.run_id, new.seq, coalesce(new.attempts, 1), new.last_status, new.last_error,
                coalesce(new.failed_at, clock_timestamp()))
        on conflict (run_id, seq) do update
            set attempts = excluded.attempts, last_status = excluded.last_status,
                last_error = excluded.last_error, failed_at = excluded.failed_at;
    elsif new.state = 'skipped' and old.state <> 'skipped' then
        insert into event_skips (run_id, seq, skipped_by, skipped_role, skip_reason)
        values (new.run_id, new.seq, coalesce(new.skipped_by, 'unknown'), new.skipped_role,
                coalesce(new.skip_reason, ''))
        on conflict (run_id, seq) do nothing;
        update runs set delivered_seq = greatest(delivered_seq, new.seq)
        where run_id = new.run_id;
        delete from pending_terminals where run_id = new.run_id and seq <= new.seq;
    elsif new.state = 'pending' and old.state = 'failed' then
        update event_failures
        set retried_by = new.retried_by, retried_role = new.retried_role,
            retried_at = new.retried_at, retries = new.retries
        where run_id = new.run_id and seq = new.seq;
    end if;
    return new;
end
$$;
drop trigger if exists events_update on events;
create trigger events_update instead of update on events
    for each row execute function events_update();

-- Relay API --------------------------------------------------------------------------------

-- Whether the run has an event after its cursor (what "pending" means, DESIGN §4.5): one probe
-- of the primary key. Blocked runs answer true (their failed head is after the cursor).
create or replace function has_pending(p_run_id text, p_cursor bigint) returns boolean
language plpgsql stable
set search_path from current
as $$
begin
    return exists (select 1 from outbox o where o.run_id = p_run_id and o.seq > p_cursor);
end
$$;

-- Marks a run idle when it has no pending event. Only while holding the run's `run_seqs` row
-- lock (the one enqueue takes): then no producer is between its insert and its commit, and
-- because the check is a new statement (fresh snapshot) every committed event is seen. If a
-- producer holds the lock the run stays active and is looked at again shortly.
create or replace function settle_run(p_run_id text) returns boolean
language plpgsql volatile
set search_path from current
as $$
begin
    perform 1 from run_seqs s where s.run_id = p_run_id for update skip locked;
    if not found then
        update runs set next_attempt_at = clock_timestamp() + interval '200 milliseconds'
        where run_id = p_run_id;
        return false;
    end if;
    if has_pending(p_run_id, (select r.delivered_seq from runs r where r.run_id = p_run_id)) then
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
-- The lock's key is new and secret at each hold (liveness_key_of): no other role can take it
-- first (issue 48 item 6). Holds of one owner take turns on its `replicas` row. Returns false,
-- and changes nothing, while a session that may hold a liveness (key_held_by_a_replica) holds
-- the key the row records: a process with the same owner id, or this process's previous
-- session that the server has not dropped yet (the caller tries again later). A key held by
-- another role proves nothing: that owner is dead. Called again on the session that holds it,
-- it keeps its lock and returns true.
-- p_incarnation names the calling process (random at each start; null from a relay of schema
-- version 3; no `/`). A replica restarted under the same owner id (a fixed replica_id, or
-- host:pid in a container, where the pid is always 1) would otherwise be taken for its dead
-- predecessor, whose leases then wait out their TTL: when the lock is free and the row names
-- another incarnation, the predecessor is dead, so its unexpired leases end now (claimable at
-- once; the fence as ever: a new token and epoch at the next claim). The same process
-- reconnecting keeps them. (Version 3 took only p_owner: migration 0007 drops that one.)
create or replace function hold_liveness(p_owner text, p_incarnation text default null)
returns boolean
language plpgsql volatile
set search_path from current
security definer
as $$
declare
    v_mine text := coalesce(p_incarnation, '') || '/' || gen_random_uuid();
    v_prev text;
    v_prev_key bigint;
    v_prev_process text;  -- the process part of v_prev
    v_recorded boolean;
begin
    if p_owner is null or p_owner = '' then
        raise exception 'relay.hold_liveness: owner must be a non-empty string' using errcode = '22023';
    end if;
    if char_length(p_incarnation) > 200 or strpos(p_incarnation, '/') > 0 then
        raise exception 'relay.hold_liveness: p_incarnation must be at most 200 characters, '
                        'without "/"' using errcode = '22023';
    end if;
    loop  -- the owner's row: ours if there was none, else locked until commit
        insert into replicas (owner, incarnation, server_started_at)
        values (p_owner, v_mine, pg_postmaster_start_time())
        on conflict (owner) do nothing;
        v_recorded := found;
        exit when v_recorded;
        select rp.incarnation into v_prev from replicas rp where rp.owner = p_owner for update;
        exit when found;  -- else deleted meanwhile (a dead owner forgotten): insert again
    end loop;
    if not v_recorded then
        v_prev_key := liveness_key_of(p_owner, v_prev);
        if session_holds_key(v_prev_key) then
            v_mine := v_prev;  -- held by this session already: kept
        elsif key_held_by_a_replica(v_prev_key) then
            return false;
        else
            -- The predecessor is dead. Another process's leases end now.
            v_prev_process := case when strpos(v_prev, '/') > 0 then split_part(v_prev, '/', 1)
                                   else v_prev end;
            if p_incarnation is not null and v_prev_process is distinct from p_incarnation then
                update runs r
                set lease_expires_at = clock_timestamp(), updated_at = clock_timestamp(),
                    next_attempt_at = least(r.next_attempt_at, clock_timestamp())
                where r.lease_owner = p_owner and r.lease_expires_at > clock_timestamp();
            end if;
        end if;
        -- The server's lifetime with it: the lock lives no longer than the server (see claim).
        update replicas rp set incarnation = v_mine, seen_at = clock_timestamp(),
            server_started_at = pg_postmaster_start_time()
        where rp.owner = p_owner;
    end if;
    if v_mine is distinct from v_prev and not pg_try_advisory_lock(liveness_key_of(p_owner, v_mine)) then
        -- a new random key already taken (odds of 2^-64): nothing of this call stays
        raise exception 'relay.hold_liveness: the new liveness key is taken; try again'
            using errcode = '55P03';
    end if;
    -- Forget dead replicas that hold no unexpired lease, as prune does: every claim looks at
    -- each row, so the table stays as small as the set of replicas that matter, even when
    -- retention is off and prune never runs (each restart brings a new owner id). A row that
    -- another hold has locked is passed over, never waited for.
    delete from replicas d
    where d.owner in (
        select x.owner from replicas x
        where x.owner <> p_owner
          and not exists (select 1 from runs w
                          where w.lease_owner = x.owner and w.lease_expires_at > clock_timestamp())
          and pg_try_advisory_xact_lock(liveness_key_of(x.owner, x.incarnation))
        for update skip locked);
    return true;
end
$$;

-- A replica's clean stop (issue 41, DESIGN §4.2), the end of what hold_liveness began: called
-- on the session that holds p_owner's liveness lock (its LISTEN connection) once its lanes
-- finished or released their work. No other session may, so one replica cannot make another
-- look stopped. An owner that holds no unexpired lease is forgotten, as prune forgets a dead
-- one, but at once: `relay status` lists a `replicas` row whose lock is free as dead, and this
-- one is not. One that still holds a lease (a release that failed) keeps its row, so once its
-- lock is free the others take those runs at once, as a dead owner's. Then the lock is given
-- up, every hold of it (it is re-entrant). Returns whether the owner was forgotten.
-- The lock goes before the delete commits (a session lock is released at once): a claim in
-- that moment may see the row with its lock free, and then judges dead an owner that holds no
-- unexpired lease, which takes nothing from it.
create or replace function replica_stopped(p_owner text) returns boolean
language plpgsql volatile
set search_path from current
security definer
as $$
declare
    v_key bigint;
    v_forgotten boolean;
begin
    perform require_liveness_holder(p_owner, 'replica_stopped');
    select liveness_key_of(rp.owner, rp.incarnation) into v_key
    from replicas rp where rp.owner = p_owner;
    delete from replicas rp
    where rp.owner = p_owner
      and not exists (select 1 from runs w
                      where w.lease_owner = rp.owner and w.lease_expires_at > clock_timestamp());
    v_forgotten := found;
    while session_holds_key(v_key) loop
        perform pg_advisory_unlock(v_key);
    end loop;
    return v_forgotten;
end
$$;

-- The owners whose leases a claim may take before their expiry (issue 18): a `replicas` row
-- whose liveness lock no session holds, recorded in this server's lifetime (issue 29: a restart
-- or a failover drops every lock, so an older row's free lock proves nothing; its leases run to
-- their expiry). The caller is never among them. The try-lock is shared and transaction-level:
-- it succeeds only while no session holds the key exclusively, takes nothing from a live owner,
-- and several claimers may hold it at once.
-- A caller that claims is alive, whatever its lock says: when its own lock is free (its LISTEN
-- session is gone while the process works on, e.g. a network cut that its pool survived), its
-- row is forgotten, so no replica takes its leases early while its LISTEN connection is down
-- (they expire as before); hold_liveness records it again on reconnect. Without this, replicas
-- whose LISTEN connections lag their pools take each other's runs back and forth.
create or replace function dead_owners(p_owner text) returns text[]
language plpgsql volatile
set search_path from current
as $$
begin
    delete from replicas me
    where me.owner = p_owner and pg_try_advisory_xact_lock_shared(
              liveness_key_of(me.owner, me.incarnation));
    return array(select rp.owner from replicas rp
                 where rp.owner <> p_owner
                   and rp.server_started_at = pg_postmaster_start_time()
                   and pg_try_advisory_xact_lock_shared(liveness_key_of(rp.owner, rp.incarnation)));
end
$$;

-- The three ways a claim picks runs (claim below takes the one its arguments name). Each
-- returns the runs it locked (FOR UPDATE SKIP LOCKED: a run another claimer holds is passed
-- over) with their previous owner and expiry. Blocked and idle runs are never picked.
-- These and claimed_prefixes are plpgsql, not sql, though each is one query: PostgreSQL plans a
-- SQL function's query again at every call (~0.5 ms a claim of 64 runs, measured), plpgsql
-- keeps its plan.

-- One run by id (the terminal drain): its lease must be free, expired or a dead owner's, and a
-- run backing off after a failure waits for its next attempt.
create or replace function pick_run(p_run_id text, p_dead text[])
returns table (run_id text, prev_owner text, prev_expires timestamptz)
language plpgsql volatile
rows 10  -- a claim's size: the planner's default of 1,000 would scan runs to join them
set search_path from current
as $$
begin
    return query
    select r.run_id, r.lease_owner, r.lease_expires_at
    from runs r
    where r.run_id = p_run_id and not r.idle and r.blocked_seq is null
      and (r.lease_expires_at is null or r.lease_expires_at <= clock_timestamp()
           or r.lease_owner = any(p_dead))
      and (r.attempts = 0 or r.next_attempt_at <= clock_timestamp()
           or r.lease_owner = any(p_dead))
    for update skip locked;
end
$$;

-- Fair shares between keys (schema version 9; docs/design.md "Scheduling: fair shares between
-- keys"). Each lane shares its claims among the fairness keys that have due work, in proportion
-- to their weights, by stride scheduling: the key with the least pass goes next, one run, and
-- its pass advances by 1,000,000 / weight. Within a key the lane's own order holds (critical:
-- the oldest pending terminal first; ordinary: the run due longest), and a run's events are
-- untouched. When one key has work, which is the usual case, the lane takes its runs as before,
-- from that key's index, and no pass is read or written.

-- The keys that have runs in the lane (up to p_limit of them, in key order): one descent of the
-- lane's index by key per key (a loose index scan). For the ordinary lane also the key's
-- earliest due time, the first entry of the key in runs_due_by_key (null for the critical lane:
-- pick_shared asks which of its keys have a due run).
create or replace function lane_keys(p_lane text, p_limit int)
returns table (key text, due_at timestamptz)
language plpgsql volatile
set search_path from current
as $$
begin
    if p_lane = 'critical' then
        return query
        with recursive k(key) as (
            (select t.fairness_key from pending_terminals t order by t.fairness_key limit 1)
            union all
            select n.key from k
            cross join lateral (select t.fairness_key as key from pending_terminals t
                                where t.fairness_key > k.key
                                order by t.fairness_key limit 1) n
        )
        select k.key, null::timestamptz from k
        limit p_limit;
    else
        return query
        with recursive k(key, due_at) as (
            (select r.fairness_key, r.next_attempt_at from runs r
             where not r.idle and r.blocked_seq is null
             order by r.fairness_key, r.next_attempt_at limit 1)
            union all
            select n.key, n.due_at from k
            cross join lateral (select r.fairness_key as key, r.next_attempt_at as due_at
                                from runs r
                                where not r.idle and r.blocked_seq is null
                                  and r.fairness_key > k.key
                                order by r.fairness_key, r.next_attempt_at limit 1) n
        )
        select k.key, k.due_at from k
        limit p_limit;
    end if;
end
$$;

-- The due runs of each key of p_keys, up to its quota (p_quotas, the same position) of them, in
-- the lane's order within the key, locked (a run another claimer holds is passed over), but
-- none of p_exclude (taken already by this claim); each key's runs together, in that order.
-- The critical lane: runs whose terminal event is not delivered yet (pending_terminals), the
-- oldest terminal event first, when due (or their owner died). The ordinary lane: any due run,
-- the one due longest first.
-- One statement for every key of a claim's round (schema version 14): a plpgsql call a key
-- cost 15-25 us of its own setup beside its query's ~25 us, 1.4-1.7 ms of a 64-run claim over 64
-- keys (docs/performance.md, "One statement for a round's keys").
create or replace function pick_of_keys(p_lane text, p_keys text[], p_quotas int[],
                                        p_dead text[], p_exclude text[])
returns table (key text, run_id text, prev_owner text, prev_expires timestamptz)
language plpgsql volatile
rows 10  -- a claim's size: the planner's default of 1,000 would scan runs to join them
set search_path from current
as $$
declare
    -- The claim's moment, read once: a variable is a parameter of the query, which the index
    -- can bound by (runs_due_by_key: fairness_key = q.key and next_attempt_at <= v_moment);
    -- clock_timestamp() is volatile, so a filter on it would read every run of the key
    -- (schema version 12). A run falling due during the claim waits for the next claim.
    v_moment timestamptz := clock_timestamp();
begin
    if p_lane = 'critical' then
        return query
        select q.key, c.run_id, c.lease_owner, c.lease_expires_at
        from unnest(p_keys, p_quotas) as q(key, n)
        cross join lateral (
            select r.run_id, r.lease_owner, r.lease_expires_at
            from pending_terminals t join runs r on r.run_id = t.run_id
            where t.fairness_key = q.key and not r.idle and r.blocked_seq is null
              and (r.next_attempt_at <= v_moment or r.lease_owner = any(p_dead))
              and not (r.run_id = any(p_exclude))
            order by t.created_at
            limit q.n
            for update of r skip locked
        ) c;
    else
        return query
        select q.key, c.run_id, c.lease_owner, c.lease_expires_at
        from unnest(p_keys, p_quotas) as q(key, n)
        cross join lateral (
            select r.run_id, r.lease_owner, r.lease_expires_at
            from runs r
            where r.fairness_key = q.key and not r.idle and r.blocked_seq is null
              and r.next_attempt_at <= v_moment
              and not (r.run_id = any(p_exclude))
            order by r.next_attempt_at
            limit q.n
            for update skip locked
        ) c;
    end if;
end
$$;
-- Until this release one key a call (pick_of_key): nothing calls it now.
drop function if exists pick_of_key(text, text, int, text[], text[]);

-- A lane's pick over its keys: the one key's runs when one key has runs in the lane, else the
-- fair share of each key with due work (pick_shared).
create or replace function pick_lane(p_lane text, p_runs int, p_dead text[], p_exclude text[])
returns table (run_id text, prev_owner text, prev_expires timestamptz)
language plpgsql volatile
rows 10
set search_path from current
as $$
declare
    v_keys text[];
begin
    if p_runs <= 0 then
        return;
    end if;
    v_keys := array(select k.key from lane_keys(p_lane, 2) k);
    if cardinality(v_keys) = 1 then
        return query
        select c.run_id, c.prev_owner, c.prev_expires
        from pick_of_keys(p_lane, v_keys, array[p_runs], p_dead, p_exclude) c;
    elsif cardinality(v_keys) > 1 then
        return query select * from pick_shared(p_lane, p_runs, p_dead, p_exclude);
    end if;
end
$$;

-- Stride scheduling over the keys with due work. A key's j-th next run (j = 0, 1, ...) is
-- served at the virtual time pass + j * stride, stride = 1,000,000 / weight; the claim takes the
-- p_runs runs with the least such tickets. A key's pass is at least the lane's clock
-- (fairness_clock): a key back from idle starts level with the least pass of the keys that had
-- work at the lane's last shared claim, with no credit for the time it had nothing to send.
-- The keys are walked in the lane's pass order (fairness_keys_by_pass_*, schema version 10),
-- passing over those without due work, and taken in only while the keys taken in hold fewer
-- tickets at or below the pass of the next due key than the claim still wants: no key after it
-- can hold one of the least tickets, so a claim reads about as many keys as it takes runs, not
-- every key (on a tie the key walked first goes first). The tickets are numbers until the least
-- are chosen (bounded first by the least of the p_runs-th smallest pass and every key's own
-- p_runs-th ticket: none above it can be among them); only then are the chosen keys' runs read,
-- as many of each as it has tickets. A key that gives fewer (it has no more due, or another
-- claimer holds them) is left out of the next round, which shares what is left among the others,
-- walking on when those hold too few tickets.
-- Claims of one lane that share are serialised by the lane's clock row (read, then written
-- with the passes); the passes are written in key order, so two lanes never deadlock.
create or replace function pick_shared(p_lane text, p_runs int, p_dead text[], p_exclude text[])
returns table (run_id text, prev_owner text, prev_expires timestamptz)
language plpgsql volatile
rows 10
set search_path from current
as $$
declare
    v_clock bigint;
    v_walk refcursor;         -- fairness_keys in the lane's pass order
    v_walked bool := false;   -- the walk reached its end
    v_key text;
    v_pass bigint;
    v_weight int;
    v_next_key text;          -- the next key with due work, not taken in yet: every key after
    v_next_pass bigint;       -- it in the walk has at least its pass
    v_next_stride bigint;
    v_below bigint;
    v_live int := 0;          -- keys taken in and not short
    v_keys text[] := '{}';    -- the keys taken in (each with due work), their pass and stride
    v_passes bigint[] := '{}';
    v_strides bigint[] := '{}';
    v_short text[] := '{}';   -- keys that ran out of runs in this claim
    v_left int := p_runs;
    v_runs text[] := '{}';
    v_owners text[] := '{}';
    v_expires timestamptz[] := '{}';
    v_served text[] := '{}';  -- the key of each run taken, in v_runs' order
    v_round_runs text[];
    v_round_owners text[];
    v_round_expires timestamptz[];
    v_round_keys text[];
    v_round_short text[];
    v_moment timestamptz := clock_timestamp();  -- the claim's moment (below)
begin
    select c.vtime into v_clock from fairness_clock c where c.lane = p_lane for update;
    -- Only the keys with due work: one descent of runs_due_by_key for each key walked past
    -- (a key whose runs are all leased or backing off has none due in either lane), and for the
    -- critical lane then its pending terminals, the oldest first, to one whose run is due.
    -- One descent because the bound is v_moment, read once: a variable is a parameter of the
    -- query, so the index scan is bounded by the key and the moment (Index Cond: fairness_key =
    -- f.key and next_attempt_at <= $n) and ends at the key's first run not due. Until schema
    -- version 12 the bound was clock_timestamp(), which is volatile: the scan was bounded by the
    -- key alone and filtered the key's runs one by one, so a key with 200 runs leased cost ~400
    -- buffers, not ~4 (docs/performance.md, issue 50). A run that falls due during the claim
    -- waits for the next claim.
    -- The critical walk's two `exists` stay subqueries asked key by key in the walk's order
    -- (`offset 0`: PostgreSQL neither turns such an exists into a join nor hashes it). Without
    -- the volatile clock it may, and the claim's generic plan then read every due run (one scan
    -- of runs_due hashed: 200,000 runs a claim at 1M events, 100-150 ms) before the first key.
    if p_lane = 'critical' then
        open v_walk for
            select f.key, f.pass_critical, f.weight from fairness_keys f
            where (cardinality(p_dead) > 0
                   or exists (select 1 from runs r
                              where r.fairness_key = f.key and not r.idle
                                and r.blocked_seq is null
                                and r.next_attempt_at <= v_moment
                              offset 0))
              and exists (select 1 from pending_terminals t join runs r on r.run_id = t.run_id
                          where t.fairness_key = f.key and not r.idle and r.blocked_seq is null
                            and (r.next_attempt_at <= v_moment
                                 or r.lease_owner = any(p_dead))
                          offset 0)
            order by f.pass_critical, f.key;
    else
        open v_walk for
            select f.key, f.pass_ordinary, f.weight from fairness_keys f
            where exists (select 1 from runs r
                          where r.fairness_key = f.key and not r.idle and r.blocked_seq is null
                            and r.next_attempt_at <= v_moment)
            order by f.pass_ordinary, f.key;
    end if;

    for v_round in 1 .. 8 loop
        exit when v_left <= 0;
        -- Take in keys until those not short hold v_left tickets at or below the next one's pass.
        loop
            while v_next_key is null and not v_walked loop
                fetch v_walk into v_key, v_pass, v_weight;
                if not found then
                    v_walked := true;
                else
                    v_next_key := v_key;
                    v_next_pass := greatest(v_pass, v_clock);
                    v_next_stride := 1000000 / v_weight;
                end if;
            end loop;
            exit when v_next_key is null;
            -- Each key taken in holds a ticket at or below the next one's pass until it is
            -- served (round 1 serves none yet): only a later round needs the tickets counted.
            if v_live >= v_left then
                exit when v_round = 1;
                select coalesce(sum((v_next_pass - k.pass) / k.stride + 1), 0) into v_below
                from (select u.pass + u.stride * (select count(*) from unnest(v_served) s
                                                  where s = u.key) as pass,
                             u.stride
                      from unnest(v_keys, v_passes, v_strides) as u(key, pass, stride)
                      where not (u.key = any(v_short))) k
                where k.pass <= v_next_pass;
                exit when v_below >= v_left;
            end if;
            v_keys := v_keys || v_next_key;
            v_passes := v_passes || v_next_pass;
            v_strides := v_strides || v_next_stride;
            v_live := v_live + 1;
            v_next_key := null;
            v_next_pass := null;
        end loop;
        exit when v_keys <@ v_short;
        with k as (
            select u.key, u.pass + u.stride * (select count(*) from unnest(v_served) s
                                               where s = u.key) as pass,
                   u.stride
            from unnest(v_keys, v_passes, v_strides) as u(key, pass, stride)
            where not (u.key = any(v_short))
        ), bound as (
            select least((select min(k.pass + (v_left - 1) * k.stride) from k),
                         (select k.pass from k order by k.pass offset v_left - 1 limit 1)) as upto
        ), tickets as (
            -- the v_left least tickets, by arithmetic alone: no run is read for the others
            select k.key, k.pass + j * k.stride as ticket
            from k cross join bound b
            cross join lateral generate_series(0, least(v_left, (b.upto - k.pass) / k.stride + 1) - 1) j
            where k.pass <= b.upto
            order by 2, 1
            limit v_left
        ), quota as (
            -- a key's tickets among them: how many of its runs the round takes
            select t.key, count(*)::int as n from tickets t group by t.key
        ), taken as materialized (
            select * from pick_of_keys(p_lane, array(select q.key from quota q order by q.key),
                                       array(select q.n from quota q order by q.key),
                                       p_dead, p_exclude || v_runs)
        )
        select coalesce(array_agg(t.run_id), '{}'), coalesce(array_agg(t.prev_owner), '{}'),
               coalesce(array_agg(t.prev_expires), '{}'), coalesce(array_agg(t.key), '{}'),
               array(select q.key from quota q
                     where q.n > (select count(*) from taken c where c.key = q.key))
        from taken t
        into v_round_runs, v_round_owners, v_round_expires, v_round_keys, v_round_short;
        exit when cardinality(v_round_runs) = 0 and cardinality(v_round_short) = 0;
        v_runs := v_runs || v_round_runs;
        v_owners := v_owners || v_round_owners;
        v_expires := v_expires || v_round_expires;
        v_served := v_served || v_round_keys;
        v_short := v_short || v_round_short;
        v_live := v_live - cardinality(v_round_short);
        v_left := v_left - cardinality(v_round_runs);
    end loop;
    close v_walk;
    if cardinality(v_keys) = 0 then
        return;
    end if;

    -- The passes after this claim: every key taken in, its runs taken counted.
    select array_agg(u.pass + u.stride * (select count(*) from unnest(v_served) s where s = u.key)
                     order by u.key),
           array_agg(u.key order by u.key)
    into v_passes, v_keys
    from unnest(v_keys, v_passes, v_strides) as u(key, pass, stride);
    if p_lane = 'critical' then
        insert into fairness_keys as f (key, pass_critical)
        select u.key, u.pass from unnest(v_keys, v_passes) as u(key, pass)
        where u.key = any(v_served)
        order by u.key
        on conflict (key) do update set pass_critical = excluded.pass_critical;
    else
        insert into fairness_keys as f (key, pass_ordinary)
        select u.key, u.pass from unnest(v_keys, v_passes) as u(key, pass)
        where u.key = any(v_served)
        order by u.key
        on conflict (key) do update set pass_ordinary = excluded.pass_ordinary;
    end if;
    -- The least pass of the keys with due work: those taken in, and the next one's (every key
    -- not taken in has at least its pass).
    update fairness_clock c
    set vtime = greatest(c.vtime, least((select min(p) from unnest(v_passes) p), v_next_pass))
    where c.lane = p_lane;

    return query select * from unnest(v_runs, v_owners, v_expires);
end
$$;

-- The advisory lock of a key's row in fairness_keys (note_fairness_key, prune_fairness_keys):
-- one of 256 per schema, by the key's hash, so a producer's transaction that makes runs of many
-- keys active holds at most 256 locks (the server's lock table is shared and bounded:
-- max_locks_per_transaction); keys that share a lock only make retention pass over more rows
-- for a turn.
create or replace function fairness_key_lock(p_key text) returns bigint
language sql immutable parallel safe
set search_path from current
as $$
    select (hashtext('ledger-relay:fairness-key:' || current_schema())::bigint << 8)
           | (hashtext(p_key) & 255)::bigint
$$;

-- A run of key p_key became active (a new run, an idle one enqueued to, an unblocked one): the
-- key gets its row in fairness_keys if it has none, or the shared claim's walk would never see
-- it (schema version 10). A plain read first: a busy key's producers find the row and write
-- nothing (no hot row), and never wait for a claim writing its pass. The shared advisory lock,
-- held to commit, keeps prune_fairness_keys from removing the row between that read and this
-- run's commit; producers' shared holds never wait for each other. The default key's row is
-- the migration's and is never pruned.
create or replace function note_fairness_key(p_key text) returns void
language plpgsql volatile
set search_path from current
as $$
begin
    perform pg_advisory_xact_lock_shared(fairness_key_lock(p_key));
    if not exists (select 1 from fairness_keys f where f.key = p_key) then
        insert into fairness_keys (key) values (p_key) on conflict do nothing;
    end if;
end
$$;

-- The critical lane: runs whose terminal event is not delivered yet, shared among their keys.
create or replace function pick_critical(p_runs int, p_dead text[])
returns table (run_id text, prev_owner text, prev_expires timestamptz)
language plpgsql volatile
rows 10  -- a claim's size: the planner's default of 1,000 would scan runs to join them
set search_path from current
as $$
begin
    return query select * from pick_lane('critical', p_runs, p_dead, '{}');
end
$$;

-- The ordinary lane takes any due run (work-conserving), a dead owner's runs first, whatever
-- their key (recovery of a replica's leases, bounded by what it held), then shares the rest
-- among the keys. Those are found through runs_leased (nothing to do while none died); their
-- order is by an expression runs_due cannot give: walking runs_due in order to its leased runs
-- (due an hour on) read every due run first, a claim O(backlog).
create or replace function pick_ordinary(p_runs int, p_dead text[])
returns table (run_id text, prev_owner text, prev_expires timestamptz)
language plpgsql volatile
rows 10  -- a claim's size: the planner's default of 1,000 would scan runs to join them
set search_path from current
as $$
declare
    v_dead_runs text[] := '{}';
begin
    if cardinality(p_dead) > 0 then
        for run_id, prev_owner, prev_expires in
            select r.run_id, r.lease_owner, r.lease_expires_at
            from runs r
            where r.lease_owner = any(p_dead) and not r.idle and r.blocked_seq is null
            order by r.next_attempt_at + interval '0'
            limit p_runs
            for update skip locked
        loop
            v_dead_runs := v_dead_runs || run_id;
            return next;
        end loop;
    end if;
    return query select * from pick_lane('ordinary', p_runs - cardinality(v_dead_runs), p_dead,
                                         v_dead_runs);
end
$$;

-- Claims up to p_runs whole runs: each run's lease is taken (owner, fresh token, expiry on the
-- database clock, epoch bumped) and its pending prefix (up to p_batch events after its cursor)
-- returned, one row per event, in seq order, each run's rows together; the run's own columns
-- (epoch, lease_token, lease_expires_at, attempts, critical, claimed_at, reclaimed_from,
-- retry_waived) on its first row only, NULL on the others (every relay version reads them
-- there). p_run_id targets one run (pick_run); else p_lane 'critical' (pick_critical) or
-- 'ordinary' (pick_ordinary). A lease is claimable before its expiry when its owner is dead
-- (dead_owners). The fence does not change: a new token, the epoch bumped,
-- acks/renewals/releases fenced as ever.
-- `reclaimed_from` names the dead owner of a run whose unexpired lease was taken, else null.
-- `retry_waived`: an operator's `relay retry` made the run due (make_due) and no attempt has
-- ended since: the relay sends it past its retry budget (schema version 11). The claim leaves it
-- set: what ends the attempt clears it (ack_round, release of a failed attempt, block_event), so
-- a claim handed back unsent (a lost lease, a stop) keeps it for the next one.
-- `p_claim` (schema version 13) names the claim: each run's token is derived from it
-- (claim_token), so that a relay whose claim's answer was lost (its connection cut after the
-- commit) can give back the runs it took without knowing them (release_claims); without it,
-- they waited for their leases to expire, their owner alive and unaware it held them.
-- Shims for relays of older versions during a rolling upgrade are in the migrations that made
-- them necessary (the signature is that of version 6, with p_claim last since version 13; the
-- result, version 6's with retry_waived last, which the relays of earlier versions do not name).
create or replace function claim(
    p_owner text, p_runs int, p_batch int, p_ttl interval, p_lane text, p_run_id text default null,
    p_max_bytes bigint default null, p_claim uuid default null
) returns table (
    run_id text, epoch bigint, lease_token uuid, lease_expires_at timestamptz, attempts int,
    critical boolean, seq bigint, event_id text, event_type text, payload text, terminal boolean,
    created_at timestamptz, traceparent text, wake_queue text, claimed_at timestamptz,
    reclaimed_from text, retry_waived boolean
)
language plpgsql volatile
set search_path from current
set plan_cache_mode = force_generic_plan
security definer
as $$
declare
    v_dead text[] := dead_owners(p_owner);
    -- the runs taken, and their columns as the update left them
    v_taken text[];
    v_epochs bigint[];
    v_tokens uuid[];
    v_expires timestamptz[];
    v_attempts int[];
    v_cursors bigint[];
    v_reclaimed text[];
    v_waived boolean[];
    v_empty text[];
begin
    with picked as (
        select * from pick_run(p_run_id, v_dead) where p_run_id is not null
        union all
        select * from pick_critical(p_runs, v_dead) where p_run_id is null and p_lane = 'critical'
        union all
        select * from pick_ordinary(p_runs, v_dead) where p_run_id is null and p_lane = 'ordinary'
    ), taken as (
        update runs u
        set epoch = u.epoch + 1,
            lease_owner = p_owner,
            lease_token = claim_token(p_claim, u.run_id),
            -- One reading of the clock: while leased, next_attempt_at is exactly the expiry.
            lease_expires_at = x.expires,
            next_attempt_at = x.expires,
            updated_at = clock_timestamp()
        from (select p.*, clock_timestamp() + p_ttl as expires from picked p) x
        where u.run_id = x.run_id
        returning u.run_id, u.epoch, u.lease_token, u.lease_expires_at, u.attempts,
            u.delivered_seq,
            case when x.prev_owner = any(v_dead) and x.prev_expires > clock_timestamp()
                 then x.prev_owner end as reclaimed,
            u.retry_waived
    )
    select array_agg(t.run_id), array_agg(t.epoch), array_agg(t.lease_token),
           array_agg(t.lease_expires_at), array_agg(t.attempts), array_agg(t.delivered_seq),
           array_agg(t.reclaimed), array_agg(t.retry_waived)
    into v_taken, v_epochs, v_tokens, v_expires, v_attempts, v_cursors, v_reclaimed, v_waived
    from taken t;
    if v_taken is null then
        return;
    end if;
    -- Runs with nothing pending after all (delivered meanwhile): give the lease back. Their
    -- rows are locked by the update above, so the statement below returns exactly the others.
    v_empty := array(select t.run_id from unnest(v_taken, v_cursors) as t(run_id, cursor)
                     where not exists (select 1 from outbox o
                                       where o.run_id = t.run_id and o.seq > t.cursor));
    if cardinality(v_empty) > 0 then
        update runs set lease_owner = null, lease_token = null, lease_expires_at = null,
                        next_attempt_at = clock_timestamp()
        where runs.run_id = any(v_empty);
        perform settle_run(x) from unnest(v_empty) as x;
    end if;
    return query select * from claimed_prefixes(v_taken, v_epochs, v_tokens, v_expires, v_attempts,
                                                v_cursors, v_reclaimed, v_waived, v_empty,
                                                p_batch, p_max_bytes, clock_timestamp());
end
$$;

-- The rows claim returns for the runs it took (v_taken, less the empty ones): each run's pending
-- prefix in seq order, the run's columns on its first row. The prefix stops early at
-- p_max_bytes of payload (a bound on the relay's memory and on the POST's size, whatever the
-- payload sizes); its first event always goes, alone if it is larger than the bound. Each
-- timestamptz, uuid and int the caller would read again costs it microseconds per event
-- (issue 16: ~5 us a row), hence NULL after the first row.
create or replace function claimed_prefixes(
    p_taken text[], p_epochs bigint[], p_tokens uuid[], p_expires timestamptz[], p_attempts int[],
    p_cursors bigint[], p_reclaimed text[], p_waived boolean[], p_empty text[], p_batch int,
    p_max_bytes bigint, p_now timestamptz
) returns table (
    run_id text, epoch bigint, lease_token uuid, lease_expires_at timestamptz, attempts int,
    critical boolean, seq bigint, event_id text, event_type text, payload text, terminal boolean,
    created_at timestamptz, traceparent text, wake_queue text, claimed_at timestamptz,
    reclaimed_from text, retry_waived boolean
)
language plpgsql volatile
set search_path from current
as $$
begin
    return query
    select u.run_id,
           case when p.n = 1 then u.epoch end,
           case when p.n = 1 then u.token end,
           case when p.n = 1 then u.expires end,
           case when p.n = 1 then u.attempts end,
           case when p.n = 1 then exists (select 1 from pending_terminals t
                                          where t.run_id = u.run_id) end,
           p.seq, p.event_id, p.event_type, p.payload, p.terminal, p.created_at,
           p.traceparent, p.wake_queue,
           case when p.n = 1 then p_now end,
           case when p.n = 1 then u.reclaimed end,
           case when p.n = 1 then u.waived end
    from unnest(p_taken, p_epochs, p_tokens, p_expires, p_attempts, p_cursors, p_reclaimed,
                p_waived)
         with ordinality as u(run_id, epoch, token, expires, attempts, cursor, reclaimed, waived,
                              i)
    cross join lateral (
        select e.seq, e.event_id, e.event_type, t.payload, e.terminal, e.created_at,
               e.traceparent, e.wake_queue,
               sum(octet_length(t.payload)) over (order by e.seq) as upto_bytes,
               row_number() over (order by e.seq) as n
        from (select * from outbox o
              where o.run_id = u.run_id and o.seq > u.cursor
              order by o.seq
              limit p_batch) e
        cross join lateral (select e.payload::text as payload) t
    ) p
    where not (u.run_id = any(p_empty))
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
-- (backoff); p_error, when given, counts a failed attempt of the run's head (its attempts, last
-- error and status live on the run; p_first_seq/p_last_seq, the events the attempt carried, are
-- accepted for the relays of version 6 and not needed) and takes an operator's waiver of the
-- retry budget, which was that attempt's (claim). Returns whether the token matched.
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
        last_status = case when p_error is null then last_status else p_status end,
        retry_waived = retry_waived and p_error is null,
        updated_at = clock_timestamp()
    where runs.run_id = p_run_id and lease_token = p_token;
    return found;
end
$$;

-- A run's lease token in the claim named p_claim: derived from the claim's name and the run, so
-- that release_claims finds the runs of a claim whose answer never arrived; a fresh random one
-- for a claim without a name (relays before version 13). Unique per run and claim, and as hard
-- to guess as the claim's name, which the relay draws at random (uuid4).
create or replace function claim_token(p_claim uuid, p_run_id text) returns uuid
language sql volatile parallel safe
set search_path from current
as $$
    select case when p_claim is null then gen_random_uuid()
                else md5(p_claim::text || p_run_id)::uuid end
$$;

-- Gives back the runs that p_owner's claims named p_claims took, when the relay never read their
-- answer (the connection was cut, or the deadline passed, after the claim may have committed):
-- their leases end now and the runs are due at once, for this replica's next claim or any
-- other's. Nothing was sent under such a lease (its events never reached the relay), so this is
-- a release without an attempt: attempts, errors and an operator's waiver stay as they were.
-- Fenced by owner and token: a run claimed since by anyone, or never taken by these claims, is
-- left alone. Returns the runs given back.
create or replace function release_claims(p_owner text, p_claims uuid[])
returns table (run_id text)
language plpgsql volatile
set search_path from current
security definer
as $$
begin
    return query
    update runs r
    set lease_owner = null, lease_token = null, lease_expires_at = null,
        next_attempt_at = clock_timestamp(), updated_at = clock_timestamp()
    where r.lease_owner = p_owner
      and r.lease_token = any(array(select claim_token(c, r.run_id) from unnest(p_claims) c))
    returning r.run_id;
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
-- fence): the run is blocked at p_seq with its lease cleared, and the failure recorded in
-- event_failures with the attempts it took (the run's failed attempts and this one). An event
-- that failed before (and was retried) adds to its row. Not granted to any role: only functions
-- of this schema call it.
create or replace function block_event(
    p_run_id text, p_seq bigint, p_status int, p_error text
) returns void
language plpgsql volatile
set search_path from current
security definer
as $$
declare
    v_attempts int;
begin
    update runs
    set lease_owner = null, lease_token = null, lease_expires_at = null,
        blocked_seq = p_seq, last_error = left(p_error, 2000), last_status = p_status,
        retry_waived = false, updated_at = clock_timestamp()
    where runs.run_id = p_run_id
    returning attempts + 1 into v_attempts;
    insert into event_failures as f (run_id, seq, attempts, last_status, last_error, failed_at)
    values (p_run_id, p_seq, v_attempts, p_status, left(p_error, 2000), clock_timestamp())
    on conflict (run_id, seq) do update
        set attempts = f.attempts + excluded.attempts, last_status = excluded.last_status,
            last_error = excluded.last_error, failed_at = excluded.failed_at;
end
$$;

-- Acknowledges delivered batches in one transaction (DESIGN §6). p_batches is a JSON array of
-- {"run_id", "token", "upto", "keep"?}: the run's cursor moves up to seq `upto` (events up to it
-- are delivered), only if the token still holds an unexpired lease. For each batch acked: one
-- outbox_delivered notification on the terminal channel, an absurd.emit_event for every event
-- with a wake, and one pg_notify('absurd_wake', queue) per queue. A stale batch changes nothing
-- and does not stop the others. An engine that rejects a wake marks that event failed and
-- blocks its run, and the cursor stops before it. The lease is released unless "keep" is true.
-- Returns one row per input batch, in input order: status 'acked' | 'stale' | 'failed', the
-- number of events acked, the seq acked up to, the commit-to-ack lag of the oldest event, and
-- the engine's error for a failed batch.
-- A run named twice in one call (the relay does not) is acknowledged in rounds, its first batch
-- in the first round (ack_round): each round sees the lease the one before left.
create or replace function ack(p_batches jsonb)
returns table (run_id text, status text, acked int, last_seq bigint, lag_seconds double precision,
               error text)
language plpgsql volatile
set search_path from current
set plan_cache_mode = force_generic_plan
security definer
as $$
declare
    v_round bigint := 0;
    v_rounds bigint;
    v_i bigint[];
    v_runs text[];
    v_tokens uuid[];
    v_upto bigint[];
    v_keep boolean[];
    r_i bigint[] := '{}';
    r_run text[] := '{}';
    r_status text[] := '{}';
    r_n int[] := '{}';
    r_last bigint[] := '{}';
    r_lag double precision[] := '{}';
    r_err text[] := '{}';
begin
    loop
        v_round := v_round + 1;
        select array_agg(b.i order by b.i), array_agg(b.run_id order by b.i),
               array_agg(b.token order by b.i), array_agg(b.upto order by b.i),
               array_agg(coalesce(b.keep, false) order by b.i), max(b.rounds)
        into v_i, v_runs, v_tokens, v_upto, v_keep, v_rounds
        from (select n.*, max(n.round) over () as rounds
              from (select x.*, row_number() over (partition by x.run_id order by x.i) as round
                    from rows from (jsonb_to_recordset(p_batches)
                                    as (run_id text, token uuid, upto bigint, keep boolean))
                         with ordinality as x(run_id, token, upto, keep, i)) n) b
        where b.round = v_round;
        exit when v_i is null;
        with a as materialized (select * from ack_round(v_i, v_runs, v_tokens, v_upto, v_keep))
        select r_i || array(select a.i from a order by a.i),
               r_run || array(select a.run_id from a order by a.i),
               r_status || array(select a.status from a order by a.i),
               r_n || array(select a.acked from a order by a.i),
               r_last || array(select a.last_seq from a order by a.i),
               r_lag || array(select a.lag_seconds from a order by a.i),
               r_err || array(select a.error from a order by a.i)
        into r_i, r_run, r_status, r_n, r_last, r_lag, r_err;
        exit when v_round >= v_rounds;
    end loop;
    return query
        select u.run_id, u.status, u.acked, u.last_seq, u.lag, u.error
        from unnest(r_i, r_run, r_status, r_n, r_last, r_lag, r_err)
             as u(i, run_id, status, acked, last_seq, lag, error)
        order by u.i;
end
$$;

-- One round of ack: batches of distinct runs, p_i their positions in the call. In order:
--   1. the fence: the runs whose lease the batch's token still holds, locked (in run_id order,
--      as every writer of runs rows locks them); the others are 'stale';
--   2. the engine wakes of the events being acked (emit_wakes), which may stop a batch short;
--   3. the transition, one statement for every batch: the cursor moves (never back, never past
--      the run's last visible event), the failed-attempt count is reset (and an operator's
--      waiver of the retry budget, the attempt's, taken), and a released run's lease is
--      cleared and the run settled (idle when nothing is left and no producer is writing it,
--      as settle_run);
--   4. a run whose engine refused a wake is blocked at that event (block_event);
--   5. a run whose terminal event is delivered leaves pending_terminals;
--   6. one outbox_delivered notification per batch that acked something, in input order.
create or replace function ack_round(
    p_i bigint[], p_runs text[], p_tokens uuid[], p_upto bigint[], p_keep boolean[]
) returns table (i bigint, run_id text, status text, acked int, last_seq bigint,
                 lag_seconds double precision, error text)
language plpgsql volatile
set search_path from current
set plan_cache_mode = force_generic_plan
as $$
declare
    v_now timestamptz := clock_timestamp();
    v_channel text := terminal_channel();
    f_i bigint[];          -- the fenced batches: position, run, cursor before, acked up to, keep
    f_runs text[];
    f_from bigint[];
    f_upto bigint[];
    f_keep boolean[];
    f_failed bigint[];     -- the seq whose wake the engine refused, else null
    f_error text[];
    v_w record;
    v_quiet text[];        -- the released runs with nothing after their new cursor
    v_locked text[];       -- ... whose run_seqs row lock this round holds
begin
    -- 1. The fence. `upto` is held to the run's last event a producer committed: a cursor past
    --    it would count events not yet written as delivered. (least() ignores a null: a batch
    --    without `upto` would otherwise take the run's last event.)
    select array_agg(b.i order by b.run_id), array_agg(b.run_id order by b.run_id),
           array_agg(r.delivered_seq order by b.run_id),
           array_agg(case when b.upto is null then r.delivered_seq  -- nothing named
                          else least(b.upto, (select max(o.seq) from outbox o
                                              where o.run_id = b.run_id)) end
                     order by b.run_id),
           array_agg(b.keep order by b.run_id)
    into f_i, f_runs, f_from, f_upto, f_keep
    from (select r.run_id, r.delivered_seq
          from unnest(p_runs, p_tokens) as t(run_id, token)
          join runs r on r.run_id = t.run_id
          where r.lease_token = t.token and r.lease_expires_at > v_now
          order by r.run_id
          for update of r) r
    join unnest(p_i, p_runs, p_upto, p_keep) as b(i, run_id, upto, keep) on b.run_id = r.run_id;
    f_i := coalesce(f_i, '{}');
    f_failed := array_fill(null::bigint, array[cardinality(f_i)]);
    f_error := array_fill(null::text, array[cardinality(f_i)]);

    -- 2. The engine wakes, for the batches whose acked events carry one.
    for v_w in
        select b.k, w.failed_seq, w.error
        from unnest(f_runs, f_from, f_upto) with ordinality as b(run_id, cursor, upto, k)
        cross join lateral emit_wakes(b.run_id, b.cursor, b.upto, v_now) as w
        where exists (select 1 from outbox o
                      where o.run_id = b.run_id and o.seq > b.cursor and o.seq <= b.upto
                        and o.wake_queue is not null)
    loop
        if v_w.failed_seq is not null then
            f_failed[v_w.k] := v_w.failed_seq;
            f_error[v_w.k] := v_w.error;
            f_upto[v_w.k] := v_w.failed_seq - 1;
        end if;
    end loop;

    -- 3. The transition. A released run with nothing after its new cursor may go idle: at once
    --    when its terminal event is delivered (no event can follow it), else only under the
    --    run's run_seqs row lock (as settle_run), taken here in a statement of its own so that
    --    the check in the update after it (a fresh snapshot) sees every event a producer
    --    committed before letting go. A run a producer holds is looked at again shortly.
    v_quiet := array(
        select b.run_id
        from unnest(f_runs, f_upto, f_keep, f_failed) as b(run_id, upto, keep, failed)
        where not b.keep and b.failed is null
          and not exists (select 1 from outbox o where o.run_id = b.run_id and o.seq > b.upto));
    v_locked := array(
        select s.run_id from run_seqs s
        where s.run_id = any(v_quiet) and s.terminal_seq is null
        order by s.run_id
        for update skip locked);
    update runs r
    set delivered_seq = greatest(r.delivered_seq, b.upto),
        delivered_at = case when b.upto > r.delivered_seq then v_now else r.delivered_at end,
        attempts = 0, last_error = null, last_status = null, retry_waived = false,
        updated_at = v_now,
        lease_owner = case when b.release then null else r.lease_owner end,
        lease_token = case when b.release then null else r.lease_token end,
        lease_expires_at = case when b.release then null else r.lease_expires_at end,
        next_attempt_at = case when not b.release then r.next_attempt_at
                               when b.busy then v_now + interval '200 milliseconds'
                               else v_now end,
        idle = b.quiet and not b.busy
               and not exists (select 1 from outbox o
                               where o.run_id = r.run_id
                                 and o.seq > greatest(r.delivered_seq, b.upto))
    from (select u.run_id, u.upto, not u.keep and u.failed is null as release,
                 u.run_id = any(v_quiet) as quiet,
                 -- caught up, unfinished, and a producer holds its lock
                 u.run_id = any(v_quiet) and not (u.run_id = any(v_locked))
                     and exists (select 1 from run_seqs s
                                 where s.run_id = u.run_id and s.terminal_seq is null) as busy
          from unnest(f_runs, f_upto, f_keep, f_failed) as u(run_id, upto, keep, failed)) b
    where r.run_id = b.run_id;

    -- 4. A refused wake blocks its run at that event.
    perform block_event(b.run_id, b.failed, null, b.error)
    from unnest(f_runs, f_failed, f_error) as b(run_id, failed, error)
    where b.failed is not null;

    -- 5. Terminal events delivered.
    delete from pending_terminals t
    using unnest(f_runs, f_upto) as b(run_id, upto)
    where t.run_id = b.run_id and t.seq <= b.upto;

    -- 6. The results, and one notification per batch that acked something, in input order.
    return query
    with acked as (
        select b.i, b.run_id, b.failed, b.error,
               count(o.seq)::int as n, max(o.seq) as last_seq, min(o.created_at) as first_created,
               array_agg(o.event_id order by o.seq) filter (where o.seq is not null) as ids
        from unnest(f_i, f_runs, f_from, f_upto, f_failed, f_error)
             as b(i, run_id, cursor, upto, failed, error)
        left join outbox o on o.run_id = b.run_id and o.seq > b.cursor and o.seq <= b.upto
        group by b.i, b.run_id, b.failed, b.error
    ), noted as (
        select a.*, case when a.n > 0
                         then pg_notify(v_channel, delivered_note(a.run_id, a.last_seq, a.ids))
                    end as sent
        from (select * from acked order by acked.i) a
    )
    select b.i, b.run_id,
           case when x.i is null then 'stale' when x.failed is not null then 'failed'
                else 'acked' end,
           coalesce(x.n, 0), x.last_seq,
           extract(epoch from v_now - x.first_created)::double precision, x.error
    from unnest(p_i, p_runs) as b(i, run_id)
    left join noted x on x.i = b.i;
end
$$;

-- The engine wakes of a run's events in (p_from, p_upto], in seq order: absurd.emit_event for
-- each event that names one, then one pg_notify('absurd_wake', queue) per queue woken (one
-- notification per queue and transaction: PostgreSQL folds identical ones). Stops at the first
-- wake the engine rejects and returns its seq and error; a transient failure (a lock wait under
-- the caller's lock_timeout, a deadlock, ...) is not a rejection: it fails the whole ack, and the
-- batch is delivered again later. Not granted to any role.
create or replace function emit_wakes(
    p_run_id text, p_from bigint, p_upto bigint, p_now timestamptz
) returns table (failed_seq bigint, error text)
language plpgsql volatile
set search_path from current
as $$
declare
    v_wake record;
    v_queues text[] := '{}';
begin
    for v_wake in
        select o.seq, o.event_id, o.wake_queue, o.wake_event from outbox o
        where o.run_id = p_run_id and o.seq > p_from and o.seq <= p_upto
          and o.wake_queue is not null
        order by o.seq
    loop
        begin
            perform absurd.emit_event(v_wake.wake_queue, v_wake.wake_event,
                jsonb_build_object('event_id', v_wake.event_id, 'run_id', p_run_id,
                                   'delivered_at', p_now));
            if not v_wake.wake_queue = any(v_queues) then
                v_queues := v_queues || v_wake.wake_queue;
            end if;
        exception
            when lock_not_available or transaction_rollback or insufficient_resources then
                raise;
            when others then
                failed_seq := v_wake.seq;
                error := 'engine wake failed: ' || sqlerrm;
                exit;
        end;
    end loop;
    perform pg_notify('absurd_wake', q) from unnest(v_queues) as q;
    return next;
end
$$;

-- The outbox_delivered notification of one acked batch: the run, the seq acked up to and the
-- event ids, without the ids when they would not fit a notification (8,000 bytes).
create or replace function delivered_note(p_run_id text, p_last_seq bigint, p_event_ids text[])
returns text
language plpgsql immutable
set search_path from current
as $$
declare
    v_note text := json_build_object('kind', 'outbox_delivered', 'run_id', p_run_id,
                                     'last_seq', p_last_seq, 'event_ids', p_event_ids)::text;
begin
    if octet_length(v_note) <= 7900 then
        return v_note;
    end if;
    return json_build_object('kind', 'outbox_delivered', 'run_id', p_run_id,
                             'last_seq', p_last_seq)::text;
end
$$;

-- The part of the outbox new events go to (schema version 8, migration 0008): the default of
-- `outbox.part`, so every insert lands in the current part, whoever makes it.
create or replace function current_outbox_part() returns smallint
language sql stable
set search_path from current
as $$ select part from outbox_parts where current $$;

-- Retention (DESIGN §4.4; schema version 8: the outbox's three parts take turns, migration
-- 0008). The part after the current one in turn, "next", is the oldest: once it stopped being
-- current more than p_retention ago, every event in it is older than that, and it is emptied
-- (empty_outbox_part). Once next is empty and the current part has been current for
-- p_retention / 2, next becomes current (rotate_outbox). Up to three such steps a call, so a
-- call with a retention of 0 removes every done event. Returns the number of events removed.
-- Then forgets what nothing needs any more: finished idle runs with no events left, and dead
-- replicas that hold no lease. Concurrent calls (every replica prunes) take turns on
-- outbox_parts in a mode producers do not wait for; a rotation holds the producers back
-- (hold_back_producers): at once when none is writing, else after a wait of at most
-- `outbox_part_lock_timeout` that producers queue behind, once per
-- `outbox_rotation_wait_every` whichever replica calls; it is tried again at the next call.
create or replace function prune(p_retention interval, p_limit int) returns int
language plpgsql volatile
set search_path from current
security definer
as $$
declare
    v_current outbox_parts;
    v_next outbox_parts;
    v_removed int := 0;
begin
    lock table outbox_parts in share update exclusive mode;
    for step in 1..3 loop
        select * into v_current from outbox_parts where current;
        select * into v_next from outbox_parts where part = (v_current.part + 1) % 3;
        if v_next.closed_at < clock_timestamp() - p_retention then
            v_removed := v_removed + empty_outbox_part(v_next.part, v_current.part, p_limit);
            select * into v_next from outbox_parts where part = v_next.part;
        end if;
        exit when v_next.closed_at is not null
               or v_current.opened_at >= clock_timestamp() - p_retention / 2
               or not hold_back_producers();
        perform rotate_outbox(v_next.part);
    end loop;
    perform forget_finished_runs(p_retention, p_limit);
    perform prune_fairness_keys(p_limit);
    -- Forget dead replicas (liveness lock free) that hold no unexpired lease: nothing of theirs
    -- is left to reclaim. The exclusive try-lock keeps a replica from taking its lock (and
    -- recording itself again) between the check and the delete; a row a hold_liveness has
    -- locked is passed over, never waited for.
    delete from replicas rp
    where rp.owner in (
        select x.owner from replicas x
        where not exists (select 1 from runs w
                          where w.lease_owner = x.owner and w.lease_expires_at > clock_timestamp())
          and pg_try_advisory_xact_lock(liveness_key_of(x.owner, x.incarnation))
        for update skip locked);
    return v_removed;
end
$$;

-- The events of part p_part of the outbox that are not done yet: after their run's cursor (a
-- blocked run's head and what follows it, a backlog), at most p_limit.
create or replace function not_done_in_part(p_part smallint, p_limit int)
returns table (run_id text, seq bigint)
language sql stable
set search_path from current
as $$
    select o.run_id, o.seq
    from outbox o left join runs r on r.run_id = o.run_id
    where o.part = p_part and o.seq > coalesce(r.delivered_seq, 0)
    limit p_limit
$$;

-- Empties part p_part of the outbox, which holds only events older than the retention, and
-- returns how many events it removed. Its events that are not done yet move to the current
-- part first, at most p_limit a call, keeping their run and seq: a call that moved p_limit
-- stops there, the next goes on. Once none is left the part is truncated under its exclusive
-- lock (no relay reads it), with the skip and failure history of its events. The lock is
-- waited for at most `outbox_part_lock_timeout` (a setting, 200 ms): a busy part is tried again
-- at the next call. Producers stopped writing the part before it closed (hold_back_producers);
-- what a writer that bypasses enqueue (an insert that names the part) committed into it
-- meanwhile is looked for again under the lock.
-- What was done stays done: a cursor never moves back, so an event found done before the lock
-- is done under it. Enqueue numbers a run's events after its cursor too (lock_run_for_enqueue),
-- so the seqs the truncate removes are never given again.
create or replace function empty_outbox_part(p_part smallint, p_current smallint, p_limit int)
returns int
language plpgsql volatile
set search_path from current
as $$
declare
    v_moved int;
    v_removed int;
begin
    update outbox o set part = p_current
    from not_done_in_part(p_part, p_limit) s
    where o.part = p_part and o.run_id = s.run_id and o.seq = s.seq;
    get diagnostics v_moved = row_count;
    if v_moved >= p_limit then
        return 0;
    end if;
    -- Counted before the lock, which every statement on the outbox waits for while it is held;
    -- an event committed into the part meanwhile is pending, and stops the truncate below.
    select count(*) into v_removed from outbox where part = p_part;
    if not lock_outbox_table('outbox_p' || p_part, 'access exclusive') then
        return 0;
    end if;
    -- committed into the part while this call waited for its lock
    perform 1 from not_done_in_part(p_part, 1);
    if found then
        return 0;
    end if;
    delete from event_failures f using outbox o
    where o.part = p_part and f.run_id = o.run_id and f.seq = o.seq;
    delete from event_skips k using outbox o
    where o.part = p_part and k.run_id = o.run_id and k.seq = o.seq;
    execute format('truncate %I', 'outbox_p' || p_part);
    update outbox_parts set opened_at = null, closed_at = null where part = p_part;
    return v_removed;
end
$$;

-- Takes a table lock of retention's (p_mode, a lock mode its callers name) on p_table, waiting at
-- most `outbox_part_lock_timeout` (a setting, 200 ms): true once held (until the transaction
-- ends), false when another transaction held it that long. The caller's own lock_timeout is put
-- back either way. Retention's two waits: for a part's truncate (empty_outbox_part) and for a
-- rotation (hold_back_producers).
create or replace function lock_outbox_table(p_table text, p_mode text) returns boolean
language plpgsql volatile
set search_path from current
as $$
declare
    v_old_timeout text := current_setting('lock_timeout');
begin
    perform set_config('lock_timeout', setting('outbox_part_lock_timeout'), true);
    begin
        execute format('lock table %I in %s mode', p_table, p_mode);
    exception when lock_not_available then
        perform set_config('lock_timeout', v_old_timeout, true);
        return false;
    end;
    perform set_config('lock_timeout', v_old_timeout, true);
    return true;
end
$$;

-- Before a rotation: waits for every producer transaction that holds the current part
-- (enqueue's lock on outbox_parts) to commit, and holds new ones back until the rotation
-- commits, so that no event id can be taken in two parts at once. Returns false when a
-- producer's transaction is still open, and prune tries again at its next call.
-- First without waiting: with no producer writing, the hold is taken at once, and with one,
-- the attempt fails at once and no producer queues behind it. Only then does it wait, at most
-- `outbox_part_lock_timeout` (200 ms), and every producer that enqueues meanwhile queues
-- behind that wait: so it waits once per `outbox_rotation_wait_every` (rotation_may_wait),
-- not at every prune of every replica while a producer holds the rotation back (each prune
-- stalled producers ~200 ms until 2026-12, issue 41).
create or replace function hold_back_producers() returns boolean
language plpgsql volatile
set search_path from current
as $$
begin
    if lock_outbox_table_at_once('outbox_parts', 'share row exclusive') then
        return true;
    end if;
    if not rotation_may_wait() then
        return false;
    end if;
    perform note_rotation_wait();
    return lock_outbox_table('outbox_parts', 'share row exclusive');
end
$$;

-- lock_outbox_table without waiting: true once held (until the transaction ends), false when
-- another transaction holds a conflicting lock. A request that fails so never joins the lock's
-- queue, so no other transaction waits behind it.
create or replace function lock_outbox_table_at_once(p_table text, p_mode text) returns boolean
language plpgsql volatile
set search_path from current
as $$
begin
    execute format('lock table %I in %s mode nowait', p_table, p_mode);
    return true;
exception when lock_not_available then
    return false;
end
$$;

-- Whether a held-back rotation may wait for the producers now: its last wait
-- (note_rotation_wait) was `outbox_rotation_wait_every` ago or more (a setting, 5 min when
-- unset), or there was none. Prune calls take turns on outbox_parts, so two never both wait.
create or replace function rotation_may_wait() returns boolean
language sql stable
set search_path from current
as $$
    select coalesce(
        to_timestamp(setting('outbox_rotation_waited_at')::double precision)
            <= clock_timestamp()
               - coalesce(setting('outbox_rotation_wait_every'), '5 min')::interval,
        true)
$$;

-- Records that a held-back rotation waits for the producers now (rotation_may_wait). State,
-- not configuration, kept in `settings` beside the settings it follows from: a row written
-- once per wait, in seconds since the epoch (no DateStyle or TimeZone can misread it).
create or replace function note_rotation_wait() returns void
language sql volatile
set search_path from current
as $$
    insert into settings (key, value)
    values ('outbox_rotation_waited_at', extract(epoch from clock_timestamp())::text)
    on conflict (key) do update set value = excluded.value
$$;

-- Makes the empty part p_to the current one: enqueue writes there from the commit on. Called
-- with the producers held back (hold_back_producers): no transaction is still writing the
-- previous current part. A part is emptied `retention` after it closed, and under its lock.
create or replace function rotate_outbox(p_to smallint) returns void
language sql volatile
set search_path from current
as $$
    update outbox_parts set current = false, closed_at = clock_timestamp() where current;
    update outbox_parts set current = true, opened_at = clock_timestamp(), closed_at = null
    where part = p_to;
$$;

-- Forgets idle runs with no events left, finished (terminal event enqueued) and quiet for
-- p_retention, at most p_limit: only finished ones, because a recreated row would restart the
-- epoch, which the ingress takes as a fencing token, while a finished run can never be claimed
-- again. Their seq counter stays in run_seqs. Each under its run_seqs row lock, checked in a
-- fresh statement, so a producer enqueueing into it can never find its runs row gone.
-- Forgets the fairness keys nothing needs (schema version 10): a key's row goes once no active
-- run has the key (idle and blocked runs come back through note_fairness_key) and its weight is
-- the default, so a weight set by set_fairness_weight stays however long its key is quiet, and
-- the default key's row stays. A key that comes back starts at its lane's clock, as a row kept
-- would (its pass is below the clock then). Each key is taken under its advisory lock, tried
-- and never waited for (a producer making one of its runs active holds it shared to commit),
-- in a statement before the one that checks for runs: a run committed before the lock was
-- taken is seen by the check, and one committed after it finds the row gone and writes it
-- again. Also writes the row of a key with active runs that has none (a run made active by a
-- previous release's enqueue during the upgrade). At most p_limit keys a call.
create or replace function prune_fairness_keys(p_limit int) returns void
language plpgsql volatile
set search_path from current
as $$
declare
    v_keys text[];
begin
    v_keys := array(
        select f.key from fairness_keys f
        where f.key <> '' and f.weight = 1
          and not exists (select 1 from runs r
                          where r.fairness_key = f.key and not r.idle and r.blocked_seq is null)
        order by f.key
        limit p_limit);
    v_keys := array(select k from unnest(v_keys) k
                    where pg_try_advisory_xact_lock(fairness_key_lock(k)));
    delete from fairness_keys f
    where f.key = any(v_keys) and f.weight = 1
      and not exists (select 1 from runs r
                      where r.fairness_key = f.key and not r.idle and r.blocked_seq is null);
    insert into fairness_keys (key)
    select k.key from lane_keys('ordinary', null) k
    where not exists (select 1 from fairness_keys f where f.key = k.key)
    on conflict do nothing;
end
$$;

create or replace function forget_finished_runs(p_retention interval, p_limit int) returns void
language plpgsql volatile
set search_path from current
as $$
declare
    v_run text;
begin
    for v_run in
        select y.run_id from runs y
        where y.idle and y.updated_at < clock_timestamp() - p_retention
          and exists (select 1 from run_seqs f
                      where f.run_id = y.run_id and f.terminal_seq is not null)
        order by y.updated_at
        limit p_limit
    loop
        perform 1 from run_seqs s where s.run_id = v_run for update skip locked;
        continue when not found;
        delete from runs r
        where r.run_id = v_run and r.idle
          and not exists (select 1 from outbox z where z.run_id = v_run);
    end loop;
end
$$;
