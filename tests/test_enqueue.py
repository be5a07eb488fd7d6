"""The producer SQL API (DESIGN §3) against a real PostgreSQL: validation, idempotency, per-run
seq order, the bounded run lock, notifications, and the Python helpers."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import errors, sql
from psycopg.types.json import Jsonb

import relay
from relay import Event
from tests.support import Inbox, fn, snapshot, wait_until

SQL_NULL = object()  # a payload argument passed as SQL NULL (not JSON null)


def _jsonb(value: Any) -> Jsonb | None:
    if value is SQL_NULL:
        return None
    return value if isinstance(value, Jsonb) else Jsonb(value)


def enq(
    conn: psycopg.Connection[Any],
    schema: str,
    run_id: str | None = "r1",
    event_id: str | None = "e1",
    event_type: str | None = "t",
    payload: Any = None,
    terminal: bool | None = False,
    wake_queue: str | None = None,
    wake_event: str | None = None,
    traceparent: str | None = None,
) -> int:
    if payload is None:
        payload = {"n": 1}
    row = conn.execute(
        sql.SQL(
            "select {}(%s::text, %s::text, %s::text, %s::jsonb, %s::boolean, %s::text, %s::text,"
            " %s::text)"
        ).format(fn(schema, "enqueue")),
        (
            run_id,
            event_id,
            event_type,
            _jsonb(payload),
            terminal,
            wake_queue,
            wake_event,
            traceparent,
        ),
    ).fetchone()
    assert row is not None
    return int(row[0])


def enq_many(conn: psycopg.Connection[Any], schema: str, run_id: str, events: Any) -> list[int]:
    row = conn.execute(
        sql.SQL("select {}(%s, %s::jsonb)").format(fn(schema, "enqueue_many")),
        (run_id, _jsonb(events)),
    ).fetchone()
    assert row is not None
    return [int(s) for s in row[0]]


def events_of(conn: psycopg.Connection[Any], schema: str, run_id: str) -> list[tuple[int, str]]:
    return [
        (int(s), e)
        for s, e in conn.execute(
            sql.SQL("select seq, event_id from {} where run_id = %s order by seq").format(
                fn(schema, "events")
            ),
            (run_id,),
        ).fetchall()
    ]


def set_setting(conn: psycopg.Connection[Any], schema: str, key: str, value: str) -> None:
    cur = conn.execute(
        sql.SQL("update {} set value = %s where key = %s").format(fn(schema, "settings")),
        (value, key),
    )
    assert cur.rowcount == 1


@pytest.fixture
def conn2(pg_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_url, autocommit=True) as c:
        yield c


@pytest.fixture
def listener(pg_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_url, autocommit=True) as c:
        yield c


@pytest.fixture
def seeded(conn: psycopg.Connection[Any], schema: str) -> dict[str, list[str]]:
    """Run r1 with one committed event; returns the snapshot."""
    assert enq(conn, schema, "r1", "e0") == 1
    return snapshot(conn, schema)


# --- bad input --------------------------------------------------------------------------------

BAD_INPUT = [
    ("empty run_id", {"run_id": ""}, "22023", "run_id must be a non-empty string"),
    ("NULL run_id", {"run_id": None}, "22023", "run_id must be a non-empty string"),
    # A URL dot segment: no ingress path can carry it (issue 40, tests/test_security.py).
    ("dot run_id", {"run_id": "."}, "22023", 'run_id must not be "." or ".."'),
    ("dot-dot run_id", {"run_id": ".."}, "22023", 'run_id must not be "." or ".."'),
    ("empty event_id", {"event_id": ""}, "22023", "event_id must be a non-empty string"),
    ("NULL event_id", {"event_id": None}, "22023", "event_id must be a non-empty string"),
    ("empty event_type", {"event_type": ""}, "22023", "event_type must be a non-empty string"),
    ("NULL payload", {"payload": SQL_NULL}, "22023", "payload must be a JSON object, got NULL"),
    ("array payload", {"payload": [1, 2]}, "22023", "payload must be a JSON object, got array"),
    ("string payload", {"payload": "x"}, "22023", "payload must be a JSON object, got string"),
    ("number payload", {"payload": 3}, "22023", "payload must be a JSON object, got number"),
    ("JSON null payload", {"payload": Jsonb(None)}, "22023", "got null"),
    ("long run_id", {"run_id": "r" * 201}, "22023", "must be at most 200 bytes"),
    ("long event_id", {"event_id": "e" * 201}, "22023", "must be at most 200 bytes"),
    # 101 characters but 202 bytes: the limit is on bytes
    ("multibyte event_id", {"event_id": "é" * 101}, "22023", "must be at most 200 bytes"),
    ("long event_type", {"event_type": "t" * 201}, "22023", "must be at most 200 bytes"),
    ("NULL terminal", {"terminal": None}, "22023", "terminal must be true or false"),
    (
        "wake_queue only",
        {"wake_queue": "q"},
        "22023",
        "wake_queue and wake_event must be given together (got only wake_queue)",
    ),
    (
        "wake_event only",
        {"wake_event": "w"},
        "22023",
        "wake_queue and wake_event must be given together (got only wake_event)",
    ),
    (
        "empty wake_event",
        {"wake_queue": "q", "wake_event": ""},
        "22023",
        "must be non-empty",
    ),
    (
        "unknown queue",
        {"wake_queue": "no_such_queue_x", "wake_event": "w"},
        "22023",
        "wakes Absurd queue no_such_queue_x which does not exist",
    ),
    ("bad traceparent", {"traceparent": "00-abc"}, "22023", "is not a W3C trace context"),
]


def call_bad(conn: psycopg.Connection[Any], schema: str, kwargs: dict[str, Any]) -> int:
    return enq(conn, schema, **{"run_id": "r1", "event_id": "e-bad", **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "sqlstate", "message"),
    [case[1:] for case in BAD_INPUT],
    ids=[case[0] for case in BAD_INPUT],
)
def test_bad_input_is_rejected_and_inserts_nothing(
    conn: psycopg.Connection[Any],
    schema: str,
    seeded: dict[str, list[str]],
    kwargs: dict[str, Any],
    sqlstate: str,
    message: str,
) -> None:
    with pytest.raises(psycopg.Error) as err:
        call_bad(conn, schema, kwargs)
    assert err.value.sqlstate == sqlstate
    assert message in str(err.value)
    assert str(err.value).startswith("relay.enqueue: ")
    assert snapshot(conn, schema) == seeded

    # Inside a caller's transaction that goes on and commits: the failed call left nothing
    # behind, not even a consumed seq.
    with conn.transaction():
        assert enq(conn, schema, "r1", "e-a") == 2
        with pytest.raises(psycopg.Error) as err, conn.transaction():
            call_bad(conn, schema, kwargs)
        assert err.value.sqlstate == sqlstate
        assert enq(conn, schema, "r1", "e-b") == 3
    assert events_of(conn, schema, "r1") == [(1, "e0"), (2, "e-a"), (3, "e-b")]
    assert len(snapshot(conn, schema)["runs"]) == 1
    assert len(snapshot(conn, schema)["run_seqs"]) == 1


def test_payload_size_limit_is_configurable_and_exact(
    conn: psycopg.Connection[Any], schema: str, seeded: dict[str, list[str]]
) -> None:
    set_setting(conn, schema, "max_payload_bytes", "64")
    before = snapshot(conn, schema)
    # jsonb's text form of {"x": "<n chars>"} is n + 9 bytes
    with pytest.raises(errors.InvalidParameterValue, match="65 bytes, over the limit of 64"):
        enq(conn, schema, "r1", "big", payload={"x": "a" * 56})
    # bytes, not characters: 28 two-byte characters are 56 bytes
    with pytest.raises(errors.InvalidParameterValue, match="over the limit of 64 bytes"):
        enq(conn, schema, "r1", "big2", payload={"x": "é" * 28})
    assert snapshot(conn, schema) == before
    assert enq(conn, schema, "r1", "fits", payload={"x": "a" * 55}) == 2


def test_ids_at_the_limit_are_accepted(conn: psycopg.Connection[Any], schema: str) -> None:
    assert enq(conn, schema, "r" * 200, "e" * 200, "t" * 200) == 1
    assert enq(conn, schema, "r" * 200, "é" * 100) == 2


def test_wake_into_an_existing_queue_is_accepted(
    conn: psycopg.Connection[Any], schema: str, queue: str
) -> None:
    assert enq(conn, schema, "r1", "e1", wake_queue=queue, wake_event="run-created:r1") == 1
    row = conn.execute(
        sql.SQL("select wake_queue, wake_event from {} where event_id = 'e1'").format(
            fn(schema, "events")
        )
    ).fetchone()
    assert row == (queue, "run-created:r1")


def test_wake_without_the_absurd_schema_is_rejected(
    conn: psycopg.Connection[Any], schema: str, queue: str
) -> None:
    before = snapshot(conn, schema)
    with conn.transaction():
        # Absurd is global to the cluster: hide it for this transaction only.
        conn.execute("alter schema absurd rename to absurd_hidden")
        with pytest.raises(errors.InvalidParameterValue) as err, conn.transaction():
            enq(conn, schema, "r1", "e1", wake_queue=queue, wake_event="w")
        assert "Absurd schema is not installed" in str(err.value)
        assert snapshot(conn, schema) == before
        # The relay schema itself does not depend on Absurd: events without a wake still work.
        assert enq(conn, schema, "r1", "e2") == 1
        raise psycopg.Rollback()
    assert conn.execute("select to_regclass('absurd.queues') is not null").fetchone() == (True,)
    assert snapshot(conn, schema) == before


def test_event_after_the_terminal_event_is_rejected(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    assert enq(conn, schema, "r1", "e1") == 1
    assert enq(conn, schema, "r1", "end", terminal=True) == 2
    before = snapshot(conn, schema)
    for terminal in (False, True):
        with pytest.raises(errors.ObjectNotInPrerequisiteState) as err:
            enq(conn, schema, "r1", f"late-{terminal}", terminal=terminal)
        assert err.value.sqlstate == "55000"
        assert "already has its terminal event (seq 2)" in str(err.value)
    with pytest.raises(errors.ObjectNotInPrerequisiteState):
        enq_many(conn, schema, "r1", [{"event_id": "late", "event_type": "t", "payload": {}}])
    assert snapshot(conn, schema) == before
    # Re-enqueueing events that are already there stays an idempotent no-op.
    assert enq(conn, schema, "r1", "end", terminal=True) == 2
    assert enq(conn, schema, "r1", "e1") == 1
    assert snapshot(conn, schema) == before


@pytest.mark.parametrize(
    "change",
    [
        {"payload": {"n": 2}},
        {"event_type": "other"},
        {"terminal": True},
        {"wake_queue": "QUEUE", "wake_event": "w"},
    ],
    ids=["payload", "type", "terminal", "wake"],
)
def test_same_event_id_with_different_content_is_rejected(
    conn: psycopg.Connection[Any],
    schema: str,
    seeded: dict[str, list[str]],
    queue: str,
    change: dict[str, Any],
) -> None:
    if change.get("wake_queue") == "QUEUE":
        change = {**change, "wake_queue": queue}
    args = {"run_id": "r1", "event_id": "e0", "payload": {"n": 1}, **change}
    with pytest.raises(errors.UniqueViolation) as err:
        enq(conn, schema, **args)
    assert err.value.sqlstate == "23505"
    assert "event_id e0 already exists in run r1 with different content" in str(err.value)
    assert snapshot(conn, schema) == seeded


@pytest.mark.parametrize("same_content", [True, False], ids=["same-content", "other-content"])
def test_an_event_id_of_another_run_is_taken_and_tells_nothing_of_that_run(
    conn: psycopg.Connection[Any], schema: str, same_content: bool
) -> None:
    """Security pass 3, item 9: the error named the other run's id and type, and re-sending
    its exact content returned its seq (confirming a guessed payload)."""
    enq(conn, schema, "secret-run", "e9", event_type="secret-type", payload={"n": 1})
    before = snapshot(conn, schema)
    payload = {"n": 1} if same_content else {"n": 2}
    with pytest.raises(errors.UniqueViolation) as err:
        enq(conn, schema, "r2", "e9", event_type="secret-type", payload=payload)
    assert err.value.sqlstate == "23505"
    message = str(err.value)
    assert "event_id e9 is already taken by another run" in message
    assert "secret" not in message and "seq" not in message, message
    assert snapshot(conn, schema) == before
    # The run that holds it keeps its idempotent re-enqueue.
    assert enq(conn, schema, "secret-run", "e9", event_type="secret-type", payload={"n": 1}) == 1


def test_same_event_id_with_identical_content_returns_the_same_seq(
    conn: psycopg.Connection[Any], schema: str, queue: str
) -> None:
    assert enq(conn, schema, "r1", "a", payload={"k": [1, 2]}) == 1
    assert enq(conn, schema, "r1", "b", wake_queue=queue, wake_event="w:b") == 2
    before = snapshot(conn, schema)
    # jsonb equality: key order and whitespace do not matter
    row = conn.execute(
        sql.SQL("select {}('r1', 'a', 't', %s::jsonb)").format(fn(schema, "enqueue")),
        ('{ "k" : [1,2] }',),
    ).fetchone()
    assert row == (1,)
    assert enq(conn, schema, "r1", "b", wake_queue=queue, wake_event="w:b") == 2
    assert enq_many(
        conn,
        schema,
        "r1",
        [{"event_id": "a", "event_type": "t", "payload": {"k": [1, 2]}}],
    ) == [1]
    assert snapshot(conn, schema) == before
    # and the counter did not move
    assert enq(conn, schema, "r1", "c") == 3


# --- seq order --------------------------------------------------------------------------------


def lock_waiters(conn: psycopg.Connection[Any], pid: int) -> int:
    """Whether backend `pid` waits for a lock (a writer of the same run holds its run_seqs row)."""
    row = conn.execute(
        "select count(*) from pg_locks where not granted and pid = %s",
        (pid,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_second_writer_of_the_run_waits_and_takes_the_next_seq(
    pg_url: str, conn: psycopg.Connection[Any], schema: str
) -> None:
    """Seq order is commit order: the second writer waits for the first to finish; if the first
    rolls back, its seq is not lost (no gap)."""
    with (
        psycopg.connect(pg_url) as first,
        psycopg.connect(pg_url) as second,
    ):
        results: dict[str, Any] = {}

        def write(name: str, c: psycopg.Connection[Any], event_id: str) -> None:
            try:
                with c.transaction():
                    results[name] = enq(c, schema, "r1", event_id)
            except Exception as exc:
                results[name] = exc

        # Round 1: the first writer rolls back; the waiting second one gets seq 1.
        with first.transaction():
            assert enq(first, schema, "r1", "gone") == 1
            t = threading.Thread(target=write, args=("second", second, "kept"))
            t.start()
            wait_until(lambda: lock_waiters(conn, second.info.backend_pid) == 1, what="wait")
            raise psycopg.Rollback()
        t.join(10)
        assert results["second"] == 1

        # Round 2: the first writer commits; the waiting one gets the next seq.
        with first.transaction():
            assert enq(first, schema, "r1", "x") == 2
            t = threading.Thread(target=write, args=("third", second, "y"))
            t.start()
            wait_until(lambda: lock_waiters(conn, second.info.backend_pid) == 1, what="wait")
        t.join(10)
        assert results["third"] == 3
        assert events_of(conn, schema, "r1") == [(1, "kept"), (2, "x"), (3, "y")]

        # Writers of other runs do not wait for each other.
        with first.transaction():
            enq(first, schema, "r1", "z")
            with second.transaction():
                assert enq(second, schema, "r2", "other") == 1


def test_a_reader_only_ever_sees_a_gapless_prefix_of_seqs(
    pg_url: str, conn: psycopg.Connection[Any], schema: str
) -> None:
    """Concurrent writers of one run; a concurrent reader (the relay's view) never sees seq k+1
    committed before seq k, and each writer's events are contiguous."""
    writers, txs_each = 6, 12
    stop = threading.Event()
    failures: list[BaseException] = []
    observations: list[list[int]] = []

    def writer(w: int) -> None:
        try:
            with psycopg.connect(pg_url) as c:
                for t in range(txs_each):
                    with c.transaction():
                        for k in range(1 + (w + t) % 3):
                            enq(c, schema, "hot", f"w{w}-t{t}-k{k}")
        except BaseException as exc:
            failures.append(exc)

    def reader() -> None:
        try:
            with psycopg.connect(pg_url, autocommit=True) as c:
                query = sql.SQL(
                    "select coalesce(array_agg(seq order by seq), '{{}}') from {}"
                    " where run_id = 'hot'"
                ).format(fn(schema, "events"))
                while not stop.is_set():
                    row = c.execute(query).fetchone()
                    assert row is not None
                    observations.append(list(row[0]))
        except BaseException as exc:
            failures.append(exc)

    r = threading.Thread(target=reader)
    r.start()
    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stop.set()
    r.join(10)
    assert not failures, failures

    total = sum(1 + (w + t) % 3 for w in range(writers) for t in range(txs_each))
    assert observations
    for seen in observations:
        assert seen == list(range(1, len(seen) + 1))
    final = events_of(conn, schema, "hot")
    assert [s for s, _ in final] == list(range(1, total + 1))
    # one transaction's events are consecutive (the run lock is held until commit)
    by_tx: dict[str, list[int]] = {}
    for seq, event_id in final:
        by_tx.setdefault(event_id.rsplit("-", 1)[0], []).append(seq)
    for seqs in by_tx.values():
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


# --- the bounded run lock ----------------------------------------------------------------------


def test_waiting_for_the_run_lock_times_out_with_a_retryable_error(
    pg_url: str, conn: psycopg.Connection[Any], schema: str
) -> None:
    set_setting(conn, schema, "enqueue_lock_timeout", "200ms")
    with psycopg.connect(pg_url) as holder, psycopg.connect(pg_url) as waiter:
        # A guard so a broken bound fails the test instead of hanging it; the caller's own
        # lock_timeout is longer than the guard, so only the function's bound can fire.
        waiter.execute("set statement_timeout = '20s'")
        waiter.commit()
        assert enq(holder, schema, "r1", "first") == 1
        holder.commit()
        with holder.transaction():
            assert enq(holder, schema, "r1", "held") == 2
            with waiter.transaction():
                waiter.execute("set local lock_timeout = '30s'")
                with pytest.raises(errors.LockNotAvailable) as err, waiter.transaction():
                    enq(waiter, schema, "r1", "late")
                assert err.value.sqlstate == "55P03"
                message = str(err.value)
                assert "timed out after 200ms" in message
                assert "run r1" in message
                assert "retry" in message
                # the caller's own setting is intact after the failure
                assert waiter.execute("select current_setting('lock_timeout')").fetchone() == (
                    "30s",
                )
                # another run is not blocked
                assert enq(waiter, schema, "r2", "free") == 1
        # the holder committed: the retry succeeds with the next seq
        with waiter.transaction():
            assert enq(waiter, schema, "r1", "late") == 3
        # A run another transaction is creating (its first event, not committed yet): the same
        # bound and SQLSTATE, in PostgreSQL's words (lock_run_for_enqueue says why).
        with holder.transaction():
            assert enq(holder, schema, "new", "held-new") == 1
            with waiter.transaction():
                waiter.execute("set local lock_timeout = '30s'")
                with pytest.raises(errors.LockNotAvailable) as err, waiter.transaction():
                    enq(waiter, schema, "new", "late-new")
                assert err.value.sqlstate == "55P03"
                assert waiter.execute("select current_setting('lock_timeout')").fetchone() == (
                    "30s",
                )
        with waiter.transaction():
            assert enq(waiter, schema, "new", "late-new") == 2


@pytest.mark.parametrize("caller", ["0", "1234ms", "session:4321ms"])
def test_the_callers_lock_timeout_is_unchanged_by_enqueue(
    pg_url: str, schema: str, caller: str
) -> None:
    with psycopg.connect(pg_url) as c:
        if caller.startswith("session:"):
            c.execute(sql.SQL("set lock_timeout = {}").format(sql.Literal(caller[8:])))
            c.commit()
            expected = caller[8:]
        elif caller != "0":
            c.execute(sql.SQL("set local lock_timeout = {}").format(sql.Literal(caller)))
            expected = caller
        else:
            expected = "0"

        def setting() -> str:
            row = c.execute("select current_setting('lock_timeout')").fetchone()
            assert row is not None
            return str(row[0])

        assert setting() == expected
        enq(c, schema, "r1", "e1")
        assert setting() == expected
        enq_many(c, schema, "r1", [{"event_id": "e2", "event_type": "t", "payload": {}}])
        assert setting() == expected
        c.commit()
        assert setting() == ("0" if not caller.startswith("session:") else expected)


# --- notifications ----------------------------------------------------------------------------


def test_terminal_enqueue_notifies_the_terminal_channel_only_at_commit(
    pg_url: str,
    conn: psycopg.Connection[Any],
    schema: str,
    listener: psycopg.Connection[Any],
) -> None:
    inbox = Inbox(listener, conn)
    channel = f"{schema}_terminal"
    inbox.listen(channel)
    inbox.listen("absurd_wake")
    with psycopg.connect(pg_url) as producer:
        # rolled back: nothing
        with producer.transaction():
            enq(producer, schema, "r-rb", "e1", terminal=True)
            raise psycopg.Rollback()
        assert inbox.received() == []

        with producer.transaction():
            enq(producer, schema, "r1", "e1", terminal=True)
            assert inbox.received() == []  # not before commit
        got = inbox.received()
    assert len(got) == 1  # and no absurd_wake for a terminal event
    assert got[0][0] == channel
    assert json.loads(got[0][1]) == {"kind": "terminal_committed", "run_id": "r1"}


def test_many_ordinary_enqueues_in_one_transaction_notify_once(
    pg_url: str,
    conn: psycopg.Connection[Any],
    schema: str,
    listener: psycopg.Connection[Any],
) -> None:
    inbox = Inbox(listener, conn)
    inbox.listen("absurd_wake")
    inbox.listen(f"{schema}_terminal")
    with psycopg.connect(pg_url) as producer:
        with producer.transaction():
            for i in range(50):
                enq(producer, schema, f"r{i % 7}", f"e{i}")
            enq_many(
                producer,
                schema,
                "r-many",
                [{"event_id": f"m{i}", "event_type": "t", "payload": {}} for i in range(20)],
            )
            assert inbox.received() == []
        first = inbox.received()
        with producer.transaction():
            enq(producer, schema, "r1", "again")
        second = inbox.received()
        with producer.transaction():
            enq(producer, schema, "r1", "rolled-back")
            raise psycopg.Rollback()
        assert inbox.received() == []
    assert len(first) == 1
    assert first[0][0] == "absurd_wake"
    assert second == first  # a constant payload


@pytest.mark.parametrize("how", ["settings", "set local"])
def test_ordinary_notifications_can_be_turned_off(
    pg_url: str,
    conn: psycopg.Connection[Any],
    schema: str,
    listener: psycopg.Connection[Any],
    how: str,
) -> None:
    inbox = Inbox(listener, conn)
    inbox.listen("absurd_wake")
    channel = f"{schema}_terminal"
    inbox.listen(channel)
    if how == "settings":
        set_setting(conn, schema, "notify_ordinary", "off")
    with psycopg.connect(pg_url) as producer:
        with producer.transaction():
            if how == "set local":
                producer.execute("set local relay.notify_ordinary = 'off'")
            for i in range(5):
                enq(producer, schema, "r1", f"e{i}")
            enq_many(producer, schema, "r2", [{"event_id": "m", "event_type": "t", "payload": {}}])
        assert inbox.received() == []
        # terminal events still notify: the relay must drain them at once
        with producer.transaction():
            if how == "set local":
                producer.execute("set local relay.notify_ordinary = 'off'")
            enq(producer, schema, "r1", "end", terminal=True)
        got = inbox.received()
        assert [c for c, _ in got] == [channel]
        if how == "settings":
            # and a transaction can turn them back on for itself
            with producer.transaction():
                producer.execute("set local relay.notify_ordinary = 'on'")
                enq(producer, schema, "r3", "x")
            assert [c for c, _ in inbox.received()] == ["absurd_wake"]


# --- the batch form ---------------------------------------------------------------------------


def test_enqueue_many_happy_path(conn: psycopg.Connection[Any], schema: str, queue: str) -> None:
    assert enq(conn, schema, "r1", "first") == 1
    seqs = enq_many(
        conn,
        schema,
        "r1",
        [
            {"event_id": "a", "event_type": "t1", "payload": {"i": 1}},
            {
                "event_id": "b",
                "event_type": "t2",
                "payload": {"i": 2},
                "wake_queue": queue,
                "wake_event": "w:b",
                "traceparent": "00-0123456789abcdef0123456789abcdef-0123456789abcdef-01",
            },
            {"event_id": "c", "event_type": "t3", "payload": {}, "terminal": True},
        ],
    )
    assert seqs == [2, 3, 4]
    assert enq_many(conn, schema, "r1", []) == []
    rows = conn.execute(
        sql.SQL(
            "select seq, event_id, event_type, payload, terminal, wake_queue, wake_event,"
            " traceparent, state from {} where run_id = 'r1' order by seq"
        ).format(fn(schema, "events"))
    ).fetchall()
    assert rows == [
        (1, "first", "t", {"n": 1}, False, None, None, None, "pending"),
        (2, "a", "t1", {"i": 1}, False, None, None, None, "pending"),
        (
            3,
            "b",
            "t2",
            {"i": 2},
            False,
            queue,
            "w:b",
            "00-0123456789abcdef0123456789abcdef-0123456789abcdef-01",
            "pending",
        ),
        (4, "c", "t3", {}, True, None, None, None, "pending"),
    ]


BAD_BATCHES = [
    ("not an array", {"event_id": "x"}, "22023", "events must be a JSON array, got object"),
    ("NULL", SQL_NULL, "22023", "events must be a JSON array, got NULL"),
    ("element not an object", ["x"], "22023", "element 1 must be a JSON object"),
    ("unknown key", [{"event_id": "x", "oops": 1}], "22023", "element 1 has unknown key oops"),
    (
        "terminal not a boolean",
        [{"event_id": "x", "event_type": "t", "payload": {}, "terminal": "yes"}],
        "22023",
        "element 1 terminal must be a boolean",
    ),
    (
        "array payload",
        [{"event_id": "x", "event_type": "t", "payload": []}],
        "22023",
        "payload must be a JSON object, got array",
    ),
    (
        "missing payload",
        [{"event_id": "x", "event_type": "t"}],
        "22023",
        "payload must be a JSON object, got NULL",
    ),
    ("missing event_id", [{"event_type": "t", "payload": {}}], "22023", "event_id must be"),
    (
        "duplicate with other content",
        [{"event_id": "e0", "event_type": "t", "payload": {"n": 99}}],
        "23505",
        "already exists in run r1 with different content",
    ),
    (
        "terminal then more",
        [
            {"event_id": "end", "event_type": "t", "payload": {}, "terminal": True},
            {"event_id": "after", "event_type": "t", "payload": {}},
        ],
        "55000",
        "already has its terminal event",
    ),
]


@pytest.mark.parametrize(
    ("bad", "sqlstate", "message"),
    [case[1:] for case in BAD_BATCHES],
    ids=[case[0] for case in BAD_BATCHES],
)
def test_enqueue_many_is_all_or_nothing(
    conn: psycopg.Connection[Any],
    schema: str,
    seeded: dict[str, list[str]],
    bad: Any,
    sqlstate: str,
    message: str,
) -> None:
    good_before = [{"event_id": "g1", "event_type": "t", "payload": {}}]
    good_after = [{"event_id": "g2", "event_type": "t", "payload": {}}]
    batch = bad if not isinstance(bad, list) else good_before + bad + good_after
    with pytest.raises(psycopg.Error) as err:
        enq_many(conn, schema, "r1", batch)
    assert err.value.sqlstate == sqlstate
    assert message in str(err.value)
    assert snapshot(conn, schema) == seeded
    # a new run is not created either
    with pytest.raises(psycopg.Error):
        enq_many(conn, schema, "r-new", batch)
    assert snapshot(conn, schema) == seeded


# --- the Python helpers -----------------------------------------------------------------------

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def helper_rows(conn: psycopg.Connection[Any], schema: str) -> list[tuple[Any, ...]]:
    return conn.execute(
        sql.SQL(
            "select run_id, seq, event_id, event_type, payload, terminal, wake_queue, wake_event,"
            " traceparent from {} order by run_id, seq"
        ).format(fn(schema, "events"))
    ).fetchall()


def test_sync_helpers(conn: psycopg.Connection[Any], schema: str, queue: str) -> None:
    with conn.transaction():
        assert relay.enqueue(conn, "r1", "e1", "created", {"a": 1}, schema=schema) == 1
        assert (
            relay.enqueue(
                conn,
                "r1",
                "e2",
                "started",
                {"b": [1, "x"]},
                wake=(queue, "run-started:r1"),
                traceparent=TRACEPARENT,
                schema=schema,
            )
            == 2
        )
        assert relay.enqueue_many(
            conn,
            "r1",
            [
                Event("e3", "step", {"c": None}),
                Event("e4", "done", {}, terminal=True),
            ],
            schema=schema,
        ) == [3, 4]
        # idempotent through the helper too
        assert relay.enqueue(conn, "r1", "e1", "created", {"a": 1}, schema=schema) == 1
    assert helper_rows(conn, schema) == [
        ("r1", 1, "e1", "created", {"a": 1}, False, None, None, None),
        ("r1", 2, "e2", "started", {"b": [1, "x"]}, False, queue, "run-started:r1", TRACEPARENT),
        ("r1", 3, "e3", "step", {"c": None}, False, None, None, None),
        ("r1", 4, "e4", "done", {}, True, None, None, None),
    ]
    with pytest.raises(errors.InvalidParameterValue, match="event_type must be"):
        relay.enqueue(conn, "r2", "x", "", {}, schema=schema)
    with pytest.raises(errors.ObjectNotInPrerequisiteState):
        relay.enqueue_many(conn, "r1", [Event("late", "t", {})], schema=schema)


@pytest.mark.anyio
async def test_async_helpers(
    aconn: psycopg.AsyncConnection[Any], conn: psycopg.Connection[Any], schema: str, queue: str
) -> None:
    async with aconn.transaction():
        assert await relay.enqueue_async(aconn, "r1", "e1", "created", {"a": 1}, schema=schema) == 1
        assert (
            await relay.enqueue_async(
                aconn,
                "r1",
                "e2",
                "started",
                {},
                wake=(queue, "w:e2"),
                traceparent=TRACEPARENT,
                schema=schema,
            )
            == 2
        )
        assert await relay.enqueue_many_async(
            aconn,
            "r1",
            [Event("e3", "x", {"k": 1}, wake_queue=queue, wake_event="w:e3"), Event("e4", "y", {})],
            schema=schema,
        ) == [3, 4]
    assert helper_rows(conn, schema) == [
        ("r1", 1, "e1", "created", {"a": 1}, False, None, None, None),
        ("r1", 2, "e2", "started", {}, False, queue, "w:e2", TRACEPARENT),
        ("r1", 3, "e3", "x", {"k": 1}, False, queue, "w:e3", None),
        ("r1", 4, "e4", "y", {}, False, None, None, None),
    ]
    with pytest.raises(errors.InvalidParameterValue, match="got only wake_queue"):
        await relay.enqueue_many_async(
            aconn, "r1", [Event("bad", "t", {}, wake_queue=queue)], schema=schema
        )
    with pytest.raises(ValueError, match="not valid"):
        await relay.enqueue_async(aconn, "r1", "e9", "t", {}, schema="Not-Valid")
