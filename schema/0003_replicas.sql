-- ledger-relay schema, version 3: replica liveness (issue 18, DESIGN §4.2).
--
-- A replica of this version holds a session advisory lock keyed by its lease owner id
-- (`liveness_key(owner)`) on its LISTEN connection for as long as its process lives, and
-- records itself here when it takes it (`hold_liveness`). A claim treats the unexpired lease of
-- an owner that has a row here but whose lock is free as expired: the database dropped the lock
-- because the owner's session is gone. An owner without a row (a relay of the previous version,
-- which holds no lock) is never judged dead, so a rolling upgrade cannot rob it.
-- The table stays small: `prune` deletes the rows of dead owners that hold no live lease.
-- (The claim reaches a dead owner's runs through the existing `runs_leased` index.)

create table replicas (
    owner      text primary key,
    started_at timestamptz not null default clock_timestamp(),  -- first took its lock
    seen_at    timestamptz not null default clock_timestamp()   -- last took its lock
);
