"""Where the CPU goes in a timed window of `relay bench`: CPU seconds of each party (the
PostgreSQL server, the relay, the sink, the bench itself) read from /proc, per event.

A machine's cores are shared by every party end to end, so CPU per event says what each limit
costs and what end to end can reach at best (`ceiling_eps`); it is also much less sensitive to
other work on the machine than events per second are (not immune: caches and cores shared
with other work, and fewer events per wake-up at lower rates, cost more per event).

How a party is counted: /proc/<pid>/stat's utime + stime (every thread of the process) plus
cutime + cstime (the children it has reaped), summed over the party's root and every live
descendant. A child that exits and is reaped moves its whole time into its parent's cutime +
cstime, so a PostgreSQL backend or parallel worker that comes and goes inside the window is
still counted, by the postmaster (`consistent_table`: a child reaped in the middle of a read
is counted once). Not counted: a process reaped by something outside the
party's tree, and kernel work charged to no process (softirqs run by ksoftirqd, for one):
`Usage.machine_busy_s` (all of the machine's non-idle time, /proc/stat) shows how much that,
and everyone else on the machine, amounts to.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

PROC = Path("/proc")


@dataclass(frozen=True)
class Stat:
    """One line of /proc/<pid>/stat, the fields this module needs (clock ticks)."""

    pid: int
    ppid: int
    own: int  # utime + stime
    reaped: int  # cutime + cstime: the children it has waited for


def parse_stat(text: str) -> Stat:
    # The command name (field 2) is in parentheses and may itself hold spaces and ")": the
    # fixed fields start after the last ")". Fields 4 (ppid) and 14-17 (utime, stime, cutime,
    # cstime), counted from 1, are rest[1] and rest[11:15].
    head, _, tail = text.rpartition(")")
    rest = tail.split()
    utime, stime, cutime, cstime = (int(v) for v in rest[11:15])
    return Stat(int(head.split("(", 1)[0]), int(rest[1]), utime + stime, cutime + cstime)


def read_table(proc: Path = PROC) -> dict[int, Stat]:
    """Every process visible now; one that exits while it is read is left out."""
    table = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            table[int(entry.name)] = parse_stat((entry / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue  # gone between the listing and the read (its time is in its parent's)
    return table


def tree_ticks(table: Mapping[int, Stat], root: int) -> int | None:
    """Ticks of `root` and its live descendants, their reaped children included; None when
    `root` is gone."""
    if root not in table:
        return None
    children: dict[int, list[int]] = defaultdict(list)
    for s in table.values():
        children[s.ppid].append(s.pid)
    total, todo = 0, [root]
    while todo:
        s = table[todo.pop()]
        total += s.own + s.reaped
        todo += children[s.pid]
    return total


@dataclass(frozen=True)
class Party:
    """Who is counted: `pids` and, with `tree`, all their descendants (a process's own time
    only, without: the bench process, whose children are the other parties)."""

    name: str
    pids: tuple[int, ...]
    tree: bool = True


def party_ticks(table: Mapping[int, Stat], party: Party) -> int | None:
    """None when one of its processes is gone: part of its time went where it is not seen."""
    total = 0
    for pid in party.pids:
        ticks = tree_ticks(table, pid) if party.tree else _own(table, pid)
        if ticks is None:
            return None
        total += ticks
    return total


def _own(table: Mapping[int, Stat], pid: int) -> int | None:
    return table[pid].own if pid in table else None


def machine_ticks(proc: Path = PROC) -> tuple[int, int]:
    """(busy, all) ticks of every core since boot, from /proc/stat's first line; busy is all
    but idle and iowait."""
    first = (proc / "stat").read_text().split("\n", 1)[0].split()
    values = [int(v) for v in first[1:9]]  # user nice system idle iowait irq softirq steal
    return sum(values) - values[3] - values[4], sum(values)


@dataclass(frozen=True)
class Snapshot:
    at: float  # monotonic seconds
    ticks: dict[str, int | None]  # party -> ticks
    machine: tuple[int, int]


def _members(table: Mapping[int, Stat], party: Party) -> frozenset[tuple[int, int]]:
    """(pid, reaped ticks) of each process of the party: what a child's exit changes."""
    todo, seen = [p for p in party.pids if p in table], set()
    while todo:
        pid = todo.pop()
        seen.add((pid, table[pid].reaped))
        if party.tree:
            todo += [s.pid for s in table.values() if s.ppid == pid]
    return frozenset(seen)


def consistent_table(
    parties: Iterable[Party], read: Callable[[], dict[int, Stat]], tries: int = 10
) -> dict[int, Stat]:
    """A table in which no process of the parties was reaped while it was read. A read is not
    atomic: a child read alive, then reaped before its parent is read (pids wrap around, so a
    child may come first), is counted twice, once alive and once in its parent's cutime; the
    other way round it is not counted at all. Either would be wrong by the child's whole
    lifetime (a backend that wrote a backlog: seconds). A read is kept when the next one finds
    the same processes with the same reaped ticks, so nothing was reaped during it."""
    parties = list(parties)
    table = read()
    for _ in range(tries):
        again = read()
        if all(_members(table, p) == _members(again, p) for p in parties):
            return table
        table = again
    return table  # still moving after `tries` reads: the last one, as good as any


def snapshot(parties: Iterable[Party], proc: Path = PROC) -> Snapshot:
    parties = list(parties)
    table = consistent_table(parties, lambda: read_table(proc))
    ticks = {p.name: party_ticks(table, p) for p in parties}
    return Snapshot(time.monotonic(), ticks, machine_ticks(proc))


TICK_S = 1 / os.sysconf("SC_CLK_TCK")
CORES = len(os.sched_getaffinity(0))  # the cores this process (and its children) may use


@dataclass
class Usage:
    """CPU seconds per party over one window (None: not measured, see `missing`)."""

    wall_s: float
    seconds: dict[str, float | None]
    machine_busy_s: float
    cores: int = CORES
    missing: dict[str, str] = field(default_factory=dict)  # party -> why

    @property
    def total_s(self) -> float:
        return sum(s for s in self.seconds.values() if s is not None)

    def us_per_event(self, events: int) -> dict[str, float | None]:
        """Each party's CPU per event and the total, in µs."""
        n = max(events, 1)
        per = {k: None if s is None else round(s * 1e6 / n, 2) for k, s in self.seconds.items()}
        return per | {"total": round(self.total_s * 1e6 / n, 2)}

    def share(self) -> float:
        """The parties' share of the machine: CPU seconds / (wall seconds x cores)."""
        return self.total_s / (self.wall_s * self.cores) if self.wall_s > 0 else 0.0

    def machine_share(self) -> float:
        """Everything's share (these parties, other work, the kernel's own)."""
        return self.machine_busy_s / (self.wall_s * self.cores) if self.wall_s > 0 else 0.0


def diff(start: Snapshot, end: Snapshot, missing: Mapping[str, str] | None = None) -> Usage:
    seconds: dict[str, float | None] = {}
    why = dict(missing or {})
    for name, before in start.ticks.items():
        after = end.ticks.get(name)
        if before is None or after is None:
            seconds[name] = None
            why.setdefault(name, "a process of it was gone at the start or end of the window")
        else:
            seconds[name] = (after - before) * TICK_S
    busy = (end.machine[0] - start.machine[0]) * TICK_S
    return Usage(end.at - start.at, seconds, busy, missing=why)


class Window:
    """What `window` measures; `usage` is set when its block ends."""

    usage: Usage


@contextmanager
def window(parties: Iterable[Party], missing: Mapping[str, str] | None = None) -> Iterator[Window]:
    """CPU of `parties` over the block. `missing`: parties not measured, and why."""
    parties = list(parties)
    w = Window()
    start = snapshot(parties)
    yield w
    w.usage = diff(start, snapshot(parties), missing)


# -- whose processes ----------------------------------------------------------------------------


def server_pid(url: str, proc: Path = PROC) -> int | None:
    """The postmaster's pid when the server at `url` runs on this machine (and this process
    can see it), else None. A backend's pid from pg_backend_pid() is a process here only by
    chance when the server is elsewhere (another host, a container): the server's processes in
    pg_stat_activity must all be children of that backend's parent, the postmaster. Every
    process of the server counts, other clients' backends too: the bench's embedded cluster
    has none, a shared `--database-url` server may."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("select pg_backend_pid()").fetchone()
        pids = [r[0] for r in conn.execute("select pid from pg_stat_activity").fetchall()]
        if row is None:
            return None
        table = read_table(proc)
        backend = table.get(int(row[0]))
        if backend is None or not _is_postgres(proc, backend.pid):
            return None
        postmaster = backend.ppid
        if not _is_postgres(proc, postmaster):
            return None
        # one that exited since the query is not in the table: no evidence either way
        if any(table[p].ppid != postmaster for p in pids if p in table):
            return None
        return postmaster


def _is_postgres(proc: Path, pid: int) -> bool:
    try:
        return (proc / str(pid) / "comm").read_text().strip() in {"postgres", "postmaster"}
    except OSError:
        return False


def parties(
    *, server: int | None, relay: Iterable[int], sink: int | None, bench: bool = False
) -> tuple[list[Party], dict[str, str]]:
    """The parties of a window, and those left unmeasured with why. `relay`: the pids running
    the relay's code (the bench's own for the limits, whose other children are not relay
    work: counted without descendants then); `bench`: count the bench's own polling."""
    out, missing = [], {}
    if server is None:
        missing["server"] = "the PostgreSQL server's processes are not visible on this machine"
    else:
        out.append(Party("server", (server,)))
    relay = tuple(relay)
    out.append(Party("relay", relay, tree=os.getpid() not in relay))
    if sink is not None:
        out.append(Party("sink", (sink,)))
    if bench:
        out.append(Party("bench", (os.getpid(),), tree=False))
    return out, missing


def median_split(usages: Iterable[tuple[Usage, int]]) -> dict[str, float]:
    """Per party (and the total), the median over reps of its µs of CPU per event; a party
    not measured in some rep is the median of the others."""
    values: dict[str, list[float]] = defaultdict(list)
    for usage, events in usages:
        for name, us in usage.us_per_event(events).items():
            if us is not None:
                values[name].append(us)
    return {name: round(statistics.median(v), 2) for name, v in values.items()}


def ceiling_eps(per_event_us: Iterable[float], cores: int = CORES) -> float:
    """Events/s of a pipeline whose stages, costing these µs of CPU per event, share `cores`
    cores and use all of them: the best end to end can do on this machine."""
    return cores * 1e6 / sum(per_event_us)


def summary(name: str, usage: Usage, events: int) -> dict[str, Any]:
    """A scenario's row and note material: µs/event per party and total, the shares."""
    return {
        "window": name,
        "events": events,
        "wall_s": round(usage.wall_s, 3),
        "us_per_event": usage.us_per_event(events),
        "share": round(usage.share(), 3),
        "machine_share": round(usage.machine_share(), 3),
        "not_measured": usage.missing,
    }


def note(name: str, usages: list[tuple[Usage, int]]) -> str:
    """One line for a scenario's notes: µs/event per party, per rep, and the shares."""
    reps = []
    for usage, events in usages:
        per = usage.us_per_event(events)
        parts = ", ".join(f"{k} {v:,.1f}" for k, v in per.items() if v is not None)
        reps.append(
            f"{parts} (parties {usage.share():.0%} of {usage.cores} cores, "
            f"machine {usage.machine_share():.0%})"
        )
    missing = {k: v for u, _ in usages for k, v in u.missing.items()}
    gone = (
        "; not measured: " + "; ".join(f"{k}: {v}" for k, v in missing.items()) if missing else ""
    )
    return f"{name} CPU µs/event per rep: " + " | ".join(reps) + gone
