"""In-process series for the status page (pure: the clock is passed in).

- `RateSeries`: the fleet's delivery rate per lane over the last `window` seconds. Each sample
  is every replica's cumulative delivered count per lane, as `report_replica` returns it; the
  rate between two samples is the sum of the per-replica increases over the time between them.
  A replica seen for the first time, or whose counter went down (it restarted under the same
  id), contributes nothing to that one interval rather than a spike.
- `LagWindow`: this replica's commit-to-ack lags of the last `window` seconds, per lane, for
  p50/p99 (bounded: at most `cap` samples kept, the oldest dropped first).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping

WINDOW = 15 * 60.0
LANES = ("critical", "ordinary")

Counts = Mapping[str, Mapping[str, int]]  # owner -> lane -> cumulative delivered


class RateSeries:
    def __init__(self, window: float = WINDOW, max_points: int = 2000) -> None:
        self.window = window
        self.points: deque[tuple[float, dict[str, float]]] = deque(maxlen=max_points)
        self._last: tuple[float, dict[str, dict[str, int]]] | None = None

    def add(self, now: float, counts: Counts) -> None:
        """One sample at `now` (seconds, any monotonic clock)."""
        current = {o: {lane: int(c.get(lane, 0)) for lane in LANES} for o, c in counts.items()}
        if self._last is not None:
            then, before = self._last
            elapsed = now - then
            if elapsed > 0:
                rates = {}
                for lane in LANES:
                    increase = 0
                    for owner, c in current.items():
                        prev = before.get(owner, {}).get(lane)
                        if prev is not None and c[lane] >= prev:
                            increase += c[lane] - prev
                    rates[lane] = increase / elapsed
                self.points.append((now, rates))
        self._last = (now, current)
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self.points and self.points[0][0] < now - self.window:
            self.points.popleft()

    def series(self, now: float) -> dict[str, list[tuple[float, float]]]:
        """Per lane: (seconds before `now`, events/s) oldest first."""
        self._trim(now)
        return {
            lane: [(round(now - t, 3), round(r[lane], 3)) for t, r in self.points] for lane in LANES
        }

    def latest(self) -> dict[str, float]:
        return dict(self.points[-1][1]) if self.points else dict.fromkeys(LANES, 0.0)


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of sorted values (None for none)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


class LagWindow:
    def __init__(self, window: float = WINDOW, cap: int = 20_000) -> None:
        self.window = window
        self.samples: deque[tuple[float, float]] = deque(maxlen=cap)

    def add(self, now: float, lag: float) -> None:
        self.samples.append((now, lag))

    def quantiles(self, now: float) -> dict[str, float | None]:
        while self.samples and self.samples[0][0] < now - self.window:
            self.samples.popleft()
        values = sorted(lag for _, lag in self.samples)
        return {
            "p50": percentile(values, 0.50),
            "p99": percentile(values, 0.99),
            "samples": float(len(values)),
        }
