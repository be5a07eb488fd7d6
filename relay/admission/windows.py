"""Sliding windows over a clock passed in: the minimum, the maximum or the sum of what was seen
in the last `span` seconds (issue 42: the adaptive POST limit's recent minimum round trip, the
event loop's recent lateness, the retry budget's recent successes and failed retries).

A window is kept in `slices` slices of `span / slices` seconds each, so its memory never grows
with the rate of what it sees (Finagle's `WindowedAdder` works the same way). What it reports
covers the current slice and the `slices - 1` before it: between `span - span / slices` and
`span` seconds of the past. The clock is monotonic (relay/core/clock.py's, the event loop's);
nothing here reads it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

SLICES = 10


class _Sliced:
    """Values added at `now`, combined per slice; slices older than the window are dropped."""

    def __init__(self, span: float, slices: int, combine: Callable[[float, float], float]) -> None:
        if span <= 0 or slices < 1:
            raise ValueError(f"a window of {span} s in {slices} slices")
        self.span = span
        self._width = span / slices
        self._slices = slices
        self._combine = combine
        self._values: dict[int, float] = {}  # slice number -> what its values combine to

    def add(self, value: float, now: float) -> None:
        current = self._slice(now)
        held = self._values.get(current)
        if held is not None:
            self._values[current] = self._combine(held, value)
            return
        # A new slice: the only time one can have left the window since the last add (it is
        # called per POST, and a slice is span / slices seconds).
        self._values[current] = value
        oldest = current - self._slices + 1
        for number in [n for n in self._values if n < oldest]:
            del self._values[number]

    def _live(self, now: float) -> list[float]:
        oldest = self._slice(now) - self._slices + 1
        return [v for n, v in self._values.items() if n >= oldest]

    def _slice(self, now: float) -> int:
        return math.floor(now / self._width)


class WindowedMin(_Sliced):
    """The smallest value seen in the window, or None when it saw none."""

    def __init__(self, span: float, slices: int = SLICES) -> None:
        super().__init__(span, slices, min)

    def value(self, now: float) -> float | None:
        return min(self._live(now), default=None)


class WindowedMax(_Sliced):
    """The largest value seen in the window, or None when it saw none."""

    def __init__(self, span: float, slices: int = SLICES) -> None:
        super().__init__(span, slices, max)

    def value(self, now: float) -> float | None:
        return max(self._live(now), default=None)


class WindowedSum(_Sliced):
    """The sum of the values added in the window (0.0 when none were)."""

    def __init__(self, span: float, slices: int = SLICES) -> None:
        super().__init__(span, slices, lambda a, b: a + b)

    def total(self, now: float) -> float:
        return math.fsum(self._live(now))
