"""Graphile Worker as a peer: one job per event in the named queue `run_id` (a named queue runs
its jobs one at a time, so per-run order holds), a task that POSTs the event to the sink with
Node's built-in fetch, jobs added with `addJobs` one call (one transaction) per 1,000.

The Node.js side is `js/worker.mjs`, with `js/package.json` and `js/package-lock.json` pinning
the version. On first use they are copied into a cache folder
(`$XDG_CACHE_HOME/ledger-relay/graphile-worker-<version>`) and installed with `npm ci`; where
node or npm is missing, or the install fails, the scenario is skipped with the reason.

Settings: Graphile Worker is measured at its plain settings (concurrency 10, no local queue,
no batched completion, pollInterval 2 s: what `run()` does when nothing is set) and tuned as
its documentation says to run it fast (worker.graphile.org/docs/performance and the
`preset.worker` options: a local queue sized to the load, batched completion, a short poll
interval, higher concurrency); every setting is a row, the best one counts (as PgQueuer's
search). `maxPoolSize` is max(10, concurrency + 2), as the option's documentation advises.
With a local queue, one batched fetch returns the jobs of a named queue in `run_at` order, and
jobs added by one `addJobs` call share one `run_at`: so every job gets its own, increasing
`runAt` (one millisecond apart, in the past), which keeps each run's order in that case too;
the sink counts the violations either way.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import orjson
import psycopg

from relay.tools.bench.kit import BenchFailed, Env, Result, Scenario, positive, reset
from relay.tools.bench.peers import event_bodies, measure, settings_text, sink_check, skipped

JS = Path(__file__).resolve().parent / "js"
SCHEMA = "graphile_worker"
CHUNK = 1_000  # jobs per addJobs call, i.e. per transaction


def version() -> str:
    deps = json.loads((JS / "package.json").read_text())["dependencies"]
    return str(deps["graphile-worker"])


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ledger-relay" / f"graphile-worker-{version()}"


def install() -> tuple[Path | None, str]:
    """(the folder to run worker.mjs in, "") once installed, else (None, why not)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        return None, "Graphile Worker needs Node.js and npm, and " + (
            "node is not on PATH" if node is None else "npm is not on PATH"
        )
    target = cache_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = (JS / "package-lock.json").read_bytes()
    stamp = hashlib.sha256(lock).hexdigest()
    with (target.parent / f"{target.name}.lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # two benches at once install once
        done = target / ".installed"
        if not (done.exists() and done.read_text() == stamp):
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            for name in ("package.json", "package-lock.json"):
                shutil.copy2(JS / name, target / name)
            try:
                proc = subprocess.run(
                    [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
                    cwd=target,
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                return None, f"npm ci of graphile-worker {version()} failed: {exc}"
            if proc.returncode != 0:
                tail = (proc.stderr or proc.stdout).strip()[-300:]
                return None, f"npm ci of graphile-worker {version()} failed: {tail}"
            done.write_text(stamp)
        # The worker is copied each time: ESM resolves `graphile-worker` next to the script.
        shutil.copy2(JS / "worker.mjs", target / "worker.mjs")
    return target, ""


# (concurrency, localQueue.size (-1: off), completeJobBatchDelay ms (-1: off), pollInterval ms)
PLAIN = "10:-1:-1:2000"
TUNED = "24:500:10:100,50:500:10:100,24:100:0:100,50:100:0:100"


def _arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("peer_graphile")
    g.add_argument("--graphile-jobs", type=positive(int), default=5_000, help="jobs (5k)")
    g.add_argument(
        "--graphile-settings",
        default=f"{PLAIN},{TUNED}",
        help="settings to try, comma-separated, each concurrency:localQueue.size:"
        "completeJobBatchDelay:pollInterval (-1: off); the best counts "
        f"(default: the plain {PLAIN} and the tuned {TUNED})",
    )


@dataclass(frozen=True)
class Setting:
    concurrency: int
    local_queue: int  # -1: no local queue
    complete_delay: int  # completeJobBatchDelay and failJobBatchDelay, ms; -1: not batched
    poll_interval: int

    @classmethod
    def parse(cls, text: str) -> Setting:
        """`concurrency:localQueue.size:completeJobBatchDelay:pollInterval`."""
        try:
            concurrency, local_queue, delay, poll = (int(x) for x in text.split(":"))
        except ValueError:
            raise BenchFailed(
                f"--graphile-settings: {text!r} is not concurrency:localQueue.size:"
                "completeJobBatchDelay:pollInterval"
            ) from None
        if concurrency < 1 or poll < 1:
            raise BenchFailed(f"--graphile-settings: {text!r}: concurrency and poll must be > 0")
        return cls(concurrency, local_queue, delay, poll)

    @property
    def plain(self) -> bool:
        return self == Setting.parse(PLAIN)

    @property
    def pool(self) -> int:
        return max(10, self.concurrency + 2)

    def shown(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "maxPoolSize": self.pool,
            "localQueue.size": self.local_queue,
            "completeJobBatchDelay": self.complete_delay,
            "pollInterval": self.poll_interval,
        }


async def _once(
    env: Env, folder: Path, base: str, setting: Setting, jobs: int, per_run: int, tag: str
) -> tuple[float, int]:
    """One repetition: a fresh graphile_worker schema and sink, the jobs added, the worker
    run to the last job. Returns (jobs/s, order violations)."""
    await reset(env)
    async with await psycopg.AsyncConnection.connect(env.url, autocommit=True) as conn:
        await conn.execute(f"drop schema if exists {SCHEMA} cascade")
    jobs_file = env.workdir / f"graphile-{tag}.jsonl"
    jobs_file.write_bytes(b"\n".join(event_bodies(jobs, per_run, tag)) + b"\n")
    config = {
        "url": env.url,
        "schema": SCHEMA,
        "jobs": str(jobs_file),
        "chunk": CHUNK,
        "sink": base,
        "concurrency": setting.concurrency,
        "pollInterval": setting.poll_interval,
        "maxPoolSize": setting.pool,
        "localQueueSize": setting.local_queue,
        "completeJobBatchDelay": setting.complete_delay,
        "staggerRunAt": True,
        "timeoutMs": int(max(120, jobs / 20) * 1000),
    }
    log = env.workdir / f"graphile-{tag}.log"
    with log.open("wb") as err:
        proc = await anyio.run_process(
            ["node", str(folder / "worker.mjs"), json.dumps(config)],
            cwd=folder,
            stderr=err,
            check=False,
        )
    lines = [ln for ln in proc.stdout.decode().splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        why = log.read_text(errors="replace")[-400:]
        raise BenchFailed(f"the Graphile Worker peer failed ({proc.returncode}): {why}")
    out = orjson.loads(lines[-1])
    violations = await sink_check(base, jobs, "peer_graphile")
    return jobs / out["seconds"], violations


async def peer_graphile(env: Env, a: argparse.Namespace) -> Result:
    folder, why = await anyio.to_thread.run_sync(install)
    if folder is None:
        return skipped("peer_graphile_eps", why)
    base = await env.external_sink()
    settings = [Setting.parse(t.strip()) for t in a.graphile_settings.split(",") if t.strip()]
    rows: list[dict[str, Any]] = []
    best: tuple[float, int, Setting] | None = None
    plain: float | None = None
    for i, setting in enumerate(settings):

        def once(rep: int, setting: Setting = setting, i: int = i) -> Awaitable[tuple[float, int]]:
            return _once(env, folder, base, setting, a.graphile_jobs, a.e2e_per_run, f"g{i}r{rep}")

        eps, violations, row = await measure(
            env, "peer_graphile_eps", setting.shown(), a.reps, once
        )
        rows.append({**row, "plain": setting.plain})
        if setting.plain:
            plain = eps
        if best is None or eps > best[0]:
            best = (eps, violations, setting)
    assert best is not None
    eps, violations, setting = best
    shown = {"version": version(), **setting.shown()}
    return Result(
        ["key", "events_per_s", "reps", "order_violations", "plain", "settings"],
        rows,
        [
            f"Graphile Worker {version()} (Node {_node_version()}) in its own process: "
            f"{a.graphile_jobs:,} jobs, one per event, queueName = run_id "
            f"({a.e2e_per_run} events per run), added with addJobs {CHUNK:,} per transaction "
            "before the worker starts; the task POSTs the event with Node's fetch (keep-alive); "
            "events/s from run() to the last POST answered (median of reps); order violations: "
            "the most in one rep; every job's runAt its own, increasing; the plain row is "
            "Graphile's defaults, the others tuned as its docs say; the best row counts",
            f"best: {settings_text(shown)}",
        ],
        metrics={
            "peer_graphile_eps": eps,
            "peer_graphile_order_violations": violations,
            **({"peer_graphile_eps_plain": plain} if plain is not None else {}),
        },
        settings={"peer_graphile_eps": settings_text(shown)},
    )


def _node_version() -> str:
    try:
        return subprocess.run(
            ["node", "--version"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


SCENARIOS = [
    Scenario(
        "peer_graphile",
        "Graphile Worker, one job per event in the named queue run_id, POSTed with fetch",
        peer_graphile,
        _arguments,
        {"graphile_jobs": 200, "graphile_settings": f"{PLAIN},24:100:0:100"},
        ("peer_graphile_eps", "peer_graphile_order_violations"),
    ),
]
