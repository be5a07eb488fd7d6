"""scripts/bench_readme.py: the README's bench section is made from the JSON alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_readme.py"


DOC = {
    "relay_version": "9.9.9",
    "at": "2026-12-01T00:00:00+00:00",
    "machine": {"cpus": 2, "platform": "linux"},
    "reps": 3,
    "metrics": {"e2e_eps": 12345.6, "peer_graphile_eps": 274.0, "by": {"1": 10.5}},
    "settings": {"peer_graphile_eps": "concurrency 24"},
    "targets": [
        {"target": "e2e_eps > peer_graphile_eps", "measured": 45.1, "needed": 1, "verdict": "met"}
    ],
    "scenarios": {
        "wake": {
            "rows": [
                {"mode": "stock polling", "p50_ms": 130.0, "p99_ms": 250.0},
                {"mode": "wake listener", "p50_ms": 5.0, "p99_ms": 8.0},
            ]
        }
    },
}


def test_the_section_carries_figures_settings_targets_and_the_wake_line(tmp_path: Path) -> None:
    f = tmp_path / "bench.json"
    f.write_text(json.dumps(DOC))
    got = subprocess.run(
        [sys.executable, str(SCRIPT), str(f)], capture_output=True, text=True, check=True
    ).stdout
    assert "ledger-relay 9.9.9, 2 CPUs (linux), 3 repetitions" in got
    assert "| `e2e_eps` | 12,346 |" in got and "| `by` | 1: 10.50 |" in got
    assert "| `peer_graphile_eps` | concurrency 24 |" in got
    assert "| e2e_eps > peer_graphile_eps | 45.1 | 1 | met |" in got
    assert "p50 130.0 ms / p99 250.0 ms" in got and "(26× at p50)" in got


def test_wrong_usage_exits_2() -> None:
    got = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert got.returncode == 2 and "bench_readme.py" in got.stderr
