"""relay/tools/bench/cpu.py: the CPU of a window's parties, read from /proc.

Processes that burn a known amount of CPU (half in user code, half in the kernel, measured by
their own `time.process_time()`) are counted whole: alive through the window, and gone
(reaped by a parent in the party) before its end. A party whose process is gone is reported
as not measured. No wall-clock thresholds: only CPU seconds, which the load of the machine
does not change much, with a tolerance of a few clock ticks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from relay.tools.bench import cpu

BURN_S = 0.4
# /proc's clock ticks are 10 ms: each of the two snapshots truncates each process's time
SLACK_S = 0.1

# Burns `seconds` of its own CPU: the first half in the kernel (copies from /dev/zero into a
# buffer of its own: system time), the second in Python (user time).
BURN = """
import os, sys, time
def burn(seconds):
    start = time.process_time()
    zero, buffer = os.open("/dev/zero", os.O_RDONLY), bytearray(1 << 20)
    while time.process_time() < start + seconds / 2:
        os.readv(zero, [buffer])
    os.close(zero)
    while time.process_time() < start + seconds:
        sum(range(20_000))
"""

# Waits for commands on stdin: "burn" burns BURN_S itself, "child" runs a child that burns
# BURN_S and waits for it (the child is reaped: its time moves to this process's cutime).
WORKER = (
    BURN
    + f"""
import subprocess
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "burn":
        burn({BURN_S})
    elif line.strip() == "child":
        code = {BURN!r} + "burn({BURN_S})"
        subprocess.run([sys.executable, "-c", code], check=True)
    print("done", flush=True)
"""
)


@pytest.fixture
def worker() -> Iterator[subprocess.Popen[str]]:
    with subprocess.Popen(
        [sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as proc:  # closes its pipes and waits for it
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        yield proc
        proc.kill()


def _ask(proc: subprocess.Popen[str], command: str) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "done"


def _measured(proc: subprocess.Popen[str], command: str, party: cpu.Party) -> cpu.Usage:
    with cpu.window([party]) as w:
        _ask(proc, command)
    return w.usage


def test_a_live_process_is_counted_user_and_system_time(
    worker: subprocess.Popen[str],
) -> None:
    usage = _measured(worker, "burn", cpu.Party("worker", (worker.pid,)))
    seconds = usage.seconds["worker"]
    assert seconds is not None
    assert BURN_S - SLACK_S <= seconds <= BURN_S + SLACK_S, seconds
    assert usage.missing == {}


def test_a_child_that_came_and_went_is_counted_by_its_parent(
    worker: subprocess.Popen[str],
) -> None:
    usage = _measured(worker, "child", cpu.Party("worker", (worker.pid,)))
    seconds = usage.seconds["worker"]
    assert seconds is not None
    # the child's start-up (an interpreter) comes on top of what it burns
    assert BURN_S - SLACK_S <= seconds <= BURN_S + 3 * SLACK_S, seconds


def test_own_time_only_leaves_the_children_out(worker: subprocess.Popen[str]) -> None:
    usage = _measured(worker, "child", cpu.Party("worker", (worker.pid,), tree=False))
    seconds = usage.seconds["worker"]
    assert seconds is not None and seconds < SLACK_S, seconds


def test_a_party_whose_process_is_gone_is_not_measured(
    worker: subprocess.Popen[str],
) -> None:
    here = cpu.Party("bench", (os.getpid(),), tree=False)
    with cpu.window([cpu.Party("worker", (worker.pid,)), here]) as w:
        worker.kill()
        worker.wait()
    assert w.usage.seconds["worker"] is None
    assert "gone" in w.usage.missing["worker"]
    per = w.usage.us_per_event(1000)
    assert per["worker"] is None and per["total"] == per["bench"]
    assert "not measured: worker" in cpu.note("x", [(w.usage, 1000)])


def _stat(pid: int, ppid: int, comm: str, ticks: tuple[int, int, int, int]) -> str:
    fields = ["S", str(ppid), *["0"] * 9, *(str(t) for t in ticks), *["0"] * 30]
    return f"{pid} ({comm}) " + " ".join(fields)


def test_a_tree_from_a_proc_table(tmp_path: Path) -> None:
    for pid, ppid, ticks in (
        (10, 1, (5, 7, 100, 20)),  # the root: its own time and its reaped children's
        (11, 10, (1, 2, 0, 0)),
        (12, 11, (3, 0, 4, 0)),  # a grandchild
        (13, 1, (1000, 0, 0, 0)),  # not in the tree
    ):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(_stat(pid, ppid, "post (gres) x", ticks))
    (tmp_path / "14").mkdir()  # gone between the listing and the read: no stat
    (tmp_path / "self").mkdir()
    table = cpu.read_table(tmp_path)
    assert sorted(table) == [10, 11, 12, 13]
    assert table[10] == cpu.Stat(10, 1, 12, 120)
    assert cpu.tree_ticks(table, 10) == 12 + 120 + 3 + 7
    assert cpu.tree_ticks(table, 14) is None
    assert cpu.party_ticks(table, cpu.Party("p", (10, 13), tree=False)) == 1012
    assert cpu.party_ticks(table, cpu.Party("p", (10, 14))) is None


def test_a_child_reaped_while_the_table_was_read_is_not_counted_twice() -> None:
    parent = cpu.Party("server", (100,))
    alive = {100: cpu.Stat(100, 1, 10, 0), 99: cpu.Stat(99, 100, 500, 0)}
    # pid 99 (a child: pids wrap around) read alive, then reaped before its parent was read
    twice = {100: cpu.Stat(100, 1, 10, 500), 99: cpu.Stat(99, 100, 500, 0)}
    reaped = {100: cpu.Stat(100, 1, 10, 500)}
    reads = iter([twice, reaped, reaped])
    table = cpu.consistent_table([parent], lambda: next(reads))
    assert cpu.party_ticks(table, parent) == 510
    # processes of other parties come and go without a second read being needed
    others = iter([alive, alive | {7: cpu.Stat(7, 1, 1, 0)}])
    assert cpu.consistent_table([parent], lambda: next(others)) == alive


def test_the_server_is_found_when_local_and_not_when_its_processes_are_not_seen(
    pg_url: str, tmp_path: Path
) -> None:
    assert cpu.server_pid(pg_url, proc=tmp_path) is None  # an empty /proc: nothing visible
    postmaster = cpu.server_pid(pg_url)
    if postmaster is None:
        pytest.skip("the test server runs elsewhere (RELAY_TEST_DATABASE_URL)")
    with psycopg.connect(pg_url) as conn:
        row = conn.execute("select pg_backend_pid()").fetchone()
        assert row is not None
        assert cpu.read_table()[row[0]].ppid == postmaster  # while the backend lives


def test_the_ceiling() -> None:
    assert cpu.ceiling_eps([10.0, 15.0], cores=2) == 80_000
    start = cpu.Snapshot(0.0, {"a": 0, "b": 10}, (0, 0))
    end = cpu.Snapshot(2.0, {"a": 100, "b": 110}, (300, 400))
    usage = cpu.diff(start, end)
    assert usage.seconds == {"a": 100 * cpu.TICK_S, "b": 100 * cpu.TICK_S}
    assert cpu.median_split([(usage, 10)]) == {
        "a": round(100 * cpu.TICK_S * 1e5, 2),
        "b": round(100 * cpu.TICK_S * 1e5, 2),
        "total": round(200 * cpu.TICK_S * 1e5, 2),
    }
