"""The chart of the capacity scenario's drop (`relay bench --only capacity --capacity-chart
PATH`): the replicas' summed `ledger_relay_post_limit` and the POSTs in flight at the ingress
against what the ingress serves at once, over time, one panel per mode (docs/performance.md).

Drawn from the scenario's JSON data (`samples_s["<mode>.drop"]`, capacity.py's `_series`), with
matplotlib as `relay bench --plot` draws its own (the bench extra).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from relay.tools.bench.kit import BenchFailed


def _capacity_steps(series: dict[str, Any], end: float) -> tuple[list[float], list[float]]:
    """The workers in force over time, as the x and y of a step line (where="post")."""
    xs = [c["at_s"] for c in series["capacity"]] + [end]
    ys = [c["workers"] for c in series["capacity"]]
    return xs, [*ys, ys[-1]]


def draw(path: Path, data: dict[str, Any], a: argparse.Namespace) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchFailed(
            "--capacity-chart needs matplotlib: pip install 'ledger-relay[bench]'"
        ) from None
    modes = [m for m in ("adaptive", "fixed") if f"{m}.drop" in data]
    fig, axes = plt.subplots(len(modes), 1, figsize=(10, 4 * len(modes)), squeeze=False)
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        series = data[f"{mode}.drop"]
        every = series["every_s"]
        flight = series["in_flight"]
        xs = [k * every for k in range(len(flight))]
        end = xs[-1] if xs else 0.0
        ax.plot(xs, flight, color="#4477aa", linewidth=0.8, label="POSTs in flight at the ingress")
        limit = series["limit"]
        pairs = [
            (t, v) for t, v in zip(limit["at_s"], limit["summed"], strict=True) if v is not None
        ]
        if pairs:
            ax.step(
                [t for t, _ in pairs],
                [v for _, v in pairs],
                where="post",
                color="#dd8833",
                linewidth=1.6,
                label="the replicas' limits summed (ledger_relay_post_limit)",
            )
        cx, cy = _capacity_steps(series, end)
        ax.step(
            cx, cy, where="post", color="black", linewidth=1.2, label="workers (served at once)"
        )
        follow = series.get("limit_follow")
        if follow and pairs:
            ax.step(
                cx,
                [3 * w for w in cy],
                where="post",
                color="black",
                linestyle=":",
                linewidth=0.8,
                label="3 × workers",
            )
        ax.set_xlim(0, end)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("POSTs")
        title = "adaptive limit (the defaults)" if mode == "adaptive" else "post_limit = fixed"
        if follow and pairs:
            title += (
                f": the limit follows the drop in {_s(follow['down_s'])}, "
                f"the recovery in {_s(follow['up_s'])}"
            )
        ax.set_title(title, fontsize=10)
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since the backlog's commit")
    fig.suptitle(
        f"relay bench capacity, drop: {a.capacity_replicas} replicas, the ingress's workers "
        f"× 1/{a.capacity_drop_factor:g} from {a.capacity_drop_at:g} s for "
        f"{a.capacity_drop_for:g} s ({a.capacity_service_ms:g} ms per POST)"
        if a.capacity_drop_kind == "workers"
        else f"relay bench capacity, drop: service × {a.capacity_drop_factor:g}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"
