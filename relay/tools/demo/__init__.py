"""`relay demo`: the whole system on one machine, checked end to end.

It starts what it needs (an embedded PostgreSQL unless RELAY_DATABASE_URL is set, the Absurd
schema and queue `demo`, the reference sink in a thread, several `relay run` replicas as
subprocesses), enqueues a scheduler-like workload (half before the relays start, half while
they run), waits until everything is acknowledged, stops the replicas with SIGTERM and prints
a Jepsen-style report: enqueued, delivered, lost, duplicated, out of order, engine wakes,
throughput and commit-to-delivery latency. Exit code 0 only when nothing was lost, nothing was
out of order, every run woke the engine once and every replica exited 0.

- `workload`: the plan (pure: `plan_workload`) and the producer threads that commit it;
- `report`: `build_report` (pure) and `render_report`;
- `replicas`: the `relay run` subprocesses;
- `run`: `Demo`, the I/O shell that owns every process and thread it starts and stops them on
  any exit;
- `cli`: `main`, the `relay demo` command.

The names callers use are re-exported here. The modules of this package import one another
directly, never through this file, so it stays free of import circles.
"""

from relay.tools.demo.cli import main, parse_args
from relay.tools.demo.report import Report, build_report, percentile, render_report
from relay.tools.demo.run import Demo, DemoFailed, Options
from relay.tools.demo.workload import Committed, RunPlan, live_rate, plan_run, plan_workload

__all__ = [
    "Committed",
    "Demo",
    "DemoFailed",
    "Options",
    "Report",
    "RunPlan",
    "build_report",
    "live_rate",
    "main",
    "parse_args",
    "percentile",
    "plan_run",
    "plan_workload",
    "render_report",
]
