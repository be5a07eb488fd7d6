"""`relay retry` makes a run go now, past the retry budget, whichever relay claims it (issue 49
item 3; schema/0011_retry_waiver.sql).

The waiver is the run's row (`runs.retry_waived`): `relay retry` sets it with the run's due time,
the claim returns it, and the end of the next attempt clears it. Until schema version 11 it lived
in the memory of the relays that heard the `run_due` notification: a relay that claimed the run
before the notification reached it, or whose LISTEN was down, or that was not running when the
operator asked, held the run back by its budget again (`retry_deferred retry_in=5.0`).

The relays here run with a retry budget that never has a token (no reserve, no deposits): every
retry it is asked about waits, unless the operator waived it. So a run that goes proves the
waiver, and a run held back shows as `retry_deferred`, never as a duration.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import anyio
import psycopg
import pytest

from relay.admission.retry_budget import RetryBudget
from relay.runner import Relay
from relay.tools.sink import Sink, serve_sink
from tests.faults.proxy import FaultProxy, via
from tests.support import bulk_backlog, q, relay_logs, settings, wait_for
from tests.test_outage_logs import Lines

pytestmark = pytest.mark.anyio


@pytest.fixture
def lines() -> Iterator[Lines]:
    with relay_logs(Lines()) as handler:
        yield handler


def no_tokens() -> RetryBudget:
    """A retry budget that holds back every retry it is asked about (and every quick try)."""
    return RetryBudget(ratio=0.0, per_second=0.0)


def backing_off(conn: psycopg.Connection[Any], schema: str, run_id: str) -> None:
    """`run_id` (one pending event) after a failed attempt, due again in an hour: what a relay's
    release of a 503 leaves."""
    (token,) = conn.execute(
        q(schema, "select lease_token from {s}.claim('setup', 1, 10, '30 s', 'ordinary', %s)"
                  " where lease_token is not null"),
        (run_id,),
    ).fetchone() or (None,)  # fmt: skip
    assert token is not None, f"{run_id} was not claimable"
    (released,) = conn.execute(
        q(schema, "select {s}.release(%s, %s, '1 hour', 'HTTP 503', 503)"), (run_id, token)
    ).fetchone() or (False,)
    assert released


def waived(conn: psycopg.Connection[Any], schema: str, run_id: str) -> bool:
    row = conn.execute(
        q(schema, "select retry_waived from {s}.runs where run_id = %s"), (run_id,)
    ).fetchone()
    assert row is not None
    return bool(row[0])


def relay_cli(pg_url: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The real `relay` in a subprocess."""
    env = {"RELAY_DATABASE_URL": pg_url, "RELAY_SCHEMA": schema, "USER": "tester",
           "PATH": "/usr/bin:/bin"}  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "relay.cli", *args],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def relay_retry(pg_url: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The real `relay retry` in a subprocess."""
    return relay_cli(pg_url, schema, "retry", *args)


def went_or_held(sink: Sink, lines: Lines, run_id: str) -> bool:
    """The run was delivered, or a relay held its retry back: what each test waits for (a held
    back run would wait for the budget forever here)."""
    held = any(f.get("run_id") == run_id for f in lines.named("retry_deferred"))
    return held or bool(sink.state.first_order.get(run_id))


def held_back(lines: Lines, run_id: str) -> list[dict[str, Any]]:
    return [f for f in lines.named("retry_deferred") if f.get("run_id") == run_id]


def test_the_run_row_keeps_the_waiver_until_an_attempt_ends(
    pg_url: str, schema: str, conn: psycopg.Connection[Any]
) -> None:
    """`relay retry` sets the waiver with the due time; every claim returns it (on the run's
    first row) until an attempt ends: a hand-back without an attempt (a lost lease, a stop, a
    deferral) keeps it, a failed attempt's release, an ack and a block each clear it."""
    bulk_backlog(conn, schema, 3, 2, prefix="r")
    for run in ("r1", "r2", "r3"):
        backing_off(conn, schema, run)
        assert not waived(conn, schema, run)

    def claim(run_id: str) -> tuple[uuid.UUID, bool]:
        rows = conn.execute(
            q(schema, "select lease_token, retry_waived from {s}.claim('t', 1, 10, '30 s',"
                      " 'ordinary', %s)"),
            (run_id,),
        ).fetchall()  # fmt: skip
        assert len(rows) == 2 and rows[1] == (None, None), rows  # the run's columns: first row
        return rows[0][0], rows[0][1]

    def release(run_id: str, token: uuid.UUID, error: str | None) -> None:
        conn.execute(
            q(schema, "select {s}.release(%s, %s, '0', %s, %s)"),
            (run_id, token, error, 503 if error else None),
        )

    got = relay_retry(pg_url, schema, "--backing-off")
    assert got.returncode == 0, got.stderr
    assert all(waived(conn, schema, run) for run in ("r1", "r2", "r3"))

    # A hand-back keeps it, claim after claim; the release of a failed attempt takes it.
    token, was = claim("r1")
    assert was
    release("r1", token, None)
    token, was = claim("r1")
    assert was and waived(conn, schema, "r1")
    release("r1", token, "HTTP 503")
    assert not waived(conn, schema, "r1")
    token, was = claim("r1")
    assert not was

    # An ack takes it (the run's failed attempts are reset with it).
    token, was = claim("r2")
    assert was
    conn.execute(q(schema, "select * from {s}.ack(%s::jsonb)"),
                 (f'[{{"run_id": "r2", "token": "{token}", "upto": 1}}]',))  # fmt: skip
    assert not waived(conn, schema, "r2")

    # A poison answer's block takes it.
    token, was = claim("r3")
    assert was
    conn.execute(q(schema, "select {s}.fail_event('r3', %s, 1, 400, 'HTTP 400')"), (token,))
    assert not waived(conn, schema, "r3")


async def test_a_relay_started_after_relay_retry_sends_the_run_past_its_budget(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], lines: Lines
) -> None:
    """The notification of `relay retry` reached no relay (none was running): the relay that
    claims the run later sends it all the same, though its budget has no token."""
    bulk_backlog(conn, schema, 1, 1, prefix="r")
    backing_off(conn, schema, "r1")
    got = relay_retry(pg_url, schema, "--run", "r1")
    assert got.returncode == 0, got.stderr
    # What it says is what happens below: the next claim sends it, past the budget.
    said = " ".join(got.stdout.split())
    assert "1 run due now" in said and "Sent past the retry budget" in said, got.stdout
    assert "within its poll_interval" in said, got.stdout
    inspected = relay_cli(pg_url, schema, "inspect", "r1")
    assert "due, past the retry budget (relay retry)" in inspected.stdout, inspected.stdout
    sink = Sink()
    async with serve_sink(sink) as url:
        r = Relay(settings(pg_url, schema, url, concurrency=2, critical_concurrency=1))
        r.budget = no_tokens()
        async with r.running():
            await wait_for(lambda: went_or_held(sink, lines, "r1"), what="r1 claimed")
    assert not held_back(lines, "r1"), held_back(lines, "r1")
    assert sink.state.first_order == {"r1": [1]} and sink.state.duplicates == 0
    assert not waived(conn, schema, "r1")


async def test_a_relay_whose_listen_is_down_sends_the_run_past_its_budget(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], lines: Lines
) -> None:
    """The relay's LISTEN connection is cut off (a silent partition) when `relay retry` runs: its
    poll claims the run with no notification heard. This is also the race of a poll that claims
    the run before the notification arrives: the claim alone carries the waiver."""
    bulk_backlog(conn, schema, 1, 1, prefix="r")
    backing_off(conn, schema, "r1")
    target = urlsplit(pg_url)
    assert target.hostname and target.port, "the test needs PostgreSQL over TCP"
    sink = Sink()
    async with anyio.create_task_group() as tg, serve_sink(sink) as url:
        proxy = FaultProxy(target.hostname, target.port, "listen")
        await proxy.start(tg)
        cfg = settings(pg_url, schema, url, concurrency=2, critical_concurrency=1,
                       listen_database_url=via(pg_url, proxy.port), poll_interval=0.5)  # fmt: skip
        r = Relay(cfg)
        r.budget = no_tokens()
        async with r.running():
            listener = r.listener
            assert listener is not None
            await wait_for(lambda: listener.up, what="LISTEN up")
            heard = listener.state.received
            proxy.blackhole()
            got = await anyio.to_thread.run_sync(lambda: relay_retry(pg_url, schema, "--run", "r1"))
            assert got.returncode == 0, got.stderr
            await wait_for(lambda: went_or_held(sink, lines, "r1"), what="r1 claimed")
            assert listener.state.received == heard, "the notification got through the partition"
            proxy.heal()
        tg.cancel_scope.cancel()
    assert not held_back(lines, "r1"), held_back(lines, "r1")
    assert sink.state.first_order == {"r1": [1]} and sink.state.duplicates == 0


async def test_the_waiver_is_for_one_attempt_the_next_failure_is_budgeted_again(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], lines: Lines
) -> None:
    """The attempt `relay retry` let past the budget fails (503): the run's next retry waits for
    the budget like any other, and is not sent again."""
    bulk_backlog(conn, schema, 1, 1, prefix="r")
    backing_off(conn, schema, "r1")
    sink = Sink()
    sink.faults.set_default(503)
    async with serve_sink(sink) as url:
        r = Relay(settings(pg_url, schema, url, concurrency=2, critical_concurrency=1,
                           http_timeout=1))  # fmt: skip
        r.budget = no_tokens()
        async with r.running():
            got = await anyio.to_thread.run_sync(lambda: relay_retry(pg_url, schema, "--run", "r1"))
            assert got.returncode == 0, got.stderr

            def attempts() -> list[dict[str, Any]]:
                return [f for f in lines.named("retry_scheduled") if f.get("run_id") == "r1"]

            await wait_for(lambda: bool(held_back(lines, "r1")) or len(attempts()) > 1,
                           what="r1 held back again, or sent again")  # fmt: skip
            assert len(attempts()) == 1, attempts()  # one attempt went: the operator's
    assert held_back(lines, "r1")
    assert not waived(conn, schema, "r1")
