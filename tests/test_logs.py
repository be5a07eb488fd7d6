"""Every stderr line of `relay run` in json mode is one JSON object (issue 15 item 2): the
relay's own records, its libraries' (psycopg, psycopg_pool, asyncio) and uncaught exceptions,
each with ts, level, logger, event or msg, and the replica id; library text is redacted."""

from __future__ import annotations

import io
import logging
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import orjson
import psycopg
import pytest

from relay import logs
from relay.tools.sink import Sink, serve_sink
from tests.faults.proxy import FaultProxy, via
from tests.support import count, wait_for
from tests.test_cli import relay_env, relay_run
from tests.test_relay import enqueue_runs

KEYS = ("ts", "level", "logger", "replica")


def dead_port() -> int:
    """A local port where nothing listens (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def with_password(url: str, password: str) -> str:
    """`url` with `password` in its userinfo (the test server trusts local connections, so
    libpq never sends it: it is only there to be redacted)."""
    parts = urlsplit(url)
    user, _, hosts = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{user or 'postgres'}:{password}@{hosts}"))


def parse_lines(text: str) -> list[dict[str, Any]]:
    """Every line as a JSON object with the common keys, or an assertion naming the line."""
    records = []
    for line in text.splitlines():
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            raise AssertionError(f"not a JSON line: {line!r}") from None
        assert isinstance(record, dict), line
        missing = [k for k in KEYS if k not in record]
        assert not missing, (missing, line)
        assert "event" in record or "msg" in record, line
        records.append(record)
    return records


# -- the formatter, in process ------------------------------------------------------------------


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    logs.configure("json", "info", stream, replica="r-1")
    try:
        yield stream
    finally:
        logs.configure("json", "warning")


def test_library_records_take_the_shape_and_lose_their_passwords(captured: io.StringIO) -> None:
    pool = logging.getLogger("psycopg.pool")
    pool.warning("error connecting in 'relay-ordinary': postgresql://app:s3cr3t@db:5432/x failed")
    pool.warning("conninfo host=db user=app password='s3 cr3t' dbname=x: refused")
    logging.getLogger("psycopg").info("below the library level: dropped")
    logs.info("claimed", run_id="r")
    records = parse_lines(captured.getvalue())
    assert [r["logger"] for r in records] == ["psycopg.pool", "psycopg.pool", "relay"]
    assert all(r["replica"] == "r-1" for r in records)
    assert "s3cr3t" not in captured.getvalue() and "cr3t" not in captured.getvalue()
    assert "app:***@db:5432" in records[0]["msg"]
    assert records[2]["event"] == "claimed" and records[2]["run_id"] == "r"


@pytest.mark.anyio
async def test_bound_fields_go_on_every_line_of_the_block_and_its_tasks(
    captured: io.StringIO,
) -> None:
    """A fleet's delivery of one database names it on each line (issue 51 item 3): the field is
    bound where the database's relay runs and reaches the tasks it starts, never another's."""

    async def line(event: str) -> None:
        logs.info(event, run_id="r")

    async with anyio.create_task_group() as tg:
        with logs.bound(database="s1"):
            tg.start_soon(line, "in_a_task")
            with logs.bound(replica_part="x"):
                logs.info("nested")
            logs.info("claimed", run_id="r", database="own")
        tg.start_soon(line, "outside")
    records = {r["event"]: r for r in parse_lines(captured.getvalue())}
    assert records["in_a_task"]["database"] == "s1"
    assert list(records["nested"])[-2:] == ["database", "replica_part"]
    assert records["claimed"]["database"] == "own"  # a line's own field wins
    assert "database" not in records["outside"]


def test_uncaught_exceptions_are_one_json_line(captured: io.StringIO) -> None:
    saved = sys.excepthook
    try:
        logs.install_hooks()
        try:
            raise RuntimeError("boom at postgresql://u:pw-123@h/db")
        except RuntimeError:
            sys.excepthook(*sys.exc_info())
    finally:
        sys.excepthook = saved
        logging.captureWarnings(False)
    (record,) = parse_lines(captured.getvalue())
    assert record["event"] == "uncaught_exception" and record["level"] == "critical"
    assert "RuntimeError: boom" in record["error"] and "traceback" in record
    assert "pw-123" not in captured.getvalue()


def test_text_mode_keeps_its_escaping() -> None:
    stream = io.StringIO()
    logs.configure("text", "info", stream)
    try:
        logging.getLogger("psycopg.pool").warning("line\nforged password=hunter2")
    finally:
        logs.configure("json", "warning")
    (line,) = stream.getvalue().splitlines()
    assert "\\n" in line and "hunter2" not in line and "logger=psycopg.pool" in line


# -- a real relay through a database outage -----------------------------------------------------


@pytest.mark.anyio
async def test_every_stderr_line_is_json_through_a_database_outage(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    sink = Sink()
    host, port = urlsplit(pg_url).hostname or "127.0.0.1", urlsplit(pg_url).port or 5432
    err_path = tmp_path / "stderr.log"
    async with serve_sink(sink) as sink_url, anyio.create_task_group() as tg:
        proxy = FaultProxy(host, port, "db")
        await proxy.start(tg)
        url = with_password(via(pg_url, proxy.port), "pw-never-logged")
        env = relay_env(
            url, schema, sink_url, RELAY_REPLICA_ID="replica-json", RELAY_LOG_FORMAT="json",
            RELAY_METRICS_ADDR="127.0.0.1:0", RELAY_STATEMENT_TIMEOUT="1s",
        )  # fmt: skip
        with err_path.open("wb") as err:
            async with relay_run(env, stdout=subprocess.DEVNULL, stderr=err) as proc:
                await wait_for(lambda: '"event":"started"' in err_path.read_text(), what="start")
                enqueue_runs(conn, schema, 3, 2, prefix="before")
                await wait_for(lambda: len(sink.state.deliveries) == 6, what="first deliveries")
                # The database goes away: open connections are reset, new ones refused.
                proxy.target = ("127.0.0.1", dead_port())
                proxy.reset()
                await wait_for(
                    lambda: (
                        '"logger":"psycopg' in err_path.read_text()
                        and "database_unreachable" in err_path.read_text()
                    ),
                    what="library lines and the probe's during the outage",
                )
                proxy.target = (host, port)
                await wait_for(
                    lambda: "database_reachable" in err_path.read_text(), what="the way back"
                )
                enqueue_runs(conn, schema, 3, 2, prefix="after")
                await wait_for(
                    lambda: count(conn, schema, "state <> 'delivered'") == 0, what="drain"
                )
                proc.send_signal(signal.SIGTERM)
                with anyio.fail_after(30):
                    code = await proc.wait()
        tg.cancel_scope.cancel()
    text = err_path.read_text()
    assert code == 0, text[-2000:]
    records = parse_lines(text)
    assert all(r["replica"] == "replica-json" for r in records)
    assert {r["logger"] for r in records} - {"relay"}, "no library line was captured"
    assert "pw-never-logged" not in text


# -- a dead owner's reclaim, summed up (issue 41) -------------------------------------------------


@pytest.mark.anyio
async def test_a_dead_owners_reclaim_is_one_summary_line_not_one_per_run(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], captured: io.StringIO
) -> None:
    """A killed replica's runs, taken over at once by a live one: one `leases_reclaimed` line
    per dead owner (its runs counted and named) at info, the per-run `lease_reclaimed` lines
    at debug (before, one info line per run and no summary: 131 lines for 131 runs)."""
    from relay.runner import Relay
    from tests.support import settings
    from tests.test_lease_sql import claim, enq
    from tests.test_liveness import Holder, die

    runs = [f"r{i}" for i in range(5)]
    for run_id in runs:
        enq(conn, schema, run_id, f"{run_id}-e1")
    crashed = Holder(pg_url, schema, "crashed")
    claim(conn, schema, owner="crashed", runs=len(runs), ttl="1 hour")
    await die(crashed, conn)
    logs.configure("json", "info", captured, replica="live-one")
    sink = Sink()
    async with serve_sink(sink) as url:
        async with Relay(settings(pg_url, schema, url, replica_id="live-one")).running():
            await wait_for(lambda: len(sink.state.first_order) == len(runs), what="every run")
    lines = parse_lines(captured.getvalue())
    summaries = [x for x in lines if x.get("event") == "leases_reclaimed"]
    assert [(x["dead_owner"], x["runs"], sorted(x["run_ids"])) for x in summaries] == [
        ("crashed", 5, runs)
    ]
    assert summaries[0]["level"] == "info" and summaries[0]["lease_owner"] == "live-one"
    assert not [x for x in lines if x.get("event") == "lease_reclaimed"]  # debug: not shown


def test_text_lines_say_the_day_and_the_millisecond_and_leave_out_empty_fields() -> None:
    """Issue 41: the text format had no date or milliseconds (two lines of one second could not
    be ordered, nor a line placed on its day) and printed `trace_id=None`."""
    stream = io.StringIO()
    logs.configure("text", "info", stream)
    try:
        logs.info("delivered", run_id="r1", trace_id=None, status=200)
    finally:
        logs.configure("json", "warning")
    (line,) = stream.getvalue().splitlines()
    stamp = line.split(" ", 1)[0]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d", stamp), line
    assert "run_id=r1" in line and "status=200" in line
    assert "trace_id" not in line, line
