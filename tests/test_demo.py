"""`relay demo`: its pure parts (workload plan, report), then the real thing end to end in a
subprocess against the test database."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import orjson
import psycopg
import pytest
from psycopg import sql

from relay.tools.demo import Committed, build_report, live_rate, percentile, plan_workload
from relay.tools.demo.replicas import count_log_events
from relay.tools.demo.workload import MAX_LIVE_RATE, MIN_LIVE_RATE
from tests.conftest import unique


def test_plan_has_the_shape_of_a_run() -> None:
    plans = plan_workload(200, "p-", seed=7)
    assert len({p.run_id for p in plans}) == 200
    for plan in plans:
        events = [e for tx in plan.transactions for e in tx]
        assert all(tx for tx in plan.transactions)
        assert events[0].event_type == "run_created"
        assert (events[0].wake_queue, events[0].wake_event) == (
            "demo",
            f"run-created:{plan.run_id}",
        )
        assert events[-1].event_type == "run_finished" and events[-1].terminal
        assert not any(e.terminal for e in events[:-1])
        assert 3 <= len(events) - 2 <= 8
        assert len({e.event_id for e in events}) == len(events)
    # Some runs commit their terminal event alone, as a scheduler finishing later would.
    assert any(len(p.transactions[-1]) == 1 for p in plans)
    assert plan_workload(5, "p-", seed=1) == plan_workload(5, "p-", seed=1)


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0
    assert percentile([5.0], 99) == 5.0


def test_live_rate_is_half_the_drain_capacity_per_transaction_and_clamped() -> None:
    assert live_rate(0, 2.0, 3.0) == MIN_LIVE_RATE  # nothing was drained: nothing measured
    assert live_rate(100, None, 3.0) == MIN_LIVE_RATE
    # 1000 runs (one POST each) in 2 s: 500 POSTs/s; half of it, at 3 events per transaction
    assert live_rate(1000, 2.0, 3.0) == 750.0
    assert live_rate(10, 10.0, 1.0) == MIN_LIVE_RATE
    assert live_rate(10**6, 1.0, 5.0) == MAX_LIVE_RATE


def test_count_log_events_names_what_the_replicas_logged(tmp_path: Path) -> None:
    log = tmp_path / "replica-1.log"
    log.write_bytes(
        b'{"event": "retry_scheduled"}\n{"msg": "lease_lost"}\n{"event": "retry_scheduled"}\n'
        b"Traceback (most recent call last):\n{}\n"
    )
    assert count_log_events([log, tmp_path / "missing.log"]) == {
        "retry_scheduled": 2,
        "lease_lost": 1,
        "non-json output": 1,
        "unknown": 1,
    }


def _report(**overrides: object) -> dict[str, object]:
    committed = [
        Committed("a1", "a", False, False),
        Committed("a2", "a", True, False),
        Committed("b1", "b", False, True),
        Committed("b2", "b", True, True),
    ]
    args: dict[str, object] = {
        "runs": 2,
        "committed": committed,
        "created_at": {"a1": 0.0, "a2": 0.0, "b1": 10.0, "b2": 10.0},
        "deliveries": {"a1": 1, "a2": 2, "b1": 1, "b2": 1},
        "first_seen_at": {"a1": 1.0, "a2": 1.5, "b1": 10.02, "b2": 10.05},
        "first_order": {"a": [1, 2], "b": [1, 2]},
        "wakes": 2,
        "replica_exit_codes": [0, 0],
        "replica_log_events": {},
        "failed_events": 0,
        "live_rate_eps": 100.0,
        "wall_s": 12.0,
    }
    args.update(overrides)
    return build_report(**args).as_json()  # type: ignore[arg-type]


def test_report_counts_like_a_queue_checker() -> None:
    r = _report()
    assert r["ok"] and r["enqueued"] == r["delivered"] == 4 and r["lost"] == 0
    assert r["duplicates"] == 1 and r["enqueued_backlog"] == 2
    assert r["latency_ms"] == {  # live events only
        "ordinary_p50": pytest.approx(20.0),
        "ordinary_p99": pytest.approx(20.0),
        "terminal_p50": pytest.approx(50.0),
        "terminal_p99": pytest.approx(50.0),
    }
    assert r["drain_s"] == 0.5 and r["drain_eps"] == 4.0


@pytest.mark.parametrize(
    "overrides",
    [
        {"deliveries": {"a1": 1, "a2": 1, "b1": 1}},  # b2 lost
        {"first_order": {"a": [2, 1], "b": [1, 2]}},  # out of order
        {"wakes": 1},  # a wake missing
        {"replica_exit_codes": [0, None]},  # a replica had to be killed
    ],
)
def test_report_fails_on_any_broken_invariant(overrides: dict[str, object]) -> None:
    assert not _report(**overrides)["ok"]


def test_demo_end_to_end(pg_url: str, tmp_path: Path) -> None:
    schema = unique("demo")
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env["RELAY_DATABASE_URL"] = pg_url
    cmd = [sys.executable, "-m", "relay.cli", "demo", "--runs", "150", "--json", str(out)]
    lines: list[str] = []
    pages: dict[str, int] = {}  # when -> the status page's answer
    try:
        with subprocess.Popen(
            [*cmd, "--schema", schema, "--timeout", "240", "--linger", "2"],
            env={**env, "COLUMNS": "200"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ) as proc:
            assert proc.stdout is not None
            url = None
            for line in proc.stdout:
                lines.append(line)
                if m := re.search(r"status page: (http://\S+/)", line):
                    url = m.group(1)
                if url and "stays up" in line:
                    pages["linger"] = httpx.get(url + "api/status", timeout=30).status_code
                elif url and "running" not in pages:
                    try:
                        pages["running"] = httpx.get(url, timeout=30).status_code
                    except httpx.TransportError:
                        pass  # the replica is still starting: try again at the next line
            proc.wait(300)
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(schema)))
    output = "".join(lines)
    assert proc.returncode == 0, output
    assert url is not None, output
    assert pages == {"running": 200, "linger": 200}, output
    report = orjson.loads(out.read_bytes())
    assert report["lost"] == 0
    assert report["order_violations"] == 0
    assert report["wakes"] == 150
    assert report["delivered"] == report["enqueued"] > 150 * 5
    assert report["replica_exit_codes"] == [0, 0]
    assert report["ok"] is True
    # The live half is paced from the drain the demo measured, not the floor it falls back to
    # when it saw no drain (it once waited 30 s for a LISTEN query it could not see while the
    # backlog drained, then paced the live half at 50 ev/s: a five-minute demo).
    assert report["live_rate_eps"] > MIN_LIVE_RATE, output
