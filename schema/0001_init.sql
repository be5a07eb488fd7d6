-- ledger-relay schema, version 1.
-- Applied by `relay migrate` with search_path set to the target schema (default `relay`), so
-- every object below lands in that schema. Functions live in functions.sql (re-applied on drift).
--
-- Who writes what (docs/state_machine.md has the full picture):
--   producers  insert `events`, upsert `run_seqs`, insert `runs` and flip `runs.idle` off;
--              a run is critical while it has a pending terminal event (no flag to write);
--   the relay  owns the lease columns of `runs` and the delivery state of `events`.
-- The split keeps a producer's open transaction from ever blocking the relay's ack.

create table settings (
    key   text primary key,
    value text not null
);
insert into settings (key, value) values
    ('max_payload_bytes', '262144'),     -- payloads above this are rejected at enqueue (256 KiB)
    ('max_id_bytes', '200'),             -- run_id / event_id / event_type length limit
    ('notify_ordinary', 'on'),           -- ordinary enqueues NOTIFY absurd_wake (DESIGN §3)
    ('enqueue_lock_timeout', '5s');      -- bound on waiting for another writer of the same run

-- Producer-owned: the per-run sequence counter. Serialised by the enqueue advisory lock.
create table run_seqs (
    run_id       text primary key,
    last_seq     bigint not null,
    terminal_seq bigint
);

-- Relay-owned scheduling state of a run: lease, epoch, backoff, block.
-- `idle` = no pending event known. Producers only ever flip it from true to false (with a
-- conditional UPDATE that touches nothing while it is already false); the relay sets it true
-- only while holding the run's advisory lock, so no producer can be mid-enqueue on it.
create table runs (
    run_id           text primary key,
    idle             boolean not null default false,
    epoch            bigint not null default 0,
    lease_owner      text,
    lease_token      uuid,
    lease_expires_at timestamptz,
    -- when the run may next be claimed; equals lease_expires_at while leased, so an expired
    -- lease is simply "due" and one index serves discovery.
    next_attempt_at  timestamptz not null default '-infinity',
    attempts         integer not null default 0,       -- failed attempts of the current head
    last_error       text,
    blocked_seq      bigint,                           -- seq of the failed head, when blocked
    updated_at       timestamptz not null default clock_timestamp()
) with (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.02,
        autovacuum_vacuum_cost_delay = 0);

create index runs_due on runs (next_attempt_at)
    where not idle and blocked_seq is null;
create index runs_idle on runs (updated_at) where idle;
create index runs_leased on runs (lease_owner) where lease_owner is not null;

create table events (
    run_id      text not null,
    seq         bigint not null,
    event_id    text not null unique,
    event_type  text not null,
    payload     jsonb not null,
    terminal    boolean not null default false,
    wake_queue  text,
    wake_event  text,
    traceparent text,
    created_at  timestamptz not null default clock_timestamp(),
    state       text not null default 'pending'
        check (state in ('pending', 'delivered', 'failed', 'skipped')),
    attempts    integer not null default 0,
    delivered_at timestamptz,
    done_at     timestamptz,      -- delivered or skipped: the retention clock
    last_status integer,
    last_error  text,
    failed_at   timestamptz,
    skipped_by  text,
    skip_reason text,
    primary key (run_id, seq)
) with (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02,
        autovacuum_vacuum_cost_delay = 0);

create index events_pending on events (run_id, seq) where state = 'pending';
-- The critical lane discovers runs through their pending terminal event: few rows, and the
-- producer never has to touch a row the relay is working on to mark a run critical.
create index events_pending_terminal on events (created_at) where terminal and state = 'pending';
create index events_done on events (done_at) where done_at is not null;
create index events_failed on events (failed_at) where state = 'failed';
