"""`relay demo`: its command line, and SIGTERM/SIGINT turned into a clean exit."""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType

import orjson
import psycopg
from rich.console import Console

from relay.maintenance.migrate import SchemaError, validate_schema_name
from relay.tools.demo.report import render_report
from relay.tools.demo.run import Demo, DemoFailed, Options


class Interrupted(BaseException):
    """SIGTERM/SIGINT: clean up and leave."""


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signal.Signals(signum).name)


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def parse_args(argv: Sequence[str]) -> Options:
    p = argparse.ArgumentParser(
        prog="relay demo",
        description="Run PostgreSQL, the reference sink and several relay replicas on this "
        "machine, push a realistic workload through them and report what arrived.",
    )
    p.add_argument("--runs", type=int, default=3000, help="runs to enqueue (default 3000)")
    p.add_argument("--replicas", type=int, default=2, help="relay replicas (default 2)")
    p.add_argument("--producers", type=int, default=4, help="producer connections (default 4)")
    p.add_argument("--schema", default="relay", help="relay schema (default relay)")
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="events/s of the live half (committed while the relays run), 0 for unpaced; "
        "default: about half the capacity the replicas showed draining the backlog",
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait for delivery (default 600)"
    )
    p.add_argument("--seed", type=int, default=None, help="workload seed (default random)")
    p.add_argument("--json", dest="json_path", type=Path, help="also write the report here")
    p.add_argument(
        "--database-url",
        default=None,
        help="use this PostgreSQL instead of an embedded one [RELAY_DATABASE_URL]",
    )
    p.add_argument(
        "--linger",
        type=float,
        default=0.0,
        help="seconds to keep the replicas and their status pages up after delivery (default 0)",
    )
    a = p.parse_args(argv)
    if a.runs < 1:
        p.error("--runs must be at least 1")
    if a.replicas < 1:
        p.error("--replicas must be at least 1")
    if a.rate is not None and a.rate < 0:
        p.error("--rate must be positive (0: unpaced)")
    if a.linger < 0:
        p.error("--linger must be 0 or more seconds")
    if a.producers < 1:
        p.error("--producers must be at least 1")
    try:
        validate_schema_name(a.schema)
    except ValueError as exc:
        p.error(str(exc))
    return Options(
        runs=a.runs,
        replicas=a.replicas,
        producers=a.producers,
        schema=a.schema,
        rate=a.rate,
        timeout=a.timeout,
        seed=a.seed if a.seed is not None else random.randrange(2**31),
        json_path=a.json_path,
        database_url=a.database_url or os.environ.get("RELAY_DATABASE_URL") or None,
        linger=a.linger,
    )


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(list(sys.argv[1:] if argv is None else argv))
    console = Console(highlight=False)
    demo = Demo(opts, console)
    code = 1
    with _signals_interrupt():
        try:
            try:
                report = demo.run()
            except BaseException:
                demo.keep_logs = True
                raise
            finally:
                demo.close()
        except Interrupted as exc:
            console.print(f"[bold red]interrupted ({exc}); everything it started is stopped")
            return 130
        except (DemoFailed, SchemaError) as exc:
            console.print(f"[bold red]relay demo failed:[/bold red] {exc}")
            return 1
        except psycopg.OperationalError as exc:
            console.print(f"[bold red]relay demo: database error:[/bold red] {exc}")
            return 1
    console.print(render_report(report))
    if opts.json_path is not None:
        opts.json_path.write_bytes(
            orjson.dumps(report.as_json(), option=orjson.OPT_INDENT_2) + b"\n"
        )
    if report.ok:
        console.print("[bold green]PASS[/bold green]: nothing lost, per-run order kept, "
                      "every run woke the engine once")  # fmt: skip
        code = 0
    else:
        console.print("[bold red]FAIL[/bold red]: see the ✗ rows above")
    return code
