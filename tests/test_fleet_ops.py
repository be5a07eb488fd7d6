"""Operating a fleet over several outbox databases (issue 51, the gaps of its last stop): each
database's backlog gauges say nothing before its first probe rather than 0; `server_connections`
bounds the one-database form's connections too, or is refused at start when too small."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import anyio
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from relay import pools as relay_pools
from relay.databases import load_all
from relay.pools import Pools
from relay.runner import Relay
from relay.serving.metrics import FleetMetrics, Metrics
from relay.tools.sink import Sink
from tests.support import count, settings, wait_for
from tests.test_cli import relay_env, run_cli
from tests.test_metrics import get, relay_port
from tests.test_relay import enqueue_runs

# The database's gauges without a label of their own, which default to 0 in prometheus_client.
PROBED = (
    "ledger_relay_blocked_runs",
    "ledger_relay_failed_events",
    "ledger_relay_oldest_failed_age_seconds",
    "ledger_relay_outbox_part_age_seconds",
)


def by_database(text: str) -> dict[str, dict[str, float]]:
    """A scrape's samples by family name, then database (summed over the other labels)."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        values = out.setdefault(family.name, {})
        for sample in family.samples:
            database = sample.labels.get("database", "")
            values[database] = values.get(database, 0.0) + sample.value
    return out


def test_a_fleet_databases_backlog_gauges_have_no_sample_until_its_first_probe() -> None:
    """Gap 2: a fleet serves each database's relay metrics from its start, before its first
    probe (which waits for its pools and its LISTEN connection). Until that probe its backlog
    gauges have no sample, not 0 ("nothing blocked, the part just begun"); the refresh's
    timestamp reads 0, never refreshed. Once probed, the figures are there."""
    a, b = Metrics(replica=False), Metrics(replica=False)
    fleet = FleetMetrics(lambda: {"a": True, "b": False}, relays=lambda: {"a": a, "b": b})
    a.set_backlog([("blocked", 0, 0, 0.0), ("ordinary", 2, 6, 3.5)])
    a.set_part_age(120.0)
    a.backlog_refreshed.set(1_700_000_000)

    scraped = by_database(fleet.exposition()[0].decode())
    for name in PROBED:
        assert set(scraped[name]) == {"a"}, (name, scraped[name])  # b: none, not 0
    assert scraped["ledger_relay_blocked_runs"] == {"a": 0.0}  # a's 0 was read
    assert scraped["ledger_relay_outbox_part_age_seconds"] == {"a": 120.0}
    assert scraped["ledger_relay_backlog_events"] == {"a": 6.0}
    assert scraped["ledger_relay_backlog_refresh_timestamp_seconds"] == {
        "a": 1_700_000_000,
        "b": 0.0,
    }

    b.set_backlog([("blocked", 1, 2, 30.0)])
    b.set_part_age(60.0)
    scraped = by_database(fleet.exposition()[0].decode())
    assert scraped["ledger_relay_blocked_runs"] == {"a": 0.0, "b": 1.0}
    assert scraped["ledger_relay_failed_events"] == {"a": 0.0, "b": 2.0}
    assert scraped["ledger_relay_oldest_failed_age_seconds"] == {"a": 0.0, "b": 30.0}
    assert scraped["ledger_relay_outbox_part_age_seconds"] == {"a": 120.0, "b": 60.0}


def test_a_relay_alones_backlog_gauges_are_described_before_their_first_probe() -> None:
    """The one-database form the same way: before the first refresh the families are there
    (HELP and TYPE: the scrape says what it exports) without a sample."""
    m = Metrics()
    families = {f.name: f for f in text_string_to_metric_families(m.exposition()[0].decode())}
    for name in PROBED:
        assert families[name].samples == [], name
    m.set_backlog([("blocked", 3, 4, 5.0)])
    families = {f.name: f for f in text_string_to_metric_families(m.exposition()[0].decode())}
    assert [s.value for s in families["ledger_relay_blocked_runs"].samples] == [3.0]


# -- server_connections in the one-database form ----------------------------------------------


def alone(**env: str) -> Any:
    settings, databases = load_all(
        {},
        {
            "RELAY_DATABASE_URL": "postgresql://relay@db1/ledger",
            "RELAY_INGRESS_URL": "http://in/runs/{run_id}",
            **env,
        },
    )
    assert databases is None
    return settings


def test_server_connections_sizes_the_one_databases_pools_within_it() -> None:
    """Gap 3: RELAY_DATABASE_URL alone with `server_connections`: its pools fit within the
    budget beside its LISTEN connection (and the status page's one when metrics_addr serves
    it), as a fleet's database fits its share; without a budget they are as they always were."""
    assert Pools(alone()).sizes == (10, 6)
    assert Pools(alone(RELAY_SERVER_CONNECTIONS="8")).sizes == (5, 2)  # + LISTEN = 8
    page = alone(RELAY_SERVER_CONNECTIONS="8", RELAY_METRICS_ADDR="127.0.0.1:0")
    assert Pools(page).sizes == (4, 2)  # + LISTEN + the page = 8
    assert Pools(alone(RELAY_SERVER_CONNECTIONS="40")).sizes == (10, 6)  # room to spare
    assert Pools(alone(RELAY_SERVER_CONNECTIONS="5")).sizes == (2, 2)


def test_a_server_connections_too_few_for_the_one_database_is_refused_naming_it() -> None:
    """`relay check` (its configuration line) and `relay run` refuse it at start, exit 2,
    before connecting (the URL names a port where nothing listens), naming the option and what
    it must hold."""
    env = relay_env("postgresql://relay@127.0.0.1:1/ledger", "relay", "http://127.0.0.1:1")
    for extra, says in (
        ({"RELAY_SERVER_CONNECTIONS": "4"}, "it needs at least 5 (its LISTEN connection, two"),
        (
            {"RELAY_SERVER_CONNECTIONS": "5", "RELAY_METRICS_ADDR": "127.0.0.1:0"},
            "it needs at least 6 (its LISTEN connection, two for each lane's pool, and the "
            "status page's on metrics_addr)",
        ),
    ):
        for command in ("check", "run"):
            got = run_cli(command, env={**env, "RELAY_STARTUP_TIMEOUT": "1s", **extra})
            assert got.returncode == 2, (command, got.stdout, got.stderr)
            said = got.stdout + got.stderr  # check: its configuration line; run: its refusal
            budget = extra["RELAY_SERVER_CONNECTIONS"]
            assert f"server_connections ({budget}) is too few for the database" in said
            assert says in said, (command, said)


def relay_connections(pg_url: str) -> int:
    """The relay's connections to the test database now, its status page's included."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        row = conn.execute(
            "select count(*) from pg_stat_activity"
            " where application_name like 'ledger-relay%%' and datname = %s",
            (urlsplit(pg_url).path.lstrip("/"),),
        ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.anyio
async def test_server_connections_bounds_the_one_databases_connections(
    pg_url: str,
    schema: str,
    conn: psycopg.Connection[Any],
    sink: tuple[Sink, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Gap 3 against the real database: a relay alone with `server_connections = 8` and its
    status page on builds its pools to 4 + 2 (unbudgeted: 10 + 6), and held no more than 8
    connections (pools, LISTEN, the page's) while it drained a backlog and the page was read."""
    built: list[int] = []

    class Recorded(relay_pools.AsyncConnectionPool):  # type: ignore[type-arg]
        def __init__(self, *args: Any, max_size: int, **kwargs: Any) -> None:
            built.append(max_size)
            super().__init__(*args, max_size=max_size, **kwargs)

    monkeypatch.setattr(relay_pools, "AsyncConnectionPool", Recorded)
    _, url = sink
    enqueue_runs(conn, schema, 300, 2, prefix="b")
    cfg = settings(
        pg_url, schema, url, server_connections=8, metrics_addr="127.0.0.1:0", retention="1h"
    )
    most = 0
    async with Relay(cfg).running() as r:
        async with anyio.create_task_group() as tg:
            tg.start_soon(get, relay_port(r), "/api/status")  # the page's own connection

            def sampled() -> bool:
                nonlocal most
                most = max(most, relay_connections(pg_url))
                return count(conn, schema, "state = 'delivered'") == 600

            await wait_for(sampled, interval=0.005, what="delivery")
    assert built == [4, 2], built
    assert 2 <= most <= 8, most
