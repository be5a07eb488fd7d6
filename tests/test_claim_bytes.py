"""The claim's byte bound (issue 13 item 5), at the SQL level: a prefix stops early at
p_max_bytes of payload, its first event always goes (alone when it is larger), and a relay of the
previous version (six arguments) still claims during a rolling upgrade."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from tests.test_lease_sql import claim, enq, fn

KIB = 1024


def claim_bytes(
    conn: psycopg.Connection[Any], schema: str, max_bytes: int | None, batch: int = 100
) -> list[int]:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(
            sql.SQL("select * from {}(%s, %s, %s, %s::interval, %s, %s, %s)").format(
                fn(schema, "claim")
            ),
            ("o1", 10, batch, "1 minute", "ordinary", None, max_bytes),
        )
        return [r["seq"] for r in cur.fetchall()]


def payload_of(size: int) -> dict[str, str]:
    return {"pad": "x" * (size - len('{"pad": ""}'))}  # jsonb text: {"pad": "xx…"}


def test_a_prefix_stops_at_the_byte_bound(conn: psycopg.Connection[Any], schema: str) -> None:
    for i in range(1, 6):
        enq(conn, schema, "r1", f"e{i}", payload=payload_of(100 * KIB))
    assert claim_bytes(conn, schema, 350 * KIB) == [1, 2, 3]


def test_an_event_larger_than_the_bound_goes_alone(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    enq(conn, schema, "r1", "big", payload=payload_of(200 * KIB))
    enq(conn, schema, "r1", "small", payload=payload_of(1 * KIB))
    assert claim_bytes(conn, schema, 100 * KIB) == [1]


def test_without_a_bound_the_prefix_is_the_batch(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    for i in range(1, 6):
        enq(conn, schema, "r1", f"e{i}", payload=payload_of(100 * KIB))
    assert claim_bytes(conn, schema, None, batch=4) == [1, 2, 3, 4]


def test_a_six_argument_claim_of_the_previous_version_still_resolves(
    conn: psycopg.Connection[Any], schema: str
) -> None:
    enq(conn, schema, "r1", "e1")
    got = claim(conn, schema)  # claim(owner, runs, batch, ttl, lane, run_id): no byte bound
    assert [r["seq"] for r in got["r1"]] == [1]
