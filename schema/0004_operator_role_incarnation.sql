-- ledger-relay schema, version 4: the database role beside the operator's name (issue 13), and the
-- incarnation of each replica (issue 18).
--
-- `relay retry --by` and `relay skip --by` record what the caller typed, and anyone who may call
-- the functions can type any name. They now also record `session_user`, the role the caller
-- logged in as, which the caller cannot choose: the audit trail names both. (The functions
-- whose result gains these columns are dropped and re-created by functions_ops.sql, in the
-- transaction that re-applies the functions.) Nullable columns: nothing is rewritten.

alter table events
    add column retried_role text,
    add column skipped_role text;

-- The incarnation of the process that holds an owner's liveness lock (random at each start):
-- a replica restarted under the same owner id ends its dead predecessor's leases at once
-- instead of waiting out their TTL (hold_liveness).
alter table replicas
    add column incarnation text;
