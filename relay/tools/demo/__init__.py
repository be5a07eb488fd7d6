"""`relay demo`; see `relay.tools.demo.run`."""

from relay.tools.demo.run import Committed, build_report, main, percentile, plan_workload

__all__ = ["Committed", "build_report", "main", "percentile", "plan_workload"]
