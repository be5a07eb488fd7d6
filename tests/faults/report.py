"""The fault report: one row per scenario, printed as a table at the end of the pytest session
(`pytest_terminal_summary` in tests/conftest.py) and written as JSON.

JSON (`RELAY_FAULTS_REPORT`, default `.pytest_cache/relay-faults-report.json`):
`{"scale": s, "rows": [<Row.as_json()>, ...], "valid": bool, "max_duplicates": n}`.
A failover scenario's row also counts the events in flight at the failover (`in_flight`) and the
duplicates beyond them (`beyond_in_flight`, DESIGN §9.5: must be 0); other rows have null there.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import orjson
from rich import box
from rich.console import Console
from rich.table import Table

from tests.faults import scale
from tests.faults.checker import Row

ROWS: list[Row] = []

COLUMNS = [
    ("scenario", "scenario"),
    ("sent", "sent"),
    ("delivered", "deliv"),
    ("lost", "lost"),
    ("duplicated", "dup"),
    ("max_duplicates", "max dup"),
    ("in_flight", "in flight"),
    ("beyond_in_flight", "dup beyond"),
    ("out_of_order", "order"),
    ("unexpected", "unexp"),
    ("acked_without_delivery", "ack w/o deliv"),
    ("delivered_not_acked", "deliv not ack"),
    ("stale_acks_rejected", "stale acks"),
    ("leases_lost", "leases lost"),
    ("stale_epochs", "stale epochs"),
    ("blocked_runs", "blocked"),
    ("poison_injected", "poison"),
    ("wakes_missing", "wake miss"),
    ("wakes_extra", "wake extra"),
    ("drain_seconds", "drain s"),
    ("faults", "faults"),
    ("valid", "valid"),
]


def record(row: Row) -> None:
    ROWS.append(row)


def path(rootdir: Path) -> Path:
    env = os.environ.get("RELAY_FAULTS_REPORT")
    return Path(env) if env else rootdir / ".pytest_cache" / "relay-faults-report.json"


def as_json(rows: list[Row]) -> dict[str, Any]:
    return {
        "scale": scale(),
        "valid": all(r.valid for r in rows),
        "max_duplicates": max((r.max_duplicates for r in rows), default=0),
        "rows": [r.as_json() for r in rows],
    }


def write(rows: list[Row], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(orjson.dumps(as_json(rows), option=orjson.OPT_INDENT_2))


def table(rows: list[Row], width: int = 200) -> str:
    t = Table(
        title=f"ledger-relay fault report (scale {scale():g})",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for _, header in COLUMNS:
        if header == "scenario":
            t.add_column(header, no_wrap=True)
        else:
            t.add_column(header, justify="right", max_width=7)
    for r in rows:
        values = r.as_json()
        cells = []
        for key, _ in COLUMNS:
            v = values[key]
            if key == "valid":
                cells.append("yes" if v else "[bold red]NO[/]")
            else:
                cells.append("-" if v is None else str(v))
        t.add_row(*cells)
    out = io.StringIO()
    Console(file=out, width=width, force_terminal=False, color_system=None).print(t)
    for r in rows:
        for p in r.problems:
            out.write(f"  {r.scenario}: {p}\n")
        for n in r.notes:
            out.write(f"  {r.scenario} (note): {n}\n")
    return out.getvalue()
