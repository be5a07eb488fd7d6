"""`relay check`: one line per check and an exit code that says which failed, run as the real
CLI in a subprocess against real PostgreSQL and a real HTTP ingress."""

from __future__ import annotations

import anyio
import httpx
import pytest

from relay.checks import (
    DATABASE,
    INGRESS,
    LISTEN,
    SCHEMA,
    Result,
    check_ingress,
    exit_code,
    scrub,
)
from relay.settings import load
from relay.tools.sink import Sink
from tests.test_cli import RELAY, relay_env

pytestmark = pytest.mark.anyio

UNREACHABLE_DB = "postgresql://nobody@127.0.0.1:1/none"
UNREACHABLE_HTTP = "http://127.0.0.1:9"


async def check(env: dict[str, str], *args: str) -> tuple[int, list[str]]:
    got = await anyio.run_process([*RELAY, "check", "--timeout", "3", *args], env=env, check=False)
    lines = got.stdout.decode().splitlines()
    assert got.stderr.decode().strip() == "", got.stderr.decode()
    return got.returncode, lines


def marks(lines: list[str]) -> dict[str, str]:
    return {line.split()[1]: line.split()[0] for line in lines}


def test_exit_code_is_a_sum_of_bits() -> None:
    results = [
        Result("configuration", True, ""),
        Result("database", False, ""),
        Result("schema", None, ""),
        Result("listen", None, ""),
        Result("ingress", False, ""),
    ]
    assert exit_code(results) == DATABASE | INGRESS == 36
    assert exit_code([Result("schema", False, ""), Result("listen", False, "")]) == 24
    assert exit_code([Result("configuration", True, "")]) == 0
    assert scrub("pw=s3cret tok=abc", ["s3cret", "abc"]) == "pw=*** tok=***"


async def test_all_checks_pass(pg_url: str, schema: str, sink: tuple[Sink, str]) -> None:
    _, url = sink
    code, lines = await check(relay_env(pg_url, schema, url))
    assert code == 0, lines
    assert [line.split()[:2] for line in lines] == [
        ["ok", "configuration"],
        ["ok", "database"],
        ["ok", "schema"],
        ["ok", "listen"],
        ["ok", "ingress"],
    ]


async def test_invalid_configuration_is_one_line_and_code_2(pg_url: str) -> None:
    env = relay_env(pg_url, "relay", UNREACHABLE_HTTP, RELAY_BATCH_SIZE="lots")
    code, lines = await check(env)
    assert code == 2
    assert (
        len(lines) == 1 and lines[0].startswith("FAIL configuration") and "batch_size" in lines[0]
    )


async def test_database_and_ingress_down(pg_url: str) -> None:
    env = relay_env(UNREACHABLE_DB, "relay", UNREACHABLE_HTTP)
    code, lines = await check(env)
    assert code == DATABASE | INGRESS, lines
    assert marks(lines) == {
        "configuration": "ok",
        "database": "FAIL",
        "schema": "skip",
        "listen": "skip",
        "ingress": "FAIL",
    }


async def test_schema_missing(pg_url: str, sink: tuple[Sink, str]) -> None:
    _, url = sink
    code, lines = await check(relay_env(pg_url, "t_not_migrated", url))
    assert code == SCHEMA, lines
    assert "run `relay migrate`" in lines[2]


async def test_listen_connection_unusable(pg_url: str, schema: str, sink: tuple[Sink, str]) -> None:
    _, url = sink
    env = relay_env(pg_url, schema, url, RELAY_LISTEN_DATABASE_URL=UNREACHABLE_DB)
    code, lines = await check(env)
    assert code == LISTEN, lines
    assert marks(lines)["listen"] == "FAIL"


async def test_ingress_rejecting_credentials() -> None:
    seen: list[httpx.Request] = []

    def app(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(401)

    s = load(
        {"database_url": UNREACHABLE_DB, "ingress_url": "https://ingress.test/runs/{run_id}/e",
         "ingress_token": "tok-wrong"},
        environ={},
    )  # fmt: skip
    got = await check_ingress(s, 3.0, transport=httpx.MockTransport(app))
    assert got.ok is False and "401" in got.detail and "tok-wrong" not in got.line()
    assert seen[0].method == "HEAD"  # nothing is delivered by a check
    assert seen[0].headers["authorization"] == "Bearer tok-wrong"
    assert seen[0].url.path == "/runs/relay-check/e"
