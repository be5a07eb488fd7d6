"""Shared fixtures: a real PostgreSQL (embedded unless RELAY_TEST_DATABASE_URL is set), the real
Absurd schema, and a freshly migrated relay schema per test (schemas isolate NOTIFY channels
too: the terminal channel is `<schema>_terminal`)."""

from __future__ import annotations

import io
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from psycopg import sql

from relay import logs
from relay.core import loop
from relay.maintenance.migrate import migrate
from relay.tools.absurd import install_absurd
from relay.tools.embedded import EmbeddedPostgres
from relay.tools.sink import Sink, serve_sink
from tests.support import LogLines, Rig


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


# The loops the relay runs on (relay/core/loop.py, issue 52): a test marked `both_loops` runs on
# each, by anyio's pytest plugin and its backend option `use_uvloop`.
LOOPS = [
    pytest.param("asyncio", id="asyncio"),
    pytest.param(
        ("asyncio", {"use_uvloop": True}),
        id="uvloop",
        marks=pytest.mark.skipif(not loop.uvloop_installed(), reason="uvloop is not installed"),
    ),
]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marked = metafunc.definition.get_closest_marker
    if marked("both_loops") is None or marked("one_loop") is not None:
        return
    if "anyio_backend" in metafunc.fixturenames:
        metafunc.parametrize("anyio_backend", LOOPS)


@pytest.fixture(scope="session")
def pg_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = os.environ.get("RELAY_TEST_DATABASE_URL")
    server = None
    if not url:
        server = EmbeddedPostgres(Path(tmp_path_factory.mktemp("pg")) / "data", durable=False)
        url = server.start()
    install_absurd(url)
    try:
        yield url
    finally:
        if server is not None:
            server.stop("immediate")


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


@pytest.fixture
def schema(pg_url: str) -> Iterator[str]:
    name = unique("t")
    migrate(pg_url, name)
    yield name
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(name)))


@pytest.fixture
def queue(pg_url: str) -> Iterator[str]:
    """A fresh Absurd queue."""
    name = unique("q")
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("select absurd.create_queue(%s)", (name,))
    yield name
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("select absurd.drop_queue(%s)", (name,))


@pytest.fixture
def conn(pg_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_url, autocommit=True) as c:
        yield c


@pytest.fixture
async def aconn(pg_url: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as c:
        yield c


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The fault report (tests/faults/report.py): a table of every fault scenario that ran,
    also written as JSON."""
    from tests.faults import report

    if not report.ROWS:
        return
    target = report.path(config.rootpath)
    report.write(report.ROWS, target)
    terminalreporter.section("fault report")
    terminalreporter.write(report.table(report.ROWS))
    terminalreporter.write_line(f"fault report JSON: {target}")


@pytest.fixture
async def sink() -> AsyncIterator[tuple[Sink, str]]:
    """The reference ingress on a real socket, in this process: (its state, its base URL)."""
    s = Sink()
    async with serve_sink(s) as url:
        yield s, url


@pytest.fixture
def rig(pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]) -> Rig:
    """The fixtures most integration tests take together, as one value (tests/support.py)."""
    s, url = sink
    return Rig(pg_url, schema, conn, s, url)


@pytest.fixture
def log_lines() -> Iterator[LogLines]:
    """The relay's JSON log lines at info and above, as dicts, read when called."""
    stream = io.StringIO()
    logs.configure("json", "info", stream)

    def read() -> list[dict[str, Any]]:
        return [orjson.loads(line) for line in stream.getvalue().splitlines() if line]

    yield read
    logs.configure("json", "warning")
