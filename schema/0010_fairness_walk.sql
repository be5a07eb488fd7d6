-- ledger-relay schema, version 10: a shared claim walks the fairness keys in pass order (issue
-- 50; docs/design.md "Scheduling: fair shares between keys").
--
-- Version 9's claim listed every key with runs in the lane at each shared claim (one descent of
-- the key index per key) before choosing: 40-50 ms a claim over 1,000 keys. From version 10 it
-- walks `fairness_keys` in the lane's pass order and stops once the keys it took in hold the
-- claim's tickets (pick_shared), so it reads about as many keys as the claim takes runs. That
-- needs a row for every key with due work:
--   * an index of each lane's pass;
--   * the default key's row, which is never pruned, and a row for every key with active runs
--     now (from version 10 enqueue and unblock write a key's row when a run of that key becomes
--     active and the key has none: note_fairness_key);
--   * retention prunes a key's row once no active run has the key and its weight is the
--     default (prune_fairness_keys), so keys come and go without the table growing.
--
-- The `runs` share lock waits for the producers in flight (so their new keys are seen below)
-- and holds back the others until this version's functions are in place.

create index fairness_keys_by_pass_critical on fairness_keys (pass_critical, key);
create index fairness_keys_by_pass_ordinary on fairness_keys (pass_ordinary, key);

lock table runs in share mode;
insert into fairness_keys (key) values ('') on conflict do nothing;
insert into fairness_keys (key)
with recursive k(key) as (
    (select r.fairness_key from runs r where not r.idle and r.blocked_seq is null
     order by r.fairness_key limit 1)
    union all
    select n.key from k
    cross join lateral (select r.fairness_key as key from runs r
                        where not r.idle and r.blocked_seq is null and r.fairness_key > k.key
                        order by r.fairness_key limit 1) n
)
select k.key from k
on conflict do nothing;
