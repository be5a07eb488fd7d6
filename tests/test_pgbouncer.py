"""The relay behind a real PgBouncer in transaction mode (issue 29, item 1; docs/operations.md §3).

- end to end: the replicas' pools and the producer through PgBouncer, LISTEN direct
  (`listen_database_url`): nothing lost, per-run order kept, wakes exact, no producer error.
- the producer helper through it, where psycopg's prepared statements fail (PgBouncer < 1.21).
- `relay check` fails a `listen_database_url` that goes through the transaction pool, and passes
  the production topology (pools through it, LISTEN direct) and a session-mode pool.

Skipped with the reason when `pgbouncer` is not installed (scripts/test.sh installs it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest

import relay
from relay.ops.checks import LISTEN
from relay.tools.sink import Sink
from tests.faults.harness import Workload
from tests.pgbouncer import MISSING, PgBouncer, pgbouncer_binary, version
from tests.steady_lab import Database, SteadyLab
from tests.test_cli import RELAY, relay_env

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def bouncer_available() -> str:
    binary = pgbouncer_binary()
    if binary is None:
        pytest.skip(MISSING)
    return binary


@pytest.fixture(scope="module")
def bouncer(bouncer_available: str, pg_url: str) -> Iterator[PgBouncer]:
    """Transaction mode, the pool sized like a production one (20 server sessions)."""
    b = PgBouncer(pg_url).start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
def one_session(bouncer_available: str, pg_url: str) -> Iterator[PgBouncer]:
    """Transaction mode with one server session: every client's transactions share it, so a
    prepared statement one client left there meets the next client at once."""
    b = PgBouncer(pg_url, pool_size=1).start()
    try:
        yield b
    finally:
        b.stop()


def admin(b: PgBouncer, command: str) -> list[dict[str, Any]]:
    with psycopg.connect(b.admin_url, autocommit=True) as conn:
        cur = conn.execute(command)
        names = [c.name for c in cur.description or []]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


# -- end to end -------------------------------------------------------------------------------


async def test_relay_and_producer_through_pgbouncer_transaction_mode(
    bouncer: PgBouncer, pg_url: str, tmp_path: Path
) -> None:
    """Two replicas whose pools go through PgBouncer (transaction mode) and whose LISTEN goes
    direct, and a producer through PgBouncer on psycopg's defaults: every event delivered once
    at least, in order per run, each wake emitted exactly once, no producer error."""
    before = admin(bouncer, "show stats")
    async with SteadyLab.open(
        Database(url=bouncer.url(), direct=pg_url),  # type: ignore[arg-type]
        "pgbouncer_transaction",
        tmp_path,
        replicas=2,
        env={"RELAY_LISTEN_DATABASE_URL": pg_url},
    ) as lab:
        lab.sink.faults.delay(0.005, times=100_000)
        lab.produce(Workload(runs=60, spread=4).scaled())
        await lab.wait_received(100)
    row = lab.row
    assert row is not None
    assert row.valid, row.problems
    assert row.lost == row.out_of_order == row.wakes_missing == row.wakes_extra == 0
    assert row.delivered == row.sent
    after = admin(bouncer, "show stats")
    xacts = sum(r["total_xact_count"] for r in after) - sum(r["total_xact_count"] for r in before)
    assert xacts > row.sent // 4, f"only {xacts} transactions went through PgBouncer"
    errors = [
        line
        for log in lab.logs
        for line in log.read_text(errors="replace").splitlines()
        if '"level":"error"' in line or "prepared statement" in line
    ]
    assert not errors, errors[:5]
    row.notes.append(
        f"pools and producer through PgBouncer {'.'.join(map(str, version(bouncer.binary)))}"
        f" (transaction mode), LISTEN direct: {xacts} transactions through it"
    )


# -- the producer helper ----------------------------------------------------------------------

REPEATS = 8  # past psycopg's prepare_threshold (5): the statement is prepared by then


def test_psycopg_prepared_statements_fail_through_a_transaction_pool_unless_turned_off(
    one_session: PgBouncer,
) -> None:
    """What an application's own statements meet through PgBouncer < 1.21: psycopg prepares a
    statement run 5 times as `_pg3_0` in the server session it happened to run in; the next
    client there prepares its own `_pg3_0` and fails. `prepare_threshold=None` is the fix."""
    if version(one_session.binary) >= (1, 21):
        pytest.skip("PgBouncer 1.21+ carries prepared statements in transaction mode")
    with (
        psycopg.connect(one_session.url(), autocommit=True) as first,
        psycopg.connect(one_session.url(), autocommit=True) as second,
    ):
        for i in range(REPEATS):
            first.execute("select %s::int", (i,))
        with pytest.raises(psycopg.errors.DuplicatePreparedStatement, match="_pg3_0"):
            for i in range(REPEATS):
                second.execute("select %s::int", (i,))
    with (
        psycopg.connect(one_session.url(), autocommit=True, prepare_threshold=None) as first,
        psycopg.connect(one_session.url(), autocommit=True, prepare_threshold=None) as second,
    ):
        for conn in (first, second, first):
            for i in range(REPEATS):
                assert conn.execute("select %s::int", (i,)).fetchone() == (i,)


def test_the_producer_helper_works_through_a_transaction_pool_on_psycopgs_defaults(
    one_session: PgBouncer, schema: str, pg_url: str
) -> None:
    """`relay.enqueue` and `relay.enqueue_many` never prepare: two producers on psycopg's
    default connections, sharing one server session, each past the prepare threshold."""
    with (
        psycopg.connect(one_session.url(), autocommit=True) as first,
        psycopg.connect(one_session.url(), autocommit=True) as second,
    ):
        for turn, (conn, run) in enumerate(((first, "a"), (second, "b"), (first, "a"))):
            for i in range(REPEATS):
                with conn.transaction():
                    relay.enqueue(conn, run, f"{turn}-{i}", "step", {}, schema=schema)
                    relay.enqueue_many(
                        conn, run, [relay.Event(f"{turn}-{i}-m", "step", {})], schema=schema
                    )
    with psycopg.connect(pg_url) as direct:
        got = direct.execute(f'select count(*) from "{schema}".events').fetchone()
    assert got == (6 * REPEATS,)


async def test_the_async_producer_helper_works_through_a_transaction_pool(
    one_session: PgBouncer, schema: str
) -> None:
    async with (
        await psycopg.AsyncConnection.connect(one_session.url(), autocommit=True) as first,
        await psycopg.AsyncConnection.connect(one_session.url(), autocommit=True) as second,
    ):
        for turn, (conn, run) in enumerate(((first, "a"), (second, "b"), (first, "a"))):
            for i in range(REPEATS):
                async with conn.transaction():
                    await relay.enqueue_async(conn, run, f"{turn}-{i}", "step", {}, schema=schema)
                    await relay.enqueue_many_async(
                        conn, run, [relay.Event(f"{turn}-{i}-m", "step", {})], schema=schema
                    )


# -- relay check ------------------------------------------------------------------------------


async def check(env: dict[str, str]) -> tuple[int, dict[str, str]]:
    got = await anyio.run_process([*RELAY, "check", "--timeout", "3"], env=env, check=False)
    assert got.stderr.decode().strip() == "", got.stderr.decode()
    lines = got.stdout.decode().splitlines()
    return got.returncode, {line.split()[1]: line for line in lines}


@pytest.fixture
async def sink_url(sink: tuple[Sink, str]) -> str:
    return sink[1]


async def test_relay_check_fails_a_listen_url_through_a_transaction_pool(
    bouncer: PgBouncer, schema: str, sink_url: str
) -> None:
    """The mistake `relay check` exists to catch: `listen_database_url` through the pool. Its
    LISTEN and NOTIFY on one connection would pass (one idle server session serves both)."""
    env = relay_env(bouncer.url(), schema, sink_url)
    env["RELAY_LISTEN_DATABASE_URL"] = bouncer.url()
    code, lines = await check(env)
    assert code == LISTEN, lines
    assert lines["listen"].startswith("FAIL"), lines["listen"]
    assert "listen_database_url" in lines["listen"]
    for name in ("configuration", "database", "schema", "ingress"):
        assert lines[name].startswith("ok"), lines[name]


async def test_relay_check_fails_a_database_url_through_a_transaction_pool_without_listen_url(
    bouncer: PgBouncer, schema: str, sink_url: str
) -> None:
    """No `listen_database_url`: LISTEN would use `database_url`, through the pool."""
    code, lines = await check(relay_env(bouncer.url(), schema, sink_url))
    assert code == LISTEN, lines
    assert lines["listen"].startswith("FAIL"), lines["listen"]


async def test_relay_check_passes_the_pools_through_pgbouncer_with_listen_direct(
    bouncer: PgBouncer, pg_url: str, schema: str, sink_url: str
) -> None:
    env = relay_env(bouncer.url(), schema, sink_url)
    env["RELAY_LISTEN_DATABASE_URL"] = pg_url
    code, lines = await check(env)
    assert code == 0, lines
    assert "receives notifications" in lines["listen"]


async def test_relay_check_passes_listen_through_a_session_pool(
    bouncer_available: str, pg_url: str, schema: str, sink_url: str
) -> None:
    """A session-mode pool keeps a client's server session for the client's whole connection:
    LISTEN works through it, and the check says so (it does not just spot PgBouncer)."""
    session_pool = PgBouncer(pg_url, pool_mode="session").start()
    try:
        env = relay_env(session_pool.url(), schema, sink_url)
        code, lines = await check(env)
    finally:
        session_pool.stop()
    assert code == 0, lines
    assert "receives notifications" in lines["listen"]


async def test_relay_check_fails_listen_through_a_round_robin_pool_by_the_lost_notification(
    bouncer_available: str, pg_url: str, schema: str, sink_url: str
) -> None:
    """With `server_round_robin` and several idle server sessions, the second client gets
    another session than the LISTEN one (different pids): then the notification it sends is
    what goes nowhere (PgBouncer drops it: "got packet 'A' from server when not linked")."""
    pool = PgBouncer(pg_url, extra={"server_round_robin": "1"}).start()
    try:
        # Four server sessions, idle in the pool: four transactions at once, then committed (a
        # client leaving in a transaction would take its server session with it).
        warm = [psycopg.connect(pool.url()) for _ in range(4)]
        for conn in warm:
            conn.execute("select 1")
        for conn in warm:
            conn.commit()
            conn.close()
        code, lines = await check(relay_env(pool.url(), schema, sink_url))
        dropped = "when not linked" in pool.log_tail(100_000)
    finally:
        pool.stop()
    assert code == LISTEN, lines
    assert "no notification came back" in lines["listen"], lines["listen"]
    assert dropped, "PgBouncer did not log the notification it dropped"
