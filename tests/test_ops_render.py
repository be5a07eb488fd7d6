"""The operator tools' plain-text tables (relay/ops/render.py): alignment, folding of free text
to the width, hostile text printed inert, and the status and action views built from known
data. Pure: no database, no terminal, no `rich`."""

from __future__ import annotations

from typing import Any

import pytest

from relay.ops.render import (
    GAP,
    MIN_FOLD,
    cell_width,
    fold,
    render_action,
    render_inspect,
    render_status,
    table,
)

LONG_ERROR = (
    '{"error": "schema violation: field amount must be a decimal string with at most two '
    "fraction digits, got 12.345; the ingress refuses the whole batch until the producer "
    'sends a corrected event or an operator skips this one", "see": '
    '"https://ingress.example/docs/events/payment-captured/v2#amount-and-currency-fields"}'
)


def column_start(header_line: str, name: str) -> int:
    return header_line.index(name)


# -- the table ---------------------------------------------------------------------------------


def test_columns_are_left_aligned_under_their_header_with_a_rule() -> None:
    got = table("Leases", ("owner", "runs"), [("a", 1), ("replica-b", 22), ("c", None)], 200)
    assert got.splitlines() == [
        "Leases",
        "owner       runs",
        "----------------",
        "a           1",
        "replica-b   22",
        "c           -",
    ]


def test_a_table_without_header_has_no_rule() -> None:
    got = table("retried event e1", ("field", "value"), [("run", "r1"), ("attempts", 2)], 80,
                header=False)  # fmt: skip
    assert got == "retried event e1\nrun        r1\nattempts   2"


def test_an_empty_table_is_its_title_header_and_rule() -> None:
    assert table("Backlog", ("lane", "runs"), [], 80) == "Backlog\nlane   runs\n-----------"
    assert table("", ("a",), [], 80) == "a\n-"


def test_a_long_error_folds_to_the_width_and_the_ids_stay_whole() -> None:
    run_id, event_id = "order-2026-000123", "order-2026-000123-7"
    columns = ("run", "seq", "event", "status", "error")
    lines = table("Blocked", columns, [(run_id, 7, event_id, 422, LONG_ERROR)], 80).splitlines()

    assert all(len(line) <= 80 for line in lines), lines
    rows = lines[3:]
    assert len(rows) > 3  # folded onto several lines
    # The first line carries every cell; the following ones only the rest of the error.
    assert rows[0].startswith(f"{run_id}   7     {event_id}   422      ")
    at = column_start(lines[1], "error")
    assert all(row[:at].strip() == "" for row in rows[1:])
    pieces = [row[at:] for row in rows]
    assert all(not p.startswith(" ") and len(p) <= 80 - at for p in pieces)
    # Broken at spaces: nothing lost, nothing added; only the URL, longer than a line, is cut.
    *words, url = LONG_ERROR.split()
    [k] = [i for i, p in enumerate(pieces) if p.startswith('"https:')]
    assert " ".join(pieces[:k]).split() == words
    assert "".join(pieces[k:]) == url and len(pieces[k:]) > 1
    # Numbers, states and times are not in folding columns: never split, even past the width.
    wide = table("", ("seq", "error"), [("9" * 70, "a b c d e f g h i j k l m n o p")], 80)
    assert wide.splitlines()[2].startswith("9" * 70 + GAP + "a b c d e f g h")
    assert max(len(line) for line in wide.splitlines()) > 80


def test_folding_columns_narrower_than_their_share_keep_their_width() -> None:
    lines = table("", ("run", "error"), [("r-1234567890", LONG_ERROR)], 60).splitlines()
    assert lines[0] == "run            error"
    assert lines[2].startswith("r-1234567890   ") and "r-1234567890" not in lines[3]
    assert all(len(line) <= 60 for line in lines)


def test_a_folding_column_never_gets_narrower_than_its_floor() -> None:
    lines = table("", ("run", "seq", "error"), [("r1", "9" * 90, "x " * 40)], 60).splitlines()
    at = column_start(lines[0], "error")
    assert all(len(row[at:]) <= MIN_FOLD for row in lines[2:])
    assert max(len(row[at:]) for row in lines[2:]) >= MIN_FOLD - 1


def test_hostile_text_prints_inert() -> None:
    got = table("Run [bold]r1\x1b]0;pwned\x07", ("run", "error"),
                [("[bold]x\x1b[31m", "body \x1b[2J\u202eevil\r\n[/bold]")], 200)  # fmt: skip
    assert "\x1b" not in got and "\x07" not in got and "\r" not in got and "\u202e" not in got
    lines = got.splitlines()
    assert lines[0] == "Run [bold]r1\\x1b]0;pwned\\x07"
    assert lines[3].startswith("[bold]x\\x1b[31m   body \\x1b[2J\\u202eevil\\r\\n[/bold]")
    assert len(lines) == 4  # a newline in a cell is shown, it does not start a row


def test_wide_characters_take_two_cells() -> None:
    assert cell_width("日本") == 4 and cell_width("e\u0301") == 1
    lines = table("", ("owner", "runs"), [("日本", 1), ("abcdef", 2)], 80).splitlines()
    assert lines[2] == "日本" + " " * 2 + GAP + "1"
    assert all(cell_width(p) <= 6 for p in fold("日本語のテキスト", 6))


def test_fold() -> None:
    assert fold("", 10) == [""]
    assert fold("short", 10) == ["short"]
    assert fold("one two three", 7) == ["one two", "three"]
    assert fold("abcdefghij", 4) == ["abcd", "efgh", "ij"]
    assert fold("a  b", 10) == ["a  b"]


def test_every_row_needs_every_cell() -> None:
    with pytest.raises(ValueError, match="2 cells"):
        table("T", ("a", "b"), [("only one",)], 80)


# -- the views ---------------------------------------------------------------------------------


def status_data(**overrides: Any) -> dict[str, Any]:
    blocked = {"run_id": "r1", "seq": 2, "event_id": "r1-2", "failed_age_seconds": 75,
               "last_status": 422, "last_error": LONG_ERROR, "held_events": 4}  # fmt: skip
    data: dict[str, Any] = {
        "lanes": [
            {"lane": "critical", "runs": 1, "events": 2, "oldest_pending_age_seconds": 301.0},
            {"lane": "ordinary", "runs": 0, "events": 0, "oldest_pending_age_seconds": None},
        ],
        "blocked": {"runs": 3, "events": 3, "held_events": 5, "oldest_failure_age_seconds": 75},
        "blocked_runs": [blocked],
        "leases": [],
        "expired_leases": 0,
        "runs_delivered_last_minute": 17,
        "outbox_part_age_seconds": 3 * 3600 + 125.5,
        "tables": {
            "outbox": 3 * 1024 * 1024,
            "event_failures": 16384,
            "event_skips": 8192,
            "pending_terminals": 16384,
            "runs": 512,
            "run_seqs": 8192,
        },
        "db_now": "2026-01-02T03:04:05.678+00:00",
    }
    data.update(overrides)
    return data


def test_status_shows_every_figure() -> None:
    got = render_status(status_data(), 200)
    for words in ("Backlog", "finished   1       2                5m 01s",
                  "due        0       0                -", "blocked    3       5 held",
                  "1m 15s since failure", "Blocked runs (3)", "r1-2", "422", "1m 15s ago",
                  "… and 2 more (--limit)", "Live leases: none",
                  "Runs with deliveries in the last minute: 17",
                  "Outbox size: outbox 3.0 MiB, event_failures 16.0 KiB, event_skips 8.0 KiB,"
                  " pending_terminals 16.0 KiB, runs 512 B, run_seqs 8.0 KiB",
                  "Current outbox part: taking new events for 3h 02m",
                  "Database time: 2026-01-02 03:04:05.678Z"):  # fmt: skip
        assert words in got, got
    assert LONG_ERROR[:100] in got and LONG_ERROR not in got  # shortened to 120
    # finished runs are not the critical lane's control traffic (issue 50): not labelled so
    assert "critical" not in got, got


def test_status_shows_the_backlog_by_fairness_key_once_a_key_is_named() -> None:
    keys = [{"key": "tenant-a", "runs": 7}, {"key": "", "runs": 3}, {"key": None, "runs": 2}]
    got = render_status(status_data(keys=keys), 200)
    for words in ("Backlog by fairness key", "tenant-a    7", "(default)   3", "(other)     2"):
        assert words in got, got
    # without keys (every run the default key's, or functions older than version 10): no table
    for data in (status_data(keys=[{"key": "", "runs": 3}]), status_data()):
        assert "fairness key" not in render_status(data, 200)


def test_status_of_functions_without_the_part_age_leaves_its_line_out() -> None:
    data = status_data()
    del data["outbox_part_age_seconds"]
    got = render_status(data, 200)
    assert "Database time" in got and "Current outbox part" not in got


def test_status_fits_a_narrow_terminal() -> None:
    leases = [{"owner": "replica-a", "runs": 2, "next_expiry": "2026-01-02T03:05:00+00:00"}]
    got = render_status(status_data(leases=leases, expired_leases=1), 80)
    assert all(len(line) <= 80 for line in got.splitlines()), got
    assert "replica-a" in got and "(expired, claimable)" in got
    assert "2026-01-02 03:05:00.000Z" in got


def test_action_and_inspect_views() -> None:
    row = {"event_id": "[red]e1", "run_id": "r1", "seq": 1, "state": "skipped",
           "skipped_by": "carol", "skipped_at": "2026-01-02T03:04:05+00:00",
           "skip_reason": "duplicate", "blocked_seq": None}  # fmt: skip
    got = render_action("skipped", row, 80)
    assert got.splitlines()[0] == "skipped event [red]e1"
    assert "by       carol at 2026-01-02 03:04:05.000Z" in got and "unblocked" in got
    run = {"run_id": "r1", "epoch": 1, "blocked_seq": 1, "blocked_event_id": "r1-1",
           "lease_live": False, "lease_owner": None, "lease_expires_at": None, "idle": False,
           "attempts": 0, "next_attempt_at": "2026-01-02T03:04:05+00:00", "critical": False,
           "last_error": "bad payload", "pending": 1, "delivered": 0, "failed": 1,
           "skipped": 0, "events_total": 2, "last_seq": 2, "terminal_seq": None}  # fmt: skip
    event = {"seq": 1, "event_id": "r1-1", "event_type": "step", "terminal": False,
             "state": "failed", "attempts": 1, "last_status": 422, "last_error": "bad payload",
             "created_at": "2026-01-02T03:04:00+00:00", "delivered_at": None,
             "failed_at": "2026-01-02T03:04:01+00:00", "skipped_at": None, "retries": 0,
             "retried_at": None, "retried_by": None}  # fmt: skip
    got = render_inspect({"run": run, "events": [event]}, 1, 100)
    for words in ("Run r1", "BLOCKED at seq 1 (event r1-1)", "last error        bad payload",
                  "01-02 03:04:00   01-02 03:04:01", "1     last error: bad payload",
                  "showing 1 events from seq 1", "failed attempts   0 (of seq 1)"):  # fmt: skip
        assert words in got, got
    # A blocked run waits for an operator, not for a next attempt (issue 41).
    assert "next attempt" not in got
    due = render_inspect({"run": {**run, "blocked_seq": None}, "events": [event]}, 1, 100)
    assert "next attempt   2026-01-02 03:04:05.000Z (failed attempts 0)" in due, due


def test_status_shows_replicas_by_liveness() -> None:
    replicas = [
        {"owner": "host-a:1", "alive": True, "started_at": "2026-01-02T03:00:00+00:00",
         "seen_at": "2026-01-02T03:01:00+00:00"},
        {"owner": "host-b:7", "alive": False, "started_at": "2026-01-02T02:00:00+00:00",
         "seen_at": "2026-01-02T02:00:00+00:00"},
    ]  # fmt: skip
    got = render_status(status_data(replicas=replicas), 100)
    assert "Replicas" in got
    lines = got.splitlines()
    assert any("host-a:1" in line and "alive" in line for line in lines), got
    assert any("host-b:7" in line and "dead" in line for line in lines), got
    assert "ended without a clean stop" in got
    assert "Replicas: none" in render_status(status_data(replicas=[]), 100)
