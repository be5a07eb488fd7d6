"""Write the "Latest full run" table of docs/performance.md from a `relay bench --json` file.

    python scripts/bench_readme.py docs/bench/latest.json [--print]

Figures, targets and the peers' settings come from the JSON alone, so the page says what was
run. The table replaces what lies between the two marker lines of docs/performance.md (the prose
after them, written by hand, stays); `--print` prints it instead.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PAGE = Path(__file__).resolve().parent.parent / "docs" / "performance.md"
START = "<!-- scripts/bench_readme.py writes from here -->"
END = "<!-- scripts/bench_readme.py writes up to here -->"


def _value(v: Any) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_value(x)}" for k, x in v.items())
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:,.2f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def section(doc: dict[str, Any]) -> str:
    m, machine = doc["metrics"], doc["machine"]
    lines = [
        f"Latest full run: {doc['at']}, ledger-relay {doc['relay_version']}, "
        f"{machine['cpus']} CPUs ({machine['platform']}), {doc['reps']} repetitions per figure "
        "(median), embedded PostgreSQL 16 with fsync on; JSON: "
        "[bench/latest.json](bench/latest.json).",
        "",
        "| key | value |",
        "|---|---|",
    ]
    lines += [f"| `{k}` | {_value(v)} |" for k, v in m.items()]
    settings = doc.get("settings") or {}
    if settings:
        lines += ["", "| peer figure | run as |", "|---|---|"]
        lines += [f"| `{k}` | {v} |" for k, v in settings.items()]
    lines += [
        "",
        "| target (ratios from this run) | measured | needed | verdict |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {t['target']} | {t['measured']} | {t['needed']} | {t['verdict']} |"
        for t in doc["targets"]
    ]
    wake = (doc.get("scenarios") or {}).get("wake")
    if wake:
        rows = {r["mode"]: r for r in wake["rows"]}
        poll, listen = rows.get("stock polling"), rows.get("wake listener")
        if poll and listen:
            ratio = poll["p50_ms"] / listen["p50_ms"]
            lines += [
                "",
                f"The wake scenario (same run): ack → task resumed p50 {poll['p50_ms']:.1f} ms / "
                f"p99 {poll['p99_ms']:.1f} ms with Absurd's stock polling worker, "
                f"{listen['p50_ms']:.1f} ms / {listen['p99_ms']:.1f} ms with the wake listener "
                f"({ratio:.0f}× at p50).",
            ]
    return "\n".join(lines)


def write_into(page: Path, text: str) -> None:
    """Replace what lies between the page's two marker lines with `text`."""
    doc = page.read_text()
    if doc.count(START) != 1 or doc.count(END) != 1 or doc.index(START) > doc.index(END):
        raise SystemExit(f"{page}: expected one {START!r} line before one {END!r} line")
    before, rest = doc.split(START, 1)
    _, after = rest.split(END, 1)
    page.write_text(f"{before}{START}\n{text}\n{END}{after}")


def main(argv: list[str], page: Path = PAGE) -> int:
    args = [a for a in argv if a != "--print"]
    if len(args) != 1 or len(argv) - len(args) > 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    text = section(json.loads(Path(args[0]).read_text()))
    if "--print" in argv:
        print(text)
    else:
        write_into(page, text)
        print(f"wrote the latest run's table into {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
