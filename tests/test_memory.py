"""The relay's memory has a byte bound whatever the payload sizes (issue 13 item 5): a claim's
prefix stops at `max_batch_bytes` of payload, a lane holds at most `max_lane_bytes` claimed,
and a replica's peak RSS stays under the stated 256 MB with the defaults.

Measured on a real `relay run` subprocess (its kernel high-water mark, VmHWM) delivering runs of
events near the 256 KiB payload limit: 16 runs x 40 events, 160 MiB of payload pending at once
(without the bound, one claim took all of it, and RSS passed 1 GB in the probe that found it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest

from tests.support import Rig, q, wait_for
from tests.test_cli import relay_env, replicas, stop_all

pytestmark = pytest.mark.anyio

RUNS, PER_RUN = 16, 40
PAYLOAD_BYTES = 250 * 1024  # within the 256 KiB producer limit
STATED_PEAK_RSS = 256 * 1024 * 1024  # docs/operations.md: the bound with the default settings


def large_backlog(conn: psycopg.Connection[Any], schema: str) -> None:
    """Rows as enqueue writes them, payloads built by the server (no 160 MiB through the test)."""
    with conn.transaction():
        conn.execute(
            q(schema, "insert into {s}.run_seqs (run_id, last_seq) select 'big' || r, %s"
                      " from generate_series(1, %s) r"),
            (PER_RUN, RUNS),
        )  # fmt: skip
        conn.execute(
            q(schema, "insert into {s}.runs (run_id, next_attempt_at) select 'big' || r,"
                      " clock_timestamp() from generate_series(1, %s) r"),
            (RUNS,),
        )  # fmt: skip
        conn.execute(
            q(schema, "insert into {s}.events (run_id, seq, event_id, event_type, payload)"
                      " select 'big' || r, i, 'big' || r || '-' || i, 'step',"
                      " jsonb_build_object('pad', repeat(md5(r || '-' || i), %s))"
                      " from generate_series(1, %s) r, generate_series(1, %s) i"),
            (PAYLOAD_BYTES // 32, RUNS, PER_RUN),
        )  # fmt: skip


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/<pid>/status")


async def test_peak_rss_stays_under_the_stated_bound_with_large_payloads(
    rig: Rig, tmp_path: Path
) -> None:
    s = rig.sink
    large_backlog(rig.conn, rig.schema)
    total = RUNS * PER_RUN
    env = relay_env(rig.pg_url, rig.schema, rig.url)
    async with replicas(1, env, tmp_path) as procs:
        await wait_for(lambda: len(s.state.deliveries) == total, timeout=180, what="every event")
        await wait_for(lambda: rig.count("state <> 'delivered'") == 0, what="acks")
        rss = peak_rss(procs[0].pid)
        codes = await stop_all(procs)
    assert codes == [0]
    assert s.state.order_violations == 0
    assert all(s.state.first_order[f"big{r}"] == list(range(1, PER_RUN + 1)) for r in range(1, 17))
    pending_bytes = total * PAYLOAD_BYTES
    assert rss < STATED_PEAK_RSS, (
        f"peak RSS {rss / 2**20:.0f} MiB with {pending_bytes / 2**20:.0f} MiB of payload pending"
        f" (stated bound {STATED_PEAK_RSS / 2**20:.0f} MiB)"
    )
    # Each POST carried at most max_batch_bytes of payload (1 MiB by default: four such events).
    largest = max(len(x["seqs"]) for x in s.state.received)
    assert largest == (1024 * 1024) // (PAYLOAD_BYTES + 64), largest


async def test_a_lane_holds_no_more_than_its_byte_budget_of_claims(rig: Rig) -> None:
    """With max_lane_bytes = 2 x max_batch_bytes, the lane holds two runs' prefixes at a time,
    not its usual concurrency + claim_runs (sampled from the database's own lease table while a
    slow ingress keeps every claim in flight)."""
    s = rig.sink
    large_backlog(rig.conn, rig.schema)
    s.faults.delay(0.1, times=10_000)
    most = 0
    async with rig.relay(max_batch_bytes="1MiB", max_lane_bytes="2MiB", concurrency=8).running():
        while len(s.state.deliveries) < RUNS * PER_RUN // 4:
            leased = rig.conn.execute(
                rig.q("select count(*) from {s}.runs where lease_expires_at > clock_timestamp()")
            ).fetchone()
            assert leased is not None
            most = max(most, leased[0])
            await anyio.sleep(0.01)  # sampling, not waiting for an effect
    assert 1 <= most <= 2, f"{most} runs held at once by a lane with room for two"
