"""Migration 0007 (issue 28, schema version 7: the delivery cursor) moves a live database of the
previous release in place. That release (tests/upgrade/BEFORE_CURSOR, one from before schema
v7, built from git history) makes the schema and, through its own functions, a history of many
runs in every state: delivered, pending, failed (blocked), failed then skipped, failed then
retried, pending and delivered terminal events, and delivered events its retention removed.
Then this release's `relay migrate`:
- every event keeps its state (the `events` view computes it from the cursor now), and the
  failed and skipped events keep their history (status, error, attempts, who retried or skipped
  and why);
- pending events keep their order and are claimed after the migration, exactly those, in seq
  order; the critical lane finds the runs with a pending terminal event;
- a run whose events retention removed goes on numbering after its last seq.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from relay.maintenance.migrate import code_version, migrate, migrations, prepare
from tests.faults.harness import relay_env
from tests.support import InThread, wait_until
from tests.upgrade import Previous, previous_or_skip

# the columns of an event whose value a migration must keep, as the previous release shows them
KEPT = (
    "run_id, seq, event_id, event_type, payload, terminal, wake_queue, wake_event, traceparent,"
    " created_at, state, last_status, last_error, skipped_by, skip_reason, retried_by, retries"
)


@pytest.fixture(scope="module")
def previous(request: pytest.FixtureRequest) -> Previous:
    return previous_or_skip(Path(request.config.rootpath), "BEFORE_CURSOR")


@pytest.fixture
def old_schema(pg_url: str, previous: Previous) -> Any:
    name = "mig_cursor"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(name)))
    env = relay_env(pg_url, name, "http://unused")
    env.pop("PYTHONPATH", None)  # the previous release's own package, not this checkout's
    subprocess.run([*previous.command, "migrate"], env=env, check=True, capture_output=True,
                   cwd="/", timeout=120)  # fmt: skip
    yield name
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(name)))


class Old:
    """The previous release's SQL API on one connection (autocommit: each call commits)."""

    def __init__(self, conn: psycopg.Connection[Any], schema: str) -> None:
        self.conn = conn
        self.schema = schema

    def call(self, fn: str, *args: Any) -> list[tuple[Any, ...]]:
        marks = sql.SQL(", ").join(sql.Placeholder() * len(args))
        query = sql.SQL("select * from {}.{}({})").format(
            sql.Identifier(self.schema), sql.Identifier(fn), marks
        )
        return self.conn.execute(query, args).fetchall()

    def enqueue(self, run: str, n: int, *, terminal: bool = False) -> None:
        for i in range(1, n + 1):
            last = terminal and i == n
            self.call("enqueue", run, f"{run}-{i}", "step", json.dumps({"i": i}), last)

    def claim_run(self, run: str) -> str:
        rows = self.call("claim", "old-relay", 1, 100, "30 seconds", "ordinary", run)
        assert rows, f"the previous release claimed nothing of {run}"
        return str(rows[0][2])

    def ack(self, run: str, token: str, upto: int) -> None:
        got = self.call("ack", json.dumps([{"run_id": run, "token": token, "upto": upto}]))
        assert got[0][1] == "acked", got

    def fail(self, run: str, token: str, seq: int) -> None:
        assert self.call("fail_event", run, token, seq, 422, f"poison {run}") == [(True,)]


def make_history(old: Old) -> dict[str, str]:
    """Runs in every state the previous release can leave them in; returns run -> what it is."""
    kinds: dict[str, str] = {}
    for r in range(12):  # delivered 1-3, pending 4-5
        run = f"partial-{r}"
        old.enqueue(run, 5)
        old.ack(run, old.claim_run(run), 3)
        kinds[run] = "partial"
    for r in range(4):  # delivered 1, failed 2 (blocked), pending 3
        run = f"failed-{r}"
        old.enqueue(run, 3)
        token = old.claim_run(run)
        old.ack(run, token, 1)
        token = old.claim_run(run)
        old.fail(run, token, 2)
        kinds[run] = "failed"
    for r in range(4):  # delivered 1, failed then skipped 2, pending 3
        run = f"skipped-{r}"
        old.enqueue(run, 3)
        old.ack(run, old.claim_run(run), 1)
        old.fail(run, old.claim_run(run), 2)
        old.call("skip_event", f"{run}-2", "alice", f"not needed in {run}")
        kinds[run] = "skipped"
    for r in range(3):  # failed 1 then retried: pending 1-2 with a retry on record
        run = f"retried-{r}"
        old.enqueue(run, 2)
        old.fail(run, old.claim_run(run), 1)
        old.call("retry_event", f"{run}-1", "bob")
        kinds[run] = "retried"
    for r in range(3):  # a pending terminal event: critical
        run = f"critical-{r}"
        old.enqueue(run, 3, terminal=True)
        old.ack(run, old.claim_run(run), 1)
        kinds[run] = "critical"
    for r in range(3):  # finished: everything delivered
        run = f"finished-{r}"
        old.enqueue(run, 2, terminal=True)
        old.ack(run, old.claim_run(run), 2)
        kinds[run] = "finished"
    for r in range(3):  # delivered, then removed by retention: only the seq counter is left
        run = f"pruned-{r}"
        old.enqueue(run, 4)
        old.ack(run, old.claim_run(run), 4)
        kinds[run] = "pruned"
    old.conn.execute(
        sql.SQL(
            "update {}.events set done_at = done_at - interval '2 days'"
            " where run_id like 'pruned-%%'"
        ).format(sql.Identifier(old.schema))
    )
    assert old.call("prune", "1 day", 1000) == [(12,)]
    return kinds


def events(conn: psycopg.Connection[Any], schema: str) -> list[tuple[Any, ...]]:
    return conn.execute(
        sql.SQL("select " + KEPT + " from {}.events order by run_id, seq").format(  # type: ignore[operator]
            sql.Identifier(schema)
        )
    ).fetchall()


def test_a_live_database_of_the_previous_release_is_moved_in_place(
    pg_url: str, old_schema: str
) -> None:
    schema = old_schema
    with psycopg.connect(pg_url, autocommit=True) as conn:
        old = Old(conn, schema)
        kinds = make_history(old)
        before = events(conn, schema)
        states = {(e[0], e[1]): e[10] for e in before}
        assert set(states.values()) == {"delivered", "pending", "failed", "skipped"}

        result = migrate(pg_url, schema)
        assert 7 in result.applied and result.version == code_version()

        # 1. every event as it was: state and history; all in part 0 of the outbox, the
        #    current part (schema version 8), parts 1 and 2 empty
        assert events(conn, schema) == before
        assert conn.execute(
            sql.SQL("select part, count(*) from {}.outbox group by part").format(
                sql.Identifier(schema)
            )
        ).fetchall() == [(0, len(before))]
        assert conn.execute(
            sql.SQL("select part, current, closed_at from {}.outbox_parts order by part").format(
                sql.Identifier(schema)
            )
        ).fetchall() == [(0, True, None), (1, False, None), (2, False, None)]
        skipped = conn.execute(
            sql.SQL(
                "select run_id, seq, skipped_by, skip_reason from {}.event_skips order by run_id"
            ).format(sql.Identifier(schema))
        ).fetchall()
        assert skipped == [
            (f"skipped-{r}", 2, "alice", f"not needed in skipped-{r}") for r in range(4)
        ]
        failed = conn.execute(
            sql.SQL(
                "select f.run_id, f.seq, f.last_status, f.last_error, r.blocked_seq"
                " from {0}.event_failures f join {0}.runs r using (run_id)"
                " where r.blocked_seq is not null order by f.run_id"
            ).format(sql.Identifier(schema))
        ).fetchall()
        assert failed == [(f"failed-{r}", 2, 422, f"poison failed-{r}", 2) for r in range(4)]

        # 2. the pending events, and only those, are claimed after the migration, in order;
        #    the critical lane first finds the runs with a pending terminal event
        new = Old(conn, schema)  # this release's functions now, same signatures
        critical = new.call("claim", "new-relay", 100, 100, "30 seconds", "critical")
        assert {row[0] for row in critical} == {f"critical-{r}" for r in range(3)}
        ordinary = new.call("claim", "new-relay", 100, 100, "30 seconds", "ordinary")
        claimed: dict[str, list[int]] = {}
        for row in critical + ordinary:
            claimed.setdefault(row[0], []).append(row[6])
        pending: dict[str, list[int]] = {}
        for (run, seq), state in sorted(states.items()):
            if state == "pending" and kinds[run] != "failed":  # a blocked run waits
                pending.setdefault(run, []).append(seq)
        assert claimed == pending

        # 3. a run whose events retention removed numbers on after its last seq
        assert new.call("enqueue", "pruned-0", "pruned-0-5", "step", "{}", False) == [(5,)]


def test_writes_of_the_previous_release_through_the_events_view_land_in_the_new_layout(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    """A function of the previous release that waited for the migration's lock resumes after the
    commit with `events` a view: its writes (the ack's, a refused wake's undo, a poison failure)
    must mean in the new layout what they meant (the rolling upgrade saw acks in flight fail
    and their events delivered again before the view took them)."""
    events = sql.Identifier(schema, "events")
    for i in range(1, 4):
        conn.execute(
            sql.SQL("select {}.enqueue('r1', %s, 'step', '{{}}', %s)").format(
                sql.Identifier(schema)
            ),
            (f"e{i}", i == 3),
        )

    def state() -> list[str]:
        got = conn.execute(sql.SQL("select state from {} order by seq").format(events))
        return [r[0] for r in got.fetchall()]

    # the old ack: every pending event up to seq 2 marked delivered
    acked = conn.execute(
        sql.SQL(
            "update {} e set state = 'delivered', delivered_at = now(), done_at = now(),"
            " attempts = e.attempts + 1 where e.run_id = 'r1' and e.seq <= 2"
            " and e.state = 'pending' returning e.seq"
        ).format(events)
    ).fetchall()
    assert sorted(r[0] for r in acked) == [1, 2]
    assert state() == ["delivered", "delivered", "pending"]
    # its undo from a refused wake at seq 2, and the failure of that event
    conn.execute(
        sql.SQL("update {} set state = 'pending' where run_id = 'r1' and seq >= 2").format(events)
    )
    conn.execute(
        sql.SQL(
            "update {} set state = 'failed', last_status = null, last_error = 'engine wake failed'"
            " where run_id = 'r1' and seq = 2 and state = 'pending'"
        ).format(events)
    )
    conn.execute(sql.SQL("update {}.runs set blocked_seq = 2").format(sql.Identifier(schema)))
    assert state() == ["delivered", "failed", "pending"]
    row = conn.execute(
        sql.SQL("select last_error from {}.event_failures").format(sql.Identifier(schema))
    ).fetchone()
    assert row == ("engine wake failed",)
    # the terminal event (seq 3) still waits: the critical lane still finds its run
    assert conn.execute(
        sql.SQL("select run_id from {}.pending_terminals").format(sql.Identifier(schema))
    ).fetchall() == [("r1",)]


def lock_waiters(url: str, application_name: str) -> int:
    """How many backends of `application_name` wait for a lock."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "select count(*) from pg_stat_activity"
            " where application_name = %s and wait_event_type = 'Lock'",
            (application_name,),
        ).fetchone()
    return int(row[0]) if row else 0


def test_an_ack_of_the_previous_release_that_waited_for_the_migration_finishes_after_it(
    pg_url: str, old_schema: str
) -> None:
    """The previous release's ack had begun when the migration took `events`: it waits in its
    first statement and resumes after the commit, running its old body against the new layout.
    Everything that body calls must still be there and mean what it meant: the rolling upgrade
    saw such an ack fail on "function run_lock_keys(text[]) does not exist" once migration
    0007 dropped it, and its events delivered again."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        old = Old(conn, old_schema)
        old.enqueue("inflight", 3)
        token = old.claim_run("inflight")
    migrator = make_conninfo(pg_url, application_name="migrate-under-test")
    acker = make_conninfo(pg_url, application_name="old-ack-under-test")
    with psycopg.connect(pg_url, autocommit=True) as holder:
        # `runs` held: the migration takes `events`, then waits for `runs`
        holder.execute("begin")
        holder.execute(sql.SQL("lock table {}.runs in access share mode").format(
            sql.Identifier(old_schema)))  # fmt: skip
        migration = InThread(lambda: migrate(migrator, old_schema, table_lock_wait=60.0))
        wait_until(lambda: lock_waiters(pg_url, "migrate-under-test") == 1, 30, "the migration")

        def old_ack() -> list[tuple[Any, ...]]:
            with psycopg.connect(acker, autocommit=True) as conn:
                return Old(conn, old_schema).call(
                    "ack", json.dumps([{"run_id": "inflight", "token": token, "upto": 2}])
                )

        ack = InThread(old_ack)
        wait_until(lambda: lock_waiters(pg_url, "old-ack-under-test") == 1, 30, "the old ack")
        holder.execute("commit")
    assert migration.result().version == code_version()
    (result,) = ack.result()
    assert result[:3] == ("inflight", "acked", 2), result
    with psycopg.connect(pg_url, autocommit=True) as conn:
        states = conn.execute(
            sql.SQL("select seq, state from {}.events where run_id = 'inflight' order by seq")
            .format(sql.Identifier(old_schema))
        ).fetchall()  # fmt: skip
        cursor = conn.execute(
            sql.SQL("select delivered_seq from {}.runs where run_id = 'inflight'").format(
                sql.Identifier(old_schema))
        ).fetchone()  # fmt: skip
    assert states == [(1, "delivered"), (2, "delivered"), (3, "pending")]
    assert cursor == (2,)


def test_the_migration_gives_way_to_a_transaction_holding_a_table_it_needs(
    pg_url: str, old_schema: str
) -> None:
    """A transaction holds `runs` and then reads `events`, in the order the previous release's
    ack takes them, while the migration holds `events` and waits for `runs`: a deadlock, unless
    the migration's wait is short. It gives way (rolls back, TABLE_LOCK_WAIT) and tries again;
    the other transaction commits untouched and the migration then completes. With the
    migration waiting as long as it likes, PostgreSQL's deadlock detector aborts one of the two:
    an ack lost this way is an event delivered again."""
    s = sql.Identifier(old_schema)
    migrator = make_conninfo(pg_url, application_name="migrate-under-test")
    with psycopg.connect(pg_url) as other:  # one transaction, like the old ack's
        other.execute(sql.SQL("select 1 from {}.runs for update").format(s))
        migration = InThread(lambda: migrate(migrator, old_schema))
        wait_until(lambda: lock_waiters(pg_url, "migrate-under-test") == 1, 30, "the migration")
        other.execute(sql.SQL("select count(*) from {}.events").format(s)).fetchone()
        other.commit()
    assert migration.result().version == code_version()


def cursors(conn: psycopg.Connection[Any], schema: str) -> dict[str, int | None]:
    rows = conn.execute(
        sql.SQL("select run_id, delivered_seq from {}.runs").format(sql.Identifier(schema))
    ).fetchall()
    return {run: seq for run, seq in rows}


def test_what_the_previous_release_changes_after_the_prepare_is_caught_up_under_the_lock(
    pg_url: str, old_schema: str
) -> None:
    """Migration 0007's prepare computes every run's cursor, history and pending terminal
    before the migration's transaction, while the previous release goes on (producers then
    wait only for the short locked part: docs/storage.md). What that release changes after the
    prepare read a run must be taken again under the migration's locks: a run delivered
    further, a head that failed, a failed head skipped or retried, runs created since. Left
    out, the run keeps the cursor and history of the moment the prepare read it."""
    schema = old_schema
    with psycopg.connect(pg_url, autocommit=True) as conn:
        old = Old(conn, schema)
        make_history(old)
        assert prepare(pg_url, schema) == [7]
        assert None not in cursors(conn, schema).values()

        old.ack("partial-0", old.claim_run("partial-0"), 5)  # delivered to the end
        old.fail("partial-1", old.claim_run("partial-1"), 4)  # its head failed: blocked
        old.call("skip_event", "failed-0-2", "carol", "skipped after the prepare")
        old.call("retry_event", "failed-1-2", "dave")
        old.enqueue("late-0", 2)
        old.enqueue("late-1", 2, terminal=True)
        before = events(conn, schema)

        migrate(pg_url, schema)

        assert events(conn, schema) == before
        got = cursors(conn, schema)
        assert [got[r] for r in ("partial-0", "partial-1", "failed-0", "failed-1")] == [5, 3, 2, 1]
        assert got["late-0"] == got["late-1"] == 0
        terminals = conn.execute(
            sql.SQL("select run_id from {}.pending_terminals order by run_id").format(
                sql.Identifier(schema)
            )
        ).fetchall()
        assert [r[0] for r in terminals] == [f"critical-{r}" for r in range(3)] + ["late-1"]


def test_a_prepare_step_passes_over_a_run_another_transaction_holds(
    pg_url: str, old_schema: str
) -> None:
    """A step of the prepare must never wait for a run's row: the previous release's ack holds
    the rows of the runs it acks, and a step waiting for one (while holding rows the ack may
    want next) would stall or deadlock it. It passes over the run (`skip locked`), which the
    migration then computes under its locks."""
    schema = old_schema
    s = sql.Identifier(schema)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        old = Old(conn, schema)
        old.enqueue("free", 2)
        old.enqueue("held", 3)
        old.ack("held", old.claim_run("held"), 1)
        (m7,) = [m for m in migrations() if m.version == 7]
        assert m7.prepare is not None
        with conn.transaction():
            conn.execute(sql.SQL("set local search_path = {}, pg_catalog").format(s))
            conn.execute(m7.prepare.encode())
        with psycopg.connect(pg_url) as holder:
            holder.execute(
                sql.SQL("select 1 from {}.runs where run_id = 'held' for update").format(s)
            )
            conn.execute("set lock_timeout = '5s'")
            step = sql.SQL("select {}.migrate_prepare_step(null)").format(s)
            assert conn.execute(step).fetchone() == ("free",)
            assert cursors(conn, schema) == {"free": 0, "held": None}
        migrate(pg_url, schema)
        assert cursors(conn, schema) == {"free": 0, "held": 1}
        claimed = Old(conn, schema).call("claim", "new-relay", 10, 100, "30 seconds", "ordinary")
        assert sorted((row[0], row[6]) for row in claimed) == [
            ("free", 1),
            ("free", 2),
            ("held", 2),
            ("held", 3),
        ]


def test_a_run_the_last_prepare_step_passed_over_is_computed_under_the_lock(
    pg_url: str, old_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`relay migrate`'s own prepare passes over a run whose row another transaction holds
    (`skip locked`), and nothing notes that run: the holder wrote no event. The migration's
    transaction waits for the holder, then must compute the run's cursor under its locks from
    `delivered_seq is null`. Left out, the run keeps a null cursor, and making the cursor
    `not null` fails the migration. Reaching this by chance takes a race; here the holder takes
    the row just before the migration's prepare steps, and lets it go once the migration waits
    for its tables."""
    import relay.maintenance.migrate as migrate_module

    schema = old_schema
    s = sql.Identifier(schema)
    migrator = make_conninfo(pg_url, application_name="migrate-under-test")
    with psycopg.connect(pg_url, autocommit=True) as conn:
        old = Old(conn, schema)
        old.enqueue("free", 2)
        old.enqueue("held", 3)
        old.ack("held", old.claim_run("held"), 1)
    holder = psycopg.connect(pg_url)
    steps = migrate_module._prepare_steps
    released: list[InThread] = []

    def let_go_once_the_migration_waits() -> None:
        wait_until(lambda: lock_waiters(pg_url, "migrate-under-test") == 1, 30, "the migration")
        holder.commit()

    def steps_with_a_run_held(conn: psycopg.Connection[Any], schema_: str) -> int:
        holder.execute(sql.SQL("select 1 from {}.runs where run_id = 'held' for update").format(s))
        n = steps(conn, schema_)
        with psycopg.connect(pg_url, autocommit=True) as look:  # passed over, not waited for
            assert cursors(look, schema) == {"free": 0, "held": None}
        released.append(InThread(let_go_once_the_migration_waits))
        return n

    monkeypatch.setattr(migrate_module, "_prepare_steps", steps_with_a_run_held)
    try:
        result = migrate(migrator, schema, table_lock_wait=60.0)
    finally:
        holder.close()
    assert result.version == code_version()
    (release,) = released
    release.result()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert cursors(conn, schema) == {"free": 0, "held": 1}
        claimed = Old(conn, schema).call("claim", "new-relay", 10, 100, "30 seconds", "ordinary")
    assert sorted((row[0], row[6]) for row in claimed) == [
        ("free", 1),
        ("free", 2),
        ("held", 2),
        ("held", 3),
    ]
