"""The backlog by class (issue 50 item 4): finished runs (a terminal event pending) and due runs
(the rest) read apart in the metrics (`class`), in `relay status` and on the status page, from
the backlog refresh the relay already makes. Before, the metrics had only `lane`, and named the
finished runs the critical lane's, though since issue 50 the critical lane claims only the
terminals it is signalled and the ordinary lane the finished and due runs."""

from __future__ import annotations

import re
from typing import Any

import psycopg
import pytest

from relay.runner import Relay
from relay.tools.sink import Sink
from tests.support import count, q, settings, wait_for
from tests.test_metrics import get, relay_port, scrape, total
from tests.test_ops import cli, cli_env, cli_json
from tests.test_relay import enqueue_runs

pytestmark = pytest.mark.anyio

FINISHED = {"runs": 3, "events": 3 * 4}  # 3 runs of 4 events, each ending in its terminal
DUE = {"runs": 2, "events": 2 * 5}  # 2 runs of 5 events, no terminal


def backlog(conn: psycopg.Connection[Any], schema: str) -> None:
    """The backlog of the module's docstring; the finished runs' events 5 minutes old, the due
    runs' just enqueued, so each class's oldest pending is told apart too."""
    enqueue_runs(conn, schema, FINISHED["runs"], 4, prefix="fin", terminal=True)
    enqueue_runs(conn, schema, DUE["runs"], 5, prefix="due", terminal=False)
    conn.execute(
        q(
            schema,
            "update {s}.outbox set created_at = clock_timestamp() - interval '5 minutes'"
            " where run_id like 'fin%%'",
        )
    )


async def test_a_backlog_of_finished_and_due_runs_reads_per_class(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    s, url = sink
    s.faults.set_default(401)  # the ingress misconfigured: the lanes pause, the backlog stays
    backlog(conn, schema)
    cfg = settings(pg_url, schema, url, metrics_addr="127.0.0.1:0", max_backoff="0.5s")
    async with Relay(cfg).running() as r:
        await wait_for(lambda: not r.health.ingress_ok, what="ingress reported misconfigured")
        assert r.endpoints is not None
        await r.endpoints.probe()  # the backlog refresh, now rather than in a few seconds
        port = relay_port(r)
        samples = await scrape(port)
        api = (await get(port, "/api/status")).json()
    assert count(conn, schema, "state = 'delivered'") == 0

    # The metrics: one series per class, the deprecated lane beside it on the same series.
    for name, of in (
        ("ledger_relay_backlog_runs", "runs"),
        ("ledger_relay_backlog_events", "events"),
    ):
        series = {labels: v for (n, labels), v in samples.items() if n == name}
        assert series == {
            (("class", "finished"), ("lane", "critical")): FINISHED[of],
            (("class", "due"), ("lane", "ordinary")): DUE[of],
        }, series
    oldest = "ledger_relay_oldest_pending_age_seconds"
    assert 300 <= total(samples, oldest, **{"class": "finished"}) < 600
    assert 0 <= total(samples, oldest, **{"class": "due"}) < 300

    # The status page: /api/status's rows carry their class; the page's figures are by class.
    rows = {x["class"]: (x["runs"], x["events"]) for x in api["lanes"]}
    assert rows == {"finished": (3, 12), "due": (2, 10)}, api["lanes"]
    figures = api["view"]["figures"]
    assert (figures["finished.runs"], figures["finished.events"]) == ("3", "12")
    assert (figures["due.runs"], figures["due.events"]) == ("2", "10")

    # relay status: its JSON's rows carry their class, its table names the rows by class.
    env = cli_env(pg_url, schema)
    rows = {x["class"]: (x["runs"], x["events"]) for x in cli_json(env, "status")["lanes"]}
    assert rows == {"finished": (3, 12), "due": (2, 10)}
    table = cli(env, "status").stdout
    assert re.search(r"^finished +3 +12 +5m", table, re.M), table
    assert re.search(r"^due +2 +10 ", table, re.M), table
