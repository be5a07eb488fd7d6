#!/usr/bin/env python3
"""Planted bugs that the tests must catch (issue 14): each mutant is one text replacement in
relay/ or schema/ and the tests that must fail because of it.

Each mutant is applied to its own scratch copy of the checkout (the files git tracks, plus
untracked ones it does not ignore), and only its named tests run there, with that copy first on
the import path. A mutant is *killed* when those tests fail, *survived* when they pass, and an
*error* when pytest could not run them (a mutant that breaks the import proves nothing). The
unmutated copy runs the same tests first: a red baseline makes every verdict void.

    python scripts/mutants.py               # every mutant
    python scripts/mutants.py --ci          # the bounded subset .ci/run runs
    python scripts/mutants.py --only NAME   # some, by name (comma separated)
    python scripts/mutants.py --list        # names, what each guards, its tests

Exit status 0 only when every mutant run was killed. docs/invariants.md maps each DESIGN §9
invariant, §5 row and the lease clock to these names.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    guards: str  # the invariant, §5 row or rule it breaks
    path: str
    old: str  # must occur exactly once in `path`
    new: str
    tests: tuple[str, ...]  # pytest node ids or files
    ci: bool = False  # in the bounded subset
    extra: tuple[str, ...] = field(default=())  # more pytest arguments (e.g. -k)


SQL = "schema/functions.sql"
CLOCK = "tests/test_lease_clock.py"
POST_TURN = "tests/test_post_turn.py"
ADMISSION_E2E = "tests/test_admission_e2e.py"
BUDGET_TEST = "test_retries_stay_within_the_budget_and_the_rest_wait_in_the_outbox"
OUTAGE_LOGS = "tests/test_outage_logs.py"
WAIVER = "tests/test_retry_waiver.py"
FLEET = "tests/test_fleet.py"
FLEET_PAGE = "tests/test_fleet_page.py"
FLEET_METRICS = "test_a_fleets_metrics_carry_each_databases_delivery_under_its_name"
FLEET_SERVERS = "tests/test_fleet_servers.py"
SERVER_KILLED = "test_a_server_killed_mid_stream_and_restarted_under_two_replicas"
FLEET_OPS = "tests/test_fleet_ops.py"
OUTAGE_TEST = "test_an_outage_logs_a_warning_per_failed_post_and_sums_up_the_deferrals"
LEASE = "tests/test_lease_sql.py"
DECIDE = "tests/test_decide.py"
LIVE = "tests/test_liveness.py"
EMPTY = "tests/test_claim_empty.py"
FAIR = "tests/test_fairness.py"
MIGRATE = "tests/test_migrate_cursor.py"
PREPARE = "schema/0007_delivery_cursor.prepare.sql"
CURSOR_MIGRATION = "schema/0007_delivery_cursor.sql"
# ack_round's fence, and its hold of `upto` to the run's last committed event
ACK_FENCE = "where r.lease_token = t.token and r.lease_expires_at > v_now"
ACK_UPTO = (
    "else least(b.upto, (select max(o.seq) from outbox o\n"
    + " " * 46
    + "where o.run_id = b.run_id)) end"
)

MUTANTS: tuple[Mutant, ...] = (
    # -- replica liveness (issue 18, DESIGN §4.2): only a provably dead owner loses early ------
    Mutant(
        "liveness-every-owner-dead",
        "§4.2 liveness: a lease is taken early only when its owner's liveness lock is free",
        SQL,
        "and pg_try_advisory_xact_lock_shared(liveness_key_of(rp.owner, rp.incarnation)));",
        "and true);",
        (
            f"{LIVE}::test_a_live_owners_lease_is_not_claimable",
            f"{LIVE}::test_a_frozen_owner_keeps_its_lease_until_expiry",
        ),
        ci=True,
    ),
    Mutant(
        "liveness-restart-keeps-old-leases",
        "§4.2 liveness: a restart under the same owner id ends its dead predecessor's leases",
        SQL,
        "if p_incarnation is not null and v_prev_process is distinct from p_incarnation then",
        "if false then",
        (f"{LIVE}::test_a_restart_under_the_same_owner_id_ends_its_predecessors_leases_at_once",),
    ),
    Mutant(
        "liveness-reconnect-ends-own-leases",
        "§4.2 liveness: the same process taking its lock again on a reconnect keeps its leases",
        SQL,
        "if p_incarnation is not null and v_prev_process is distinct from p_incarnation then",
        "if true then",
        (f"{LIVE}::test_a_restart_under_the_same_owner_id_ends_its_predecessors_leases_at_once",),
    ),
    Mutant(
        "liveness-no-replicas-row",
        "§4.2 liveness: an owner that never recorded its liveness (previous version) is never dead",
        SQL,
        "    return array(select rp.owner from replicas rp\n",
        # every lease owner a candidate; the row's server lifetime taken as current, so that
        # the mutant is well formed (dead_owners reads rp.server_started_at)
        "    return array(select rp.owner from (select distinct lease_owner as owner,"
        " pg_postmaster_start_time() as server_started_at from runs"
        " where lease_owner is not null) rp\n",
        (f"{LIVE}::test_an_owner_without_a_replicas_row_is_never_reclaimed",),
    ),
    Mutant(
        "liveness-claimer-not-alive",
        "§4.2 liveness: a replica that claims is alive, even while its LISTEN session is down",
        SQL,
        "where me.owner = p_owner and pg_try_advisory_xact_lock_shared",
        "where false and pg_try_advisory_xact_lock_shared",
        (f"{LIVE}::test_an_owner_that_still_claims_without_its_lock_is_not_robbed",),
    ),
    Mutant(
        "liveness-reclaim-wave",
        "§9.5: after a restart or failover, a free lock of an older server lifetime proves nothing",
        SQL,
        "                   and rp.server_started_at = pg_postmaster_start_time()\n",
        "",
        (  # the scenario first: it is the one that measured the wave (issue 29)
            "tests/test_failover.py::test_failover_to_a_synchronous_standby",
            f"{LIVE}::test_an_owner_recorded_before_a_restart_is_not_judged_dead_by_its_free_lock",
        ),
    ),
    Mutant(
        "liveness-server-lifetime-not-renewed",
        "§4.2 liveness: an owner recorded again after a restart is judged by its lock at once",
        SQL,
        "            server_started_at = pg_postmaster_start_time()\n        where rp.owner",
        "            server_started_at = rp.server_started_at\n        where rp.owner",
        (f"{LIVE}::test_an_owner_recorded_before_a_restart_is_not_judged_dead_by_its_free_lock",),
    ),
    Mutant(
        "liveness-stopped-by-anyone",
        "§4.2 liveness: only the session holding an owner's lock may say it stopped or report for "
        "it (issue 41; require_liveness_holder)",
        SQL,
        "    if not session_holds_liveness(p_owner) then\n"
        "        raise exception 'relay.%: this session",
        "    if false then\n        raise exception 'relay.%: this session",
        (f"{LIVE}::test_a_clean_stop_forgets_the_owner_and_gives_its_lock_up",),
    ),
    Mutant(
        "liveness-stopped-hides-leases",
        "§4.2 liveness: an owner that stops holding a lease stays, so its runs are taken at once",
        SQL,
        "      and not exists (select 1 from runs w\n"
        "                      where w.lease_owner = rp.owner and w.lease_expires_at >"
        " clock_timestamp());\n    v_forgotten := found;",
        ";\n    v_forgotten := found;",
        (f"{LIVE}::test_a_clean_stop_that_still_holds_a_lease_leaves_it_to_be_reclaimed",),
    ),
    Mutant(
        "liveness-key-predictable",
        "§4.2 liveness: no other role can take a replica's liveness lock first (issue 48 item 6:"
        " the key derived from the owner id alone)",
        SQL,
        "    select case when strpos(p_incarnation, '/') > 0\n",
        "    select case when false\n",
        (
            "tests/test_liveness_key.py::test_the_producer_cannot_take_a_replicas_liveness_lock_before_it_starts",
            "tests/test_liveness_key.py::test_a_key_taken_after_its_replica_died_keeps_no_one_out",
        ),
        ci=True,
    ),
    Mutant(
        "liveness-squatter-keeps-out",
        "§4.2 liveness: a key another role took after its replica's session ended keeps no"
        " replica out (issue 48 item 6)",
        SQL,
        "          and has_function_privilege(a.usesysid, 'hold_liveness(text, text)',"
        " 'execute'))\n",
        "          and true)\n",
        ("tests/test_liveness_key.py::test_a_key_taken_after_its_replica_died_keeps_no_one_out",),
    ),
    # -- the lease clock (DESIGN §4.2): statement time, never transaction time ------------------
    Mutant(
        "clock-claim-expiry",
        "§4.2 lease clock: claim computes expiry at the statement",
        SQL,
        "(select p.*, clock_timestamp() + p_ttl as expires from picked p) x",
        "(select p.*, now() + p_ttl as expires from picked p) x",
        (f"{CLOCK}::test_a_claim_in_an_old_transaction_sets_its_expiry_from_the_statement_clock",),
        ci=True,
    ),
    Mutant(
        "clock-claim-targeted-expired",
        "§4.2 lease clock: a targeted claim judges expiry at the statement",
        SQL,
        "or r.lease_expires_at <= clock_timestamp()\n",
        "or r.lease_expires_at <= now()\n",
        (f"{CLOCK}::test_a_lease_that_expired_while_the_transaction_waited_is_claimable",),
    ),
    Mutant(
        "clock-claim-ordinary-due",
        "§4.2 lease clock: the ordinary lane judges due/expired at the statement",
        SQL,
        "and r.next_attempt_at <= v_moment\n              and not (r.run_id = any(p_exclude))",
        "and r.next_attempt_at <= now()\n              and not (r.run_id = any(p_exclude))",
        (f"{CLOCK}::test_a_lease_that_expired_while_the_transaction_waited_is_claimable",),
    ),
    Mutant(
        "clock-claim-critical-due",
        "§4.2 lease clock: the critical lane judges due/expired at the statement",
        SQL,
        "(r.next_attempt_at <= v_moment or r.lease_owner = any(p_dead))",
        "(r.next_attempt_at <= now() or r.lease_owner = any(p_dead))",
        (f"{CLOCK}::test_a_lease_that_expired_while_the_transaction_waited_is_claimable",),
    ),
    Mutant(
        "clock-renew-expiry",
        "§4.2 lease clock: renew computes the new expiry at the statement",
        SQL,
        "select u.run_id, u.token, clock_timestamp() + p_ttl as expires",
        "select u.run_id, u.token, now() + p_ttl as expires",
        (f"{CLOCK}::test_a_renewal_in_an_old_transaction_extends_from_the_statement_clock",),
    ),
    Mutant(
        "clock-renew-check",
        "§4.2 lease clock + §9.3 fencing: renew refuses a lease expired at the statement",
        SQL,
        "and r.lease_expires_at > clock_timestamp()\n    returning r.run_id",
        "and r.lease_expires_at > now()\n    returning r.run_id",
        (f"{CLOCK}::test_a_renewal_in_an_old_transaction_sees_the_lease_expired_at_the_statement",),
        ci=True,
    ),
    Mutant(
        "clock-ack",
        "§4.2 lease clock + §9.3 fencing: ack judges expiry at the statement",
        SQL,
        ACK_FENCE,
        "where r.lease_token = t.token and r.lease_expires_at > now()",
        (f"{CLOCK}::test_an_ack_in_an_old_transaction_is_fenced_by_the_statement_clock",),
        ci=True,
    ),
    Mutant(
        "clock-release",
        "§4.2 lease clock: a release schedules the retry from the statement",
        SQL,
        "next_attempt_at = clock_timestamp() + p_delay",
        "next_attempt_at = now() + p_delay",
        (f"{CLOCK}::test_a_release_in_an_old_transaction_schedules_from_the_statement_clock",),
    ),
    Mutant(
        "clock-fail",
        "§4.2 lease clock: failed_at from the statement clock",
        SQL,
        "values (p_run_id, p_seq, v_attempts, p_status, left(p_error, 2000), clock_timestamp())",
        "values (p_run_id, p_seq, v_attempts, p_status, left(p_error, 2000), now())",
        (
            f"{CLOCK}::test_a_poison_fail_in_an_old_transaction_is_fenced_and_stamped_by_the_statement_clock",
        ),
    ),
    Mutant(
        "clock-prune",
        "§4.4 retention measured on the statement clock",
        SQL,
        "if v_next.closed_at < clock_timestamp() - p_retention then",
        "if v_next.closed_at < now() - p_retention then",
        (f"{CLOCK}::test_prune_in_an_old_transaction_measures_retention_on_the_statement_clock",),
    ),
    # -- fencing (§9.3) --------------------------------------------------------------------------
    # Since schema version 7 (issue 28) every batch of an ack goes through one set-based path
    # (ack_round). The "-grouped" mutants once planted each rule in the set-based path beside the
    # per-batch loop; each now plants its rule at its one site in ack_round (or, where the rule
    # has one site only, there again), caught by a test acking several batches in one call.
    Mutant(
        "fence-ack-token",
        "§9.3 fencing: an ack with a stale token changes nothing",
        SQL,
        ACK_FENCE,
        "where r.lease_expires_at > v_now",
        (f"{LEASE}::test_stale_token_renew_release_fail_and_ack_change_nothing",),
        ci=True,
    ),
    Mutant(
        "fence-ack-token-e2e",
        "§9.3 fencing end to end: a zombie's ack under the new owner's live lease is fenced",
        SQL,
        ACK_FENCE,
        "where r.lease_expires_at > v_now",
        ("tests/test_relay.py::test_stale_lease_ack_is_rejected_and_wakes_once",),
    ),
    Mutant(
        "fence-ack-expiry",
        "§9.3 fencing: an ack under an expired lease changes nothing",
        SQL,
        ACK_FENCE,
        "where r.lease_token = t.token",
        (f"{LEASE}::test_ack_with_an_expired_lease_that_was_not_replaced_changes_nothing",),
    ),
    Mutant(
        "fence-ack-token-grouped",
        "§9.3 fencing: a stale batch among others in one ack changes nothing, stops none of them"
        " (v7: fence-ack-token's site, ack_round's fence)",
        SQL,
        ACK_FENCE,
        "where r.lease_expires_at > v_now",
        (f"{LEASE}::test_a_grouped_ack_acks_the_good_batch_and_skips_the_stale_one",),
    ),
    Mutant(
        "fence-ack-expiry-grouped",
        "§9.3 fencing: an expired batch among others in one ack changes nothing"
        " (v7: fence-ack-expiry's site, ack_round's fence)",
        SQL,
        ACK_FENCE,
        "where r.lease_token = t.token",
        (f"{LEASE}::test_a_grouped_ack_fences_a_batch_whose_lease_expired_and_acks_the_others",),
    ),
    Mutant(
        "clock-ack-grouped",
        "§4.2 lease clock: ack_round reads the statement clock once, for its fence and for the"
        " delivery time (v7: one ack path)",
        SQL,
        "v_now timestamptz := clock_timestamp();",
        "v_now timestamptz := now();",
        (
            f"{CLOCK}::test_an_ack_in_an_old_transaction_is_fenced_by_the_statement_clock",
            f"{CLOCK}::test_an_ack_in_an_old_transaction_stamps_delivery_with_the_statement_clock",
        ),
    ),
    Mutant(
        "ack-past-upto-grouped",
        "§9.1: never acknowledged without a 2xx (ack_round's transition moves the cursor only to"
        " the batch's accepted seq)",
        SQL,
        "set delivered_seq = greatest(r.delivered_seq, b.upto),",
        "set delivered_seq = greatest(r.delivered_seq,"
        " (select max(o.seq) from outbox o where o.run_id = r.run_id)),",
        (f"{LEASE}::test_ack_marks_only_events_up_to_upto",),
        ci=True,
    ),
    Mutant(
        "settle-grouped-without-lock",
        "§9.1 no loss: a run goes idle only while no producer is mid-enqueue on it (the ack's"
        " settle takes the run's run_seqs row lock, skip locked)",
        SQL,
        "        order by s.run_id\n        for update skip locked);",
        "        order by s.run_id);",
        (f"{LEASE}::test_an_ack_racing_a_producer_never_strands_its_event",),
        ci=True,
    ),
    Mutant(
        "wake-grouped-skips-engine",
        "§9.4 wake iff ack: a batch whose acked events carry a wake goes through emit_wakes",
        SQL,
        "                        and o.wake_queue is not null)",
        "                        and false)",
        (f"{LEASE}::test_ack_emits_the_engine_wake_and_notifies",),
    ),
    Mutant(
        "ack-grouped-ignores-keep",
        "§4.2: an ack that keeps its lease (poison narrowing) does not release it",
        SQL,
        "not u.keep and u.failed is null as release",
        "u.failed is null as release",
        (f"{LEASE}::test_an_ack_with_keep_holds_the_lease",),
    ),
    Mutant(
        "ack-grouped-repeated-run",
        "§9.3: a run named twice in one ack is answered as two acks in a row (one round each)",
        SQL,
        "row_number() over (partition by x.run_id order by x.i) as round",
        "1::bigint as round",
        (f"{LEASE}::test_one_ack_call_answers_every_kind_of_batch_in_order",),
    ),
    Mutant(
        "ack-grouped-notify-missing",
        "§6: each acked batch notifies its waiters (outbox_delivered)",
        SQL,
        "then pg_notify(v_channel, delivered_note(a.run_id, a.last_seq, a.ids))",
        "then delivered_note(a.run_id, a.last_seq, a.ids)",
        (f"{LEASE}::test_outbox_delivered_notification_carries_run_seq_and_ids",),
    ),
    # -- the delivery cursor (schema version 7, DESIGN §4.5, docs/storage.md) ------------------
    Mutant(
        "ack-upto-past-last-event",
        "§9.1: the cursor never passes the run's last committed event (the ack holds `upto` to"
        " it), or an event committed later would count as delivered unsent",
        SQL,
        ACK_UPTO,
        "else b.upto end",
        (f"{LEASE}::test_an_ack_never_moves_the_cursor_past_what_it_names_or_what_exists",),
        ci=True,
    ),
    Mutant(
        "ack-without-upto-moves-cursor",
        "§9.1: a batch that names no `upto` acknowledges nothing (least() ignores a null)",
        SQL,
        "case when b.upto is null then r.delivered_seq",
        "case when false then r.delivered_seq",
        (f"{LEASE}::test_an_ack_never_moves_the_cursor_past_what_it_names_or_what_exists",),
    ),
    Mutant(
        "ack-cursor-moves-back",
        "§9.1/§9.4: the cursor never moves back (an ack below it re-opens nothing delivered)",
        SQL,
        "set delivered_seq = greatest(r.delivered_seq, b.upto),",
        "set delivered_seq = b.upto,",
        (f"{LEASE}::test_an_ack_below_the_cursor_moves_it_back_nowhere",),
        ci=True,
    ),
    Mutant(
        "ack-terminal-stays-pending",
        "§4.3: a run whose terminal event the cursor passed leaves pending_terminals (the"
        " critical lane's discovery holds the critical backlog only)",
        SQL,
        "where t.run_id = b.run_id and t.seq <= b.upto;",
        "where false;",
        (
            f"{LEASE}::"
            "test_the_ack_that_delivers_the_terminal_event_takes_the_run_out_of_the_critical_lane",
        ),
    ),
    Mutant(
        "claim-prefix-includes-cursor",
        "§9.2/§9.4: a claim's prefix starts after the cursor (nothing delivered is sent again)",
        SQL,
        "              where o.run_id = u.run_id and o.seq > u.cursor\n",
        "              where o.run_id = u.run_id and o.seq >= u.cursor\n",
        (f"{LEASE}::test_ack_marks_only_events_up_to_upto",),
        ci=True,
    ),
    Mutant(
        "enqueue-seq-ignores-floor",
        "§9.2 per-run seqs only grow: after retention removed a run's events, enqueue numbers"
        " after the run's cursor (retention removes only events at or below it)",
        SQL,
        " " * 29 + "(select r.delivered_seq from runs r where r.run_id = p_run_id),\n",
        "",
        (f"{LEASE}::test_prune_keeps_seqs_and_epochs_monotonic_per_run",),
        ci=True,
    ),
    Mutant(
        "retention-removes-pending",
        "§9.1 nothing is lost: retention removes only events at or below their run's cursor (the"
        " part's others move to the current part first)",
        SQL,
        "    where o.part = p_part and o.seq > coalesce(r.delivered_seq, 0)\n",
        "    where o.part = p_part and o.seq > coalesce(r.delivered_seq, 0) + 1\n",
        (f"{LEASE}::test_prune_empties_a_part_past_retention_and_keeps_what_is_not_done",),
        ci=True,
    ),
    Mutant(
        "retention-no-second-look",
        "§9.1 nothing is lost: what a writer that bypasses enqueue committed into a part while"
        " retention waited for its lock is looked for again before the truncate",
        SQL,
        "    perform 1 from not_done_in_part(p_part, 1);\n    if found then\n",
        "    perform 1 from not_done_in_part(p_part, 1);\n    if false then\n",
        (f"{LEASE}::test_a_part_is_emptied_only_with_every_event_committed_into_it_done",),
    ),
    Mutant(
        "enqueue-plans-by-statistics",
        "enqueue's lookups of a run stay point lookups however many runs its transaction wrote,"
        " whatever the statistics (issue 52 item 4)",
        SQL,
        "set enable_seqscan = off\n",
        "",
        (
            "tests/test_enqueue_scaling.py::"
            "test_enqueue_reads_no_more_for_a_run_however_many_the_transaction_wrote",
        ),
    ),
    Mutant(
        "enqueue-ignores-rotation",
        "§2 an event id is unique across the outbox's parts: a producer holds the current part"
        " until it commits, so no rotation lets two parts be written at once",
        SQL,
        "    lock table outbox_parts in row exclusive mode;\n",
        "",
        (
            f"{LEASE}::test_an_event_id_is_taken_once_across_a_rotation",
            f"{LEASE}::test_a_producer_still_writing_holds_a_rotation_back_for_a_bounded_wait",
        ),
        ci=True,
    ),
    Mutant(
        "rotation-without-waiting",
        "§2 an event id is unique across the outbox's parts: a rotation waits for the producers"
        " still writing the current part, and holds new ones back until it commits",
        SQL,
        "               or not hold_back_producers();\n",
        "               ;\n",
        (
            f"{LEASE}::test_an_event_id_is_taken_once_across_a_rotation",
            f"{LEASE}::test_a_producer_still_writing_holds_a_rotation_back_for_a_bounded_wait",
        ),
    ),
    Mutant(
        "stale-snapshot-enqueue",
        "§2 an event id is unique across the outbox's parts: a repeatable-read producer whose"
        " snapshot predates a rotation fails rather than write the part no longer current",
        SQL,
        "        perform 1 from outbox_parts where current for share;\n",
        "        null;\n",
        (f"{LEASE}::test_a_repeatable_read_producer_older_than_a_rotation_is_refused",),
    ),
    Mutant(
        "skip-keeps-cursor",
        "§9.2: skipping a run's failed head moves its cursor past it (delivery goes on after it)",
        "schema/functions_ops.sql",
        "    update runs r set delivered_seq = greatest(r.delivered_seq, v_seq)\n"
        "    where r.run_id = v_run;\n",
        "",
        (
            "tests/test_ops.py::test_skip_event_records_who_why_and_when_and_unblocks_its_run",
            "tests/test_ops.py::test_skipping_the_last_event_lets_the_run_settle",
        ),
    ),
    Mutant(
        "retry-now-moves-a-leased-run",
        "§9.3: `relay retry --run` of a run backing off never moves a leased run's due time",
        "schema/functions_ops.sql",
        "and not r.idle and r.blocked_seq is null and r.lease_token is null",
        "and not r.idle and r.blocked_seq is null",
        (
            "tests/test_ops.py::"
            "test_retry_run_now_refuses_a_run_that_is_not_backing_off_and_changes_nothing",
        ),
    ),
    Mutant(
        "claim-critical-flag-lost",
        "§4.3: a claimed run with a terminal event not yet delivered is flagged critical",
        SQL,
        "case when p.n = 1 then exists (select 1 from pending_terminals t\n"
        + " " * 42
        + "where t.run_id = u.run_id) end,",
        "case when p.n = 1 then false end,",
        (f"{LEASE}::test_the_critical_lane_takes_only_runs_with_a_pending_terminal_event",),
    ),
    Mutant(
        "claim-reclaimed-from-lost",
        "§4.2 liveness: a claim says whose unexpired lease it took (lease_reclaimed, the metric)",
        SQL,
        "case when p.n = 1 then u.reclaimed end",
        "case when p.n = 1 then null::text end",
        (f"{LIVE}::test_all_three_paths_reclaim_a_dead_owners_runs",),
    ),
    Mutant(
        "claim-empty-run-keeps-lease",
        "§4.2: a claimed run with nothing pending gives its lease back and settles",
        SQL,
        "        where runs.run_id = any(v_empty);",
        "        where false;",
        (
            "tests/test_ops.py::test_skipping_the_last_event_lets_the_run_settle",
            f"{LEASE}::test_an_ack_racing_a_producer_never_strands_its_event",
        ),
    ),
    Mutant(
        "claim-empty-check-includes-cursor",
        "§4.2/§9.1: a claim's empty check counts only events after the cursor (the delivered one at"
        " it, not yet removed, left a run with nothing to send leased and returned without rows)",
        SQL,
        "where o.run_id = t.run_id and o.seq > t.cursor));",
        "where o.run_id = t.run_id and o.seq >= t.cursor));",
        (f"{EMPTY}::test_a_claim_that_finds_a_run_empty_gives_its_lease_back_and_settles_it",),
        ci=True,
    ),
    Mutant(
        "settle-claim-without-lock",
        "§9.1 no loss: the claim's settle sets a run idle only while no producer is mid-enqueue"
        " on it (settle_run takes the run's run_seqs row lock, skip locked)",
        SQL,
        "    perform 1 from run_seqs s where s.run_id = p_run_id for update skip locked;\n"
        "    if not found then\n"
        "        update runs set next_attempt_at = clock_timestamp() + interval '200 milliseconds'",
        "    perform 1 from run_seqs s where s.run_id = p_run_id;\n"
        "    if not found then\n"
        "        update runs set next_attempt_at = clock_timestamp() + interval '200 milliseconds'",
        (
            f"{EMPTY}::"
            "test_a_claim_that_finds_a_run_empty_while_a_producer_writes_it_never_strands_its_event",
        ),
        ci=True,
    ),
    Mutant(
        "fence-renew-token",
        "§9.3 fencing: a renewal with a stale token changes nothing",
        SQL,
        "where r.run_id = t.run_id and r.lease_token = t.token",
        "where r.run_id = t.run_id",
        (f"{LEASE}::test_stale_token_renew_release_fail_and_ack_change_nothing",),
    ),
    Mutant(
        "fence-release-token",
        "§9.3 fencing: a release with a stale token changes nothing",
        SQL,
        "    where runs.run_id = p_run_id and lease_token = p_token;\n",
        "    where runs.run_id = p_run_id;\n",
        (f"{LEASE}::test_stale_token_renew_release_fail_and_ack_change_nothing",),
    ),
    Mutant(
        "fence-fail-token",
        "§9.3 fencing: failing an event without the run's lease changes nothing (issue 13.4)",
        SQL,
        "where r.run_id = p_run_id and r.lease_token = p_token"
        " and r.lease_expires_at > clock_timestamp()",
        "where r.run_id = p_run_id",
        (
            f"{LEASE}::test_stale_token_renew_release_fail_and_ack_change_nothing",
            "tests/test_hostile_sql.py::test_the_relay_role_cannot_fail_an_event_of_a_run_it_does_not_hold",
        ),
        ci=True,
    ),
    Mutant(
        "fence-fail-expiry",
        "§9.3 fencing: failing an event under an expired lease changes nothing",
        SQL,
        "where r.run_id = p_run_id and r.lease_token = p_token"
        " and r.lease_expires_at > clock_timestamp()",
        "where r.run_id = p_run_id and r.lease_token = p_token",
        ("tests/test_hostile_sql.py::test_fail_event_needs_a_live_lease_not_only_its_token",),
    ),
    Mutant(
        "enqueue-unbounded-wake-event",
        "§3 bad input inserts nothing: an oversized wake_event is refused at enqueue (13.3)",
        SQL,
        "if octet_length(p_wake_event) > 1024 then",
        "if false then",
        (
            "tests/test_hostile_sql.py::test_oversized_wake_and_trace_fields_are_refused_at_enqueue_with_a_short_error",
        ),
    ),
    # -- memory bound (issue 13 item 5) ----------------------------------------------------------
    Mutant(
        "bytes-claim-unbounded",
        "memory bound: a claim's prefix stops at max_batch_bytes of payload",
        SQL,
        "and (p.n = 1 or p_max_bytes is null or p.upto_bytes <= p_max_bytes)",
        "and true",
        ("tests/test_claim_bytes.py", "tests/test_memory.py"),
        ci=True,
    ),
    Mutant(
        "bytes-lane-unbounded",
        "memory bound: a lane holds at most max_lane_bytes of claims",
        "relay/delivery/holdings.py",
        "return (self.settings.max_lane_bytes - self.held_bytes) // self.settings.max_batch_bytes",
        "return 10**6",
        ("tests/test_memory.py::test_a_lane_holds_no_more_than_its_byte_budget_of_claims",),
    ),
    # -- lanes (§4.3, §9.6) ----------------------------------------------------------------------
    Mutant(
        "lane-critical-takes-ordinary",
        "§4.3: the critical lane never takes ordinary work",
        SQL,
        "            from pending_terminals t join runs r on r.run_id = t.run_id\n"
        "            where t.fairness_key = q.key",
        "            from runs r left join pending_terminals t on t.run_id = r.run_id\n"
        "            where r.fairness_key = q.key",
        (f"{LEASE}::test_the_critical_lane_takes_only_runs_with_a_pending_terminal_event",),
        ci=True,
    ),
    Mutant(
        "lane-critical-claims-as-ordinary",
        "§4.3/issue 50: the critical lane takes targeted terminals only, no backlog (end to end)",
        "relay/delivery/lane.py",
        'self.targeted_only = name == "critical"',
        "self.targeted_only = False",
        ("tests/test_lanes_e2e.py",),
        ci=True,
    ),
    Mutant(
        "lane-foretold-terminal-claimed-as-ordinary",
        "issue 50: a terminal notified while its run's ordinary claim is on the wire goes first",
        "relay/delivery/lane.py",
        "            if self.foretold.take(claim.run_id, now):",
        "            if False:",
        (
            "tests/test_lane_targets.py::"
            "test_a_terminal_notified_while_its_runs_ordinary_claim_is_on_the_wire_goes_first",
        ),
    ),
    Mutant(
        "lane-terminal-drain-to-ordinary",
        "§4.3/§9.6: a targeted terminal drain goes to the critical lane",
        "relay/runner.py",
        'self.lanes["critical"].drain(run_id)',
        'self.lanes["ordinary"].drain(run_id)',
        ("tests/test_lanes_e2e.py",),
        ci=True,
    ),
    # -- fair shares between keys (issue 50 item 3, schema version 9) ----------------------------
    Mutant(
        "fair-key-ignored",
        "issue 50: the claim takes a key's runs, not the oldest of any key",
        SQL,
        "where r.fairness_key = q.key and not r.idle",
        "where not r.idle",
        (
            f"{FAIR}::test_a_quiet_key_goes_in_the_first_claim_beside_a_noisy_backlog",
            f"{FAIR}::test_weights_5_3_2_share_the_first_600_runs",
        ),
        ci=True,
    ),
    Mutant(
        "fair-weights-ignored",
        "issue 50: keys share in proportion to their weights",
        SQL,
        "v_next_stride := 1000000 / v_weight;",
        "v_next_stride := 1000000;",
        (f"{FAIR}::test_weights_5_3_2_share_the_first_600_runs",),
    ),
    Mutant(
        "fair-idle-banks-credit",
        "issue 50: a key back from idle starts level with the others, no credit banked",
        SQL,
        "v_next_pass := greatest(v_pass, v_clock);",
        "v_next_pass := v_pass;",
        (f"{FAIR}::test_a_key_back_from_idle_has_no_banked_credit",),
    ),
    Mutant(
        "fair-claim-walks-every-key",
        "issue 50: a shared claim stops walking the keys once it holds its tickets",
        SQL,
        "            if v_live >= v_left then",
        "            if false then",
        (
            f"{FAIR}::test_a_shared_claim_reads_about_as_many_keys_as_it_takes_runs[ordinary]",
            f"{FAIR}::test_a_shared_claim_reads_about_as_many_keys_as_it_takes_runs[critical]",
        ),
    ),
    Mutant(
        "fair-claim-filters-due-row-by-row",
        "issue 50: the walk's due bound is one the index can use (schema 12)",
        SQL,
        "                            and r.next_attempt_at <= v_moment)\n"
        "            order by f.pass_ordinary, f.key;",
        "                            and r.next_attempt_at <= clock_timestamp())\n"
        "            order by f.pass_ordinary, f.key;",
        (f"{FAIR}::test_a_key_with_runs_but_none_due_costs_the_walk_one_descent[ordinary]",),
    ),
    Mutant(
        "fair-prune-races-enqueue",
        "issue 50: retention never prunes a key's row under a producer making its run active",
        SQL,
        "                    where pg_try_advisory_xact_lock(fairness_key_lock(k)));",
        "                    where true);",
        (f"{FAIR}::test_retention_keeps_the_row_of_a_key_whose_run_is_being_enqueued",),
    ),
    Mutant(
        "backlog-class-is-the-lane",
        "issue 50 item 4: the backlog gauges name the class of runs they count, not the lane of"
        " before issue 50 (finished runs as `critical`)",
        "relay/serving/metrics.py",
        "                labels = (backlog_class(row), row)",
        "                labels = (row, row)",
        ("tests/test_backlog_classes.py::test_a_backlog_of_finished_and_due_runs_reads_per_class",),
    ),
    Mutant(
        "fair-run-changes-key",
        "issue 50: a run has one key; a later event naming another is refused",
        SQL,
        "elsif p_fairness_key is not null and p_fairness_key <> v_key then",
        "elsif false then",
        (f"{FAIR}::test_a_later_event_naming_another_key_is_refused",),
    ),
    # -- the §5 answer table (relay/core/policy.py decide: one pure function, a test per row) ---
    Mutant(
        "answer-409-not-accepted",
        "§5 row 409: duplicates count as accepted",
        "relay/core/policy.py",
        "if 200 <= status < 300 or status == 409:",
        "if 200 <= status < 300:",
        (
            f"{DECIDE}::test_409_duplicates_ack_every_event_whatever_the_body",
            "tests/test_failures.py::test_409_acks_as_duplicates",
        ),
        ci=True,
    ),
    Mutant(
        "answer-429-poison",
        "§5 row transient: 429 is retried, never poison",
        "relay/core/policy.py",
        "TRANSIENT_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})",
        "TRANSIENT_STATUSES = frozenset({408, 425, 500, 502, 503, 504})",
        (f"{DECIDE}::test_transient_status_reschedules_with_backoff_and_allows_quick_retries",),
    ),
    Mutant(
        "answer-401-poison",
        "§5 row misconfigured: 401 pauses the lane, never fails events",
        "relay/core/policy.py",
        "MISCONFIGURED_STATUSES = frozenset({401, 403, 404, 405, 407, 410})",
        "MISCONFIGURED_STATUSES = frozenset({403, 404, 405, 407, 410})",
        (f"{DECIDE}::test_misconfigured_endpoint_pauses_the_lane",),
    ),
    Mutant(
        "answer-3xx-poison",
        "§5 row misconfigured: a 3xx is the endpoint's fault",
        "relay/core/policy.py",
        "if status in MISCONFIGURED_STATUSES or 300 <= status < 400:",
        "if status in MISCONFIGURED_STATUSES:",
        (f"{DECIDE}::test_misconfigured_endpoint_pauses_the_lane",),
    ),
    Mutant(
        "answer-accepted-k-ignored",
        "§5 row 2xx {accepted: k}: only the first k are acked (§9.1)",
        "relay/core/policy.py",
        "return max(0, min(k, n_events))",
        "return n_events",
        (
            f"{DECIDE}::test_2xx_accepted_k_acks_the_first_k",
            "tests/test_failures.py::test_accepted_k_acks_only_the_first_k",
        ),
        ci=True,
    ),
    Mutant(
        "answer-retry-after-ignored",
        "§5 row transient: Retry-After is honoured",
        "relay/core/policy.py",
        "after = parse_retry_after(answer.retry_after, now, maximum=cap)",
        "after = None",
        (
            f"{DECIDE}::test_retry_after_seconds_sets_the_delay",
            "tests/test_failures.py::test_retry_after_is_honoured",
        ),
    ),
    Mutant(
        "answer-cut-body-accepted",
        "§5 row 2xx: a body cut at the read limit is transient (issue 13.6)",
        "relay/core/policy.py",
        "if status != 409 and answer.truncated:",
        "if False:",
        ("tests/test_hostile_http.py",),
        ci=True,
    ),
    Mutant(
        "answer-garbled-body-accepted",
        "§5 row 2xx: a non-empty body that is not JSON is transient (issue 13.6)",
        "relay/core/policy.py",
        "    if parsed is _NOT_JSON:\n        return None",
        "    if parsed is _NOT_JSON:\n        return n_events",
        (
            f"{DECIDE}::test_2xx_with_a_body_that_is_not_json_is_transient",
            "tests/test_hostile_http.py",
        ),
    ),
    # -- the one HTTP client (relay/edges/http_client.py): the rest is httpx's and its transport
    Mutant(
        "http-body-unbounded",
        "issue 13: an answer is read to READ_LIMIT bytes only, then the connection is dropped",
        "relay/edges/http_client.py",
        "        if size >= READ_LIMIT:",
        "        if False:",
        ("tests/test_ingress_unit.py::test_post_reads_at_most_max_body",),
        ci=True,
    ),
    Mutant(
        "http-stale-answer-transport",
        "§9.1 (issue 40): an answer written twice is never read as the next POST's",
        "relay/edges/http_client.py",
        "    name = RETIRED_TRANSPORTS.get(configured, configured)",
        '    name = "httpx"',
        ("tests/test_http_client.py::test_an_answer_written_twice_is_not_read_as_the_next_posts",),
    ),
    Mutant(
        "http-cookies-kept",
        "issue 40: an ingress's Set-Cookie never grows the client's state",
        "relay/edges/http_client.py",
        "        return None  # an answer's cookies are never read",
        "        super().extract_cookies(response)",
        ("tests/test_http_client.py::test_the_ingress_cannot_set_cookies_on_the_client",),
    ),
    Mutant(
        "stale-pooled-connection-reused",
        "§9.1 (issue 48 item 1): a pooled connection holding an answer no request asked for is "
        "never handed to the next POST",
        "relay/edges/http_client.py",
        "            if protocol is None or not protocol.should_close:",
        "            if True:",
        ("tests/test_stale_answer.py::test_the_next_post_reads_its_own_answer_after_a_late_copy",),
        ci=True,
    ),
    Mutant(
        "httpx-transport-keeps-alive-by-default",
        "§9.1 (issue 48 item 1): over httpx's own transport, unless `ingress_keepalive=true` is "
        "set, no connection carries a second POST (h11 keeps a copy that came in the answer's "
        "segment where no reuse check sees it)",
        "relay/edges/http_client.py",
        "    return False, (\n        f\"the default with httpx's own transport",
        "    return True, (\n        f\"the default with httpx's own transport",
        (
            "tests/test_stale_answer.py::test_httpxs_own_transport_uses_no_connection_twice_"
            "unless_told[asyncio-direct-http_transport=httpx]",
        ),
        ci=True,
    ),
    Mutant(
        "unframed-empty-2xx-accepted",
        "§9.1 (issue 40): an empty 2xx ended only by the connection (maybe a reset) is no ack",
        "relay/core/policy.py",
        "        if status != 409 and answer.unframed and not answer.body.strip():",
        "        if False:",
        (
            "tests/test_http_client.py::"
            "test_a_reset_after_a_2xx_head_without_a_length_is_not_an_ack",
        ),
        ci=True,
    ),
    Mutant(
        "poison-narrowing-continues",
        "§9.2: nothing after a poison event is delivered (narrowing stops at it)",
        "relay/delivery/narrowing.py",
        "            if isinstance(single.decision, Poison):\n"
        "                return await self.results.block("
        "claim, event, single.decision, resent=single)",
        "            if isinstance(single.decision, Poison):\n"
        "                await self.results.block(claim, event, single.decision, resent=single)\n"
        "                continue",
        ("tests/test_failures.py::test_poison_in_the_middle_of_a_100_event_batch",),
    ),
    Mutant(
        "batch-refusal-blocks-every-run",
        "§5 4xx: only a run's own refusal blocks it, not a refusal of a whole multi-run request",
        "relay/delivery/deliveries.py",
        "        if len(holds) > 1 and _refused_whole(posted := _posted(outcomes)):",
        "        if False:",
        (
            "tests/test_relay.py::"
            "test_a_refused_multi_run_request_blocks_no_run_until_each_is_sent_alone",
        ),
    ),
    Mutant(
        "batch-slot-held-through-acks",
        "§4.3 pipelining: a multi-run POST frees its slot once every run was accepted whole",
        "relay/delivery/deliveries.py",
        "        if free_early and _only_acks_left(outcomes):",
        "        if False:",
        ("tests/test_relay.py::test_a_multi_run_post_frees_its_slot_before_its_acks",),
    ),
    # -- the claim as a value (issue 27 item 4): each change is a new claim its holder keeps ----
    Mutant(
        "claim-renewal-dropped",
        "§4.2 trust window: the delivery reads the window its lease was renewed to",
        "relay/delivery/renewal.py",
        "                held.claim = held.claim.renewed(trust)",
        "                held.claim.renewed(trust)",
        (
            "tests/test_relay.py::"
            "test_a_quick_retry_trusts_the_window_a_renewal_moved_during_its_post",
            "tests/test_claim.py::test_the_renewer_gives_each_holder_its_claim_under_the_new_window",
        ),
    ),
    Mutant(
        "claim-promotion-dropped",
        "§4.3/§9.6: a queued run whose terminal event commits turns critical (handed over)",
        "relay/delivery/lane.py",
        "            held.claim = held.claim.promoted()",
        "            held.claim.promoted()",
        (
            "tests/test_relay.py::"
            "test_a_terminal_committed_for_a_queued_run_is_handed_to_the_critical_lane",
        ),
    ),
    # -- the lane's one POST slot queue (issue 27 item 3) ---------------------------------------
    Mutant(
        "slot-queue-critical-not-first",
        "§4.3: a freed POST slot goes to a critical claim first, single or group alike",
        "relay/delivery/slots.py",
        "(w for w in self._waiters if w.critical)",
        "(w for w in self._waiters if False)",
        (
            "tests/test_slots.py::"
            "test_a_freed_slot_goes_to_critical_waiters_first_then_in_queue_order",
            "tests/test_lane_slots.py::"
            "test_a_freed_slot_goes_to_the_critical_claim_before_an_earlier_group",
            "tests/test_lane_slots.py::test_a_promoted_run_makes_its_queued_group_critical",
        ),
    ),
    Mutant(
        "slot-queue-promoted-claim-not-woken",
        "§4.3/§9.6: a promotion wakes the queued claim it turns critical (to be handed over)",
        "relay/delivery/post_turn.py",
        "        self.slots.wake(run_id)",
        "        pass",
        (
            "tests/test_relay.py::"
            "test_a_terminal_committed_for_a_queued_run_is_handed_to_the_critical_lane",
            "tests/test_lane_slots.py::test_a_promoted_run_makes_its_queued_group_critical",
        ),
    ),
    # -- the POST turn under the adaptive limit, and the retry budget (issue 42) ----------------
    Mutant(
        "post-turn-ordinary-takes-critical",
        "§9.6 at the ingress: the ordinary lane's POSTs ask for ordinary permits (not the reserve)",
        "relay/delivery/post_turn.py",
        '    if lane == "critical":\n        return True',
        "    if True:\n        return True",
        (
            f"{POST_TURN}::test_the_ordinary_lane_cannot_take_the_reserve_a_critical_post_gets_at_once",
        ),
    ),
    Mutant(
        "classes-finished-always-first",
        "issue 50: finished runs go first 3:1, and due runs are not starved beside them",
        "relay/core/classes.py",
        "return Discovered.FINISHED if finished <= due else Discovered.DUE",
        "return Discovered.FINISHED",
        ("tests/test_classes.py",),
        ci=True,
    ),
    Mutant(
        "discovery-finished-claim-not-filled",
        "issue 50: what finished runs lack in a claim, any due run fills in the same pass",
        "relay/delivery/discovery.py",
        "        if first is Discovered.FINISHED and len(claims) < want:",
        "        if False:",
        (
            "tests/test_discovery.py::"
            "test_a_short_claim_of_finished_runs_is_filled_from_any_due_run_in_the_same_pass",
        ),
    ),
    Mutant(
        "discovery-empty-passes-not-spaced",
        "§4.1: wakes coalesce: the pass after one that found nothing waits for the spacing",
        "relay/delivery/discovery.py",
        "        while (left := spaced_until - now) > 0:",
        "        while False:",
        (
            "tests/test_discovery.py::test_the_pass_after_one_that_found_nothing_waits_for_the_spacing",
        ),
    ),
    Mutant(
        "classes-credit-banked-while-idle",
        "issue 50: a class with no due work banks no credit (it cannot take every claim after)",
        "relay/core/classes.py",
        "self._pass[kind] = max(self._pass[kind], self._pass[other])",
        "pass",
        ("tests/test_classes.py::test_no_credit_is_banked_while_finished_runs_have_none_due",),
    ),
    Mutant(
        "post-turn-finished-runs-take-the-reserve",
        "issue 50: a finished run found by discovery is not control traffic: no reserve, no"
        " jumping the slot queue",
        "relay/delivery/post_turn.py",
        "    for h in holds:  # a loop, not any(): once per POST\n        if h.claim.targeted:",
        "    for h in holds:  # a loop, not any(): once per POST\n        if h.claim.critical:",
        (
            f"{POST_TURN}::test_the_ordinary_lane_cannot_take_the_reserve_a_critical_post_gets_at_once",
            "tests/test_lane_slots.py::test_a_finished_run_found_by_discovery_waits_its_turn_in_queue_order",
        ),
        ci=True,
    ),
    Mutant(
        "admission-reserve-ignored",
        "§9.6 at the ingress: the ordinary lane never takes the critical reserve of the limit",
        "relay/admission/permits.py",
        "return self.inflight < allowed and ordinary < allowed - self.reserve",
        "return self.inflight < allowed",
        (
            f"{POST_TURN}::test_the_ordinary_lane_cannot_take_the_reserve_a_critical_post_gets_at_once",
        ),
    ),
    Mutant(
        "permits-cancelled-grant-leaked",
        "issue 42: a permit granted to a waiter cancelled meanwhile is passed on, never leaked",
        "relay/delivery/post_turn.py",
        "                self.release(waiter.permit)",
        "                pass",
        (f"{POST_TURN}::test_a_waiter_cancelled_after_its_grant_passes_the_permit_on",),
        ci=True,
    ),
    Mutant(
        "post-turn-cancelled-slot-leaked",
        "issue 42: a turn stopped or cancelled while it waits for a permit gives its slot back",
        "relay/delivery/post_turn.py",
        "                    release_slot()",
        "                    pass",
        (
            f"{POST_TURN}::test_a_turn_cancelled_while_waiting_for_a_permit_gives_its_slot_back",
            f"{POST_TURN}::test_stop_wakes_the_permit_waiters_and_their_slots_go_back",
        ),
    ),
    Mutant(
        "post-turn-promoted-permit-waiter-not-woken",
        "§9.6: a promotion wakes the claim's permit waiter, which queues again as critical",
        "relay/delivery/post_turn.py",
        "        if self.permits is not None:\n"
        "            self.permits.wake((self.database, run_id))",
        "        if self.permits is not None:\n            pass",
        (
            f"{POST_TURN}::"
            "test_a_promoted_group_waiting_for_a_permit_goes_before_earlier_ordinary_waiters",
        ),
    ),
    Mutant(
        "adaptive-limit-off",
        "§9.6 at the ingress (issue 42): post_limit = adaptive puts the lanes' POSTs under permits",
        "relay/runner.py",
        'if settings.post_limit == "fixed":',
        "if True:",
        (
            f"{ADMISSION_E2E}::test_a_terminal_post_queues_behind_few_ordinary_posts_at_a_saturated_ingress",
        ),
        ci=True,
    ),
    Mutant(
        "limit-samples-not-fed",
        "issue 42: each answer to a POST is a sample of the adaptive limit",
        "relay/delivery/bookkeeping.py",
        "            answered(sample)",
        "            pass",
        (f"{ADMISSION_E2E}::test_the_limit_falls_on_503s_and_recovers_after",),
    ),
    # -- an operator's second week (issue 49) ------------------------------------------------------
    Mutant(
        "limit-fell-warns-on-queueing",
        "issue 49 item 5: a fall of the limit for queueing alone is info, not a warning",
        "relay/admission/limit.py",
        "Level.FALLEN, now, overload",
        "Level.FALLEN, now, True",
        (
            "tests/test_limit_events.py::"
            "test_a_fall_for_queueing_is_info_and_one_for_overload_a_warning",
        ),
    ),
    Mutant(
        "limit-fallen-when-idle",
        "issue 49 item 5: an idle replica's limit is not left fallen",
        "relay/runner.py",
        "                background.start_soon(self.permits.settle_when_idle)",
        "                pass",
        (f"{ADMISSION_E2E}::test_an_idle_replica_that_fell_recovers",),
    ),
    Mutant(
        "inspect-head-status-not-the-runs",
        "issue 49 item 6: relay inspect shows the last answer of a head that backs off",
        "schema/functions_ops.sql",
        "                         and r.attempts > 0 then r.last_status else e.last_status end,",
        "                         and false then r.last_status else e.last_status end,",
        ("tests/test_inspect_answer.py",),
    ),
    Mutant(
        "build-info-without-commit",
        "issue 49 item 10: build_info names the commit a replica runs",
        "relay/serving/metrics.py",
        "labels(__version__, build.commit(), platform.python_version())",
        "labels(__version__, __version__, platform.python_version())",
        ("tests/test_build_info.py::test_a_scrape_carries_the_version_and_the_commit",),
    ),
    Mutant(
        "budget-not-wired",
        "issue 42: retries stay within the replica's retry budget",
        "relay/runner.py",
        "            budget=self.budget,",
        "            budget=None,",
        (f"{ADMISSION_E2E}::{BUDGET_TEST}",),
    ),
    Mutant(
        "budget-quick-retries-unasked",
        "issue 42: quick retries ask the retry budget too",
        "relay/delivery/retries.py",
        "_BudgetSpent(may_retry))",
        "_BudgetSpent(lambda: True))",
        (f"{ADMISSION_E2E}::{BUDGET_TEST}",),
    ),
    Mutant(
        "budget-deferral-counted-as-attempt",
        "issue 42: a retry the budget defers is not an attempt (its backoff does not grow)",
        "relay/delivery/release.py",
        "released = await self.store.release(claim, deferred.delay)",
        'released = await self.store.release(claim, deferred.delay, error="retry_budget")',
        (f"{ADMISSION_E2E}::{BUDGET_TEST}",),
    ),
    Mutant(
        "budget-served-retries-free",
        "issue 42: while the ingress fails, a served retry is charged too (else an ingress that "
        "fails every first attempt and serves every retry sees 2 POSTs per first attempt)",
        "relay/admission/retry_budget.py",
        "        charged = retry and (result is Result.FAILED or not self.healthy(now))",
        "        charged = retry and result is Result.FAILED",
        (
            "tests/test_admission_budget.py::"
            "test_an_ingress_failing_every_first_attempt_and_serving_every_retry_is_held_to_it",
        ),
    ),
    Mutant(
        "budget-awaits-answers-when-sick",
        "a retry held back at an unhealthy ingress waits the budget's floor, not a moment, even "
        "when only tokens in flight are lacking (issue 42's churn: 19,253 deferrals a minute)",
        "relay/admission/retry_budget.py",
        "return self.spent(now) and self.healthy(now) and self.balance(now) + self._retrying",
        "return self.spent(now) and self.balance(now) + self._retrying",
        (
            "tests/test_admission_budget.py::"
            "test_a_budget_awaits_answers_only_for_tokens_in_flight_at_a_healthy_ingress",
        ),
    ),
    Mutant(
        "slow-start-doubles-while-the-ingress-queues",
        "the limit doubles on until its first decrease, though the round trip has risen: every "
        "replica doubles once more at an ingress that queues (issue 50's quiet key waited 0.6 s)",
        "relay/admission/limit.py",
        "return median > floor + rise + window.lag",
        "return False",
        (
            "tests/test_admission_limit.py::"
            "test_slow_start_ends_once_the_round_trip_rises_by_an_eighth",
        ),
    ),
    Mutant(
        "deferral-waits-the-window-for-tokens-in-flight",
        "after an outage the runs that waited drain at the ingress's pace: a retry held back only "
        "for the tokens of retries in flight waits 0.5-1 s, not 5 s and its backoff",
        "relay/delivery/bookkeeping.py",
        "        if self.budget.awaits_answers(now):\n",
        "        if False:\n",
        (
            "tests/test_bookkeeping.py::"
            "test_a_retry_held_back_only_for_the_tokens_in_flight_waits_a_moment",
        ),
    ),
    Mutant(
        "outage-last-try-warns-twice",
        "issue 49 item 3: one warning per failed POST (an attempt's last try is told by its "
        "retry_scheduled warning)",
        "relay/delivery/execute.py",
        "logging.WARNING if warned else logging.INFO,",
        "logging.WARNING,",
        (f"{OUTAGE_LOGS}::{OUTAGE_TEST}",),
    ),
    Mutant(
        "outage-batch-warns-per-run",
        "issue 49 item 3: a multi-run POST that failed is one warning, not one per run in it",
        "relay/delivery/release.py",
        "            logging.INFO if echo else logging.WARNING,",
        "            logging.WARNING,",
        (f"{OUTAGE_LOGS}::{OUTAGE_TEST}[batch]",),
    ),
    Mutant(
        "outage-deferral-line-per-run",
        "issue 49 item 3: a deferral is a count in its lane's retries_deferred line, its own line "
        "at debug",
        "relay/delivery/release.py",
        """        logs.debug(
            "retry_deferred",""",
        """        logs.info(
            "retry_deferred",""",
        (f"{OUTAGE_LOGS}::{OUTAGE_TEST}",),
    ),
    Mutant(
        "outage-reschedule-ignores-budget",
        "issue 49 item 3: retry_scheduled says when the run really goes, the budget considered",
        "relay/delivery/execute.py",
        "decision = self.books.scheduled(decision, held.claim.attempts)",
        "decision = decision",
        (f"{OUTAGE_LOGS}::{OUTAGE_TEST}",),
    ),
    Mutant(
        "fleet-lane-claims-past-its-share",
        "issue 51 item 3: a database's backlog does not starve another's trickle",
        "relay/delivery/lane.py",
        "        posts = self.post_turn.posts if permits is not None else None",
        "        posts = None",
        (
            f"{FLEET}::"
            "test_a_backlog_in_one_database_does_not_starve_anothers_trickle_nor_its_terminal",
        ),
    ),
    Mutant(
        "fleet-permit-waiters-keyed-by-run-id-alone",
        "issue 51: a promotion in one database of a fleet never wakes another's waiter",
        "relay/delivery/post_turn.py",
        "        self.database = database",
        "        self.database = None",
        (f"{POST_TURN}::test_a_promotion_in_one_database_does_not_wake_another_databases_waiter",),
    ),
    Mutant(
        "operator-retry-held-by-budget",
        "issue 49 item 3: relay retry sends a run at once, past the retry budget (the claim"
        " carries the run's waiver)",
        "relay/edges/store.py",
        "                retry_waived=r[15],",
        "                retry_waived=False,",
        (
            f"{OUTAGE_LOGS}::test_relay_retry_sends_a_run_the_budget_holds_back_at_once",
            f"{WAIVER}::test_a_relay_started_after_relay_retry_sends_the_run_past_its_budget",
            f"{WAIVER}::test_a_relay_whose_listen_is_down_sends_the_run_past_its_budget",
        ),
    ),
    Mutant(
        "operator-retry-waiver-outlives-its-attempt",
        "issue 49 item 3: relay retry's waiver of the retry budget is for one attempt",
        SQL,
        "        retry_waived = retry_waived and p_error is null,",
        "        retry_waived = retry_waived,",
        (
            f"{WAIVER}::test_the_waiver_is_for_one_attempt_the_next_failure_is_budgeted_again",
            f"{WAIVER}::test_the_run_row_keeps_the_waiver_until_an_attempt_ends",
        ),
    ),
    Mutant(
        "ack-unknown-not-sent-again",
        "§9.5: an ack that did not commit (the database away) is sent again, not redelivered",
        "relay/delivery/ack.py",
        "        (result,) = await self.store.ack([(p.claim, p.upto, p.keep)])",
        '        result = AckResult(run_id, "not_committed", 0, None, None, None)',
        ("tests/test_failures.py::test_ack_with_unknown_outcome_is_resolved_by_rereading",),
    ),
    Mutant(
        "claim-widening-dropped",
        "§4.3: a promoted claim's POST carries the terminal event committed since the claim",
        "relay/delivery/execute.py",
        "            held.claim = held.claim.widened(more)",
        "            held.claim.widened(more)",
        (
            "tests/test_relay.py::"
            "test_a_terminal_committed_for_a_queued_run_is_handed_to_the_critical_lane",
        ),
    ),
    # -- order (§9.2) ----------------------------------------------------------------------------
    Mutant(
        "order-prefix-reversed",
        "§9.2 per-run order: a claim returns the prefix in seq order",
        SQL,
        "    order by u.i, p.seq;\n",
        "    order by u.i, p.seq desc;\n",
        (f"{LEASE}::test_claim_takes_whole_runs_and_returns_prefixes_in_seq_order",),
    ),
    Mutant(
        "order-blocked-run-claimed",
        "§9.2: nothing after a failed event is delivered until retried or skipped",
        SQL,
        "where r.fairness_key = q.key and not r.idle and r.blocked_seq is null\n",
        "where r.fairness_key = q.key and not r.idle\n",
        (f"{LEASE}::test_fail_event_blocks_the_run_until_an_operator_acts",),
    ),
    # -- acknowledgement and wakes (§6, §9.1, §9.4) ----------------------------------------------
    Mutant(
        "ack-past-upto",
        "§9.1: never acknowledged without a 2xx (the ack's fence takes the batch's accepted seq)",
        SQL,
        ACK_UPTO,
        "else (select max(o.seq) from outbox o where o.run_id = b.run_id) end",
        (f"{LEASE}::test_an_ack_with_keep_holds_the_lease",),
        ci=True,
    ),
    Mutant(
        "wake-for-already-acked",
        "§9.4 wake iff ack: no engine event for an event the cursor had passed before this ack",
        SQL,
        "        where o.run_id = p_run_id and o.seq > p_from and o.seq <= p_upto\n",
        "        where o.run_id = p_run_id and o.seq <= p_upto\n",
        (f"{LEASE}::test_a_redelivered_event_is_not_emitted_again",),
        ci=True,
    ),
    Mutant(
        "wake-missing",
        "§9.4 wake iff ack: an acked event with a wake emits its engine event",
        SQL,
        "perform absurd.emit_event(v_wake.wake_queue, v_wake.wake_event,",
        "perform jsonb_build_array(v_wake.wake_queue, v_wake.wake_event,",
        (f"{LEASE}::test_ack_emits_the_engine_wake_and_notifies",),
    ),
    Mutant(
        "prepare-notes-nothing",
        "§9.1 no loss, §9.2 order: the migration's prepare ran ahead of its locks, so a run the"
        " previous release changed after the prepare read it is computed again under them",
        PREPARE,
        "    insert into migrate_0007_changed (run_id) select distinct run_id from changed;\n",
        "    perform 1;\n",
        (
            f"{MIGRATE}::"
            "test_what_the_previous_release_changes_after_the_prepare_is_caught_up_under_the_lock",
        ),
    ),
    Mutant(
        "prepare-step-waits",
        "rolling upgrade: a step of the migration's prepare never waits for a run an ack holds",
        PREPARE,
        "          for update skip locked) batch;",
        "          for update) batch;",
        (f"{MIGRATE}::test_a_prepare_step_passes_over_a_run_another_transaction_holds",),
    ),
    Mutant(
        "catch-up-forgets-passed-over",
        "rolling upgrade: a run the last prepare step passed over (held, noted by nothing) is"
        " computed under the migration's locks",
        CURSOR_MIGRATION,
        "select migrate_0007_runs(array(select run_id from runs where delivered_seq is null\n"
        "                               union\n"
        "                               select run_id from migrate_0007_changed));",
        "select migrate_0007_runs(array(select run_id from migrate_0007_changed));",
        (f"{MIGRATE}::test_a_run_the_last_prepare_step_passed_over_is_computed_under_the_lock",),
    ),
    # -- tracing (issue 40): one observer after the writes, a bounded flush at shutdown ----------
    Mutant(
        "tracing-resend-unobserved",
        "tracing: every outcome reaches the observer once, after its write (a narrowing's acked"
        " resend too)",
        "relay/delivery/complete.py",
        "        self.observe(resent, result)\n",
        "",
        ("tests/test_tracing.py::test_every_outcome_is_observed_once_after_it_is_written",),
        ci=True,
    ),
    Mutant(
        "tracing-flush-unbounded",
        "§4.2 graceful shutdown: a collector that drips its answer holds a stopping relay no"
        " longer than the flush's bound",
        "relay/integrations/otel.py",
        "        self._stopping.join(timeout)\n",
        "        self._stopping.join()\n",
        (
            "tests/test_tracing.py::test_a_collector_that_drips_its_answer_cannot_hold_a_stopping_relay",
        ),
    ),
    Mutant(
        "tracing-answer-unbounded",
        "memory bounds: the OTLP exporter reads a collector's endless answer without limit"
        " (issue 48 item 3)",
        "relay/integrations/otel.py",
        '    session.hooks["response"].append(_cut_answer)\n',
        "",
        ("tests/test_collector_answer.py",),
        ci=True,
    ),
    # -- the clock on either event loop (issue 52 item 2) ---------------------------------------
    Mutant(
        "deadlines-trust-the-timer",
        "a POST is cut no sooner than its http_timeout by the hot paths' clock: uvloop's timers"
        " fire up to a millisecond before a deadline of that clock",
        "relay/edges/ingress.py",
        "        self._timer = None\n        now = clock.now()\n",
        "        self._timer = None\n        now = self._timer_at\n",
        (
            "tests/test_clock_loops.py::"
            "test_a_request_is_cut_only_once_the_hot_paths_clock_reached_its_deadline",
        ),
        ci=True,
    ),
    Mutant(
        "looplag-dense-only-from-the-answer",
        "issue 52: after a quiet spell the loop's lateness is measured densely from the first"
        " POST's permit, so its answer reads what the loop did while it was on the wire",
        "relay/delivery/post_turn.py",
        "        self.lag.stir()\n",
        "",
        (
            "tests/test_looplag.py::"
            "test_a_posts_permit_wakes_a_sparse_probe_so_its_answer_sees_the_loop_blocked",
        ),
    ),
    # -- one fleet over many outbox databases (issue 51) ------------------------------------------
    Mutant(
        "fleet-set-aside-fatal",
        "issue 51 item 2: a database down or at an unservable schema version is set aside, never"
        " the process's end",
        "relay/fleet.py",
        "                self._set_aside(member, reason, delay)",
        "                raise ConnectionError(reason)",
        (f"{FLEET}::test_a_database_at_a_schema_version_this_release_cannot_serve_is_set_aside",),
        ci=True,
    ),
    Mutant(
        "fleet-relay-failure-fatal",
        "issue 51 item 2: a relay that fails once serving sets its database aside, not the process",
        "relay/fleet.py",
        "        except Exception as exc:  # never the process's end: the database is set aside",
        "        except ZeroDivisionError as exc:",
        (f"{FLEET}::test_a_relay_that_fails_once_serving_is_set_aside_and_started_again",),
    ),
    Mutant(
        "fleet-database-header-missing",
        "issue 51 item 3: each POST of a fleet names its database",
        "relay/edges/ingress.py",
        '            h["relay-database"] = self.database',
        "            pass",
        (f"{FLEET}::test_three_databases_deliver_into_one_ingress_each_post_naming_its_own",),
    ),
    Mutant(
        "fleet-terminal-posted-as-ordinary",
        "issue 51 item 3: a terminal goes first across the databases (the reserve, critical"
        " waiters first)",
        "relay/delivery/post_turn.py",
        '    if lane == "critical":\n        return True\n    for h in holds:',
        "    return False\n    for h in holds:",
        (
            f"{FLEET}::"
            "test_a_terminal_goes_ahead_of_other_databases_backlogs_queued_for_the_permits",
        ),
    ),
    Mutant(
        "fleet-startup-timeout-ignores-served",
        "issue 51: startup_timeout ends a fleet only when none of its databases was served",
        "relay/fleet.py",
        "# its lanes run: the fleet has served\n                self._startup_over.set()",
        "# its lanes run: the fleet has served\n                pass",
        (f"{FLEET}::test_startup_timeout_never_ends_a_fleet_once_a_database_is_served",),
    ),
    Mutant(
        "fleet-pools-unbudgeted",
        "issue 51: a fleet's connections to one server stay within server_connections",
        "relay/fleet.py",
        "pool_sizes=self.pool_sizes.get(name),",
        "pool_sizes=None,",
        (f"{FLEET}::test_server_connections_bounds_a_replicas_connections_to_one_server",),
    ),
    Mutant(
        "fleet-metrics-without-database",
        "issue 51 item 4: a fleet's metrics carry each database's name",
        "relay/serving/metrics.py",
        'sample._replace(labels={**sample.labels, "database": database})',
        "sample._replace(labels={**sample.labels})",
        (f"{FLEET}::{FLEET_METRICS}",),
    ),
    Mutant(
        "fleet-metrics-relays-not-kept",
        "issue 51 item 4: a fleet's /metrics serves each database's delivery metrics",
        "relay/fleet.py",
        '"keep_metrics": settings.metrics_addr is not None,',
        '"keep_metrics": False,',
        (f"{FLEET}::{FLEET_METRICS}",),
    ),
    Mutant(
        "fleet-backlog-gauges-not-refreshed",
        "issue 51 item 4: a fleet's /metrics serves each database's backlog gauges, refreshed as"
        " a relay alone's are",
        "relay/serving/health.py",
        "    elif metrics is not None:  # one database's of a fleet: for its /metrics and page",
        "    elif False:  # planted: no gauges, no report, no page",
        (f"{FLEET}::test_a_fleets_metrics_carry_each_databases_backlog_gauges_under_its_name",),
    ),
    Mutant(
        "fleet-report-not-written",
        "issue 51 item 4: each database's relay of a fleet writes this replica's report into its"
        " database, as a relay alone does",
        "relay/serving/health.py",
        "    await status.run()",
        "    await status.gauges.run()",
        (
            f"{FLEET_PAGE}::test_each_database_of_a_fleet_holds_this_replicas_report_and_its_status"
            "_shows_it",
        ),
    ),
    Mutant(
        "fleet-page-leaves-down-databases-out",
        "issue 51 item 4: a fleet's status page shows every database, a down one unmistakably",
        "relay/fleet.py",
        "lambda: [m.page_state() for m in self.members],",
        "lambda: [m.page_state() for m in self.members if m.up],",
        (f"{FLEET_PAGE}::test_a_fleets_page_shows_every_database_a_down_one_unmistakably",),
    ),
    Mutant(
        "fleet-page-lost-server-shown-up",
        "issue 51 item 4: a database served whose server is lost shows down on the fleet's page,"
        " as ledger_relay_database_up reads it",
        "relay/fleet.py",
        "            state.value,\n            self.up,",
        "            state.value,\n            state is State.SERVING,",
        (
            f"{FLEET_PAGE}::test_a_database_whose_server_is_lost_while_served_shows_down_until_it_is"
            "_back",
        ),
    ),
    Mutant(
        "fleet-page-ungated",
        "issue 32 item 3 in a fleet: ui_token guards the fleet's page as a relay alone's",
        "relay/serving/ui/fleet.py",
        "refused = gate(self.token, self.open_without_token, request)",
        "refused = None",
        (f"{FLEET_PAGE}::test_a_fleets_page_is_guarded_by_ui_token_as_a_relay_alones",),
    ),
    Mutant(
        "fleet-database-up-ignores-its-server",
        "issue 51 item 4: ledger_relay_database_up reads 0 for a served database whose server is"
        " gone",
        "relay/fleet.py",
        "        listener = self.relay.view.listener()\n        return listener is not None and"
        " listener.up",
        "        return True",
        (f"{FLEET_SERVERS}::{SERVER_KILLED}",),
    ),
    Mutant(
        "fleet-not-ready-while-a-database-is-down",
        "issue 51 item 4: a fleet's /readyz answers 200 while it serves, whatever its databases do",
        "relay/fleet.py",
        "            self.stopping,\n",
        "            self.stopping or not all(self.up().values()),\n",
        (f"{FLEET_SERVERS}::{SERVER_KILLED}",),
    ),
    Mutant(
        "pool-reconnect-gives-up",
        "issue 51: a pool whose server is gone keeps trying, a series of attempts every"
        " RECONNECT_WINDOW, with nothing asking it for a connection",
        "relay/pools.py",
        "            reconnect_failed=rearm,\n",
        "",
        (
            "tests/test_pools.py::"
            "test_a_pool_keeps_trying_past_its_window_and_reconnects_with_nobody_asking",
        ),
    ),
    Mutant(
        "one-database-pools-unbudgeted",
        "issue 51: server_connections bounds the one-database form's connections too",
        "relay/pools.py",
        "        share = own_share(settings)\n",
        "        share = None\n",
        (
            f"{FLEET_OPS}::test_server_connections_sizes_the_one_databases_pools_within_it",
            f"{FLEET_OPS}::test_server_connections_bounds_the_one_databases_connections",
        ),
    ),
    Mutant(
        "fleet-listen-url-ignored",
        "issue 51: a fleet's database LISTENs through its NAME.listen URL",
        "relay/databases.py",
        "        listen_database_url=database.listen_url,\n",
        "        listen_database_url=None,\n",
        (f"{FLEET_OPS}::test_each_database_listens_through_its_own_listen_url",),
    ),
    Mutant(
        "fleet-backlog-gauges-zero-before-probe",
        "issue 51: a database's backlog gauges have no sample before its first probe, never a 0"
        " nobody read",
        "relay/serving/metrics.py",
        "                    family.samples.clear()  # its HELP and TYPE still say what it is",
        "                    pass",
        (
            f"{FLEET_OPS}::test_a_fleet_databases_backlog_gauges_have_no_sample_until_its_first_"
            "probe",
        ),
    ),
    Mutant(
        "fleet-set-aside-retry-capped-at-30s",
        "issue 51: a database set aside is probed again within the pools' window once fixed",
        "relay/fleet.py",
        "MAX_RETRY = RECONNECT_WINDOW\n",
        "MAX_RETRY = 30.0\n",
        (
            "tests/test_fleet_states.py::"
            "test_a_database_set_aside_is_tried_again_within_the_pools_window_however_long_it_was_down",
        ),
        ci=True,
    ),
    Mutant(
        "fleet-set-aside-cleared-on-probe",
        "issue 51 item 4: a database set aside is shown DOWN with its reason until a relay serves"
        " it again",
        "relay/fleet.py",
        "        member.relay = relay\n",
        "        member.relay, member.set_aside, member.since = relay, None, time.time()\n",
        (
            "tests/test_fleet_states.py::"
            "test_a_database_set_aside_is_shown_down_with_its_reason_while_its_next_relay_starts",
        ),
    ),
    Mutant(
        "fleet-down-since-the-set-aside",
        "issue 51 item 4: a database is shown down since its server was lost, not since it was"
        " set aside",
        "relay/fleet.py",
        "            member.since = member.lost or time.time()",
        "            member.since = time.time()",
        (
            "tests/test_fleet_states.py::"
            "test_a_relay_that_rode_out_a_lost_server_then_failed_is_down_since_the_loss",
        ),
    ),
    Mutant(
        "claim-answer-lost-left-to-expire",
        "faults (schema 13): the runs of a claim whose answer was lost are given back by the lane's"
        " next turn, not left leased to a live owner until their leases expire",
        "relay/delivery/lane.py",
        "                    await self.store.give_back()",
        "                    pass",
        (
            "tests/test_claims_given_back.py::"
            "test_the_runs_of_a_claim_whose_answer_was_lost_go_without_waiting_for_the_lease",
        ),
    ),
    Mutant(
        "hand-back-failure-forgotten",
        "faults (schema 13): a lease whose hand-back failed is owed and given back once the"
        " database answers",
        "relay/delivery/release.py",
        "            self.store.owe(claim)",
        "            pass",
        (
            "tests/test_claims_given_back.py::"
            "test_a_lease_whose_hand_back_failed_is_given_back_once_the_database_answers",
        ),
    ),
)


def scratch_copy(dest: Path) -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for raw in listed:
        if not raw:
            continue
        rel = raw.decode()
        src = ROOT / rel
        if not src.is_file():
            continue  # deleted in the working tree
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
    # The previous release the upgrade tests run is built from git history, which the copy
    # lacks; the checkout's build (git-ignored) serves the copy too.
    previous = ROOT / ".venv-previous"
    if previous.is_dir():
        (dest / ".venv-previous").symlink_to(previous)


def apply(copy: Path, m: Mutant) -> None:
    path = copy / m.path
    text = path.read_text()
    n = text.count(m.old)
    if n != 1:
        raise SystemExit(f"mutant {m.name}: {m.path} holds its text {n} times, not once: {m.old!r}")
    path.write_text(text.replace(m.old, m.new))


def run_tests(copy: Path, tests: tuple[str, ...], extra: tuple[str, ...]) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    # A basetemp of the copy's own: pytest's default one is shared by every run of this user, and
    # a run clears it, stopping the embedded PostgreSQL of any other test run going on.
    basetemp = f"--basetemp={copy / '.pytest-tmp'}"
    pytest = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", basetemp]
    proc = subprocess.run(
        [*pytest, *extra, *tests],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
    )
    return proc.returncode, proc.stdout[-3000:] + proc.stderr[-2000:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ci", action="store_true", help="only the bounded subset")
    p.add_argument("--only", help="mutant names, comma separated")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="print pytest's output")
    a = p.parse_args(argv)
    chosen = list(MUTANTS)
    if a.only:
        names = {n.strip() for n in a.only.split(",") if n.strip()}
        unknown = names - {m.name for m in MUTANTS}
        if unknown:
            print(f"mutants.py: no mutant named {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        chosen = [m for m in chosen if m.name in names]
    elif a.ci:
        chosen = [m for m in chosen if m.ci]
    if a.list:
        for m in chosen:
            print(f"{m.name:34} {m.guards}\n{'':34} {m.path}; tests: {', '.join(m.tests)}")
        return 0

    with tempfile.TemporaryDirectory(prefix="relay-mutants-") as tmp:
        base = Path(tmp) / "base"
        scratch_copy(base)
        for m in chosen:  # every mutant's text must be where it says, before anything runs
            text = (base / m.path).read_text()
            if text.count(m.old) != 1:
                print(f"mutant {m.name}: its text is not exactly once in {m.path}", file=sys.stderr)
                return 2
        all_tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        code, out = run_tests(base, all_tests, ())
        if code != 0:
            print(f"baseline: the named tests fail without any mutant (exit {code}):\n{out}")
            return 1
        print(f"baseline: {len(all_tests)} test targets pass unmutated")
        verdicts: dict[str, list[str]] = {"killed": [], "survived": [], "error": []}
        for m in chosen:
            copy = Path(tmp) / m.name
            shutil.copytree(base, copy)
            apply(copy, m)
            started = time.monotonic()
            code, out = run_tests(copy, m.tests, m.extra)
            verdict = {0: "survived", 1: "killed"}.get(code, "error")
            verdicts[verdict].append(m.name)
            print(f"{verdict:8} {m.name:34} {time.monotonic() - started:5.1f}s  {m.guards}")
            if a.verbose or verdict != "killed":
                print("    " + out.strip().replace("\n", "\n    ")[-1500:])
            shutil.rmtree(copy, ignore_errors=True)
    total = len(chosen)
    print(
        f"{len(verdicts['killed'])}/{total} killed, {len(verdicts['survived'])} survived, "
        f"{len(verdicts['error'])} errors"
    )
    return 0 if len(verdicts["killed"]) == total else 1


if __name__ == "__main__":
    sys.exit(main())
