-- ledger-relay schema, version 6: the server lifetime each replica's liveness lock was taken in
-- (issue 29, DESIGN §9.5).
--
-- A session advisory lock lives in the server's memory: a restart of PostgreSQL or a failover to
-- a standby drops them all, while the `replicas` rows (durable, replicated) stay. Until each
-- replica's LISTEN session reconnects and takes its lock again, every owner looked dead, and the
-- claims of the others took its runs (the reclaim wave: runs in the middle of their POSTs
-- delivered twice). A free lock proves death only for a row recorded in the server's current
-- lifetime, `pg_postmaster_start_time()`, which a restart and a promotion both change: the
-- leases of older rows run to their expiry, and their owners record themselves anew when their
-- LISTEN sessions come back (hold_liveness).
--
-- The rows there now keep today's judgement: they get the current lifetime (the default is
-- stable, so it is read once and nothing is rewritten).

alter table replicas
    add column server_started_at timestamptz not null default pg_postmaster_start_time();
