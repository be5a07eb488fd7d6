-- ledger-relay schema, version 11: an operator's retry passes the retry budget by the run's row
-- (issue 49 item 3; docs/admission.md §3).
--
-- `relay retry --run` / `--backing-off` (make_due) make a run backing off due now. Until version
-- 10 the relays let its next attempt past their retry budget only on hearing make_due's
-- `run_due` notification, a waiver kept in memory: a poll that claimed the run before the
-- notification arrived held it back by the budget again (at least 5 s), and a relay whose LISTEN
-- was down never heard it at all. From version 11:
--   * `runs.retry_waived`: set by make_due with next_attempt_at, in the same update; claim
--     returns it on the run's first row (a new last column of its result), and the relay sends
--     such a claim whatever its budget's balance;
--   * what ends the run's next attempt clears it (ack_round, release of a failed attempt,
--     block_event): a waiver is for one attempt. A claim handed back unsent keeps it.
-- The notification stays the wake: the relays claim the run at once, not at the next poll.
--
-- In place: a boolean with a constant default (no row is rewritten), in no index, so the updates
-- that write it stay HOT. It costs no write of its own: make_due's update sets it, and claim,
-- ack, release and block write the run's row anyway.
--
-- Rolling upgrade: claim keeps its signature, and its result gains `retry_waived` last, which the
-- relays of earlier versions never name (each selects the columns it reads by name). A result
-- type cannot be replaced, only dropped: claim, and claimed_prefixes whose arguments change, are
-- dropped here and created again by this version's functions in the same transaction (callers
-- see the old ones or the new, never none). A relay of the previous release goes on waiving the
-- budget from the notification alone, which make_due still sends. `relay inspect`'s
-- inspect_run_summary gains `retry_waived` last the same way (callers read its columns by name).

drop function if exists claim(text, int, int, interval, text, text, bigint);
drop function if exists claimed_prefixes(text[], bigint[], uuid[], timestamptz[], int[], bigint[],
                                         text[], text[], int, bigint, timestamptz);
drop function if exists inspect_run_summary(text);

alter table runs add column retry_waived boolean not null default false;
