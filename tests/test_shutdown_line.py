"""A stop that cuts a POST short says so (issue 49 item 11): against an ingress that never
answers, the relay stops within `shutdown_timeout` as before, and one `post_abandoned` line names
the run whose lease it hands back, which is pending again, due now, with no attempt counted."""

from __future__ import annotations

import pytest

from relay.runner import Relay
from tests.support import Decisions, Rig, relay_logs, wait_for
from tests.test_relay import enqueue_runs

pytestmark = pytest.mark.anyio


async def test_a_stop_names_the_run_whose_post_it_abandoned_and_hands_it_back(rig: Rig) -> None:
    s, conn = rig.sink, rig.conn
    s.faults.delay(600.0, run_id="r1")  # the ingress never answers r1's POST (until it closes)
    enqueue_runs(conn, rig.schema, 2, 2, terminal=False)
    cfg = rig.settings(shutdown_timeout="0.3", http_timeout="20s", lease_ttl="60s")
    with relay_logs(Decisions()) as said:
        async with Relay(cfg).running():
            await wait_for(lambda: s.faults.pending() == 0, what="r1's POST held by the ingress")
            await wait_for(lambda: rig.count("run_id = 'r0' and state = 'delivered'") == 2)
    # r0 was answered and acked: no line for it. r1's POST was cut short: one line, naming it.
    abandoned = said.named("post_abandoned")
    assert [f.get("run_id") for f in abandoned] == ["r1"], "one post_abandoned line, for r1"
    line = abandoned[0]
    assert line["lane"] == "ordinary" and line["epoch"] == 1, line
    assert line["in_flight_s"] > 0 and line["next"] == "hand_back", line
    # Handed back: no lease, due now, not counted as a failed attempt; its events still pending.
    row = conn.execute(
        rig.q(
            "select lease_token, lease_owner, attempts, next_attempt_at <= clock_timestamp()"
            " from {s}.runs where run_id = 'r1'"
        )
    ).fetchone()
    assert row == (None, None, 0, True)
    assert rig.count("run_id = 'r1' and state = 'pending'") == 2
    assert not [f for f in said.named("delivered") if f["run_id"] == "r1"]


async def test_a_multi_run_post_cut_short_is_one_line_naming_every_run(rig: Rig) -> None:
    """With `ingress_batch_url` three runs share one POST: one line for it, with the three."""
    s, conn = rig.sink, rig.conn
    s.faults.delay(600.0)  # the ingress never answers the request (until it closes)
    enqueue_runs(conn, rig.schema, 3, 1, terminal=False)
    cfg = rig.settings(
        ingress_batch_url=rig.url + "/batch", concurrency=1, claim_runs=3,
        shutdown_timeout="0.3", http_timeout="20s", lease_ttl="60s",
    )  # fmt: skip
    with relay_logs(Decisions()) as said:
        async with Relay(cfg).running() as r:
            lane = r.lanes["ordinary"]
            await wait_for(lambda: len(lane.inflight) == 3, what="three runs claimed")
            await wait_for(lambda: s.faults.pending() == 0, what="the POST held by the ingress")
    abandoned = said.named("post_abandoned")
    assert len(abandoned) == 1, abandoned
    [line] = abandoned
    assert sorted(line["run_ids"]) == ["r0", "r1", "r2"] and line["runs"] == 3, line
    assert line["lane"] == "ordinary" and line["next"] == "hand_back", line
    assert rig.count("state = 'pending'") == 3
    leased = conn.execute(rig.q("select count(lease_token) from {s}.runs")).fetchone()
    assert leased == (0,)
