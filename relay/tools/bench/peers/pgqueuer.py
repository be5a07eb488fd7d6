"""PgQueuer as a peer, run the way its own benchmark (`tools/benchmark.py`, drain strategy)
runs it: several consumers, each a `QueueManager` with its own connection, dequeuing in
batches, on the asyncpg driver (psycopg's async driver where asyncpg is not installed) and
uvloop where installed; one job per event, whose entrypoint POSTs it to the sink with one
aiohttp session per worker process (keep-alive; aiohttp is the relay's own POST client).

Why these settings, and why the earlier setup (one consumer, psycopg, httpx) reached ~199/s:
docs/performance.md, "Peers". PgQueuer keeps no per-run order; the sink counts violations.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

import anyio
import orjson
import psycopg

from relay.tools.bench.kit import (
    BenchFailed,
    Env,
    Result,
    Scenario,
    median,
    positive,
    reset,
    rotated,
)
from relay.tools.bench.peers import (
    HEADERS,
    event_bodies,
    measure,
    settings_text,
    sink_check,
    skipped,
)


@dataclass(frozen=True)
class Setting:
    consumers: int  # QueueManagers (PgQueuer's benchmark: --dequeue, 5)
    batch_size: int  # QueueManager.run(batch_size=...) (its benchmark: 10)
    driver: str  # "asyncpg" or "psycopg"
    loop: str  # "uvloop" or "asyncio"
    max_tasks: int = 0  # QueueManager.run(max_concurrent_tasks=...) per consumer; 0: unlimited

    def shown(self) -> dict[str, Any]:
        return {
            "consumers": self.consumers,
            "batch_size": self.batch_size,
            "max_concurrent_tasks": self.max_tasks or "unlimited",
            "driver": self.driver,
            "loop": self.loop,
            "http": "aiohttp",
        }


def _arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("peer_pgqueuer")
    g.add_argument("--peer-events", type=positive(int), default=20_000, help="PgQueuer jobs")
    g.add_argument(
        "--pgqueuer-consumers",
        default="1,5",
        help="QueueManagers (one connection each), or several to try, comma-separated (1,5)",
    )
    g.add_argument(
        "--pgqueuer-batch", default="100", help="dequeue batch size, or several to try (100)"
    )
    g.add_argument(
        "--pgqueuer-max-tasks",
        type=int,
        default=0,
        help="max_concurrent_tasks per consumer (0: unlimited, PgQueuer's default)",
    )
    g.add_argument(
        "--pgqueuer-driver",
        choices=["auto", "asyncpg", "psycopg"],
        default="auto",
        help="auto: asyncpg where installed (PgQueuer's benchmark default), else psycopg",
    )


# -- the worker process ---------------------------------------------------------------------


async def _consumer(setting: Setting, url: str, sink: str, state: dict[str, Any]) -> None:
    from pgqueuer.models import Job
    from pgqueuer.qm import QueueManager
    from pgqueuer.queries import Queries
    from pgqueuer.types import QueueExecutionMode

    session = state["session"]
    if setting.driver == "asyncpg":
        import asyncpg
        from pgqueuer.db import AsyncpgDriver

        driver: Any = AsyncpgDriver(await asyncpg.connect(dsn=url))
    else:
        from pgqueuer.db import PsycopgDriver

        driver = PsycopgDriver(await psycopg.AsyncConnection.connect(url, autocommit=True))
    qm = QueueManager(Queries(driver))

    @qm.entrypoint("post_event")
    async def post_event(job: Job) -> None:
        assert job.payload is not None
        run_id = orjson.loads(job.payload)["run_id"]
        async with session.post(
            f"{sink}/runs/{run_id}/events", data=job.payload, headers=HEADERS
        ) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"the sink answered {r.status}")
        state["done"] += 1
        state["last"] = time.monotonic()

    await qm.run(
        mode=QueueExecutionMode.drain,
        batch_size=setting.batch_size,
        max_concurrent_tasks=setting.max_tasks or None,
    )


async def _worker(setting: Setting, url: str, sink: str) -> None:
    import aiohttp

    # aiohttp's default pool (100 connections), kept alive; one session for every consumer
    connector = aiohttp.TCPConnector(keepalive_timeout=30)
    async with aiohttp.ClientSession(connector=connector) as session:
        state: dict[str, Any] = {"session": session, "done": 0, "last": 0.0}
        print("ready", flush=True)
        started = time.monotonic()
        await asyncio.gather(
            *(_consumer(setting, url, sink, state) for _ in range(setting.consumers))
        )
        # From the start to the last POST: drain mode's exit check is not counted.
        print(orjson.dumps({"seconds": state["last"] - started, "done": state["done"]}).decode())


def worker_main(argv: list[str]) -> None:
    url, sink, consumers, batch, driver, loop, max_tasks = argv
    setting = Setting(int(consumers), int(batch), driver, loop, int(max_tasks))
    if loop == "uvloop":
        import uvloop

        uvloop.run(_worker(setting, url, sink))
    else:
        asyncio.run(_worker(setting, url, sink))


CODE = (
    "import sys; from relay.tools.bench.peers.pgqueuer import worker_main;"
    " worker_main(sys.argv[1:])"
)

# -- the scenario ---------------------------------------------------------------------------


async def _once(
    env: Env, base: str, setting: Setting, jobs: int, per_run: int, tag: str
) -> tuple[float, int]:
    from pgqueuer.db import PsycopgDriver
    from pgqueuer.queries import Queries

    await reset(env)
    async with await psycopg.AsyncConnection.connect(env.url, autocommit=True) as conn:
        queries = Queries(PsycopgDriver(conn))
        if await queries.schema_is_installed():
            await queries.uninstall()
        await queries.install()
        try:
            bodies: list[bytes | None] = list(event_bodies(jobs, per_run, tag))
            for lo in range(0, len(bodies), 5000):
                chunk = bodies[lo : lo + 5000]
                await queries.enqueue(["post_event"] * len(chunk), chunk, [0] * len(chunk))
            log = env.workdir / f"pgqueuer-{tag}.log"
            with log.open("wb") as err:
                argv = [
                    str(v)
                    for v in (
                        setting.consumers,
                        setting.batch_size,
                        setting.driver,
                        setting.loop,
                        setting.max_tasks,
                    )
                ]
                with anyio.fail_after(max(120, jobs / 50)):
                    proc = await anyio.run_process(
                        [sys.executable, "-c", CODE, env.url, base, *argv], stderr=err, check=False
                    )
            lines = [ln for ln in proc.stdout.decode().splitlines() if ln.startswith("{")]
            if proc.returncode != 0 or not lines:
                why = log.read_text(errors="replace")[-400:]
                raise BenchFailed(f"the PgQueuer worker failed: {why}")
            out = orjson.loads(lines[-1])
        finally:
            await queries.uninstall()
    violations = await sink_check(base, jobs, "peer_pgqueuer")
    return jobs / out["seconds"], violations


def _driver(choice: str) -> str:
    if choice == "auto":
        return "asyncpg" if importlib.util.find_spec("asyncpg") else "psycopg"
    return choice


async def peer_pgqueuer(env: Env, a: argparse.Namespace) -> Result:
    if importlib.util.find_spec("pgqueuer") is None:
        why = "pgqueuer is not installed: pip install 'ledger-relay[bench]'"
        return skipped("peer_pgqueuer_eps", why)
    driver = _driver(a.pgqueuer_driver)
    if driver == "asyncpg" and importlib.util.find_spec("asyncpg") is None:
        raise BenchFailed("--pgqueuer-driver asyncpg: asyncpg is not installed")
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    base = await env.external_sink()
    rows: list[dict[str, Any]] = []
    best: tuple[float, int, Setting] | None = None
    for consumers in (int(c) for c in a.pgqueuer_consumers.split(",") if c.strip()):
        for batch in (int(b) for b in a.pgqueuer_batch.split(",") if b.strip()):
            setting = Setting(consumers, batch, driver, loop, a.pgqueuer_max_tasks)

            def once(rep: int, setting: Setting = setting) -> Awaitable[tuple[float, int]]:
                return _once(env, base, setting, a.peer_events, a.e2e_per_run, f"p{rep}")

            eps, violations, row = await measure(
                env, "peer_pgqueuer_eps", setting.shown(), a.reps, once
            )
            rows.append(row)
            if best is None or eps > best[0]:
                best = (eps, violations, setting)
    assert best is not None
    eps, violations, setting = best
    shown = {"version": version("pgqueuer"), **setting.shown()}
    pairs = await _paired(env, base, setting, a)
    rows += pairs.rows
    return Result(
        ["key", "events_per_s", "reps", "order_violations", "settings"],
        rows,
        [
            f"PgQueuer {version('pgqueuer')} worker in its own process, drain mode, "
            f"{a.peer_events:,} jobs, one per event ({a.e2e_per_run} per run), enqueued before "
            "it starts; its entrypoint POSTs the event with aiohttp (keep-alive); events/s from "
            "the worker's start to its last POST (median of reps); no per-run order, violations: "
            "the most in one rep; the best row counts",
            f"best: {settings_text(shown)}",
            *pairs.notes,
        ],
        metrics={
            "peer_pgqueuer_eps": eps,
            "peer_pgqueuer_order_violations": violations,
            "peer_eps": eps,  # the name of this figure before issue 16
            **pairs.metrics,
        },
        settings={"peer_pgqueuer_eps": settings_text(shown)},
    )


async def _paired(env: Env, base: str, setting: Setting, a: argparse.Namespace) -> Result:
    """The relay on runs of one event against PgQueuer's best setting, in alternating reps of
    the same number of events (issue 16). On runs of one event the relay POSTs once per event,
    as PgQueuer does per job; their figures measured minutes apart in a full run differ by
    more than the two differ (docs/performance.md), so this comparison pairs each relay rep
    with a PgQueuer rep run next to it, alternating which goes first, and judges the median of
    the pairs' ratios."""
    # Imported here: the PgQueuer worker process imports this module, and loads none of the
    # relay's own delivery code.
    from relay.tools.bench.throughput import e2e_once

    rates: dict[str, list[float]] = {"peer": [], "relay": []}
    for rep in range(a.reps):
        for who in rotated(["peer", "relay"], rep):
            if who == "peer":
                eps, _ = await _once(env, base, setting, a.peer_events, 1, f"q{rep}")
            else:
                what = f"tiny_runs_eps paired, rep {rep + 1}"
                eps, _ = await e2e_once(env, what, 1, a.peer_events, 1)
            rates[who].append(eps)
    relay, peer = rates["relay"], rates["peer"]
    relay_eps, peer_eps = median(relay), median(peer)
    ratios = [r / p for r, p in zip(relay, peer, strict=True)]
    per_pair = ", ".join(f"{r:.2f}" for r in ratios)
    return Result(
        [],
        [
            {
                "key": "tiny_runs_eps_paired",
                "events_per_s": relay_eps,
                "reps": [round(r) for r in relay],
            },
            {
                "key": "peer_pgqueuer_eps_paired",
                "events_per_s": peer_eps,
                "reps": [round(p) for p in peer],
                "settings": "the best row's",
            },
        ],
        [
            f"paired: {a.reps} pairs of {a.peer_events:,} runs of one event through one `relay "
            f"run` and {a.peer_events:,} PgQueuer jobs (the best setting), alternating which "
            f"goes first (one event per run: no order to keep); relay / PgQueuer: {per_pair}"
        ],
        metrics={
            "tiny_runs_eps_paired": relay_eps,
            "peer_pgqueuer_eps_paired": peer_eps,
            "tiny_runs_paired_ratio": round(statistics.median(ratios), 3),
        },
    )


SCENARIOS = [
    Scenario(
        "peer_pgqueuer",
        "PgQueuer with its benchmark's settings, one job per event POSTed with aiohttp",
        peer_pgqueuer,
        _arguments,
        {"peer_events": 200, "pgqueuer_consumers": "5"},
        (
            "peer_pgqueuer_eps",
            "peer_pgqueuer_order_violations",
            "peer_eps",
            "tiny_runs_eps_paired",
            "peer_pgqueuer_eps_paired",
            "tiny_runs_paired_ratio",
        ),
    ),
]
