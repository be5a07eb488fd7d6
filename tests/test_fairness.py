"""Fair shares between tenants (issue 50 item 3, schema version 9) against a real PostgreSQL:
a run's fairness key and its refusals, the owner's weights, and the claim's stride scheduling
within each lane, through claim() itself (docs/design.md "Scheduling: fair shares between keys").
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import psycopg
import pytest
from psycopg import errors, sql
from psycopg.types.json import Jsonb

import relay
from relay import Event
from relay.maintenance.migrate import migrate
from relay.maintenance.roles import Roles
from tests.conftest import unique
from tests.support import InThread, fn, wait_until, waits_for_a_lock


def enq(
    conn: psycopg.Connection[Any],
    schema: str,
    run_id: str,
    event_id: str,
    key: str | None,
    *,
    terminal: bool = False,
) -> int:
    row = conn.execute(
        sql.SQL("select {}(%s, %s, 't', %s, p_terminal => %s, p_fairness_key => %s::text)").format(
            fn(schema, "enqueue")
        ),
        (run_id, event_id, Jsonb({"id": event_id}), terminal, key),
    ).fetchone()
    assert row is not None
    return int(row[0])


def backlog(
    conn: psycopg.Connection[Any],
    schema: str,
    key: str | None,
    runs: int,
    *,
    terminal: bool = False,
    prefix: str | None = None,
) -> None:
    """`runs` one-event runs of `key`, enqueued in one statement (each its own run)."""
    prefix = prefix or (key or "nokey")
    conn.execute(
        sql.SQL(
            "select {}(%(p)s || i, %(p)s || i || '.1', 't', '{{}}', %(t)s, p_fairness_key => %(k)s)"
            " from generate_series(1, %(n)s) i"
        ).format(fn(schema, "enqueue")),
        {"p": f"{prefix}-", "t": terminal, "k": key, "n": runs},
    )


def weight(conn: psycopg.Connection[Any], schema: str, key: str, w: int) -> int:
    row = conn.execute(
        sql.SQL("select {}(%s, %s)").format(fn(schema, "set_fairness_weight")), (key, w)
    ).fetchone()
    assert row is not None
    return int(row[0])


def claim(
    conn: psycopg.Connection[Any], schema: str, runs: int, lane: str = "ordinary"
) -> list[str]:
    """The runs one claim took, in the order it returned them."""
    rows = conn.execute(
        sql.SQL("select run_id from {}('o1', %s, 10, '1 hour'::interval, %s)").format(
            fn(schema, "claim")
        ),
        (runs, lane),
    ).fetchall()
    return list(dict.fromkeys(r[0] for r in rows))


def key_of(conn: psycopg.Connection[Any], schema: str, run_id: str) -> str:
    row = conn.execute(
        sql.SQL("select fairness_key from {} where run_id = %s").format(fn(schema, "runs")),
        (run_id,),
    ).fetchone()
    assert row is not None
    return str(row[0])


# --- a run's key --------------------------------------------------------------------------


def test_a_run_has_its_first_events_key(conn: psycopg.Connection[Any], schema: str) -> None:
    enq(conn, schema, "r1", "e1", "tenant-a")
    enq(conn, schema, "r1", "e2", None)  # no key: keeps the run's
    enq(conn, schema, "r1", "e3", "tenant-a")  # the same key again
    enq(conn, schema, "r2", "f1", None)
    assert key_of(conn, schema, "r1") == "tenant-a"
    assert key_of(conn, schema, "r2") == ""  # the default key
    # the terminal's pending row carries the run's key, for the critical lane
    enq(conn, schema, "r1", "e4", None, terminal=True)
    row = conn.execute(
        sql.SQL("select fairness_key from {} where run_id = 'r1'").format(
            fn(schema, "pending_terminals")
        )
    ).fetchone()
    assert row == ("tenant-a",)


def test_a_later_event_naming_another_key_is_refused(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    enq(conn, schema, "r1", "e1", "tenant-a")
    with pytest.raises(errors.InvalidParameterValue) as info:
        enq(conn, schema, "r1", "e2", "tenant-b")
    message = str(info.value)
    assert "tenant-a" in message and "tenant-b" in message, message
    assert info.value.sqlstate == "22023"
    # a run begun without a key has the default one: naming a key later is another key
    enq(conn, schema, "r2", "f1", None)
    with pytest.raises(errors.InvalidParameterValue) as info:
        enq(conn, schema, "r2", "f2", "tenant-b")
    assert "(none)" in str(info.value) and "tenant-b" in str(info.value)
    # nothing of a refused event was written
    row = conn.execute(
        sql.SQL("select count(*) from {} where event_id in ('e2', 'f2')").format(
            fn(schema, "outbox")
        )
    ).fetchone()
    assert row == (0,)


def pending_key(conn: psycopg.Connection[Any], schema: str, run_id: str) -> Any:
    row = conn.execute(
        sql.SQL("select fairness_key from {} where run_id = %s").format(
            fn(schema, "pending_terminals")
        ),
        (run_id,),
    ).fetchone()
    return None if row is None else row[0]


def test_the_terminals_pending_row_carries_the_key_of_a_new_run_and_of_an_idle_one(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    """A new run's key is its first event's, even when that event is its terminal; an existing
    run's is read, whether the run is active or idle; and a refused event leaves an idle run as
    it was."""
    enq(conn, schema, "one", "one.1", "tenant-a", terminal=True)  # a run of one event
    assert key_of(conn, schema, "one") == "tenant-a"
    assert pending_key(conn, schema, "one") == "tenant-a"
    enq(conn, schema, "bare", "bare.1", None, terminal=True)
    assert pending_key(conn, schema, "bare") == ""
    enq(conn, schema, "idle", "idle.1", "tenant-b")
    conn.execute(
        sql.SQL("update {} set idle = true where run_id = 'idle'").format(fn(schema, "runs"))
    )
    with pytest.raises(errors.InvalidParameterValue, match="tenant-c"):
        enq(conn, schema, "idle", "idle.2", "tenant-c", terminal=True)
    row = conn.execute(
        sql.SQL("select idle, fairness_key from {} where run_id = 'idle'").format(
            fn(schema, "runs")
        )
    ).fetchone()
    assert row == (True, "tenant-b")
    assert pending_key(conn, schema, "idle") is None
    enq(conn, schema, "idle", "idle.2", "tenant-b", terminal=True)  # its own key, once idle
    row = conn.execute(
        sql.SQL("select idle, fairness_key from {} where run_id = 'idle'").format(
            fn(schema, "runs")
        )
    ).fetchone()
    assert row == (False, "tenant-b")
    assert pending_key(conn, schema, "idle") == "tenant-b"


def test_an_empty_key_is_refused(conn: psycopg.Connection[Any], schema: str) -> None:
    with pytest.raises(errors.InvalidParameterValue, match="fairness_key"):
        enq(conn, schema, "r1", "e1", "")


def test_enqueue_many_and_the_python_helper_take_a_key(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    relay.enqueue(conn, "r1", "e1", "t", {}, fairness_key="tenant-a", schema=schema)
    relay.enqueue_many(
        conn, "r2", [Event("f1", "t", {}), Event("f2", "t", {})], fairness_key="b", schema=schema
    )
    assert key_of(conn, schema, "r1") == "tenant-a"
    assert key_of(conn, schema, "r2") == "b"
    with pytest.raises(errors.InvalidParameterValue, match="tenant-a"):
        relay.enqueue_many(conn, "r1", [Event("e2", "t", {})], fairness_key="c", schema=schema)


# --- weights --------------------------------------------------------------------------------


def test_weights_are_bounded_and_return_the_one_replaced(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    assert weight(conn, schema, "a", 5) == 1
    assert weight(conn, schema, "a", 1000) == 5
    for bad in (0, 1001, -3):
        with pytest.raises(errors.InvalidParameterValue, match=str(bad)):
            weight(conn, schema, "a", bad)


def test_the_producer_role_cannot_set_a_weight(pg_url: str) -> None:
    schema = unique("t")
    roles = Roles(producer=unique("prod"), relay=unique("rel"))
    migrate(pg_url, schema, roles=roles)
    try:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            for role in (roles.producer, roles.relay):
                conn.execute(sql.SQL("set role {}").format(sql.Identifier(role)))
                with pytest.raises(errors.InsufficientPrivilege):
                    weight(conn, schema, "a", 5)
                conn.execute("reset role")
            # the producer may still enqueue with a key
            conn.execute(sql.SQL("set role {}").format(sql.Identifier(roles.producer)))
            enq(conn, schema, "r1", "e1", "a")
            conn.execute("reset role")
            assert weight(conn, schema, "a", 5) == 1  # the owner may
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(sql.SQL("drop schema {} cascade").format(sql.Identifier(schema)))
            for role in (roles.producer, roles.relay):
                conn.execute(sql.SQL("drop role {}").format(sql.Identifier(role)))


# --- the claim's shares ---------------------------------------------------------------------


@pytest.mark.parametrize("lane", ["ordinary", "critical"])
def test_weights_5_3_2_share_the_first_600_runs(
    conn: psycopg.Connection[Any], schema: str, lane: str
) -> None:
    for key, w in (("five", 5), ("three", 3), ("two", 2)):
        weight(conn, schema, key, w)
        backlog(conn, schema, key, 500, terminal=lane == "critical")
    taken: list[str] = []
    while len(taken) < 600:
        got = claim(conn, schema, 64, lane)
        assert got, taken
        taken += got
    shares = Counter(key_of(conn, schema, r) for r in taken[:600])
    for key, want in (("five", 0.5), ("three", 0.3), ("two", 0.2)):
        assert abs(shares[key] / 600 - want) <= 0.05, shares


def test_within_a_key_the_order_is_the_lanes(conn: psycopg.Connection[Any], schema: str) -> None:
    backlog(conn, schema, "a", 20)
    backlog(conn, schema, "b", 20)
    taken = []
    while got := claim(conn, schema, 7):
        taken += got
    for key in ("a", "b"):
        mine = [r for r in taken if r.startswith(f"{key}-")]
        assert mine == [f"{key}-{i}" for i in range(1, 21)], mine


def test_a_quiet_key_goes_in_the_first_claim_beside_a_noisy_backlog(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    backlog(conn, schema, "noisy", 1500)
    backlog(conn, schema, "quiet", 2)  # enqueued after the whole backlog
    first = claim(conn, schema, 8)
    assert {"quiet-1", "quiet-2"} <= set(first), first


def test_the_default_key_has_its_share_beside_a_keyed_backlog(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    backlog(conn, schema, "noisy", 500)
    backlog(conn, schema, None, 1)
    assert "nokey-1" in claim(conn, schema, 4)


def test_a_weight_1_key_is_not_starved_beside_a_weight_1000_key(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    weight(conn, schema, "heavy", 1000)
    backlog(conn, schema, "heavy", 3000)
    backlog(conn, schema, "light", 5)
    taken: list[str] = []
    for _ in range(40):  # 2,560 runs: the light key's share is 2.56 of them
        taken += claim(conn, schema, 64)
    light = [r for r in taken if r.startswith("light-")]
    assert 2 <= len(light) <= 4, len(light)
    # and once the heavy key is out of work, the light one takes every claim (work-conserving)
    taken = []
    while got := claim(conn, schema, 64):
        taken += got
    rest = {r for r in taken if r.startswith("light-")}
    assert rest == {f"light-{i}" for i in range(1, 6)} - set(light)


def test_a_key_back_from_idle_has_no_banked_credit(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    """A key with nothing to send while others were served starts level with them: it gets its
    share from then on, not every run until it has caught up."""
    backlog(conn, schema, "a", 400)
    backlog(conn, schema, "b", 400)
    for _ in range(5):
        claim(conn, schema, 64)  # 320 runs shared by a and b: their passes move on
    backlog(conn, schema, "c", 400)
    got = claim(conn, schema, 60)
    shares = Counter(key_of(conn, schema, r) for r in got)
    assert 15 <= shares["c"] <= 25, shares


def test_one_key_claims_as_before_and_writes_no_pass(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    backlog(conn, schema, "solo", 30)
    assert claim(conn, schema, 10) == [f"solo-{i}" for i in range(1, 11)]
    # the key has its row (schema version 10: the shared claim walks them), no pass written
    rows = conn.execute(
        sql.SQL("select key, pass_critical, pass_ordinary from {} order by key").format(
            fn(schema, "fairness_keys")
        )
    )
    assert rows.fetchall() == [("", 0, 0), ("solo", 0, 0)]


def index_descents(conn: psycopg.Connection[Any], schema: str, index: str) -> int:
    """Scans of `index` by this transaction so far (pg_stat_get_xact_numscans)."""
    row = conn.execute(
        "select pg_stat_get_xact_numscans(%s::regclass)", (f'"{schema}"."{index}"',)
    ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("lane", ["ordinary", "critical"])
def test_a_shared_claim_reads_about_as_many_keys_as_it_takes_runs(
    pg_url: str, conn: psycopg.Connection[Any], schema: str, lane: str
) -> None:
    """Schema version 10: a claim over 300 keys with due work walks the keys in pass order and
    stops once it holds its tickets, instead of listing every key at each claim (version 9
    descended each key's index once: 300 scans of runs_due_by_key, 40-50 ms at 1,000 keys).
    Half of the keys' runs are leased elsewhere (no due work): the walk passes over them."""
    conn.execute(
        sql.SQL(
            "select {}('r' || k || '-' || i, 'e' || k || '-' || i, 't', '{{}}', true,"
            " p_fairness_key => 'key-' || k)"
            " from generate_series(1, 300) k, generate_series(1, 2) i order by k, i"
        ).format(fn(schema, "enqueue"))
    )
    conn.execute(
        sql.SQL(
            "update {} set lease_owner = 'elsewhere', lease_expires_at = now() + interval '1 hour',"
            " next_attempt_at = now() + interval '1 hour'"
            " where fairness_key in (select 'key-' || k from generate_series(1, 300, 2) k)"
        ).format(fn(schema, "runs"))
    )
    conn.execute("analyze")
    with psycopg.connect(pg_url) as tx:  # one transaction: its own statistics so far
        indexes = ("runs_due_by_key", "pending_terminals_by_key")
        before = sum(index_descents(tx, schema, i) for i in indexes)
        got = claim(tx, schema, 10, lane)
        descents = sum(index_descents(tx, schema, i) for i in indexes) - before
        tx.rollback()
    assert len(got) == 10 and len({key_of(conn, schema, r) for r in got}) == 10, got
    assert descents <= 60, descents


def runs_read(conn: psycopg.Connection[Any], schema: str) -> int:
    """Entries of `runs` this transaction's scans read so far, whatever the plan: its indexes'
    (idx_tup_read) and a sequential scan's rows (seq_tup_read), each an object's
    pg_stat_get_xact_tuples_returned."""
    row = conn.execute(
        "select sum(pg_stat_get_xact_tuples_returned(c.oid)) from pg_class c"
        " where c.oid = %(t)s::regclass"
        " or c.oid in (select i.indexrelid from pg_index i where i.indrelid = %(t)s::regclass)",
        {"t": f'"{schema}"."runs"'},
    ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("lane", ["ordinary", "critical"])
def test_a_shared_claim_reads_its_rounds_runs_in_one_call(
    pg_url: str, conn: psycopg.Connection[Any], schema: str, lane: str
) -> None:
    """A round of a shared claim reads the runs of all its keys in one statement
    (pick_of_keys). One function call a key cost a 64-run claim over 64 keys some 1.5 ms, a
    tenth of it (docs/performance.md, "The claim at 1M pending events over 1,000 keys")."""
    conn.execute(
        sql.SQL(
            "select {}('r' || k || '-' || i, 'e' || k || '-' || i, 't', '{{}}', true,"
            " p_fairness_key => 'key-' || k)"
            " from generate_series(1, 64) k, generate_series(1, 2) i order by k, i"
        ).format(fn(schema, "enqueue"))
    )
    with psycopg.connect(pg_url) as tx:
        tx.execute("set local track_functions = 'all'")
        got = claim(tx, schema, 64, lane)
        calls = dict(
            tx.execute(
                "select funcname, calls from pg_stat_xact_user_functions where schemaname = %s",
                (schema,),
            ).fetchall()
        )
        tx.rollback()
    assert len(got) == 64 and len({key_of(conn, schema, r) for r in got}) == 64, got
    assert calls.get("pick_shared") == 1, calls
    assert calls.get("pick_of_keys") == 1, calls  # one round, every key in it


@pytest.mark.parametrize("lane", ["ordinary", "critical"])
def test_a_key_with_runs_but_none_due_costs_the_walk_one_descent(
    pg_url: str, conn: psycopg.Connection[Any], schema: str, lane: str
) -> None:
    """Schema version 12: the walk asks runs_due_by_key for a key's due run bounded by the
    claim's moment read once (a query parameter), so the index scan ends at the key's first run
    not due. Bounded by clock_timestamp() (volatile), the scan was bounded by the key alone and
    read every run of each key walked past: here 20 keys of 500 runs leased elsewhere, walked
    before the 10 keys with due work (the issue's 1M-event case: 1,000 keys of 1,000 runs)."""
    conn.execute(
        sql.SQL(
            "select {}('busy' || k || '-' || i, 'eb' || k || '-' || i, 't', '{{}}', true,"
            " p_fairness_key => 'a-busy-' || k)"
            " from generate_series(1, 20) k, generate_series(1, 500) i order by k, i"
        ).format(fn(schema, "enqueue"))
    )
    conn.execute(
        sql.SQL(
            "update {} set lease_owner = 'elsewhere', lease_expires_at = now() + interval '1 hour',"
            " next_attempt_at = now() + interval '1 hour' where fairness_key like 'a-busy-%%'"
        ).format(fn(schema, "runs"))
    )
    conn.execute(
        sql.SQL(
            "select {}('due' || k || '-' || i, 'ed' || k || '-' || i, 't', '{{}}', true,"
            " p_fairness_key => 'z-due-' || k)"
            " from generate_series(1, 10) k, generate_series(1, 2) i order by k, i"
        ).format(fn(schema, "enqueue"))
    )
    conn.execute(sql.SQL("vacuum (analyze) {}").format(fn(schema, "runs")))  # no dead entries
    with psycopg.connect(pg_url) as tx:  # one transaction: its own statistics so far
        before = runs_read(tx, schema)
        got = claim(tx, schema, 10, lane)
        read = runs_read(tx, schema) - before
        tx.rollback()
    assert len(got) == 10 and {key_of(conn, schema, r) for r in got} == {
        f"z-due-{k}" for k in range(1, 11)
    }, got
    # 30 keys walked, 10 runs taken: a few entries a key (122 ordinary, 50 critical, measured),
    # not the 10,000 runs leased (10,122 and 10,040 with clock_timestamp() in the walk)
    assert read <= 5 * 30, read


def keys_kept(conn: psycopg.Connection[Any], schema: str) -> list[str]:
    rows = conn.execute(
        sql.SQL("select key from {} order by key").format(fn(schema, "fairness_keys"))
    ).fetchall()
    return [r[0] for r in rows]


def prune(conn: psycopg.Connection[Any], schema: str) -> None:
    conn.execute(sql.SQL("select {}('1 hour', 1000)").format(fn(schema, "prune")))


def test_retention_prunes_a_key_with_no_active_run_but_keeps_a_weight(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    """Schema version 10: a key's row goes once no active run has it and its weight is the
    default; a weight set by the owner stays, and so does the default key's row. A key that
    comes back gets its row again, and its runs are claimed beside the others."""
    for key in ("gone", "busy"):
        backlog(conn, schema, key, 2)
    weight(conn, schema, "kept", 5)  # no run at all
    conn.execute(
        sql.SQL("update {} set idle = true where fairness_key = 'gone'").format(fn(schema, "runs"))
    )
    prune(conn, schema)
    assert keys_kept(conn, schema) == ["", "busy", "kept"]
    enq(conn, schema, "gone-1", "gone-1.2", None)  # an idle run of the key enqueued to again
    assert keys_kept(conn, schema) == ["", "busy", "gone", "kept"]
    assert {key_of(conn, schema, r) for r in claim(conn, schema, 3)} == {"busy", "gone"}


def test_a_transaction_of_many_new_keys_holds_a_bounded_number_of_locks(
    pg_url: str, schema: str
) -> None:
    """note_fairness_key's advisory locks are one of 256 per schema: a producer's transaction
    that starts runs of 600 new keys does not fill the server's shared lock table."""
    with psycopg.connect(pg_url) as producer:
        producer.execute(
            sql.SQL(
                "select {}('many-' || k, 'many-' || k || '.1', 't', '{{}}',"
                " p_fairness_key => 'm' || k) from generate_series(1, 600) k"
            ).format(fn(schema, "enqueue"))
        )
        row = producer.execute(
            "select count(*) from pg_locks where locktype = 'advisory' and pid = pg_backend_pid()"
        ).fetchone()
        producer.rollback()
    assert row is not None and 0 < row[0] <= 256, row


def test_an_unblocked_run_brings_its_keys_row_back(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    """A blocked run is not active: its key's row may be pruned, and the operator's retry that
    unblocks it writes the row again, so the shared claim's walk sees the key."""
    backlog(conn, schema, "tenant", 1)
    conn.execute(
        sql.SQL("select {}('tenant-1', 1, 422, 'bad payload')").format(fn(schema, "block_event"))
    )
    prune(conn, schema)
    assert keys_kept(conn, schema) == [""]
    conn.execute(sql.SQL("select * from {}('tenant-1', 'me')").format(fn(schema, "retry_run")))
    assert keys_kept(conn, schema) == ["", "tenant"]
    backlog(conn, schema, "other", 1)
    assert set(claim(conn, schema, 2)) == {"tenant-1", "other-1"}


def test_retention_keeps_the_row_of_a_key_whose_run_is_being_enqueued(
    pg_url: str, conn: psycopg.Connection[Any], schema: str
) -> None:
    """A producer's transaction that made a run of a key active holds the key's row against
    pruning until it commits: the uncommitted run is invisible to retention's check, and a row
    pruned then would leave the run out of every shared claim's walk."""
    backlog(conn, schema, "tenant", 1)
    conn.execute(sql.SQL("update {} set idle = true").format(fn(schema, "runs")))
    with psycopg.connect(pg_url) as producer:
        enq(producer, schema, "late", "late.1", "tenant")  # open: not committed yet
        prune(conn, schema)
        producer.commit()
    assert "tenant" in keys_kept(conn, schema)
    backlog(conn, schema, "other", 1)
    assert set(claim(conn, schema, 2)) == {"late", "other-1"}


def test_the_backlog_by_key_is_the_top_keys_and_the_rest_summed(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    """Issue 50 item 4: backlog_by_key(n) gives the n keys with the most active runs and one
    row (key null) for the rest, however many keys there are; blocked and idle runs count in
    none."""
    for key, runs in (("a", 5), ("b", 4), (None, 3), ("c", 2), ("d", 1)):
        backlog(conn, schema, key, runs)
    conn.execute(
        sql.SQL("update {} set idle = true where run_id = 'd-1'").format(fn(schema, "runs"))
    )
    rows = conn.execute(
        sql.SQL("select key, runs from {}(2)").format(fn(schema, "backlog_by_key"))
    ).fetchall()
    assert rows == [("a", 5), (None, 5), ("b", 4)]
    # `relay status` shows the 10 keys with the most (all five here)
    status = conn.execute(sql.SQL("select {}()").format(fn(schema, "status"))).fetchone()
    assert status is not None
    assert status[0]["keys"] == [
        {"key": "a", "runs": 5},
        {"key": "b", "runs": 4},
        {"key": "", "runs": 3},
        {"key": "c", "runs": 2},
    ]


# --- no hot row, no deadlock ------------------------------------------------------------------


def test_producers_of_one_key_do_not_wait_for_each_other(
    pg_url: str, conn: psycopg.Connection[Any], schema: str
) -> None:
    """Two open transactions enqueue new runs of one key: neither waits for the other (no
    per-key row is written by enqueue; a wait would end in the lock timeout below)."""
    backlog(conn, schema, "busy", 3)
    weight(conn, schema, "busy", 2)
    claim(conn, schema, 1)  # one key: nothing written; the key's row exists from the weight
    with psycopg.connect(pg_url) as a, psycopg.connect(pg_url) as b:
        for c in (a, b):
            c.execute("set lock_timeout = '1s'")
        enq(a, schema, "a1", "a1.1", "busy")
        enq(b, schema, "b1", "b1.1", "busy")  # while a's transaction is open
        enq(a, schema, "a2", "a2.1", "busy", terminal=True)
        enq(b, schema, "b2", "b2.1", "busy", terminal=True)
        a.commit()
        b.commit()
    assert {key_of(conn, schema, r) for r in ("a1", "a2", "b1", "b2")} == {"busy"}


def test_a_shared_claim_in_an_open_transaction_holds_the_other_lane_back_then_both_take_runs(
    pg_url: str, conn: psycopg.Connection[Any], schema: str
) -> None:
    """Shared claims of the two lanes write the same keys' rows (each its own lane's pass): the
    second waits for the first to commit, then takes other runs; neither fails."""
    for key in ("a", "b", "c"):
        backlog(conn, schema, key, 30, terminal=True)
    with psycopg.connect(pg_url) as one, psycopg.connect(pg_url) as two:
        for c in (one, two):
            c.execute("set deadlock_timeout = '100ms'")
        first = claim(one, schema, 6, "critical")  # transaction left open
        waiter = InThread(lambda: claim(two, schema, 6, "ordinary"))
        wait_until(lambda: waits_for_a_lock(pg_url, two.info.backend_pid), what="a wait")
        one.commit()
        second = waiter.result()
        two.commit()
    assert len(first) == 6 and len(second) == 6
    assert not set(first) & set(second)
