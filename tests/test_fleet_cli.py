"""The operator commands over the list form of the database (issue 51 item 4): `relay migrate`,
`check`, `status`, `inspect`, `retry` and `skip` act on every database of RELAY_DATABASES or on
the one `--database` names, each part of their output naming its database, a database that is
down one failure line while the others still run; a command about one run or event acts only
where it is. The real CLI in subprocesses, against databases of the embedded cluster."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import httpx
import psycopg
import pytest
from psycopg import sql

from relay.databases import load_all, load_databases
from relay.maintenance.migrate import _read_version, code_version, migrate
from relay.ops.checks import DATABASE, INGRESS, check_ingresses, exit_code
from relay.ops.format import NOT_FOUND, UNAVAILABLE, USAGE, OpsError
from relay.ops.targets import Target, pick, targets, where
from relay.producer import enqueue
from relay.settings import ConfigError, load
from relay.tools.sink import Sink
from tests.conftest import unique
from tests.test_cli import RELAY
from tests.test_ops import add_run, blocked_run, event_row

SCHEMA = "relay"
DOWN = "postgresql://nobody@127.0.0.1:1/none"


@pytest.fixture
def two(pg_url: str) -> Iterator[dict[str, str]]:
    """Two empty databases in the embedded cluster: name -> URL."""
    made = {name: unique(f"ops_{name}") for name in ("shard1", "shard2")}
    with psycopg.connect(pg_url, autocommit=True) as conn:
        for dbname in made.values():
            conn.execute(sql.SQL("create database {}").format(sql.Identifier(dbname)))
    try:
        yield {n: urlunsplit(urlsplit(pg_url)._replace(path=f"/{d}")) for n, d in made.items()}
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            for dbname in made.values():
                drop = sql.SQL("drop database if exists {} with (force)")
                conn.execute(drop.format(sql.Identifier(dbname)))


@pytest.fixture
def shards(two: dict[str, str]) -> dict[str, str]:
    """The two databases migrated, r1 blocked in shard1, r2 in shard2 and `both` in both."""
    for url in two.values():
        migrate(url, SCHEMA)
    with psycopg.connect(two["shard1"], autocommit=True) as conn:
        blocked_run(conn, SCHEMA, "r1", n=2)
        add_run(conn, SCHEMA, "both", 1)  # event both-1
    with psycopg.connect(two["shard2"], autocommit=True) as conn:
        blocked_run(conn, SCHEMA, "r2", n=2)
        with conn.transaction():
            enqueue(conn, "both", "both-x", "step", {}, schema=SCHEMA)
    return two


def env_of(databases: dict[str, str], **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    entries = " ".join(f"{name}={url}" for name, url in databases.items())
    env.update(RELAY_DATABASES=entries, RELAY_SCHEMA=SCHEMA, USER="tester", **extra)
    return env


def relay(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    got = subprocess.run(
        [*RELAY, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert "Traceback" not in got.stderr, got.stderr
    return got


def keyed(env: dict[str, str], *args: str) -> tuple[int, dict[str, Any]]:
    got = relay(env, *args, "--json")
    return got.returncode, json.loads(got.stdout)


def version(url: str) -> int:
    """The schema's version in the database at `url` (0: not installed)."""
    with psycopg.connect(url) as conn:
        return _read_version(conn, SCHEMA)


# -- migrate -----------------------------------------------------------------------------------


def test_migrate_migrates_every_database_of_the_list_and_names_a_down_one(
    two: dict[str, str],
) -> None:
    env = env_of({"shard1": two["shard1"], "down": DOWN, "shard2": two["shard2"]})
    got = relay(env, "migrate")
    assert got.returncode == 1, got.stderr
    # The down one is one line naming it; the one after it is migrated all the same.
    assert version(two["shard1"]) == version(two["shard2"]) == code_version()
    [failed] = got.stderr.splitlines()
    assert failed.startswith("relay migrate: down: database at "), failed
    out = got.stdout.splitlines()
    headers = [line for line in out if line.startswith("== database ")]
    assert [h.split()[2] for h in headers] == ["shard1:", "down:", "shard2:"], out
    assert sum(line.startswith(f"schema {SCHEMA} at version") for line in out) == 2, out


def test_migrate_with_database_migrates_that_one_only(two: dict[str, str]) -> None:
    got = relay(env_of(two), "migrate", "--database", "shard2")
    assert got.returncode == 0, got.stderr
    assert version(two["shard2"]) == code_version()
    assert version(two["shard1"]) == 0


# -- check -------------------------------------------------------------------------------------


async def check(env: dict[str, str], *args: str) -> tuple[int, str]:
    """`relay check` in a subprocess, the event loop free meanwhile to serve the sink."""
    got = await anyio.run_process([*RELAY, "check", "--timeout", "3", *args], env=env, check=False)
    assert got.stderr.decode().strip() == "", got.stderr.decode()
    return got.returncode, got.stdout.decode()


@pytest.mark.anyio
async def test_check_names_each_database_and_a_down_one_fails_alone(
    shards: dict[str, str], sink: tuple[Sink, str]
) -> None:
    _, ingress = sink
    env = env_of({**shards, "down": DOWN}, RELAY_INGRESS_URL=ingress + "/runs/{run_id}/events")
    code, out = await check(env)
    lines = out.splitlines()
    assert code == DATABASE, lines
    assert lines[0].startswith("ok   configuration"), lines
    seen = {(line.split()[1], line.split()[2]): line.split()[0] for line in lines[1:]}
    assert seen == {
        ("database", "[shard1]"): "ok", ("schema", "[shard1]"): "ok",
        ("listen", "[shard1]"): "ok",
        ("database", "[shard2]"): "ok", ("schema", "[shard2]"): "ok",
        ("listen", "[shard2]"): "ok",
        ("database", "[down]"): "FAIL", ("schema", "[down]"): "skip",
        ("listen", "[down]"): "skip",
        # The ingress as each database would post to it, the down one's included.
        ("ingress", "[shard1]"): "ok", ("ingress", "[shard2]"): "ok",
        ("ingress", "[down]"): "ok",
    }, lines  # fmt: skip
    assert [line.split()[1] for line in lines[-3:]] == ["ingress"] * 3, lines

    code, out = await check(env, "--database", "shard2")
    assert code == 0, out
    assert "[shard2]" in out and "[shard1]" not in out and "[down]" not in out


@pytest.mark.anyio
async def test_check_probes_the_ingress_as_each_database_posts_to_it() -> None:
    """Issue 51: with `{database}` in the ingress URLs, each database's probe goes to its own
    URL with its `relay-database` header; an ingress that knows one database only fails the
    other's lines alone."""
    seen: list[tuple[str, str | None]] = []

    def ingress(request: httpx.Request) -> httpx.Response:
        seen.append((str(request.url), request.headers.get("relay-database")))
        known = request.url.path.startswith("/shard1/")
        return httpx.Response(422 if known else 404, json={})

    settings, databases = load_all(
        {},
        {
            "RELAY_DATABASES": "shard1=postgresql://u@h/a shard2=postgresql://u@h/b",
            "RELAY_INGRESS_URL": "http://in/{database}/runs/{run_id}/events",
            "RELAY_INGRESS_BATCH_URL": "http://in/{database}/batch",
        },
    )
    results = await check_ingresses(
        settings, 3.0, databases, transport=httpx.MockTransport(ingress)
    )
    got = [(r.name, r.database, r.ok) for r in results]
    assert got == [
        ("ingress", "shard1", True),
        ("ingress_batch", "shard1", True),
        ("ingress", "shard2", False),
        ("ingress_batch", "shard2", False),
    ], [r.line() for r in results]
    assert sorted(seen) == [
        ("http://in/shard1/batch", "shard1"),
        ("http://in/shard1/runs/relay-check/events", "shard1"),
        ("http://in/shard2/batch", "shard2"),
        ("http://in/shard2/runs/relay-check/events", "shard2"),
    ]
    assert "fix ingress_url" in results[2].line() and "[shard2]" in results[2].line()
    assert exit_code(results) == INGRESS
    # The one-database form: one probe, as `default`, without the header.
    seen.clear()
    one = load(
        {},
        {
            "RELAY_DATABASE_URL": "postgresql://u@h/a",
            **{"RELAY_INGRESS_URL": "http://in/{database}/runs/{run_id}/events"},
        },
    )
    [alone] = await check_ingresses(one, 3.0, None, transport=httpx.MockTransport(ingress))
    assert alone.database is None and not alone.ok
    assert seen == [("http://in/default/runs/relay-check/events", None)]


# -- status ------------------------------------------------------------------------------------


def test_status_over_every_database_keyed_by_name_a_down_one_its_own_failure(
    shards: dict[str, str],
) -> None:
    # The down one in the middle: the one after it is still asked.
    env = env_of({"shard1": shards["shard1"], "down": DOWN, "shard2": shards["shard2"]})
    code, data = keyed(env, "status")
    assert code == UNAVAILABLE
    assert list(data) == ["shard1", "down", "shard2"]
    assert [b["run_id"] for b in data["shard1"]["blocked_runs"]] == ["r1"]
    assert [b["run_id"] for b in data["shard2"]["blocked_runs"]] == ["r2"]
    assert data["down"]["exit_code"] == UNAVAILABLE
    assert "cannot connect" in data["down"]["error"]

    text = relay(env, "status")
    assert text.returncode == UNAVAILABLE
    parts = text.stdout.split("== database ")
    assert [p.split(":")[0] for p in parts[1:]] == ["shard1", "down", "shard2"], text.stdout
    assert "r1" in parts[1] and "r2" not in parts[1] and "r2" in parts[3]
    [failed] = text.stderr.splitlines()
    assert failed.startswith("relay status: down: cannot connect"), failed

    code, data = keyed(env, "status", "--database", "shard2")
    assert code == 0 and list(data) == ["shard2"]


# -- inspect, retry, skip: where the run or event is -------------------------------------------


def test_inspect_retry_skip_act_where_the_run_or_event_is(shards: dict[str, str]) -> None:
    env = env_of(shards)
    code, data = keyed(env, "inspect", "r2")
    assert code == 0 and list(data) == ["shard2"], data
    assert data["shard2"]["run"]["blocked_seq"] == 1

    code, data = keyed(env, "retry", "r1-1", "--by", "alice")
    assert code == 0 and list(data) == ["shard1"] and data["shard1"]["unblocked"], data
    code, data = keyed(env, "retry", "--run", "r2", "--by", "alice")
    assert code == 0 and list(data) == ["shard2"], data
    with psycopg.connect(shards["shard1"]) as conn:
        assert event_row(conn, SCHEMA, "r1-1")["state"] == "pending"
    with psycopg.connect(shards["shard2"]) as conn:
        assert event_row(conn, SCHEMA, "r2-1")["state"] == "pending"
        block_again = "select * from {}.block_event('r2', 1, 422, 'bad')"
        conn.execute(sql.SQL(block_again).format(sql.Identifier(SCHEMA)))
        conn.commit()
    code, data = keyed(env, "skip", "r2-1", "--reason", "superseded", "--by", "carol")
    assert code == 0 and data["shard2"]["state"] == "skipped", data

    text = relay(env, "inspect", "r1")
    assert text.returncode == 0 and text.stdout.startswith("== database shard1: "), text.stdout


def test_a_run_in_two_databases_is_refused_without_database_naming_both(
    shards: dict[str, str],
) -> None:
    env = env_of(shards)
    got = relay(env, "inspect", "both")
    assert got.returncode == USAGE, got.stderr
    assert "is in shard1, shard2: give --database NAME" in got.stderr
    got = relay(env, "retry", "--run", "both")
    assert got.returncode == USAGE and "shard1, shard2" in got.stderr
    code, data = keyed(env, "inspect", "both", "--database", "shard2")
    assert code == 0 and [e["event_id"] for e in data["shard2"]["events"]] == ["both-x"]

    got = relay(env, "inspect", "nowhere")
    assert got.returncode == NOT_FOUND
    assert "no run 'nowhere' in any database (shard1, shard2)" in got.stderr


def test_with_a_database_down_a_write_is_refused_and_changes_nothing(
    shards: dict[str, str],
) -> None:
    env = env_of({**shards, "down": DOWN})
    got = relay(env, "retry", "r1-1", "--by", "alice")
    assert got.returncode == UNAVAILABLE, got.stderr
    lines = got.stderr.splitlines()
    assert lines[0].startswith("relay retry: down: cannot connect"), lines
    assert "could not search down (found in shard1)" in lines[1], lines
    with psycopg.connect(shards["shard1"]) as conn:
        assert event_row(conn, SCHEMA, "r1-1")["state"] == "failed"
    # Named, the database that holds it is acted on; the down one is not asked.
    code, data = keyed(env, "retry", "r1-1", "--by", "alice", "--database", "shard1")
    assert code == 0 and data["shard1"]["state"] == "pending"


# -- --database NAME ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [["migrate"], ["status"], ["inspect", "r1"], ["retry", "r1-1"], ["check"],
     ["skip", "r1-1", "--reason", "x"]],
)  # fmt: skip
def test_an_unknown_database_is_refused_naming_the_configured_ones(command: list[str]) -> None:
    env = env_of(
        {"shard1": "postgresql://u@127.0.0.1:1/a", "shard2": "postgresql://u@127.0.0.1:1/b"},
        RELAY_INGRESS_URL="http://127.0.0.1:9/runs/{run_id}",
    )
    got = relay(env, *command, "--database", "shard9")
    assert got.returncode == 2, (got.stdout, got.stderr)
    said = got.stdout + got.stderr
    assert "--database 'shard9': no such database; configured: shard1, shard2" in said, said


def test_database_with_the_one_database_form_knows_only_default(pg_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update(RELAY_DATABASE_URL=pg_url, RELAY_SCHEMA=unique("t"))
    got = relay(env, "status", "--database", "shard1")
    assert got.returncode == 2
    assert "no such database; configured: default" in got.stderr


# -- the choice, pure --------------------------------------------------------------------------


def test_where_acts_only_where_the_one_holder_is_and_says_why_not() -> None:
    a, b, c = Target("a", "u1"), Target("b", "u2"), Target("c", "u3")
    assert where("run 'r'", [a, b, c], [b], []) == b
    with pytest.raises(OpsError) as caught:
        where("run 'r'", [a, b, c], [a, c], [])
    assert caught.value.code == USAGE and "run 'r' is in a, c" in str(caught.value)
    with pytest.raises(OpsError) as caught:
        where("run 'r'", [a, b, c], [], [])
    assert caught.value.code == NOT_FOUND and "(a, b, c)" in str(caught.value)
    with pytest.raises(OpsError) as caught:
        where("run 'r'", [a, b, c], [a], [c])  # c may hold it too
    assert caught.value.code == UNAVAILABLE and "could not search c (found in a)" in str(
        caught.value
    )


def test_pick_all_one_or_refuse_naming_the_configured() -> None:
    dbs = load_databases({}, {"RELAY_DATABASES": "a=postgresql://h/x b=postgresql://h/y"})
    assert dbs is not None
    assert pick(dbs, None) == dbs
    assert pick(dbs, "b") == [dbs[1]]
    assert pick(None, None) is None and pick(None, "default") is None
    with pytest.raises(ConfigError, match="configured: a, b"):
        pick(dbs, "c")
    with pytest.raises(ConfigError, match="configured: default"):
        pick(None, "a")
    assert targets(None, None, "postgresql://h/z") == [Target(None, "postgresql://h/z")]


def test_no_password_of_the_list_is_shown(shards: dict[str, str]) -> None:
    """Headers, failure lines and JSON errors name each database by its redacted URL."""
    down = "postgresql://nobody:CANARY-pw@127.0.0.1:1/none"
    env = env_of({**shards, "down": down}, RELAY_INGRESS_URL="http://127.0.0.1:9/runs/{run_id}")
    for command in (["status"], ["status", "--json"], ["migrate"], ["inspect", "r1"],
                    ["check", "--timeout", "1"]):  # fmt: skip
        got = relay(env, *command)
        assert got.returncode != 0, (command, got.stdout, got.stderr)
        assert "CANARY-pw" not in got.stdout + got.stderr, (command, got.stdout, got.stderr)
