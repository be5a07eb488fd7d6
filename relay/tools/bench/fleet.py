"""The fleet scenario of `relay bench` (issue 51 items 5-6): one fleet over several outbox
databases against one relay over one database, the same backlog, paired in one run.

Each rep writes a backlog of finished runs (`--fleet-runs` runs of `--fleet-per-run` events,
each ending in its terminal, as an outage leaves them) and drains it with one `relay run`
replica at its defaults into the `relay sink` subprocess, twice, the order rotating per rep:

- `one`: the whole backlog in the bench's database, one relay (`RELAY_DATABASE_URL`);
- `fleet`: the same backlog spread evenly over `--fleet-databases` databases made on the same
  server for the scenario, one fleet (`RELAY_DATABASES`, relay/fleet.py).

Events/s run from the commit of the (first) backlog to the last receipt: for the fleet the
other databases' backlogs are written inside its window, which counts against it. The
connections are the most the replica held to the server at once (`pg_stat_activity` rows
named `ledger-relay`, sampled every 50 ms), beside the arithmetic of docs/sharding.md (17 per
database at the defaults). Target: fleet ≥ 0.9 × one (the median of the paired reps' ratios).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Mapping
from urllib.parse import urlsplit, urlunsplit

import anyio
import psycopg
from psycopg import sql

from relay.maintenance.migrate import migrate
from relay.tools.bench import fleet_outage, kit

MODES = ("one", "fleet")
SAMPLE_EVERY = 0.05  # seconds between two counts of the replica's connections
PER_DATABASE = 17  # connections per database and replica at the defaults (docs/sharding.md)


ARGUMENTS = kit.positive_options(
    "fleet (issue 51)",
    ("--fleet-runs", int, 20_000, "runs in all (20k)"),
    ("--fleet-per-run", int, 10, "events (10)"),
    ("--fleet-databases", int, 3, "(3)"),
    ("--fleet-reps", int, 2, "paired reps (2)"),
)


SMOKE = {"fleet_runs": 300, "fleet_per_run": 5, "fleet_reps": 1}
KEYS = (
    "fleet_eps_one",
    "fleet_eps",
    "fleet_ratio",
    "fleet_connections_one",
    "fleet_connections",
)


def _database_url(url: str, dbname: str) -> str:
    """`url` naming the database `dbname` on the same server (a URL, as the bench is given)."""
    if "://" not in url:
        raise kit.BenchFailed("the fleet scenario needs the database as a URL (postgresql://...)")
    return urlunsplit(urlsplit(url)._replace(path=f"/{dbname}"))


async def _databases(env: kit.Env, n: int) -> dict[str, str]:
    """`n` databases made on the bench's server, each with the relay's schema: name -> URL."""
    urls: dict[str, str] = {}
    async with await psycopg.AsyncConnection.connect(env.url, autocommit=True) as conn:
        for i in range(n):
            dbname = f"{env.schema}_fleet{i}"
            try:
                await conn.execute(sql.SQL("create database {}").format(sql.Identifier(dbname)))
            except psycopg.Error as exc:
                raise kit.BenchFailed(
                    f"the fleet scenario could not create a database: {exc}"
                ) from exc
            urls[f"shard{i}"] = _database_url(env.url, dbname)
            env.stack.push_async_callback(_drop, env.url, dbname)
    for url in urls.values():
        await anyio.to_thread.run_sync(migrate, url, env.schema)
    return urls


async def _drop(url: str, dbname: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(
            sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(dbname))
        )


class Connections:
    """The most `ledger-relay` sessions the server held at once, while `run()` samples."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.most = 0

    async def run(self) -> None:
        async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as conn:
            while True:
                cur = await conn.execute(
                    "select count(*) from pg_stat_activity where application_name = 'ledger-relay'"
                )
                row = await cur.fetchone()
                self.most = max(self.most, int(row[0]) if row else 0)
                await anyio.sleep(SAMPLE_EVERY)


async def _drain(
    env: kit.Env,
    a: argparse.Namespace,
    mode: str,
    shards: Mapping[str, str],
    what: str,
) -> tuple[float, int]:
    """One rep of one mode: its backlog drained by one replica. (events/s, most connections)"""
    spread = dict(shards) if mode == "fleet" else {"one": env.url}
    envs = [dataclasses.replace(env, url=url) for url in spread.values()]
    for each in envs:
        await kit.reset(each)
    base = await env.external_sink()
    per = [a.fleet_runs // len(envs) + (i < a.fleet_runs % len(envs)) for i in range(len(envs))]
    total = a.fleet_runs * a.fleet_per_run
    listed = " ".join(f"{name}={url}" for name, url in spread.items())
    environ = {"RELAY_DATABASES": listed} if mode == "fleet" else None
    connections = Connections(env.url)
    async with (
        kit.relay_processes(env, 1, base, environ=environ),
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(connections.run)
        commits = [
            await kit.backlog(each, runs, a.fleet_per_run, f"f{i}-", terminals=True)
            for i, (each, runs) in enumerate(zip(envs, per, strict=True))
        ]
        committed = commits[0]  # the first: the others' writing counts against the fleet
        finished = await kit.until_received(env, base, total, what, timeout=max(120, total / 200))
        tg.cancel_scope.cancel()
    return total / (finished - committed), connections.most


async def fleet(env: kit.Env, a: argparse.Namespace) -> kit.Result:
    shards = await _databases(env, a.fleet_databases)
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    most: dict[str, int] = dict.fromkeys(MODES, 0)
    started = time.monotonic()
    for rep in range(a.fleet_reps):
        for mode in kit.rotated(MODES, rep):
            eps, conns = await _drain(env, a, mode, shards, f"fleet: {mode}, rep {rep + 1}")
            rates[mode].append(eps)
            most[mode] = max(most[mode], conns)
    ratios = [f / o for o, f in zip(rates["one"], rates["fleet"], strict=True)]
    ratio = round(statistics.median(ratios), 3)
    n = a.fleet_databases
    rows = [
        {
            "mode": "one database, one relay" if mode == "one" else f"{n} databases, one fleet",
            "events_per_s": kit.median(rates[mode]),
            "reps": [round(r) for r in rates[mode]],
            "connections": most[mode],
            "arithmetic": PER_DATABASE * (1 if mode == "one" else n),
        }
        for mode in MODES
    ]
    verdict = "met" if ratio >= 0.9 else "NOT met"
    return kit.Result(
        ["mode", "events_per_s", "reps", "connections", "arithmetic"],
        rows,
        [
            f"one `relay run` replica at its defaults, `relay sink` subprocess; backlog "
            f"{a.fleet_runs * a.fleet_per_run:,} events over {a.fleet_runs:,} finished runs "
            f"(each ending in its terminal), all in one database or spread over {n} of the "
            f"same server; paired reps, order rotating; {time.monotonic() - started:.0f} s",
            "events/s from the commit of the (first) backlog to the last receipt; the fleet's "
            "other backlogs are written inside its window",
            "connections: the most `ledger-relay` sessions at once (pg_stat_activity, every "
            f"{SAMPLE_EVERY * 1000:g} ms); arithmetic: {PER_DATABASE} per database at the "
            "defaults (docs/sharding.md)",
            f"per rep fleet / one: {', '.join(f'{r:.2f}' for r in ratios)}; target "
            f"fleet ≥ 0.9 × one: {verdict} ({ratio})",
        ],
        metrics={
            "fleet_eps_one": kit.median(rates["one"]),
            "fleet_eps": kit.median(rates["fleet"]),
            "fleet_ratio": ratio,
            "fleet_connections_one": most["one"],
            "fleet_connections": most["fleet"],
        },
        settings={"fleet_eps": f"{n} databases, one fleet"},
    )


SCENARIOS = [
    kit.Scenario(
        "fleet",
        "one fleet over three databases against one relay over one, the same backlog of "
        "finished runs, paired: e2e events/s, their ratio, connections (issue 51)",
        fleet,
        ARGUMENTS,
        SMOKE,
        KEYS,
    ),
    *fleet_outage.SCENARIOS,  # one server of three killed and restarted (issue 51's targets)
]
