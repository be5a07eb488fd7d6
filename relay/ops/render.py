"""What the operator sees: plain-text tables, no `rich` (it is only in the demo extra).

A table is a title line, a header, a rule under the header and left-aligned columns separated
by three spaces. Every title and cell goes through `clean()` and is printed as text, never as
markup, so an id or an ingress body ("[bold]", escape sequences) cannot style or drive the
terminal. Free-text columns (`FOLDING`) fold to fit the width; ids, states, numbers and times
stay on one line, so a table of long ids may be wider than the terminal rather than break one.

The renderers are pure (data and a width in, text out); `write`, `print_json` and
`output_width` are the only parts that touch stdout."""

from __future__ import annotations

import re
import shutil
import sys
import textwrap
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from relay.core.classes import backlog_class
from relay.ops.format import (
    audit,
    clean,
    fmt_age,
    fmt_bytes,
    fmt_time,
    key_label,
    operator,
    run_state,
)

FOLDING = frozenset({"error", "note", "value", "event", "type", "run", "owner"})
GAP = "   "
# A folding column is never narrower than this (nor than its header): cut finer, an id or a
# phrase is harder to read than a table a little wider than the terminal.
MIN_FOLD = 16
PIPED_WIDTH = 200  # piped output (a log, a ticket) gets room for the tables
# The outbox's tables in the order `relay status` lists their sizes (status() names them).
# A replica listed without a POST limit in `relay status`, when others have one.
NO_LIMIT = "none reported (post_limit = fixed, a relay before this release, or no fresh report)"
TABLES = ("outbox", "event_failures", "event_skips", "pending_terminals", "runs", "run_seqs")


# -- the plain table ---------------------------------------------------------------------------


def _char_width(ch: str) -> int:
    if unicodedata.combining(ch) or unicodedata.category(ch) == "Cf":
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def cell_width(text: str) -> int:
    """Terminal cells `text` takes (wide East Asian characters take two)."""
    return sum(_char_width(ch) for ch in text)


def _pad(text: str, width: int) -> str:
    return text + " " * (width - cell_width(text))


def _cut(word: str, width: int) -> tuple[str, str]:
    """The longest head of `word` that fits in `width` cells (at least one character)."""
    used = 0
    for i, ch in enumerate(word):
        used += _char_width(ch)
        if used > width:
            return word[: max(i, 1)], word[max(i, 1) :]
    return word, ""


def fold(text: str, width: int) -> list[str]:
    """`text` in lines of at most `width` cells: broken at spaces, and inside a word only when
    the word alone is longer than a line."""
    lines: list[str] = []
    line, used = "", 0
    for space, word in re.findall(r"(\s*)(\S+)", text):
        gap, size = cell_width(space), cell_width(word)
        if line and used + gap + size <= width:
            line, used = line + space + word, used + gap + size
            continue
        if line:
            lines.append(line)
        while size > width:
            head, word = _cut(word, width)
            lines.append(head)
            size = cell_width(word)
        line, used = word, size
    if line or not lines:
        lines.append(line)
    return lines


def _widths(
    columns: Sequence[str], rows: Sequence[Sequence[str]], width: int, header: bool
) -> list[int]:
    """Each column's natural width; when the table would be wider than `width`, the folding
    columns share what the others leave, the narrow ones keeping their natural width."""
    natural = [
        max([cell_width(name) if header else 0, *(cell_width(row[i]) for row in rows)])
        for i, name in enumerate(columns)
    ]
    folding = [i for i, name in enumerate(columns) if name in FOLDING]
    if not folding or sum(natural) + len(GAP) * (len(columns) - 1) <= width:
        return natural
    widths = list(natural)
    room = width - len(GAP) * (len(columns) - 1)
    room -= sum(n for i, n in enumerate(natural) if i not in folding)
    pending = sorted(folding, key=lambda i: natural[i])
    while pending and natural[pending[0]] <= room // len(pending):
        room -= natural[pending.pop(0)]
    for k, i in enumerate(pending):
        share = room // len(pending) + (1 if k < room % len(pending) else 0)
        least = max(MIN_FOLD, cell_width(columns[i]) if header else 0)
        widths[i] = min(natural[i], max(least, share))
    return widths


def table(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[object]], width: int,
    *, header: bool = True,
) -> str:  # fmt: skip
    """The table as text, its lines without trailing spaces; a cell of None shows as "-"."""
    cells = [["-" if c is None else clean(c) for c in row] for row in rows]
    if any(len(row) != len(columns) for row in cells):
        raise ValueError(f"every row of {title!r} needs {len(columns)} cells")
    widths = _widths(columns, cells, width, header)

    def line(parts: Sequence[str]) -> str:
        return GAP.join(_pad(p, w) for p, w in zip(parts, widths, strict=True)).rstrip()

    out = [clean(title)] if title else []
    if header:
        out += [line(columns), "-" * (sum(widths) + len(GAP) * (len(columns) - 1))]
    for row in cells:
        folded = [
            fold(c, w) if name in FOLDING else [c]
            for c, w, name in zip(row, widths, columns, strict=True)
        ]
        for k in range(max(len(f) for f in folded)):
            out.append(line([f[k] if k < len(f) else "" for f in folded]))
    return "\n".join(out)


# -- the operator's views ----------------------------------------------------------------------


def render_status(data: Mapping[str, Any], width: int) -> str:
    # The backlog's rows by the class of runs they count (issue 50 item 4; relay/core/classes.py),
    # as the metrics' `class` label and the claim counters name them: a run whose terminal event
    # is pending is a finished one, found by discovery; the critical lane's control traffic is
    # only the terminals it is signalled (docs/design.md, "Scheduling: which run goes next"), so
    # the row is not called "critical" here.
    lanes = []
    for lane in data["lanes"]:
        age = fmt_age(lane["oldest_pending_age_seconds"]) if lane["events"] else "-"
        lanes.append((backlog_class(lane["lane"]), lane["runs"], lane["events"], age))
    b = data["blocked"]
    since = fmt_age(b["oldest_failure_age_seconds"]) + " since failure" if b["runs"] else "-"
    lanes.append(("blocked", b["runs"], f"{b['held_events']} held", since))
    parts = [table("Backlog", ("runs", "count", "pending events", "oldest pending"), lanes, width)]
    keys = data.get("keys") or []  # absent before schema version 10's functions
    if any(k["key"] != "" for k in keys):  # only once a producer names a key
        by_key = [(key_label(k["key"]), k["runs"]) for k in keys]
        parts.append(
            table("Backlog by fairness key (the 10 with the most)", ("key", "runs"), by_key, width)
        )

    shown = data["blocked_runs"]
    if shown:
        title = f"Blocked runs ({b['runs']}): fix with `relay retry` or `relay skip`"
        rows = [
            (r["run_id"], r["seq"], r["event_id"], fmt_age(r["failed_age_seconds"]) + " ago",
             r["last_status"], clean(r["last_error"] or "", 120), r["held_events"])
            for r in shown
        ]  # fmt: skip
        blocked = ("run", "seq", "event", "failed", "status", "error", "held")
        parts.append(table(title, blocked, rows, width))
        if len(shown) < b["runs"]:
            parts[-1] += f"\n… and {b['runs'] - len(shown)} more (--limit)"

    leases = [(x["owner"], x["runs"], fmt_time(x["next_expiry"])) for x in data["leases"]]
    if data["expired_leases"]:
        leases.append(("(expired, claimable)", data["expired_leases"], "-"))
    owners = ("owner", "runs", "next expiry")
    parts.append(table("Live leases", owners, leases, width) if leases else "Live leases: none")
    replicas = [
        (x["owner"], "alive" if x["alive"] else "dead", fmt_time(x["seen_at"]))
        for x in data.get("replicas", ())
    ]
    heads = ("owner", "liveness", "lock taken")
    parts.append(table("Replicas", heads, replicas, width) if replicas else "Replicas: none")
    if any(x[1] == "dead" for x in replicas):
        # issue 41: a replica that stopped cleanly is not listed, so dead means what it says
        parts[-1] += "\ndead: ended without a clean stop (killed, crashed, or LISTEN lost)"
    parts[-1] += "".join("\n" + line for line in _limit_lines(data.get("replicas", ()), width))
    parts[-1] += "".join("\n" + line for line in _claim_lines(data.get("replicas", ()), width))

    sizes = ", ".join(f"{name} {fmt_bytes(data['tables'][name])}" for name in TABLES)
    lines = [
        f"Runs with deliveries in the last minute: {data['runs_delivered_last_minute']}",
        *fold(f"Outbox size: {sizes}", width),
        *_part_age_line(data, width),
        f"Database time: {fmt_time(data['db_now'])}",
    ]
    parts.append("\n".join(lines))
    return "\n\n".join(parts)


def limit_text(limit: Mapping[str, Any]) -> str:
    """A replica's adaptive POST limit as its report gives it (status()'s `limit`, issue 42):
    `limit 7/36 (fallen), in flight 6 (critical 1), waiting 12, min rtt 41 ms, retry tokens
    9.5`. A figure the report lacks shows as "?"."""

    def n(key: str) -> Any:
        value = limit.get(key)
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return value if ok else "?"

    def total(a: str, b: str) -> Any:
        x, y = n(a), n(b)
        return x + y if "?" not in (x, y) else "?"

    text = f"limit {n('limit')}/{n('ceiling')}" + (" (fallen)" if limit.get("fallen") else "")
    text += f", in flight {total('in_flight_critical', 'in_flight_ordinary')}"
    text += f" (critical {n('in_flight_critical')})"
    text += f", waiting {total('waiting_critical', 'waiting_ordinary')}"
    if limit.get("waiting_critical"):
        text += f" (critical {n('waiting_critical')})"
    rtt = limit.get("min_rtt_ms")
    text += ", min rtt -" if rtt is None else f", min rtt {n('min_rtt_ms')} ms"
    if limit.get("retry_tokens") is not None:
        tokens = n("retry_tokens")
        text += f", retry tokens {tokens:g}" if tokens != "?" else ", retry tokens ?"
    return text


def _limit_lines(replicas: Sequence[Mapping[str, Any]], width: int) -> list[str]:
    """Under the replicas, each one's POST limit from its report (status()'s `limit`); nothing
    when no replica reports one (every one under post_limit = fixed, or of a release before
    issue 42), and a word for a replica without one among others that have one."""
    if not any(isinstance(x.get("limit"), dict) for x in replicas):
        return []
    lines = ["POST limit, as each replica reported it in the last 2 minutes:"]
    for x in replicas:
        limit = x.get("limit")
        text = limit_text(limit) if isinstance(limit, dict) else NO_LIMIT
        lines += ["  " + line for line in fold(f"{clean(x['owner'], 120)}: {text}", width - 2)]
    return lines


def _claim_lines(replicas: Sequence[Mapping[str, Any]], width: int) -> list[str]:
    """Under the replicas, each one's runs claimed by class from its report (status()'s
    `claimed_by_class`, issue 50 item 4); nothing when no replica reports them."""
    if not any(isinstance(x.get("claimed_by_class"), dict) for x in replicas):
        return []
    lines = ["Runs claimed by class since start, as each replica reported it:"]
    for x in replicas:
        c = x.get("claimed_by_class")
        text = (
            ", ".join(f"{name} {c.get(name, 0):,}" for name in ("targeted", "finished", "due"))
            if isinstance(c, dict)
            else "none reported"
        )
        lines += ["  " + line for line in fold(f"{clean(x['owner'], 120)}: {text}", width - 2)]
    return lines


def _part_age_line(data: Mapping[str, Any], width: int) -> list[str]:
    """How long the outbox's current part has taken new events (absent from the functions of
    a release before it: nothing is shown)."""
    age = data.get("outbox_part_age_seconds")
    if age is None:
        return []
    text = (
        f"Current outbox part: taking new events for {fmt_age(age)}"
        " (retention makes the next one current every retention / 2)"
    )
    return fold(text, width)


def render_inspect(data: Mapping[str, Any], limit: int | None, width: int) -> str:
    run = data["run"]
    live = "live" if run["lease_live"] else "not live"
    lease = f"{run['lease_owner'] or '-'}, expires {fmt_time(run['lease_expires_at'])} ({live})"
    counts = ", ".join(f"{k} {run[k]}" for k in ("pending", "delivered", "failed", "skipped"))
    head: list[tuple[str, object]] = [
        ("state", run_state(run)),
        ("class", "finished (terminal event pending)" if run["critical"] else "open"),
        ("lease", f"{lease}, epoch {run['epoch']}"),
    ]
    if run["blocked_seq"] is None:  # a blocked run has no next attempt until an operator acts
        attempt = f"{fmt_time(run['next_attempt_at'])} (failed attempts {run['attempts']})"
        head.append(("next attempt", attempt))
    else:
        head.append(("failed attempts", f"{run['attempts']} (of seq {run['blocked_seq']})"))
    if run["last_error"]:
        head.append(("last error", clean(run["last_error"], 300)))
    head.append(("events", f"{run['events_total']} ({counts}); last seq {run['last_seq']}, "
                 f"terminal seq {run['terminal_seq'] or '-'}"))  # fmt: skip
    parts = [table(f"Run {clean(run['run_id'])}", ("field", "value"), head, width, header=False)]

    events, notes = [], []
    for e in data["events"]:
        kind = e["event_type"] + (" (terminal)" if e["terminal"] else "")
        done = {"delivered": e["delivered_at"], "skipped": e["skipped_at"]}.get(
            e["state"], e["failed_at"] if e["state"] == "failed" else None
        )
        created = fmt_time(e["created_at"], short=True)
        events.append((e["seq"], e["event_id"], kind, e["state"], e["attempts"], e["last_status"],
                       created, fmt_time(done, short=True)))  # fmt: skip
        note = [f"last error: {clean(e['last_error'], 300)}"] if e["last_error"] else []
        if audit(e) != "-":
            note.append(audit(e))
        if note:
            notes.append((e["seq"], "; ".join(note)))
    columns = ("seq", "event", "type", "state", "att", "status", "created",
               "delivered / failed / skipped")  # fmt: skip
    parts.append(table("Events (times UTC)", columns, events, width))
    if notes:
        parts.append(table("Errors and operator actions", ("seq", "note"), notes, width))
    if limit and len(data["events"]) == limit and run["events_total"] > limit:
        first = data["events"][0]["seq"]
        parts[-1] += f"\nshowing {limit} events from seq {first} (--from-seq, --limit for more)"
    return "\n\n".join(parts)


def render_action(verb: str, row: Mapping[str, Any], width: int) -> str:
    """What `relay retry` (`verb` "retried") or `relay skip` ("skipped") did."""
    rows: list[tuple[str, object]] = [
        ("run", row["run_id"]), ("seq", row["seq"]), ("state", row["state"]),
    ]  # fmt: skip
    if verb == "retried":
        who = operator(row["retried_by"], row.get("retried_role"))
        rows.append(("by", f"{who} at {fmt_time(row['retried_at'])}"))
        rows.append(("attempts", f"{row['attempts']} (operator retries {row['retries']})"))
    else:
        who = operator(row["skipped_by"], row.get("skipped_role"))
        rows.append(("by", f"{who} at {fmt_time(row['skipped_at'])}"))
        rows.append(("reason", row["skip_reason"]))
    if row["blocked_seq"] is None:
        rows.append(("run", "unblocked: the relay delivers the rest of it in seq order"))
    else:
        rows.append(("run", f"still blocked at seq {row['blocked_seq']}"))
    title = f"{verb} event {clean(row['event_id'])}"
    return table(title, ("field", "value"), rows, width, header=False)


def render_due(runs: Sequence[Mapping[str, Any]], width: int) -> str:
    """What `relay retry --run` (of a run backing off) or `relay retry --backing-off` did: the
    runs made due now, each with its failed attempts, last failure and the backoff it skipped."""
    if not runs:
        return "No run is backing off after a failed attempt (in that time): nothing to retry"
    rows = [
        (r["run_id"], r["attempts"], r["last_status"], fmt_time(r["failed_at"], short=True),
         fmt_time(r["was_due_at"], short=True), clean(r["last_error"] or "", 120))
        for r in runs
    ]  # fmt: skip
    plural = "s" if len(runs) != 1 else ""
    title = f"{len(runs)} run{plural} due now (backing off until now; times UTC)"
    columns = ("run", "att", "status", "failed", "was due", "error")
    return table(title, columns, rows, width) + "\n" + textwrap.fill(_DUE_NOW, max(40, width))


# What happens next to a run `relay retry` made due (schema version 11, runs.retry_waived): the
# waiver is the run's, so it holds whichever relay claims the run, and whenever.
_DUE_NOW = (
    "Sent past the retry budget: the relays were woken and claim each run at once (a relay that"
    " missed the wake, within its poll_interval), and send it whatever their budget holds. If"
    " that attempt fails too, the run backs off again and its next retry waits for the budget as"
    " any other."
)


# -- stdout ------------------------------------------------------------------------------------


def output_width() -> int:
    """The terminal's width (or $COLUMNS) when stdout is one, else room for piped tables."""
    return shutil.get_terminal_size().columns if sys.stdout.isatty() else PIPED_WIDTH


def write(text: str) -> None:
    """`text` and a newline on stdout; a character its encoding lacks becomes an escape."""
    sys.stdout.flush()
    encoding = sys.stdout.encoding or "utf-8"
    sys.stdout.buffer.write((text + "\n").encode(encoding, "backslashreplace"))
    sys.stdout.flush()


def print_json(data: object) -> None:
    sys.stdout.buffer.write(orjson.dumps(data, option=orjson.OPT_INDENT_2) + b"\n")
    sys.stdout.flush()
