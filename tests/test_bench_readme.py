"""scripts/bench_readme.py: the latest run's table in docs/performance.md is made from its JSON."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_readme.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_readme", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
        [sys.executable, str(SCRIPT), str(f), "--print"], capture_output=True, text=True, check=True
    ).stdout
    assert "ledger-relay 9.9.9, 2 CPUs (linux), 3 repetitions" in got
    assert "| `e2e_eps` | 12,346 |" in got and "| `by` | 1: 10.50 |" in got
    assert "| `peer_graphile_eps` | concurrency 24 |" in got
    assert "| e2e_eps > peer_graphile_eps | 45.1 | 1 | met |" in got
    assert "p50 130.0 ms / p99 250.0 ms" in got and "(26× at p50)" in got


def test_wrong_usage_exits_2() -> None:
    got = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert got.returncode == 2 and "bench_readme.py" in got.stderr


def test_it_writes_between_the_markers_and_keeps_the_rest(tmp_path: Path) -> None:
    script = _script()
    f, page = tmp_path / "bench.json", tmp_path / "performance.md"
    f.write_text(json.dumps(DOC))
    page.write_text(f"# before\n\n{script.START}\nold table\n{script.END}\n\nprose after\n")
    assert script.main([str(f)], page=page) == 0
    got = page.read_text()
    assert got.startswith(f"# before\n\n{script.START}\nLatest full run: ")
    assert "old table" not in got and "| `e2e_eps` | 12,346 |" in got
    assert got.endswith(f"(26× at p50).\n{script.END}\n\nprose after\n")


def test_a_page_without_its_markers_is_refused(tmp_path: Path) -> None:
    script = _script()
    page = tmp_path / "performance.md"
    page.write_text("no markers here\n")
    with pytest.raises(SystemExit, match="expected one"):
        script.write_into(page, "table")
    assert page.read_text() == "no markers here\n"


def test_the_shipped_page_says_what_the_shipped_json_says() -> None:
    """docs/performance.md's table is the one the script makes from docs/bench/latest.json."""
    script = _script()
    doc = (ROOT / "docs" / "performance.md").read_text()
    table = doc.split(script.START + "\n", 1)[1].split("\n" + script.END, 1)[0]
    latest = json.loads((ROOT / "docs" / "bench" / "latest.json").read_text())
    assert table == script.section(latest)
