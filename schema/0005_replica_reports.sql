-- ledger-relay schema, version 5: what each replica reports about itself (issue 17).
--
-- Every replica writes its own counters and ingress health into its `replicas` row from its
-- health probe loop (`report_replica`, functions_ui.sql), so the status page of any replica shows
-- the whole fleet. The row is the one hold_liveness created: a report never inserts one (that
-- would make a replica without its liveness lock look dead to claims). The rows are pruned as
-- before (hold_liveness, claim, prune: dead owners without live leases), and a report older
-- than the page's TTL is shown as stale.

alter table replicas
    add column reported_at timestamptz,  -- last report, database clock
    add column report      jsonb;        -- {"lanes": {...counters...}, "ingress": ..., ...}
