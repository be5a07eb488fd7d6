"""Helpers shared by the integration tests: the rig most of them stand on, settings, waiting on
conditions, bulk backlogs, the SQL API's tables as snapshots, notifications read up to a
sentinel, and the POST turn's views as a replica shows and reports them."""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import anyio
import psycopg
from psycopg import sql

from relay.admission.limit import LimitView
from relay.admission.permits import AdmissionView, Priority
from relay.admission.retry_budget import BudgetView
from relay.core.policy import Trust
from relay.edges.store import Claim, ClaimedEvent
from relay.runner import Relay
from relay.settings import Settings, load
from relay.tools.sink import Sink

T = TypeVar("T")
H = TypeVar("H", bound=logging.Handler)
# What the `log_lines` fixture (tests/conftest.py) gives: the relay's JSON log lines so far.
LogLines = Callable[[], list[dict[str, Any]]]

# Every HTTP client the relay can POST with (`http_transport`; aiohttp from its extra, which dev
# installs through bench): the contract, hostile-answer and transport suites run once per entry.
HTTP_TRANSPORTS = ["aiohttp", "httpx"]


def settings(pg_url: str, schema: str, sink_url: str, **overrides: Any) -> Settings:
    flags: dict[str, str | None] = {
        "database_url": pg_url,
        "schema": schema,
        "ingress_url": sink_url + "/runs/{run_id}/events",
        "poll_interval": "0.2",
        "log_level": "warning",
        "retention": "0",
    }
    flags.update({k: str(v) for k, v in overrides.items()})
    return load(flags, environ={})


def offline_settings(**flags: str) -> Settings:
    """The relay's settings for a test that reaches neither a database nor an ingress (a pure
    part, or one over stand-ins): both URLs name port 1, where nothing listens."""
    return load(
        {
            "database_url": "postgresql://relay@127.0.0.1:1/relay",
            "ingress_url": "http://127.0.0.1:1/runs/{run_id}/events",
            **flags,
        },
        environ={},
    )


@dataclass(frozen=True)
class Rig:
    """What an integration test of the relay stands on (the `rig` fixture): the server's URL, a
    freshly migrated schema, an autocommit connection, and the reference ingress in this process
    (its state and base URL)."""

    pg_url: str
    schema: str
    conn: psycopg.Connection[Any]
    sink: Sink
    url: str

    def settings(self, **overrides: Any) -> Settings:
        """The relay's settings for this schema and ingress (see `settings`)."""
        return settings(self.pg_url, self.schema, self.url, **overrides)

    def relay(self, **overrides: Any) -> Relay:
        """An in-process relay on `settings(**overrides)`, not yet running."""
        return Relay(self.settings(**overrides))

    def count(self, where: str = "true") -> int:
        """How many of the schema's events match `where` (see `count`)."""
        return count(self.conn, self.schema, where)

    def q(self, text: str) -> sql.Composed:
        """`text` with `{s}` replaced by the quoted schema (see `q`)."""
        return q(self.schema, text)


async def wait_for(
    predicate: Callable[[], bool | Awaitable[bool]],
    *,
    timeout: float = 60.0,  # noqa: ASYNC109 - a deadline for waiting, not an I/O timeout
    interval: float = 0.02,
    what: str = "condition",
) -> None:
    """Wait until `predicate()` holds; fail with `what` after `timeout` (a deadline, not a
    performance threshold: generous on purpose)."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if not isinstance(got, bool):
            got = await got
        if got:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await anyio.sleep(interval)


@contextmanager
def relay_logs(handler: H) -> Iterator[H]:
    """`handler` on the `relay` logger at DEBUG for the block, whatever another test configured
    the logger to do."""
    logger = logging.getLogger("relay")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def q(schema: str, text: str) -> sql.Composed:
    """`text` with `{s}` replaced by the quoted schema."""
    return sql.SQL(text).format(s=sql.Identifier(schema))


def fn(schema: str, name: str) -> sql.Identifier:
    """A function or table of the relay's schema, quoted."""
    return sql.Identifier(schema, name)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """`wait_for` for synchronous tests: poll `predicate` until it holds or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.005)


def snapshot(conn: psycopg.Connection[Any], schema: str) -> dict[str, list[str]]:
    """Every row of the tables the SQL API writes (events, runs, run_seqs), in full: equal
    snapshots before and after a call that was refused mean it wrote nothing."""
    out = {}
    for table, order in (("events", "run_id, seq"), ("runs", "run_id"), ("run_seqs", "run_id")):
        out[table] = [
            r[0]
            for r in conn.execute(
                sql.SQL("select to_jsonb(t)::text from {} t order by {}").format(
                    fn(schema, table), sql.SQL(order)
                )
            ).fetchall()
        ]
    return out


class Inbox:
    """Notifications received by `listener`, read up to a sentinel so that "nothing was sent"
    is checked without waiting for a timeout: notifications arrive in commit order, so anything
    committed before the sentinel arrives before it."""

    def __init__(self, listener: psycopg.Connection[Any], sender: psycopg.Connection[Any]):
        self.listener = listener
        self.sender = sender
        self.sentinel_channel = f"sentinel_{uuid.uuid4().hex[:8]}"
        self.listen(self.sentinel_channel)

    def listen(self, channel: str) -> None:
        self.listener.execute(sql.SQL("listen {}").format(sql.Identifier(channel)))

    def received(self) -> list[tuple[str, str]]:
        mark = uuid.uuid4().hex
        self.sender.execute("select pg_notify(%s, %s)", (self.sentinel_channel, mark))
        got: list[tuple[str, str]] = []
        for n in self.listener.notifies(timeout=10):
            if n.channel == self.sentinel_channel and n.payload == mark:
                return got
            got.append((n.channel, n.payload))
        raise AssertionError(f"sentinel not received; got {got}")


def count(conn: psycopg.Connection[Any], schema: str, where: str = "true") -> int:
    row = conn.execute(q(schema, "select count(*) from {s}.events where " + where)).fetchone()
    assert row is not None
    return int(row[0])


def bulk_backlog(
    conn: psycopg.Connection[Any], schema: str, runs: int, per_run: int, prefix: str = "b"
) -> int:
    """A large pending backlog written straight into the tables (the same rows enqueue writes,
    without 10^5 function calls): fixture set-up for tests about the relay, not the producer."""
    with conn.transaction():
        conn.execute(
            q(
                schema,
                "insert into {s}.run_seqs (run_id, last_seq)"
                " select %s || r, %s from generate_series(1, %s) r",
            ),
            (prefix, per_run, runs),
        )
        conn.execute(
            q(
                schema,
                "insert into {s}.runs (run_id, next_attempt_at)"
                " select %s || r, clock_timestamp() from generate_series(1, %s) r",
            ),
            (prefix, runs),
        )
        conn.execute(
            q(
                schema,
                "insert into {s}.outbox (run_id, seq, event_id, event_type, payload)"
                " select %s || r, i, %s || r || '-' || i, 'step', jsonb_build_object('i', i)"
                " from generate_series(1, %s) r, generate_series(1, %s) i",
            ),
            (prefix, prefix, runs, per_run),
        )
    conn.execute(q(schema, "analyze {s}.outbox, {s}.runs"))
    return runs * per_run


def assert_acked_only_if_received(
    conn: psycopg.Connection[Any], schema: str, received: dict[str, int]
) -> None:
    """Invariant 1's other half: never acknowledged without a 2xx — every event the outbox marks
    delivered was received (processed) by the ingress."""
    rows = conn.execute(q(schema, "select event_id from {s}.events where state = 'delivered'"))
    acked = {r[0] for r in rows.fetchall()}
    missing = acked - set(received)
    assert not missing, f"acknowledged but never received by the ingress: {sorted(missing)[:10]}"


OUTBOX_PART = re.compile(r"^outbox_p[0-9]")


def scan_counters(conn: psycopg.Connection[Any], schema: str) -> dict[str, tuple[int, int]]:
    """This transaction's (scans, tuples read) per table and index of the schema: seq scans for
    a table, index scans for an index. The outbox's three parts (schema version 8) and their
    indexes are summed under the names of the one table they replace (`outbox`,
    `outbox_pkey`, `outbox_event_id_key`); a table with no page (an empty part) is left out:
    the planner rightly scans it rather than its index, and such a scan reads nothing."""
    counters: dict[str, tuple[int, int]] = {}
    for name, scans, tuples in conn.execute(
        "select c.relname, pg_stat_get_xact_numscans(c.oid),"
        " pg_stat_get_xact_tuples_returned(c.oid)"
        " from pg_class c where c.relnamespace = %s::regnamespace"
        " and (c.relkind = 'i' or c.relkind = 'r' and pg_relation_size(c.oid) > 0)",
        (schema,),
    ).fetchall():
        key = OUTBOX_PART.sub("outbox", name)
        seen = counters.get(key, (0, 0))
        counters[key] = (seen[0] + int(scans), seen[1] + int(tuples))
    return counters


def scans(
    conn: psycopg.Connection[Any], schema: str, call: Callable[[], T]
) -> tuple[T, dict[str, tuple[int, int]]]:
    """`call()`'s result and the (scans, tuples read) it caused, per table and index."""
    with conn.transaction():  # pending counters are not flushed inside a transaction
        before = scan_counters(conn, schema)
        got = call()
        after = scan_counters(conn, schema)
    delta = {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after}
    return got, delta


def waits_for_a_lock(url: str, pid: int) -> bool:
    """Whether backend `pid` is waiting for a lock."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "select wait_event_type = 'Lock' from pg_stat_activity where pid = %s", (pid,)
        ).fetchone()
    return bool(row and row[0])


class InThread:
    """`fn()` on a thread of its own; `result()` joins it and returns or raises what it did."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._outcome: list[tuple[str, Any]] = []
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._outcome.append(("value", fn()))
        except BaseException as exc:  # handed to result()
            self._outcome.append(("error", exc))

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: float = 60.0) -> Any:
        self._thread.join(timeout)
        assert self._outcome, "the thread did not finish"
        kind, value = self._outcome[0]
        if kind == "error":
            raise value
        return value


CLAIMED_AT = datetime(2024, 5, 17, 12, 0, 0, tzinfo=UTC)


def one_event_claim(run_id: str, *, critical: bool = False, targeted: bool = False) -> Claim:
    """A claim of one step event, trusted for 30 s from 0.0: for the unit tests of what a lane
    does with claims (its holdings, slots and POST turn), which never reach a database.
    `critical`: a run with a pending terminal (as discovery finds one); `targeted`: a targeted
    terminal (issue 50), critical too."""
    return Claim(
        run_id=run_id,
        epoch=1,
        token=uuid.uuid4(),
        attempts=0,
        critical=critical or targeted,
        targeted=targeted,
        claimed_at=CLAIMED_AT,
        trust=Trust(started=0.0, ttl=30.0, margin=6.0),
        events=(ClaimedEvent(1, f"{run_id}-1", "step", "{}", False, CLAIMED_AT, None, None),),
    )


class Decisions(logging.Handler):
    """Every decision the relay logs: (event name, fields)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, dict[str, Any]]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.getMessage(), dict(getattr(record, "fields", {}) or {})))

    def named(self, event: str) -> list[dict[str, Any]]:
        return [fields for name, fields in self.records if name == event]


def admission_view(*, min_rtt: float | None = 0.0414, fallen: bool = True) -> AdmissionView:
    """A replica's adaptive limit as the status page and its report read it
    (relay/serving/ui/data.py): 7 POSTs allowed of a ceiling of 36, fallen unless told otherwise, a
    critical reserve of 2, 6 in flight (1 critical) and 12 ordinary ones waiting; `min_rtt` None
    before any answer."""
    limit = LimitView(value=7.4, allowed=7, ceiling=36, min_rtt=min_rtt, median_rtt=0.09,
                      paused_until=0.0, fallen=fallen)  # fmt: skip
    return AdmissionView(
        limit=limit,
        reserve=2,
        inflight={Priority.CRITICAL: 1, Priority.ORDINARY: 5},
        waiting={Priority.CRITICAL: 0, Priority.ORDINARY: 12},
    )


# The retry budget beside it: 9.5 tokens, no retry in flight.
TOKENS = BudgetView(9.5, 0)


# The metrics a fleet alone serves (RELAY_DATABASES): the shipped rules may read them, and
# tests/test_fleet.py finds them in a fleet's scrape, tests/test_monitoring.py the rest in a
# single relay's.
FLEET_ONLY = frozenset({"ledger_relay_database_up"})
