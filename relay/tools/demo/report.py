"""The demo's report (pure): what producers committed against what the sink received, as a
Jepsen-style `Report` (`build_report`) and as a table (`render_report`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.table import Table

from relay.tools.demo.workload import Committed


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile (p in 0..100) of unsorted values; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * p // 100))  # ceil without floats drifting
    return ordered[int(rank) - 1]


@dataclass
class Report:
    runs: int
    replicas: int
    enqueued: int
    enqueued_backlog: int
    delivered: int
    lost: int
    duplicates: int
    order_violations: int
    wakes: int
    throughput_eps: float
    delivery_window_s: float
    drain_eps: float  # the backlog, drained with nothing else arriving: the replicas' capacity
    drain_s: float
    live_rate_eps: float  # the pace of the live half (0: unpaced)
    latency_ms: dict[str, float | None]
    replica_exit_codes: list[int | None]
    replica_log_events: dict[str, int]
    failed_events: int
    wall_s: float
    lost_examples: list[str] = field(default_factory=list)
    seed: int | None = None  # of the workload, to run the same one again (--seed)

    @property
    def replicas_clean(self) -> bool:
        return all(code == 0 for code in self.replica_exit_codes)

    @property
    def ok(self) -> bool:
        return (
            self.lost == 0
            and self.order_violations == 0
            and self.wakes == self.runs
            and self.replicas_clean
        )

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        return out


def build_report(
    *,
    runs: int,
    committed: Sequence[Committed],
    created_at: Mapping[str, float],
    deliveries: Mapping[str, int],
    first_seen_at: Mapping[str, float],
    first_order: Mapping[str, Sequence[int]],
    wakes: int,
    replica_exit_codes: list[int | None],
    replica_log_events: dict[str, int],
    failed_events: int,
    live_rate_eps: float,
    wall_s: float,
) -> Report:
    """Compare what producers committed with what the sink received.

    `created_at` (commit time, from the outbox) and `first_seen_at` (the sink) must be on the
    same clock: the caller corrects the database clock's offset first."""
    ids = [c.event_id for c in committed]
    lost = [i for i in ids if i not in deliveries]
    delivered = len(ids) - len(lost)
    duplicates = sum(max(0, deliveries.get(i, 0) - 1) for i in ids)
    violations = 0
    for run_id in {c.run_id for c in committed}:
        top = None
        for seq in first_order.get(run_id, ()):
            if top is not None and seq < top:
                violations += 1
            top = seq if top is None else max(top, seq)
    window, _ = _window([first_seen_at[i] for i in ids if i in first_seen_at])
    drain, drained = _window([first_seen_at[c.event_id] for c in committed
                              if not c.live and c.event_id in first_seen_at])  # fmt: skip
    lat: dict[str, list[float]] = {"ordinary": [], "terminal": []}
    for c in committed:
        if c.live and c.event_id in first_seen_at and c.event_id in created_at:
            kind = "terminal" if c.terminal else "ordinary"
            lat[kind].append((first_seen_at[c.event_id] - created_at[c.event_id]) * 1000)
    latency: dict[str, float | None] = {}
    for kind, values in lat.items():
        for p in (50, 99):
            v = percentile(values, p)
            latency[f"{kind}_p{p}"] = None if v is None else round(v, 1)
    return Report(
        runs=runs,
        replicas=len(replica_exit_codes),
        enqueued=len(ids),
        enqueued_backlog=sum(1 for c in committed if not c.live),
        delivered=delivered,
        lost=len(lost),
        duplicates=duplicates,
        order_violations=violations,
        wakes=wakes,
        throughput_eps=round(delivered / window, 1) if window > 0 else 0.0,
        delivery_window_s=round(window, 3),
        drain_eps=round(drained / drain, 1) if drain > 0 else 0.0,
        drain_s=round(drain, 3),
        live_rate_eps=round(live_rate_eps, 1),
        latency_ms=latency,
        replica_exit_codes=replica_exit_codes,
        replica_log_events=replica_log_events,
        failed_events=failed_events,
        wall_s=round(wall_s, 2),
        lost_examples=lost[:10],
    )


def _window(times: Sequence[float]) -> tuple[float, int]:
    """The span of `times` and how many there are."""
    return (max(times) - min(times) if len(times) > 1 else 0.0), len(times)


def render_report(report: Report) -> Table:
    def mark(good: bool) -> str:
        return "[green]✓[/green]" if good else "[bold red]✗[/bold red]"

    def ms(key: str) -> str:
        v = report.latency_ms.get(key)
        return "–" if v is None else f"{v:,.1f} ms"

    t = Table(
        title="relay demo",
        title_justify="left",
        header_style="bold",
        caption="latency: commit (outbox created_at) to first receipt at the sink, live events",
        caption_justify="left",
    )
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_column("", justify="center")
    live = report.enqueued - report.enqueued_backlog
    t.add_row("runs", f"{report.runs:,}", "")
    t.add_row(
        "events enqueued",
        f"{report.enqueued:,} ({report.enqueued_backlog:,} backlog, {live:,} live)",
        "",
    )
    t.add_row("delivered (unique at the sink)", f"{report.delivered:,}", "")
    t.add_row("lost", f"{report.lost:,}", mark(report.lost == 0))
    t.add_row("duplicates", f"{report.duplicates:,}", "")
    t.add_row("per-run order violations", f"{report.order_violations:,}", mark(
        report.order_violations == 0
    ))  # fmt: skip
    t.add_row("engine wakes emitted", f"{report.wakes:,} / {report.runs:,}", mark(
        report.wakes == report.runs
    ))  # fmt: skip
    if report.failed_events:
        t.add_row("events failed (runs blocked)", f"{report.failed_events:,}", "")
    t.add_row(
        "throughput, backlog drain",
        f"{report.drain_eps:,.0f} ev/s ({report.enqueued_backlog:,} in {report.drain_s:,.1f} s)",
        "",
    )
    t.add_row(
        "throughput, overall",
        f"{report.throughput_eps:,.0f} ev/s over {report.delivery_window_s:,.1f} s",
        "",
    )
    pace = f"{report.live_rate_eps:,.0f} ev/s" if report.live_rate_eps else "unpaced"
    t.add_row("live traffic paced at", pace, "")
    t.add_row("latency ordinary p50 / p99", f"{ms('ordinary_p50')} / {ms('ordinary_p99')}", "")
    t.add_row("latency terminal p50 / p99", f"{ms('terminal_p50')} / {ms('terminal_p99')}", "")
    codes = ", ".join("killed" if c is None else str(c) for c in report.replica_exit_codes)
    t.add_row("replicas (exit codes)", f"{report.replicas} ({codes})", mark(report.replicas_clean))
    if report.replica_log_events:
        noted = ", ".join(f"{k} ×{v}" for k, v in sorted(report.replica_log_events.items()))
        t.add_row("replica warnings/errors", noted, "")
    t.add_row("wall time", f"{report.wall_s:,.1f} s", "")
    return t
