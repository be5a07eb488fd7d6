"""The queue checker of one scenario (Jepsen's `queue` checker, extended for the relay).

Inputs are facts gathered after fault → heal → drain: what the producer committed, what the
ingress processed (the sink's own bookkeeping), what the outbox says, what the engine holds, and
what the replicas logged. The checker never consults the relay's view of itself for a verdict.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Facts:
    scenario: str
    sent: set[str]  # commits the producer saw confirmed
    attempted: set[str]  # everything the producer tried (a commit outcome may be unknown)
    received: dict[str, int]  # the sink: event_id -> times processed (2xx or accepted part)
    first_order: dict[str, list[int]]  # the sink: per run, seqs in order of first delivery
    stale_epochs: int  # the sink: requests carrying a lower epoch than one already seen
    outbox: list[tuple[str, str, int, str]]  # (event_id, run_id, seq, state)
    blocked: dict[str, int]  # run_id -> blocked_seq
    poison: set[str]  # event ids the nemesis made the ingress reject
    wakes_expected: set[str]  # wake names of delivered events that carry one
    wakes_emitted: set[str]  # rows in absurd."e_<queue>"
    emit_attempts: Counter[str]  # every emit the engine saw committed (trigger-counted)
    wake_payload_mismatches: int  # engine payload not matching the acked event
    lease_lost: Counter[str]  # replicas' `lease_lost` log lines by `where`
    drain_seconds: float
    faults: int  # fault injections the nemesis made
    notes: list[str] = field(default_factory=list)
    # A database failover (DESIGN §9.5): the events in flight at it, i.e. received by the ingress
    # before the new primary took writes and not acked there. Only they may come again.
    in_flight: set[str] | None = None


@dataclass
class Row:
    scenario: str
    sent: int
    delivered: int
    lost: int
    duplicated: int
    max_duplicates: int
    out_of_order: int
    unexpected: int
    acked_without_delivery: int
    delivered_not_acked: int
    stale_acks_rejected: int
    leases_lost: int
    stale_epochs: int
    blocked_runs: int
    poison_injected: int
    wakes_missing: int
    wakes_extra: int
    drain_seconds: float
    faults: int
    valid: bool
    problems: list[str]
    notes: list[str]
    in_flight: int | None = None  # at a failover (None: the scenario had none)
    beyond_in_flight: int | None = None  # duplicates of events that were not in flight

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def check(f: Facts) -> Row:
    state = {eid: st for eid, _run, _seq, st in f.outbox}
    where = {eid: (run, seq) for eid, run, seq, _st in f.outbox}
    delivered = set(f.received)

    # Not delivered is fine only for the poison event itself (failed) and the events of its run
    # queued behind it (pending and visible, DESIGN §9.1): the run is blocked, nothing else.
    def excused(eid: str) -> bool:
        if eid not in where:
            return False
        run, seq = where[eid]
        if state[eid] == "failed":
            return eid in f.poison
        block = f.blocked.get(run)
        return state[eid] == "pending" and block is not None and seq > block

    lost = {eid for eid in f.sent if eid not in delivered and not excused(eid)}
    unexpected = delivered - f.attempted
    acked = {eid for eid, st in state.items() if st == "delivered"}
    acked_without_delivery = acked - delivered
    delivered_not_acked = {eid for eid in delivered if state.get(eid) != "delivered"}

    out_of_order = 0
    for seqs in f.first_order.values():
        top = 0
        for s in seqs:
            if s < top:
                out_of_order += 1
            top = max(top, s)

    duplicated = sum(n - 1 for n in f.received.values() if n > 1)
    max_dup = max((n - 1 for n in f.received.values()), default=0)
    missing = f.wakes_expected - f.wakes_emitted
    extra = (
        len(f.wakes_emitted - f.wakes_expected)
        + sum(n - 1 for n in f.emit_attempts.values() if n > 1)
        + f.wake_payload_mismatches
    )
    poison_runs = {where[e][0] for e in f.poison if e in where}
    beyond = None
    if f.in_flight is not None:
        beyond = sum(n - 1 for e, n in f.received.items() if n > 1 and e not in f.in_flight)

    problems = []
    if lost:
        problems.append(f"lost: {sorted(lost)[:5]}")
    if unexpected:
        problems.append(f"unexpected: {sorted(unexpected)[:5]}")
    if out_of_order:
        problems.append(f"out of order: {out_of_order}")
    if acked_without_delivery:
        problems.append(f"acknowledged without delivery: {sorted(acked_without_delivery)[:5]}")
    if missing:
        problems.append(f"wakes missing: {sorted(missing)[:5]}")
    if extra:
        problems.append(f"wakes extra: {extra}")
    if beyond:
        problems.append(f"delivered again though not in flight at the failover: {beyond}")
    if set(f.blocked) != poison_runs:
        problems.append(f"blocked runs {sorted(f.blocked)} != poisoned runs {sorted(poison_runs)}")
    return Row(
        scenario=f.scenario,
        sent=len(f.sent),
        delivered=len(delivered),
        lost=len(lost),
        duplicated=duplicated,
        max_duplicates=max_dup,
        out_of_order=out_of_order,
        unexpected=len(unexpected),
        acked_without_delivery=len(acked_without_delivery),
        delivered_not_acked=len(delivered_not_acked),
        stale_acks_rejected=f.lease_lost.get("ack_fenced", 0),
        leases_lost=sum(f.lease_lost.values()),
        stale_epochs=f.stale_epochs,
        blocked_runs=len(f.blocked),
        poison_injected=len(f.poison),
        wakes_missing=len(missing),
        wakes_extra=extra,
        drain_seconds=round(f.drain_seconds, 2),
        faults=f.faults,
        valid=not problems,
        problems=problems,
        notes=f.notes,
        in_flight=None if f.in_flight is None else len(f.in_flight),
        beyond_in_flight=beyond,
    )
