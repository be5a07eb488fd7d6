"""`relay bench`: the benchmarks (scenarios, targets as ratios, report)."""

from relay.tools.bench.main import SCENARIOS, main

__all__ = ["SCENARIOS", "main"]
