"""The relay's SQL API against a real PostgreSQL (DESIGN §4.2, §6, §9): claims of whole runs,
fenced leases on the database clock, acknowledgement with engine wakes, lanes, blocking,
settling and pruning."""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import psycopg
import pytest
from psycopg import errors, sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from tests.support import Inbox, InThread, fn, scans, snapshot, wait_until, waits_for_a_lock

Row = dict[str, Any]


# --- helpers ----------------------------------------------------------------------------------


def enq(
    conn: psycopg.Connection[Any],
    schema: str,
    run_id: str,
    event_id: str,
    *,
    terminal: bool = False,
    wake: tuple[str, str] | None = None,
    payload: dict[str, Any] | None = None,
) -> int:
    queue, name = wake if wake else (None, None)
    row = conn.execute(
        sql.SQL("select {}(%s, %s, 't', %s, %s, %s, %s)").format(fn(schema, "enqueue")),
        (run_id, event_id, Jsonb(payload or {"id": event_id}), terminal, queue, name),
    ).fetchone()
    assert row is not None
    return int(row[0])


def claim(
    conn: psycopg.Connection[Any],
    schema: str,
    *,
    owner: str = "o1",
    runs: int = 10,
    batch: int = 100,
    ttl: str = "1 minute",
    lane: str = "ordinary",
    run_id: str | None = None,
) -> dict[str, list[Row]]:
    """The claimed runs, each with its rows in the order claim returned them."""
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(
            sql.SQL("select * from {}(%s, %s, %s, %s::interval, %s, %s)").format(
                fn(schema, "claim")
            ),
            (owner, runs, batch, ttl, lane, run_id),
        )
        out: dict[str, list[Row]] = {}
        for r in cur.fetchall():
            out.setdefault(r["run_id"], []).append(r)
        return out


def seqs(claimed: dict[str, list[Row]], run_id: str) -> list[int]:
    return [r["seq"] for r in claimed[run_id]]


def token(claimed: dict[str, list[Row]], run_id: str) -> str:
    return str(claimed[run_id][0]["lease_token"])


def ack(
    conn: psycopg.Connection[Any], schema: str, *batches: tuple[str, str, int], keep: bool = False
) -> list[Row]:
    items = [{"run_id": r, "token": t, "upto": u} for r, t, u in batches]
    if keep:
        items = [{**item, "keep": True} for item in items]
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(sql.SQL("select * from {}(%s)").format(fn(schema, "ack")), (Jsonb(items),))
        return cur.fetchall()


def call(
    conn: psycopg.Connection[Any], schema: str, name: str, *args: Any
) -> list[tuple[Any, ...]]:
    placeholders = sql.SQL(", ").join(sql.Placeholder() * len(args))
    return conn.execute(
        sql.SQL("select * from {}({})").format(fn(schema, name), placeholders), args
    ).fetchall()


def run_row(conn: psycopg.Connection[Any], schema: str, run_id: str) -> Row:
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(
            sql.SQL("select * from {} where run_id = %s").format(fn(schema, "runs")), (run_id,)
        ).fetchone()
    assert row is not None
    return row


def event_rows(conn: psycopg.Connection[Any], schema: str, run_id: str) -> list[Row]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(
            sql.SQL("select * from {} where run_id = %s order by seq").format(fn(schema, "events")),
            (run_id,),
        ).fetchall()


def states(conn: psycopg.Connection[Any], schema: str, run_id: str) -> list[tuple[int, str]]:
    return [(e["seq"], e["state"]) for e in event_rows(conn, schema, run_id)]


def engine_events(conn: psycopg.Connection[Any], queue: str) -> dict[str, Any]:
    return dict(
        conn.execute(
            # await_event pre-creates a row with a NULL payload: "not emitted yet"
            sql.SQL("select event_name, payload from {} where payload is not null").format(
                sql.Identifier("absurd", f"e_{queue}")
            )
        ).fetchall()
    )


def wait_db_clock_past(conn: psycopg.Connection[Any], moment: datetime) -> None:
    """Lease times are on the database clock: wait until it has passed `moment`."""

    def passed() -> bool:
        row = conn.execute("select clock_timestamp() > %s", (moment,)).fetchone()
        return bool(row and row[0])

    wait_until(passed, what=f"database clock past {moment}")


def wait_lease_expired(conn: psycopg.Connection[Any], schema: str, run_id: str) -> None:
    expires = run_row(conn, schema, run_id)["lease_expires_at"]
    assert expires is not None
    wait_db_clock_past(conn, expires)


def wait_due(conn: psycopg.Connection[Any], schema: str, run_id: str) -> None:
    wait_db_clock_past(conn, run_row(conn, schema, run_id)["next_attempt_at"])


@pytest.fixture
def inbox(pg_url: str, conn: psycopg.Connection[Any], schema: str) -> Iterator[Inbox]:
    with psycopg.connect(pg_url, autocommit=True) as listener:
        box = Inbox(listener, conn)
        box.listen(f"{schema}_terminal")
        box.listen("absurd_wake")
        yield box


@pytest.fixture
def own_queue(pg_url: str) -> Iterator[str]:
    """An Absurd queue that a test may drop or tamper with."""
    name = f"q_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute("select absurd.create_queue(%s)", (name,))
    yield name
    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute("select absurd.drop_queue(%s)", (name,))


# --- claim ------------------------------------------------------------------------------------


def test_claim_takes_whole_runs_and_returns_prefixes_in_seq_order(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    for i in range(5):
        enq(conn, schema, "a", f"a{i}")
    for i in range(2):
        enq(conn, schema, "b", f"b{i}")

    claimed = claim(conn, schema, batch=3)

    assert set(claimed) == {"a", "b"}
    assert seqs(claimed, "a") == [1, 2, 3]  # a prefix of the batch size, in order
    assert seqs(claimed, "b") == [1, 2]
    a = claimed["a"]
    assert [r["event_id"] for r in a] == ["a0", "a1", "a2"]
    assert json.loads(a[0]["payload"]) == {"id": "a0"}
    # the run's own columns on its first row only (read there), NULL on the others
    own = ("epoch", "lease_token", "lease_expires_at", "attempts", "critical", "claimed_at")
    for rows in claimed.values():
        assert all(rows[0][k] is not None for k in own), rows[0]
        assert all(r[k] is None for r in rows[1:] for k in (*own, "reclaimed_from")), rows
        assert rows[0]["epoch"] == 1
        assert rows[0]["lease_expires_at"] > rows[0]["claimed_at"]
        assert rows[0]["critical"] is False
    assert token(claimed, "a") != token(claimed, "b")
    row = run_row(conn, schema, "a")
    assert row["lease_owner"] == "o1"
    assert str(row["lease_token"]) == token(claimed, "a")
    # a leased run is not due before its lease expires (one index serves discovery)
    assert row["next_attempt_at"] >= row["lease_expires_at"]
    # nothing else is claimable while the leases live: not the rest of run a either
    assert claim(conn, schema, owner="o2") == {}
    assert claim(conn, schema, owner="o2", lane="critical") == {}
    assert claim(conn, schema, owner="o2", run_id="a") == {}
    assert states(conn, schema, "a") == [(i, "pending") for i in range(1, 6)]


def test_claim_takes_at_most_p_runs_oldest_due_first(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    for r in ("r1", "r2", "r3"):
        enq(conn, schema, r, f"{r}-e")
    first = claim(conn, schema, runs=2)
    assert set(first) == {"r1", "r2"}
    second = claim(conn, schema, runs=2)
    assert set(second) == {"r3"}


def test_concurrent_claims_never_return_the_same_run(
    pg_url: str, conn: psycopg.Connection[Any], schema: str
) -> None:
    n_runs, n_claimers = 40, 5
    for i in range(n_runs):
        enq(conn, schema, f"r{i:02}", f"e{i}")
        enq(conn, schema, f"r{i:02}", f"e{i}-2", terminal=i % 3 == 0)
    barrier = threading.Barrier(n_claimers)
    taken: list[tuple[str, str, str]] = []
    failures: list[BaseException] = []
    lock = threading.Lock()

    def claimer(k: int) -> None:
        try:
            with psycopg.connect(pg_url, autocommit=True) as c:
                barrier.wait(10)
                for _ in range(n_runs + 1):  # each round takes a run, or the claimer is done
                    lane = "critical" if k % 2 else "ordinary"
                    got = claim(c, schema, owner=f"o{k}", runs=3, lane=lane)
                    if not got and lane == "critical":
                        got = claim(c, schema, owner=f"o{k}", runs=3)
                    if not got:
                        return
                    with lock:
                        taken.extend((run, f"o{k}", token(got, run)) for run in got)
                raise AssertionError(f"claimer {k} still claiming after {n_runs + 1} rounds")
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=claimer, args=(k,)) for k in range(n_claimers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a claimer hung"
    assert not failures, failures
    runs = [r for r, _, _ in taken]
    assert sorted(runs) == sorted(f"r{i:02}" for i in range(n_runs))  # each exactly once
    for run, owner, tok in taken:
        row = run_row(conn, schema, run)
        assert (row["lease_owner"], str(row["lease_token"]), row["epoch"]) == (owner, tok, 1)


def test_an_expired_lease_is_claimable_again_with_a_higher_epoch_and_a_new_token(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    enq(conn, schema, "r1", "e1")
    enq(conn, schema, "r1", "e2")
    first = claim(conn, schema, ttl="50 milliseconds")
    wait_lease_expired(conn, schema, "r1")

    second = claim(conn, schema, owner="o2")

    assert seqs(second, "r1") == [1, 2]  # the same prefix, redelivered
    assert second["r1"][0]["epoch"] == first["r1"][0]["epoch"] + 1
    assert token(second, "r1") != token(first, "r1")
    row = run_row(conn, schema, "r1")
    assert (row["lease_owner"], str(row["lease_token"])) == ("o2", token(second, "r1"))


def test_the_critical_lane_takes_only_runs_with_a_pending_terminal_event(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    enq(conn, schema, "plain", "p1")
    enq(conn, schema, "plain", "p2")
    enq(conn, schema, "ending", "x1")
    enq(conn, schema, "ending", "x2", terminal=True)

    critical = claim(conn, schema, lane="critical", batch=1)
    assert set(critical) == {"ending"}
    # the whole run is critical work, even while the terminal event is beyond this batch
    assert seqs(critical, "ending") == [1]
    assert critical["ending"][0]["critical"] is True
    assert claim(conn, schema, lane="critical") == {}

    ordinary = claim(conn, schema)
    assert set(ordinary) == {"plain"}
    assert ordinary["plain"][0]["critical"] is False

    # work-conserving: the ordinary lane takes critical runs too
    assert call(conn, schema, "release", "ending", token(critical, "ending")) == [(True,)]
    again = claim(conn, schema)
    assert set(again) == {"ending"}
    assert again["ending"][0]["critical"] is True
    assert seqs(again, "ending") == [1, 2]

    # once the terminal event is delivered, the run is no longer critical work
    ack(conn, schema, ("ending", token(again, "ending"), 2))
    enq(conn, schema, "plain2", "q1")
    assert claim(conn, schema, lane="critical") == {}


def test_a_targeted_claim_takes_only_its_run(conn: psycopg.Connection[Any], schema: str) -> None:
    enq(conn, schema, "other", "o1")
    enq(conn, schema, "r1", "e1", terminal=True)
    got = claim(conn, schema, lane="critical", run_id="r1")
    assert set(got) == {"r1"}
    assert claim(conn, schema, lane="critical", run_id="r1") == {}  # leased
    tok = token(got, "r1")
    # released without an error but with a delay: a targeted drain does not wait for it ...
    assert call(conn, schema, "release", "r1", tok, "1 hour") == [(True,)]
    assert claim(conn, schema, lane="critical") == {}
    got = claim(conn, schema, lane="critical", run_id="r1")
    assert set(got) == {"r1"}
    # ... but it honours the backoff after a failed attempt
    assert call(conn, schema, "release", "r1", token(got, "r1"), "1 hour", "boom", 503) == [(True,)]
    assert claim(conn, schema, lane="critical", run_id="r1") == {}
    assert set(claim(conn, schema)) == {"other"}


# --- renew, release, fencing ------------------------------------------------------------------


def test_renew_extends_only_a_live_lease_with_its_token(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    enq(conn, schema, "r1", "e1")
    enq(conn, schema, "r2", "e1b")
    got = claim(conn, schema, ttl="1 minute")
    before = run_row(conn, schema, "r1")["lease_expires_at"]
    renewed = call(
        conn,
        schema,
        "renew",
        ["r1", "r2"],
        [token(got, "r1"), str(uuid.uuid4())],
        "10 minutes",
    )
    assert [r[0] for r in renewed] == ["r1"]
    row = run_row(conn, schema, "r1")
    assert row["lease_expires_at"] == renewed[0][1] > before
    assert row["next_attempt_at"] >= row["lease_expires_at"]


# A batch with an engine wake is acked one by one, a plain one set-based: both are fenced.
WAKE_OR_PLAIN = pytest.mark.parametrize("wake", [True, False], ids=["engine-wake", "plain"])


@WAKE_OR_PLAIN
def test_stale_token_renew_release_fail_and_ack_change_nothing(
    conn: psycopg.Connection[Any], schema: str, queue: str, inbox: Inbox, wake: bool
) -> None:
    enq(conn, schema, "r1", "e1", wake=(queue, "w:e1") if wake else None)
    enq(conn, schema, "r1", "e2")
    old = claim(conn, schema, ttl="50 milliseconds")
    wait_lease_expired(conn, schema, "r1")
    new = claim(conn, schema, owner="o2")
    stale = token(old, "r1")
    assert stale != token(new, "r1")
    before = snapshot(conn, schema)
    inbox.received()

    assert call(conn, schema, "renew", ["r1"], [stale], "1 hour") == []
    assert call(conn, schema, "release", "r1", stale, "1 hour", "boom", 500, 1, 2) == [(False,)]
    assert call(conn, schema, "fail_event", "r1", stale, 1, 422, "poison") == [(False,)]
    result = ack(conn, schema, ("r1", stale, 2))
    assert [(r["run_id"], r["status"], r["acked"]) for r in result] == [("r1", "stale", 0)]

    assert snapshot(conn, schema) == before
    assert engine_events(conn, queue) == {}
    assert inbox.received() == []
    # the current owner is unaffected
    assert [r[0] for r in call(conn, schema, "renew", ["r1"], [token(new, "r1")], "1 hour")] == [
        "r1"
    ]


@WAKE_OR_PLAIN
def test_ack_with_an_expired_lease_that_was_not_replaced_changes_nothing(
    conn: psycopg.Connection[Any], schema: str, queue: str, inbox: Inbox, wake: bool
) -> None:
    enq(conn, schema, "r1", "e1", wake=(queue, "w:e1") if wake else None)
    got = claim(conn, schema, ttl="50 milliseconds")
    wait_lease_expired(conn, schema, "r1")
    before = snapshot(conn, schema)
    inbox.received()

    assert call(conn, schema, "renew", ["r1"], [token(got, "r1")], "1 hour") == []
    result = ack(conn, schema, ("r1", token(got, "r1"), 1))

    assert [r["status"] for r in result] == ["stale"]
    assert snapshot(conn, schema) == before
    assert engine_events(conn, queue) == {}
    assert inbox.received() == []


def test_release_gives_the_lease_back_and_counts_a_failed_attempt(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    for i in range(3):
        enq(conn, schema, "r1", f"e{i}")
    got = claim(conn, schema)
    assert call(
        conn, schema, "release", "r1", token(got, "r1"), "1 hour", "HTTP 503", 503, 1, 2
    ) == [(True,)]
    row = run_row(conn, schema, "r1")
    assert (row["lease_owner"], row["lease_token"], row["lease_expires_at"]) == (None, None, None)
    # The failed attempt is the run's (schema version 7): its head's attempts, status and
    # error live on the run, and no event row is written.
    assert (row["attempts"], row["last_status"], row["last_error"]) == (1, 503, "HTTP 503")
    assert [
        (e["state"], e["attempts"], e["last_status"]) for e in event_rows(conn, schema, "r1")
    ] == [("pending", 0, None)] * 3
    assert claim(conn, schema) == {}  # backing off
    # a released token is stale from then on
    assert call(conn, schema, "release", "r1", token(got, "r1")) == [(False,)]


# --- ack --------------------------------------------------------------------------------------


def test_ack_marks_only_events_up_to_upto(conn: psycopg.Connection[Any], schema: str) -> None:
    for i in range(5):
        enq(conn, schema, "r1", f"e{i}")
    got = claim(conn, schema)
    assert seqs(got, "r1") == [1, 2, 3, 4, 5]

    result = ack(conn, schema, ("r1", token(got, "r1"), 3))

    assert len(result) == 1
    r = result[0]
    assert (r["run_id"], r["status"], r["acked"], r["last_seq"], r["error"]) == (
        "r1",
        "acked",
        3,
        3,
        None,
    )
    assert r["lag_seconds"] >= 0
    events = event_rows(conn, schema, "r1")
    assert [e["state"] for e in events] == ["delivered"] * 3 + ["pending"] * 2
    for e in events[:3]:
        assert e["delivered_at"] is not None
        assert e["done_at"] == e["delivered_at"]
        # attempts count failed attempts (event_failures, schema version 7): a delivery adds none
        assert e["attempts"] == 0
    for e in events[3:]:
        assert (e["delivered_at"], e["done_at"], e["attempts"]) == (None, None, 0)
    row = run_row(conn, schema, "r1")
    assert (row["lease_owner"], row["lease_token"], row["idle"]) == (None, None, False)
    # the rest is claimable at once, by a new lease
    again = claim(conn, schema)
    assert seqs(again, "r1") == [4, 5]
    assert again["r1"][0]["epoch"] == 2


def test_an_ack_with_keep_holds_the_lease(conn: psycopg.Connection[Any], schema: str) -> None:
    for i in range(3):
        enq(conn, schema, "r1", f"e{i}")
    got = claim(conn, schema)
    leased = run_row(conn, schema, "r1")

    result = ack(conn, schema, ("r1", token(got, "r1"), 1), keep=True)

    assert [(r["status"], r["acked"], r["last_seq"]) for r in result] == [("acked", 1, 1)]
    assert states(conn, schema, "r1") == [(1, "delivered"), (2, "pending"), (3, "pending")]
    row = run_row(conn, schema, "r1")
    for column in ("lease_owner", "lease_token", "lease_expires_at", "epoch", "next_attempt_at"):
        assert row[column] == leased[column], column
    assert claim(conn, schema, owner="o2") == {}
    # the same lease goes on: renew and ack the rest, which releases it
    assert [r[0] for r in call(conn, schema, "renew", ["r1"], [token(got, "r1")], "1 minute")] == [
        "r1"
    ]
    result = ack(conn, schema, ("r1", token(got, "r1"), 3))
    assert [(r["status"], r["acked"], r["last_seq"]) for r in result] == [("acked", 2, 3)]
    row = run_row(conn, schema, "r1")
    assert (row["lease_token"], row["idle"]) == (None, True)


def test_ack_emits_the_engine_wake_and_notifies(
    conn: psycopg.Connection[Any], schema: str, queue: str, inbox: Inbox
) -> None:
    # An Absurd task sleeping on the event the ack will emit.
    task_id, absurd_run = conn.execute(
        "select task_id, run_id from absurd.spawn_task(%s, 'job', '{}'::jsonb)", (queue,)
    ).fetchone() or (None, None)
    assert conn.execute(
        "select run_id from absurd.claim_task(%s, 'w1', 60, 1)", (queue,)
    ).fetchall()
    suspended = conn.execute(
        "select should_suspend from absurd.await_event(%s, %s, %s, 'wait', 'run-created:r1')",
        (queue, task_id, absurd_run),
    ).fetchone()
    assert suspended == (True,)
    absurd_runs = sql.Identifier("absurd", f"r_{queue}")
    assert conn.execute(
        sql.SQL("select state from {} where run_id = %s").format(absurd_runs), (absurd_run,)
    ).fetchone() == ("sleeping",)

    enq(conn, schema, "r1", "e1", wake=(queue, "run-created:r1"))
    enq(conn, schema, "r1", "e2")
    enq(conn, schema, "r1", "e3", wake=(queue, "run-started:r1"))
    got = claim(conn, schema)
    inbox.received()

    # rolled back: no wake, nothing delivered, no notification
    with conn.transaction():
        assert [r["status"] for r in ack(conn, schema, ("r1", token(got, "r1"), 3))] == ["acked"]
        raise psycopg.Rollback()
    assert engine_events(conn, queue) == {}
    assert states(conn, schema, "r1") == [(1, "pending"), (2, "pending"), (3, "pending")]
    assert inbox.received() == []

    assert [r["status"] for r in ack(conn, schema, ("r1", token(got, "r1"), 3))] == ["acked"]

    events = {e["event_id"]: e for e in event_rows(conn, schema, "r1")}
    emitted = engine_events(conn, queue)
    assert set(emitted) == {"run-created:r1", "run-started:r1"}
    payload = emitted["run-created:r1"]
    assert payload["event_id"] == "e1"
    assert payload["run_id"] == "r1"
    delivered_at = conn.execute(
        "select %s::timestamptz = %s", (payload["delivered_at"], events["e1"]["delivered_at"])
    ).fetchone()
    assert delivered_at == (True,)
    # the sleeping task woke up
    assert conn.execute(
        sql.SQL("select state from {} where run_id = %s").format(absurd_runs), (absurd_run,)
    ).fetchone() == ("pending",)
    notes = inbox.received()
    # one outbox_delivered for the batch, and one absurd_wake per distinct queue
    assert sorted(c for c, _ in notes) == sorted([f"{schema}_terminal", "absurd_wake"])
    assert (("absurd_wake", queue)) in notes


def test_a_redelivered_event_is_not_emitted_again(
    conn: psycopg.Connection[Any], schema: str, own_queue: str, inbox: Inbox
) -> None:
    # Count every emit attempt, including ones Absurd would ignore (first write wins).
    conn.execute("create temp table emit_attempts (event_name text)")
    conn.execute(
        """
        create function pg_temp.count_emit() returns trigger language plpgsql as $$
        begin
            insert into pg_temp.emit_attempts values (new.event_name);
            return new;
        end $$"""
    )
    conn.execute(
        sql.SQL(
            "create trigger count_emit before insert on {} for each row"
            " execute function pg_temp.count_emit()"
        ).format(sql.Identifier("absurd", f"e_{own_queue}"))
    )
    enq(conn, schema, "r1", "e1", wake=(own_queue, "w:e1"))
    first = claim(conn, schema)
    assert [r["status"] for r in ack(conn, schema, ("r1", token(first, "r1"), 1))] == ["acked"]
    first_delivered = event_rows(conn, schema, "r1")[0]["delivered_at"]
    enq(conn, schema, "r1", "e2", wake=(own_queue, "w:e2"))
    second = claim(conn, schema)
    assert seqs(second, "r1") == [2]
    inbox.received()

    # The second lease's ack covers seq 1 again (upto 2): e1 is already delivered.
    result = ack(conn, schema, ("r1", token(second, "r1"), 2))

    assert [(r["status"], r["acked"], r["last_seq"]) for r in result] == [("acked", 1, 2)]
    attempts = [r[0] for r in conn.execute("select event_name from emit_attempts").fetchall()]
    assert sorted(attempts) == ["w:e1", "w:e2"]  # each emitted exactly once
    emitted = engine_events(conn, own_queue)
    assert emitted["w:e1"]["event_id"] == "e1"
    assert conn.execute(
        "select %s::timestamptz = %s", (emitted["w:e1"]["delivered_at"], first_delivered)
    ).fetchone() == (True,)
    # the run's cursor moved again: an event's delivered_at is its run's last delivery (the
    # cursor keeps no time per event), so it moved with it, while the engine kept the first
    assert event_rows(conn, schema, "r1")[0]["delivered_at"] > first_delivered
    notes = inbox.received()
    delivered = [json.loads(p) for c, p in notes if c == f"{schema}_terminal"]
    assert delivered == [
        {"kind": "outbox_delivered", "run_id": "r1", "last_seq": 2, "event_ids": ["e2"]}
    ]


def test_a_grouped_ack_acks_the_good_batch_and_skips_the_stale_one(
    conn: psycopg.Connection[Any], schema: str, queue: str, inbox: Inbox
) -> None:
    enq(conn, schema, "stale", "s1", wake=(queue, "w:s1"))
    enq(conn, schema, "good", "g1", wake=(queue, "w:g1"))
    enq(conn, schema, "good", "g2")
    old = claim(conn, schema, ttl="50 milliseconds", runs=1)
    assert set(old) == {"stale"}
    good = claim(conn, schema, runs=1)
    assert set(good) == {"good"}
    wait_lease_expired(conn, schema, "stale")
    new = claim(conn, schema, owner="o2")
    assert set(new) == {"stale"}
    stale_before = (run_row(conn, schema, "stale"), event_rows(conn, schema, "stale"))
    inbox.received()

    result = ack(conn, schema, ("stale", token(old, "stale"), 1), ("good", token(good, "good"), 2))

    assert [(r["run_id"], r["status"], r["acked"]) for r in result] == [
        ("stale", "stale", 0),
        ("good", "acked", 2),
    ]
    assert (run_row(conn, schema, "stale"), event_rows(conn, schema, "stale")) == stale_before
    assert states(conn, schema, "good") == [(1, "delivered"), (2, "delivered")]
    assert set(engine_events(conn, queue)) == {"w:g1"}
    notes = inbox.received()
    delivered = [json.loads(p) for c, p in notes if c == f"{schema}_terminal"]
    assert [d["run_id"] for d in delivered] == ["good"]


def test_one_ack_call_answers_every_kind_of_batch_in_order(
    conn: psycopg.Connection[Any], schema: str, queue: str, inbox: Inbox
) -> None:
    """Plain batches take a set-based path and the rest (stale, keep, an engine wake, a run
    named twice) the per-batch one: one call mixing them all answers each batch, in input
    order, exactly as if the batches had been acked one after another."""
    enq(conn, schema, "s", "s1")  # the oldest due: claimed first
    for run in ("a", "b", "k", "d"):
        enq(conn, schema, run, f"{run}1")
        enq(conn, schema, run, f"{run}2")
    enq(conn, schema, "w", "w1", wake=(queue, "w:w1"))
    old = claim(conn, schema, ttl="50 milliseconds", runs=1)
    assert set(old) == {"s"}
    got = claim(conn, schema)
    assert set(got) == {"a", "b", "k", "d", "w"}
    wait_lease_expired(conn, schema, "s")
    assert set(claim(conn, schema, owner="o2")) == {"s"}
    kept = run_row(conn, schema, "k")
    inbox.received()

    def item(run: str, upto: int, **more: Any) -> dict[str, Any]:
        return {"run_id": run, "token": token(got, run), "upto": upto, **more}

    batches = [
        item("a", 2),
        {"run_id": "s", "token": token(old, "s"), "upto": 1},
        item("k", 1, keep=True),
        item("w", 1),
        item("d", 1),
        item("d", 2),  # the first "d" released the lease: this one is stale
        item("b", 1),
    ]
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(sql.SQL("select * from {}(%s)").format(fn(schema, "ack")), (Jsonb(batches),))
        result = cur.fetchall()

    assert [(r["run_id"], r["status"], r["acked"], r["last_seq"]) for r in result] == [
        ("a", "acked", 2, 2),
        ("s", "stale", 0, None),
        ("k", "acked", 1, 1),
        ("w", "acked", 1, 1),
        ("d", "acked", 1, 1),
        ("d", "stale", 0, None),
        ("b", "acked", 1, 1),
    ]
    assert all(r["lag_seconds"] >= 0 for r in result if r["status"] == "acked")
    assert states(conn, schema, "a") == [(1, "delivered"), (2, "delivered")]
    assert states(conn, schema, "s") == [(1, "pending")]
    assert states(conn, schema, "k") == [(1, "delivered"), (2, "pending")]
    assert states(conn, schema, "d") == [(1, "delivered"), (2, "pending")]
    assert states(conn, schema, "b") == [(1, "delivered"), (2, "pending")]
    assert set(engine_events(conn, queue)) == {"w:w1"}
    rows = {r: run_row(conn, schema, r) for r in ("a", "b", "k", "d", "w", "s")}
    assert rows["k"]["lease_token"] == kept["lease_token"]  # keep: still leased
    assert rows["s"]["lease_owner"] == "o2"  # the stale batch changed nothing
    for run in ("a", "b", "d", "w"):
        assert rows[run]["lease_token"] is None, run
    assert (rows["a"]["idle"], rows["w"]["idle"], rows["b"]["idle"]) == (True, True, False)
    notes = inbox.received()
    delivered = sorted(
        (d["run_id"], d["last_seq"], tuple(d["event_ids"]))
        for d in (json.loads(p) for c, p in notes if c == f"{schema}_terminal")
    )
    assert delivered == [
        ("a", 2, ("a1", "a2")),
        ("b", 1, ("b1",)),
        ("d", 1, ("d1",)),
        ("k", 1, ("k1",)),
        ("w", 1, ("w1",)),
    ]
    assert ("absurd_wake", queue) in notes
    # what is left is claimable at once, the kept run excepted
    assert set(claim(conn, schema, owner="o3")) == {"b", "d"}


def test_outbox_delivered_notification_carries_run_seq_and_ids(
    conn: psycopg.Connection[Any], schema: str, inbox: Inbox
) -> None:
    for i in range(3):
        enq(conn, schema, "r1", f"e{i}")
    long_ids = [f"{i:03}-" + "x" * 190 for i in range(60)]  # > 8,000 bytes of ids
    for event_id in long_ids:
        enq(conn, schema, "r2", event_id)
    enq(conn, schema, "r2", "end", terminal=True)
    got = claim(conn, schema)
    inbox.received()

    ack(conn, schema, ("r1", token(got, "r1"), 3), ("r2", token(got, "r2"), 61))

    notes = [json.loads(p) for c, p in inbox.received() if c == f"{schema}_terminal"]
    assert notes[0] == {
        "kind": "outbox_delivered",
        "run_id": "r1",
        "last_seq": 3,
        "event_ids": ["e0", "e1", "e2"],
    }
    # too long for NOTIFY with the ids: they are dropped, the rest stays
    assert notes[1] == {"kind": "outbox_delivered", "run_id": "r2", "last_seq": 61}
    assert len(notes) == 2


def test_an_engine_that_rejects_a_wake_fails_that_event_and_blocks_its_run(
    conn: psycopg.Connection[Any], schema: str, own_queue: str, queue: str, inbox: Inbox
) -> None:
    enq(conn, schema, "r1", "e1")
    enq(conn, schema, "r1", "e2", wake=(queue, "w:e2"))
    enq(conn, schema, "r1", "e3", wake=(own_queue, "w:e3"))
    enq(conn, schema, "r1", "e4", wake=(queue, "w:e4"))
    enq(conn, schema, "r1", "e5")
    enq(conn, schema, "ok", "k1", wake=(queue, "w:k1"))
    got = claim(conn, schema)
    conn.execute("select absurd.drop_queue(%s)", (own_queue,))
    inbox.received()

    result = ack(conn, schema, ("r1", token(got, "r1"), 5), ("ok", token(got, "ok"), 1))

    by_run = {r["run_id"]: r for r in result}
    failed = by_run["r1"]
    assert (failed["status"], failed["acked"], failed["last_seq"]) == ("failed", 2, 2)
    assert "engine wake failed" in failed["error"]
    assert "does not exist" in failed["error"]
    assert by_run["ok"]["status"] == "acked"

    events = event_rows(conn, schema, "r1")
    assert [e["state"] for e in events] == [
        "delivered",
        "delivered",
        "failed",
        "pending",
        "pending",
    ]
    e3 = events[2]
    assert e3["last_error"] == failed["error"]
    assert e3["failed_at"] is not None
    assert (e3["delivered_at"], e3["done_at"]) == (None, None)
    for e in events[3:]:
        assert (e["delivered_at"], e["done_at"], e["attempts"]) == (None, None, 0)
    row = run_row(conn, schema, "r1")
    assert row["blocked_seq"] == 3
    assert (row["lease_owner"], row["lease_token"], row["lease_expires_at"]) == (None, None, None)
    assert row["last_error"] == failed["error"]
    # wakes of the delivered events happened; the one after the failure did not
    assert set(engine_events(conn, queue)) == {"w:e2", "w:k1"}
    notes = [json.loads(p) for c, p in inbox.received() if c == f"{schema}_terminal"]
    assert {n["run_id"]: n for n in notes}["r1"] == {
        "kind": "outbox_delivered",
        "run_id": "r1",
        "last_seq": 2,
        "event_ids": ["e1", "e2"],
    }
    # a blocked run is claimed by nobody
    assert claim(conn, schema) == {}
    assert claim(conn, schema, lane="critical") == {}
    assert claim(conn, schema, run_id="r1") == {}


def test_a_transient_engine_error_fails_the_ack_instead_of_blocking_the_run(
    pg_url: str, conn: psycopg.Connection[Any], schema: str, queue: str
) -> None:
    """A lock wait in the engine that hits the relay's lock_timeout is not a deterministic
    rejection: the ack raises (the batch is retried later), nothing is failed or blocked."""
    enq(conn, schema, "r1", "e1", wake=(queue, "w:e1"))
    got = claim(conn, schema)
    before = snapshot(conn, schema)
    with psycopg.connect(pg_url) as other:
        # An uncommitted insert of the same event name (what await_event does) makes the
        # engine's insert wait.
        other.execute(
            sql.SQL("insert into {} (event_name, payload) values ('w:e1', null)").format(
                sql.Identifier("absurd", f"e_{queue}")
            )
        )
        with pytest.raises(errors.LockNotAvailable), conn.transaction():
            conn.execute("set local lock_timeout = '100ms'")
            ack(conn, schema, ("r1", token(got, "r1"), 1))
        other.rollback()
    assert snapshot(conn, schema) == before
    assert [r["status"] for r in ack(conn, schema, ("r1", token(got, "r1"), 1))] == ["acked"]
    assert set(engine_events(conn, queue)) == {"w:e1"}


def test_fail_event_blocks_the_run_until_an_operator_acts(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    for i in range(3):
        enq(conn, schema, "bad", f"b{i}", terminal=i == 2)
    enq(conn, schema, "fine", "f1")
    bad = claim(conn, schema, run_id="bad", ttl="50 milliseconds")
    got = claim(conn, schema, run_id="fine")
    assert call(conn, schema, "fail_event", "bad", token(bad, "bad"), 1, 422, "HTTP 422: nope") == [
        (True,)
    ]
    assert [r["status"] for r in ack(conn, schema, ("fine", token(got, "fine"), 1))] == ["acked"]
    row = run_row(conn, schema, "bad")
    assert (row["blocked_seq"], row["lease_token"]) == (1, None)
    assert [(e["state"], e["last_status"]) for e in event_rows(conn, schema, "bad")] == [
        ("failed", 422),
        ("pending", None),
        ("pending", None),
    ]
    # never claimed, on any lane, even with a pending terminal event, even once due
    wait_due(conn, schema, "bad")
    enq(conn, schema, "fine", "f2")
    assert set(claim(conn, schema)) == {"fine"}
    assert claim(conn, schema, lane="critical") == {}
    assert claim(conn, schema, lane="critical", run_id="bad") == {}


# --- settling -----------------------------------------------------------------------------------


def test_a_run_goes_idle_after_its_last_ack_and_wakes_on_a_new_enqueue(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    enq(conn, schema, "r1", "e1")
    got = claim(conn, schema)
    ack(conn, schema, ("r1", token(got, "r1"), 1))
    row = run_row(conn, schema, "r1")
    assert row["idle"] is True
    assert claim(conn, schema) == {}
    assert claim(conn, schema, run_id="r1") == {}

    enq(conn, schema, "r1", "e2")

    assert run_row(conn, schema, "r1")["idle"] is False
    again = claim(conn, schema)
    assert seqs(again, "r1") == [2]
    assert again["r1"][0]["epoch"] == 2


def test_an_ack_racing_a_producer_never_strands_its_event(
    pg_url: str, conn: psycopg.Connection[Any], schema: str
) -> None:
    """The ack's settle runs while a producer is between its enqueue and its commit: the run
    must not go idle, or the producer's event would never be claimed."""
    enq(conn, schema, "r1", "e1")
    got = claim(conn, schema)
    with psycopg.connect(pg_url) as producer:
        with producer.transaction():
            enq(producer, schema, "r1", "e2")
            assert [r["status"] for r in ack(conn, schema, ("r1", token(got, "r1"), 1))] == [
                "acked"
            ]
            assert run_row(conn, schema, "r1")["idle"] is False
        wait_due(conn, schema, "r1")
        again = claim(conn, schema)
        assert seqs(again, "r1") == [2]

        # and when the producer rolls back instead, the run settles on the next claim
        ack(conn, schema, ("r1", token(again, "r1"), 2))  # idle now
        enq(conn, schema, "r1", "e3")
        third = claim(conn, schema)
        with producer.transaction():
            enq(producer, schema, "r1", "e4")
            ack(conn, schema, ("r1", token(third, "r1"), 3))
            raise psycopg.Rollback()
    assert run_row(conn, schema, "r1")["idle"] is False
    wait_due(conn, schema, "r1")
    assert claim(conn, schema) == {}
    row = run_row(conn, schema, "r1")
    assert (row["idle"], row["lease_token"]) == (True, None)


# --- prune --------------------------------------------------------------------------------------


def age_parts(conn: psycopg.Connection[Any], schema: str, by: str = "2 days") -> None:
    """As if `by` had passed since the outbox's parts opened and closed (schema version 8)."""
    conn.execute(
        sql.SQL(
            "update {} set opened_at = opened_at - %(by)s::interval,"
            " closed_at = closed_at - %(by)s::interval"
        ).format(fn(schema, "outbox_parts")),
        {"by": by},
    )


def current_part(conn: psycopg.Connection[Any], schema: str) -> int:
    row = conn.execute(
        sql.SQL("select part from {} where current").format(fn(schema, "outbox_parts"))
    ).fetchone()
    assert row is not None
    return int(row[0])


def parts(conn: psycopg.Connection[Any], schema: str) -> dict[str, int]:
    """event id -> the part of the outbox it is in."""
    rows = conn.execute(sql.SQL("select event_id, part from {}").format(fn(schema, "outbox")))
    return {event_id: part for event_id, part in rows.fetchall()}


def test_prune_empties_a_part_past_retention_and_keeps_what_is_not_done(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    """DESIGN §4.4 with the outbox in three parts that take turns (0008): a part is emptied
    once it closed more than `retention` ago; its events that are not done move to the current
    part first (at most p_limit a call), the rest goes with its skip history; younger parts
    are kept whole."""
    for i in range(4):
        enq(conn, schema, "r1", f"e{i}")
    enq(conn, schema, "r2", "f1")
    enq(conn, schema, "r3", "g1")
    got = claim(conn, schema)
    ack(conn, schema, ("r1", token(got, "r1"), 2))  # e0, e1 delivered
    call(conn, schema, "fail_event", "r2", token(got, "r2"), 1, 400, "bad")
    call(conn, schema, "fail_event", "r3", token(got, "r3"), 1, 400, "bad")
    call(conn, schema, "skip_event", "g1", "op", "not needed")
    assert set(parts(conn, schema).values()) == {0}

    assert call(conn, schema, "prune", "1 day", 100) == [(0,)]  # part 0 is current and young
    assert current_part(conn, schema) == 0
    age_parts(conn, schema)
    assert call(conn, schema, "prune", "1 day", 100) == [(0,)]  # part 1 takes over
    assert current_part(conn, schema) == 1
    enq(conn, schema, "r4", "y1")  # young, and delivered
    ack(conn, schema, ("r4", token(claim(conn, schema, run_id="r4"), "r4"), 1))
    assert parts(conn, schema)["y1"] == 1
    age_parts(conn, schema, "13 hours")  # part 0 closed 13 hours ago: not past retention yet
    assert call(conn, schema, "prune", "1 day", 100) == [(0,)]  # part 2 takes over
    assert current_part(conn, schema) == 2
    age_parts(conn, schema, "12 hours")  # part 0 closed 25 hours ago, part 1 12 hours ago

    assert call(conn, schema, "prune", "1 day", 1) == [(0,)]  # one of three moved: not yet
    assert call(conn, schema, "prune", "1 day", 100) == [(3,)]  # e0, e1, g1
    assert call(conn, schema, "prune", "1 day", 100) == [(0,)]

    remaining = {
        e["event_id"]: e["state"]
        for r in ("r1", "r2", "r3", "r4")
        for e in event_rows(conn, schema, r)
    }
    # young delivered, pending and failed (until an operator acts) are kept
    assert remaining == {
        "e2": "pending", "e3": "pending", "f1": "failed", "y1": "delivered"
    }  # fmt: skip
    assert parts(conn, schema) == {"e2": 2, "e3": 2, "f1": 2, "y1": 1}
    # the skip of g1 went with it; f1's failure stays while f1 does
    history = conn.execute(
        sql.SQL("select (select count(*) from {}), (select count(*) from {})").format(
            fn(schema, "event_skips"), fn(schema, "event_failures")
        )
    ).fetchone()
    assert history == (0, 1)
    # what moved is delivered as it was: in its run's order, after its cursor
    assert seqs(claim(conn, schema, run_id="r1"), "r1") == [3, 4]


def set_part_lock_timeout(conn: psycopg.Connection[Any], schema: str, timeout: str) -> None:
    conn.execute(
        sql.SQL("update {} set value = %s where key = 'outbox_part_lock_timeout'").format(
            fn(schema, "settings")
        ),
        (timeout,),
    )


def test_a_part_is_emptied_only_with_every_event_committed_into_it_done(
    conn: psycopg.Connection[Any], schema: str, pg_url: str
) -> None:
    """A writer that bypasses enqueue (an insert that names part 0) may commit into the part
    after retention looked for the events that are not done: retention waits for the part's
    lock (which that transaction holds), then looks again, and truncates nothing pending.
    (Enqueue itself stops writing a part before it closes: the tests below.)"""
    set_part_lock_timeout(conn, schema, "30s")
    enq(conn, schema, "r1", "e1")
    ack(conn, schema, ("r1", token(claim(conn, schema), "r1"), 1))
    age_parts(conn, schema)
    assert call(conn, schema, "prune", "1 day", 100) == [(0,)]  # part 1 is current now
    age_parts(conn, schema)  # the next prune makes part 2 current, then empties part 0
    with psycopg.connect(pg_url) as writer:  # one open transaction
        writer.execute(
            sql.SQL(
                "insert into {} (run_id, seq, event_id, event_type, payload, part)"
                " values ('late', 1, 'late-1', 't', '{{}}', 0)"
            ).format(fn(schema, "outbox"))
        )
        writer.execute(
            sql.SQL("insert into {} (run_id, next_attempt_at) values ('late', now())").format(
                fn(schema, "runs")
            )
        )
        pid = conn.info.backend_pid
        retention = InThread(lambda: call(conn, schema, "prune", "1 day", 100))
        wait_until(lambda: waits_for_a_lock(pg_url, pid), 30, "retention waiting for part 0")
        writer.commit()
    assert retention.result() == [(0,)]  # late-1 is pending: part 0 stays
    assert parts(conn, schema) == {"e1": 0, "late-1": 0}
    assert call(conn, schema, "prune", "1 day", 100) == [(1,)]  # moved, then e1 removed
    assert parts(conn, schema) == {"late-1": 2}
    assert seqs(claim(conn, schema, run_id="late"), "late") == [1]


def finished_or_waiting(thread: InThread, url: str, pid: int) -> bool:
    return thread.done() or waits_for_a_lock(url, pid)


def test_an_event_id_is_taken_once_across_a_rotation(
    conn: psycopg.Connection[Any], schema: str, pg_url: str
) -> None:
    """DESIGN §2: an event id is unique across the outbox's parts. Two runs are given the same
    id by producers on either side of a rotation: the rotation waits for the first producer's
    commit and holds the second back until it has rotated, so the second one's lookup sees the
    first's event and is refused. Each part's unique index sees only its own events: without
    the hold, both would be taken, in two parts."""
    set_part_lock_timeout(conn, schema, "30s")
    age_parts(conn, schema)  # part 0 has been current long enough: the next prune rotates
    with (
        psycopg.connect(pg_url) as first,
        psycopg.connect(pg_url, autocommit=True) as second,
    ):
        enq(first, schema, "r1", "shared")  # into part 0, not committed yet
        rotation = InThread(lambda: call(conn, schema, "prune", "1 day", 100))
        wait_until(
            lambda: finished_or_waiting(rotation, pg_url, conn.info.backend_pid),
            30,
            "the rotation, done or waiting",
        )
        taken = InThread(lambda: enq(second, schema, "r2", "shared"))
        wait_until(
            lambda: finished_or_waiting(taken, pg_url, second.info.backend_pid),
            30,
            "the second producer, done or waiting",
        )
        first.commit()
        assert rotation.result() == [(0,)]
        with pytest.raises(errors.UniqueViolation, match="already taken by another run"):
            taken.result()
    assert current_part(conn, schema) == 1
    assert parts(conn, schema) == {"shared": 0}
    assert [e["event_id"] for e in event_rows(conn, schema, "r1")] == ["shared"]


def test_a_repeatable_read_producer_older_than_a_rotation_is_refused(
    conn: psycopg.Connection[Any], schema: str, pg_url: str
) -> None:
    """A producer under repeatable read whose snapshot predates a rotation it did not wait for
    (its transaction began before, and enqueues after) would see the old part as current and
    miss what was committed since: it fails with a serialization error (retry) rather than take
    an event id another run took in the new part."""
    age_parts(conn, schema)
    with psycopg.connect(pg_url) as old:
        old.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        old.execute("select 1")  # its snapshot: part 0 is current
        assert call(conn, schema, "prune", "1 day", 100) == [(0,)]
        assert current_part(conn, schema) == 1
        enq(conn, schema, "r1", "shared")  # into part 1, committed
        with pytest.raises(errors.SerializationFailure):
            enq(old, schema, "r2", "shared")
        old.rollback()
    assert parts(conn, schema) == {"shared": 1}
    # a new transaction at the same level sees the new part, and the id taken
    with psycopg.connect(pg_url) as new:
        new.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        with pytest.raises(errors.UniqueViolation, match="already taken by another run"):
            enq(new, schema, "r2", "shared")
        new.rollback()
        enq(new, schema, "r2", "own")
        new.commit()
    assert parts(conn, schema) == {"shared": 1, "own": 1}


def test_a_producer_still_writing_holds_a_rotation_back_for_a_bounded_wait(
    conn: psycopg.Connection[Any], schema: str, pg_url: str
) -> None:
    """Retention rotates the parts only with no producer transaction still writing the current
    one: it waits for that at most `outbox_part_lock_timeout`, leaves the parts as they are,
    and rotates at a later call, once the producer committed."""
    set_part_lock_timeout(conn, schema, "50ms")
    age_parts(conn, schema)
    with psycopg.connect(pg_url) as producer:
        enq(producer, schema, "r1", "e1")
        assert call(conn, schema, "prune", "1 day", 100) == [(0,)]
        assert current_part(conn, schema) == 0  # not rotated: the producer still writes part 0
        enq(producer, schema, "r1", "e2")  # and it was not held up
        producer.commit()
    assert call(conn, schema, "prune", "1 day", 100) == [(0,)]
    assert current_part(conn, schema) == 1
    assert parts(conn, schema) == {"e1": 0, "e2": 0}


def prune_waited(conn: psycopg.Connection[Any], schema: str, url: str) -> bool:
    """Runs prune on `conn` and says whether it waited for a lock while it ran (sampled until it
    returns; its caller makes a wait last long enough to be seen, `outbox_part_lock_timeout`).
    A producer that enqueues while prune waits for the rotation's hold queues behind it: each
    such wait is a stall of the producers."""
    pid = conn.info.backend_pid
    pruning = InThread(lambda: call(conn, schema, "prune", "1 day", 100))
    waited = False
    while not pruning.done():
        waited = waits_for_a_lock(url, pid) or waited
    pruning.result()
    return waited


def age_rotation_wait(conn: psycopg.Connection[Any], schema: str, seconds: int) -> None:
    """As if the last wait of a held-back rotation for the producers were `seconds` older."""
    conn.execute(
        sql.SQL(
            "update {} set value = (value::double precision - %s)::text"
            " where key = 'outbox_rotation_waited_at'"
        ).format(fn(schema, "settings")),
        (seconds,),
    )


def test_a_held_back_rotation_stalls_producers_once_not_at_every_prune(
    conn: psycopg.Connection[Any], schema: str, pg_url: str
) -> None:
    """While an open producer transaction holds a due rotation back, the first prune waits for
    it (at most `outbox_part_lock_timeout`, and producers queue behind that wait); the prunes
    after it, of this replica or any other, try the hold without waiting until
    `outbox_rotation_wait_every` has passed (issue 41: every prune stalled producers ~200 ms).
    Waits are counted, not timed: each is made long here so that none goes unseen."""
    set_part_lock_timeout(conn, schema, "2s")
    age_parts(conn, schema)  # part 0 has been current long enough: a rotation is due
    with psycopg.connect(pg_url) as producer, psycopg.connect(pg_url, autocommit=True) as other:
        enq(producer, schema, "r1", "e1")  # open: holds part 0, and the rotation back
        assert prune_waited(conn, schema, pg_url)  # waits in vain
        assert not prune_waited(conn, schema, pg_url)  # the next prune: no wait
        assert not prune_waited(other, schema, pg_url)  # nor another replica's
        assert current_part(conn, schema) == 0
        # once the window has passed, a held-back rotation waits again, once
        age_rotation_wait(conn, schema, 5 * 60)
        assert prune_waited(other, schema, pg_url)
        assert not prune_waited(conn, schema, pg_url)
        enq(producer, schema, "r1", "e2")
        producer.commit()
    # the producer gone, the hold is taken at once (within the window: no wait needed)
    assert not prune_waited(conn, schema, pg_url)
    assert current_part(conn, schema) == 1
    assert parts(conn, schema) == {"e1": 0, "e2": 0}


def test_prune_keeps_seqs_and_epochs_monotonic_per_run(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    """Pruning an idle run must not reset its seq counter or its epoch: the ingress receives
    the epoch as a fencing token and may reject lower ones (the reference sink answers 409,
    which the relay takes as "already have it" and acks: a lost event)."""
    for name in ("open", "done"):
        for i in range(2):
            enq(conn, schema, name, f"{name}{i}")
            got = claim(conn, schema, run_id=name)
            ack(conn, schema, (name, token(got, name), i + 1))
    enq(conn, schema, "done", "done-end", terminal=True)
    got = claim(conn, schema, run_id="done")
    ack(conn, schema, ("done", token(got, "done"), 3))
    assert [run_row(conn, schema, r)["epoch"] for r in ("open", "done")] == [2, 3]
    assert run_row(conn, schema, "open")["idle"] is True
    conn.execute(
        sql.SQL("update {} set updated_at = updated_at - interval '2 days'").format(
            fn(schema, "runs")
        )
    )

    # a retention of 0 takes every part in turn: every done event goes in one call
    assert call(conn, schema, "prune", "0", 100) == [(5,)]

    assert conn.execute(
        sql.SQL("select count(*) from {}").format(fn(schema, "events"))
    ).fetchone() == (0,)
    # An open run comes back with its seqs and epochs going on.
    assert enq(conn, schema, "open", "open-later") == 3
    again = claim(conn, schema)
    assert seqs(again, "open") == [3]
    assert again["open"][0]["epoch"] == 3
    # A finished run may be forgotten: nothing can be enqueued into it any more.
    with pytest.raises(errors.ObjectNotInPrerequisiteState):
        enq(conn, schema, "done", "done-later")
    assert conn.execute(
        sql.SQL("select run_id from {} order by run_id").format(fn(schema, "runs"))
    ).fetchall() == [("open",)]


# --- claim cost does not grow with the backlog --------------------------------------------------


def _backlog(conn: psycopg.Connection[Any], schema: str, n: int) -> None:
    """n due runs with one pending event each, n idle runs, n leased runs, two critical."""
    statements = [
        """insert into {s}.runs (run_id, next_attempt_at)
           select 'due' || g, clock_timestamp() - interval '1 hour' + g * interval '1 ms'
           from generate_series(1, %(n)s) g""",
        """insert into {s}.runs (run_id, idle, next_attempt_at)
           select 'idle' || g, true, clock_timestamp() - interval '1 day'
           from generate_series(1, %(n)s) g""",
        """insert into {s}.runs (run_id, lease_owner, lease_token, lease_expires_at,
                                next_attempt_at, epoch)
           select 'leased' || g, 'other', gen_random_uuid(), t.until, t.until, 1
           from generate_series(1, %(n)s) g,
                (select clock_timestamp() + interval '1 hour' as until) t""",
        "insert into {s}.run_seqs (run_id, last_seq) select run_id, 1 from {s}.runs",
        """insert into {s}.outbox (run_id, seq, event_id, event_type, payload, terminal)
           select r.run_id, 1, 'ev-' || r.run_id, 't', '{{}}', r.run_id in ('due17', 'due4242')
           from {s}.runs r""",
        # the idle runs' one event is delivered: their cursors are past it
        "update {s}.runs set delivered_seq = 1, delivered_at = clock_timestamp() where idle",
        """insert into {s}.pending_terminals (run_id, seq, created_at)
           select run_id, seq, created_at from {s}.outbox where terminal""",
        "analyze {s}.runs",
        "analyze {s}.outbox",
    ]
    for statement in statements:
        query = sql.SQL(statement).format(s=sql.Identifier(schema))
        conn.execute(query, {"n": n} if "%(n)s" in statement else None)


def _claim_scans(
    conn: psycopg.Connection[Any], schema: str, lane: str
) -> tuple[dict[str, list[Row]], dict[str, tuple[int, int]]]:
    return scans(conn, schema, lambda: claim(conn, schema, runs=5, lane=lane))


def test_claim_is_index_backed_whatever_the_backlog(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    _backlog(conn, schema, 20_000)

    got, delta = _claim_scans(conn, schema, "ordinary")
    assert set(got) == {f"due{i}" for i in range(1, 6)}  # the five longest due
    assert delta["runs"][0] == 0, delta  # no sequential scan of runs
    assert delta["outbox"][0] == 0, delta  # nor of the events
    # through the key's index (schema version 9): one key here, so its due runs in order
    assert delta["runs_due_by_key"][0] >= 1, delta
    assert delta["runs_due_by_key"][1] <= 10, delta  # reads what it takes, not the backlog

    got, delta = _claim_scans(conn, schema, "critical")
    assert set(got) == {"due17", "due4242"}
    assert delta["runs"][0] == 0, delta
    assert delta["outbox"][0] == 0, delta
    # pending_terminals holds only the critical backlog (two rows here, scanned whole; through
    # pending_terminals_created_at when it is large): nothing of the ordinary backlog is read
    read = delta["pending_terminals"][1] + delta["pending_terminals_by_key"][1]
    assert 1 <= read <= 10, delta

    # The same through the planner: EXPLAIN of the ordinary pick of one key as installed.
    src = conn.execute(
        "select prosrc from pg_proc where proname = 'pick_of_keys'"
        " and pronamespace = %s::regnamespace",
        (schema,),
    ).fetchone()
    assert src is not None
    found = re.search(r"else\n\s*return query\n(.*?);\n", src[0], flags=re.S)
    assert found, "the ordinary pick (pick_of_keys) is not where this test looks for it"
    query = (
        found.group(1)
        .replace("p_keys", "array['']")
        .replace("p_quotas", "array[5]")
        .replace("p_exclude", "'{}'::text[]")
        .replace("v_moment", "now()")  # the claim's moment, a parameter there (schema v12)
    )
    with conn.transaction():
        conn.execute(
            sql.SQL("set local search_path = {}, pg_catalog").format(sql.Identifier(schema))
        )
        plan = conn.execute(sql.SQL("explain (format json) " + query)).fetchone()  # type: ignore[arg-type]
    assert plan is not None
    nodes: list[dict[str, Any]] = []

    def walk(node: dict[str, Any]) -> None:
        nodes.append(node)
        for child in node.get("Plans", []):
            walk(child)

    walk(plan[0][0]["Plan"])
    assert any(n.get("Index Name") == "runs_due_by_key" for n in nodes), nodes
    assert not any(n["Node Type"] in ("Seq Scan", "Sort", "Bitmap Heap Scan") for n in nodes), nodes

    # A dead owner's runs (issue 18) are found through runs_leased, not by scanning runs.
    src = conn.execute(
        "select prosrc from pg_proc where proname = 'pick_ordinary'"
        " and pronamespace = %s::regnamespace",
        (schema,),
    ).fetchone()
    assert src is not None
    found = re.search(r" in\n(.*?)\n\s*loop\n", src[0], flags=re.S)
    assert found, "the dead owners' pick (pick_ordinary) is not where this test looks for it"
    query = found.group(1).replace("p_runs", "5").replace("p_dead", "array['gone']::text[]")
    with conn.transaction():
        conn.execute(
            sql.SQL("set local search_path = {}, pg_catalog").format(sql.Identifier(schema))
        )
        plan = conn.execute(sql.SQL("explain (format json) " + query)).fetchone()  # type: ignore[arg-type]
    assert plan is not None
    nodes = []
    walk(plan[0][0]["Plan"])
    assert any(n.get("Index Name") == "runs_leased" for n in nodes), nodes
    assert not any(n["Node Type"] == "Seq Scan" for n in nodes), nodes


def test_the_ack_is_index_backed_whatever_the_backlog(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    """The ack and the claim run on generic plans (`plan_cache_mode = force_generic_plan` in
    their definitions: planning their statements afresh cost more than running them, per call).
    A generic plan does not see how many batches a call carries, so it must stay on the indexes
    for any count."""
    _backlog(conn, schema, 20_000)
    for size in (1, 5, 40):  # several calls on one session: the cached plans are reused
        got = claim(conn, schema, runs=size)
        assert len(got) == size
        batches = [(r, token(got, r), seqs(got, r)[-1]) for r in got]
        acked, delta = scans(conn, schema, lambda b=batches: ack(conn, schema, *b))
        assert [(a["run_id"], a["status"], a["acked"]) for a in acked] == [
            (r, "acked", 1) for r, _, _ in batches
        ]
        assert delta["runs"][0] == 0, delta  # no sequential scan of runs
        assert delta["outbox"][0] == 0, delta  # nor of the events
        read = sum(tuples for name, (_, tuples) in delta.items() if name not in ("runs", "outbox"))
        assert read <= 10 * size, delta  # reads the batches' rows, not the backlog
    for name in ("claim", "ack"):  # the claim's pick is index-backed too (the test above)
        config = conn.execute(
            "select proconfig from pg_proc where proname = %s and pronamespace = %s::regnamespace",
            (name, schema),
        ).fetchone()
        assert config is not None, name
        assert "plan_cache_mode=force_generic_plan" in (config[0] or []), (name, config)


def test_a_dead_owners_runs_are_claimed_through_runs_leased_on_the_functions_own_plan(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    """The claim's pick of a dead owner's runs (issue 18), measured on claim()'s own generic
    plan rather than on EXPLAIN of its text: through runs_leased, never a scan of runs."""
    _backlog(conn, schema, 20_000)  # 20k runs leased by 'other' for another hour
    conn.execute(sql.SQL("insert into {} (owner) values ('other')").format(fn(schema, "replicas")))
    got, delta = _claim_scans(conn, schema, "ordinary")
    assert len(got) == 5 and all(r.startswith("leased") for r in got), sorted(got)
    assert delta["runs"][0] == 0, delta  # no sequential scan of runs
    assert delta["outbox"][0] == 0, delta
    assert delta["runs_leased"][0] >= 1, delta
    # not a walk past every due run to the leased ones
    assert delta["runs_due_by_key"][1] <= 10, delta


def test_an_ack_never_moves_the_cursor_past_what_it_names_or_what_exists(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    """The cursor (schema version 7) moves up to the batch's `upto`, held to the run's last
    committed event: an `upto` beyond it, or none, cannot count events not yet written (or
    not named) as delivered."""
    for i in range(3):
        enq(conn, schema, "r1", f"e{i}")
    got = claim(conn, schema)
    tok = token(got, "r1")
    no_upto = call(conn, schema, "ack", json.dumps([{"run_id": "r1", "token": tok, "keep": True}]))
    assert [(r[1], r[2]) for r in no_upto] == [("acked", 0)]
    assert [e["state"] for e in event_rows(conn, schema, "r1")] == ["pending"] * 3
    result = ack(conn, schema, ("r1", tok, 1_000_000))
    assert [(r["status"], r["acked"], r["last_seq"]) for r in result] == [("acked", 3, 3)]
    assert run_row(conn, schema, "r1")["delivered_seq"] == 3
    # the next event, enqueued after that ack, is pending and claimed
    enq(conn, schema, "r1", "e3")
    assert [e["state"] for e in event_rows(conn, schema, "r1")][-1] == "pending"
    assert seqs(claim(conn, schema), "r1") == [4]


def test_a_grouped_ack_fences_a_batch_whose_lease_expired_and_acks_the_others(
    conn: psycopg.Connection[Any], schema: str, inbox: Inbox
) -> None:
    """An expired lease nobody replaced (its token still on the run) fences its batch in a call
    of several batches as it does alone, and the others are acked."""
    enq(conn, schema, "late", "l1")
    enq(conn, schema, "good", "g1")
    late = claim(conn, schema, ttl="50 milliseconds", runs=1)
    assert set(late) == {"late"}
    good = claim(conn, schema, runs=1)
    assert set(good) == {"good"}
    wait_lease_expired(conn, schema, "late")
    before = (run_row(conn, schema, "late"), event_rows(conn, schema, "late"))
    inbox.received()

    result = ack(conn, schema, ("late", token(late, "late"), 1), ("good", token(good, "good"), 1))

    assert [(r["run_id"], r["status"], r["acked"]) for r in result] == [
        ("late", "stale", 0),
        ("good", "acked", 1),
    ]
    assert (run_row(conn, schema, "late"), event_rows(conn, schema, "late")) == before
    delivered = [json.loads(p) for c, p in inbox.received() if c == f"{schema}_terminal"]
    assert [d["run_id"] for d in delivered] == ["good"]


def test_an_ack_below_the_cursor_moves_it_back_nowhere(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    """A late ack naming a lower `upto` than one before it (under the same lease) leaves the
    cursor where it is: what was delivered is never pending again (nor sent, nor woken again)."""
    for i in range(3):
        enq(conn, schema, "r1", f"e{i}")
    got = claim(conn, schema)
    tok = token(got, "r1")
    assert [(r["status"], r["acked"]) for r in ack(conn, schema, ("r1", tok, 3), keep=True)] == [
        ("acked", 3)
    ]

    result = ack(conn, schema, ("r1", tok, 1))

    assert [(r["status"], r["acked"], r["last_seq"]) for r in result] == [("acked", 0, None)]
    assert run_row(conn, schema, "r1")["delivered_seq"] == 3
    assert states(conn, schema, "r1") == [(1, "delivered"), (2, "delivered"), (3, "delivered")]
    assert claim(conn, schema) == {}  # nothing to send again: the run settles
    assert run_row(conn, schema, "r1")["idle"] is True


def test_the_ack_that_delivers_the_terminal_event_takes_the_run_out_of_the_critical_lane(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    """pending_terminals holds a run until the cursor passes its terminal event (schema
    version 7): the critical lane's discovery reads the critical backlog only, and a run whose
    terminal event is delivered is no longer critical work, even while it is active."""

    def pending_terminals() -> list[tuple[Any, ...]]:
        return conn.execute(
            sql.SQL("select run_id, seq from {} order by run_id").format(
                fn(schema, "pending_terminals")
            )
        ).fetchall()

    enq(conn, schema, "end", "e1")
    enq(conn, schema, "end", "e2", terminal=True)
    got = claim(conn, schema, lane="critical")
    tok = token(got, "end")
    assert pending_terminals() == [("end", 2)]
    ack(conn, schema, ("end", tok, 1), keep=True)
    assert pending_terminals() == [("end", 2)]  # not passed yet

    ack(conn, schema, ("end", tok, 2), keep=True)

    assert pending_terminals() == []
    assert call(conn, schema, "release", "end", tok) == [(True,)]
    epoch = run_row(conn, schema, "end")["epoch"]
    assert claim(conn, schema, lane="critical") == {}
    assert run_row(conn, schema, "end")["epoch"] == epoch  # not taken by the critical lane
