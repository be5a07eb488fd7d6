"""Operating a fleet over several outbox databases (issue 51, the gaps of its last stop): each
database's backlog gauges say nothing before its first probe rather than 0; `server_connections`
bounds the one-database form's connections too, or is refused at start when too small; each
database of a fleet may LISTEN through a URL of its own (`NAME.listen=URL`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import httpx
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

from relay import pools as relay_pools
from relay.databases import for_database, load_all, load_databases
from relay.maintenance.migrate import migrate
from relay.ops.checks import run_checks
from relay.pools import Pools
from relay.runner import Relay
from relay.serving.metrics import FleetMetrics, Metrics
from relay.settings import ConfigError
from relay.tools.sink import Sink
from tests.conftest import unique
from tests.faults.proxy import FaultProxy, via
from tests.support import count, settings, wait_for
from tests.test_cli import relay_env, run_cli
from tests.test_fleet import closed_port, delivered, fleet, ingress
from tests.test_fleet import enqueue_runs as enqueue_in
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


# -- a LISTEN URL per database ------------------------------------------------------------------

PASSWORD = "CANARY-pw"


def test_a_listen_entry_gives_its_database_a_listen_url_in_either_list_form(
    tmp_path: Path,
) -> None:
    """Gap 4: `NAME.listen=URL` beside `NAME=URL`, in any order, in RELAY_DATABASES and in
    RELAY_DATABASES_FILE; the database's relay (and `relay check`) LISTENs through it, and a
    database without one LISTENs on its URL, as the one-database form without
    listen_database_url does."""
    listed = (
        "s1.listen=postgresql://relay@pg1/a s1=postgresql://relay@bouncer:6432/a "
        "s2=postgresql://relay@pg2/b"
    )
    listed_file = tmp_path / "databases"
    listed_file.write_text("# shards\n" + "\n".join(listed.split()) + "\n")
    for environ in ({"RELAY_DATABASES": listed}, {"RELAY_DATABASES_FILE": str(listed_file)}):
        databases = load_databases({}, environ)
        assert databases is not None
        assert [d.name for d in databases] == ["s1", "s2"]
        s1, s2 = databases
        assert s1.listen_url is not None
        assert s1.listen_url.reveal() == "postgresql://relay@pg1/a"
        assert s2.listen_url is None
    settings, databases = load_all(
        {}, {"RELAY_DATABASES": listed, "RELAY_INGRESS_URL": "http://in/runs/{run_id}"}
    )
    assert databases is not None
    one = for_database(settings, databases[0])
    assert one.database_url.reveal() == "postgresql://relay@bouncer:6432/a"
    assert one.listen_database_url is not None
    assert one.listen_database_url.reveal() == "postgresql://relay@pg1/a"
    assert for_database(settings, databases[1]).listen_database_url is None
    assert PASSWORD not in repr(databases)


@pytest.mark.parametrize(
    ("entries", "says"),
    [
        (
            f"s1=postgresql://u@h/a s1.lisen=postgresql://u:{PASSWORD}@h/a",
            "entry 2: 's1.lisen' is neither NAME=URL nor NAME.listen=URL",
        ),
        (
            f"s1=postgresql://u@h/a s9.listen=postgresql://u:{PASSWORD}@h/a",
            "entry 2 (s9.listen) names no database of the list",
        ),
        (
            f"s1=postgresql://u@h/a s1.listen=postgresql://u@d/a s1.listen=postgresql://u:{PASSWORD}@d/a",
            "entry 3 (s1.listen): s1's listen URL is given twice",
        ),
        (
            f"s1=postgresql://u@h/a s1.listen=postgresql://u:{PASSWORD}@h:80x/a",
            "entry 2 (s1.listen): the URL its port is not a number",
        ),
        (
            f"s1=postgresql://u@h/a s1.listen=postgresql://u:{PASSWORD}@d/a?sslmod=require",
            "entry 2 (s1.listen): the URL libpq has no parameter 'sslmod'",
        ),
        (
            f"s1=postgresql://u@h/a s2=postgresql://u@h/b s1.listen=postgresql://u:{PASSWORD}@h/b",
            "entry 3 (s1.listen) names the same server and database as 's2' (host h, port 5432,"
            " database b): s1 would LISTEN on s2's database",
        ),
        (
            "s1=postgresql://u@p/a s2=postgresql://u@p/b s1.listen=postgresql://u@d/x "
            f"s2.listen=postgresql://u:{PASSWORD}@d/x",
            "entry 4 (s2.listen) names the same server and database as 's1'",
        ),
        ("s1.listen=postgresql://u@d/x", "names no database"),
    ],
)
def test_a_bad_listen_entry_is_refused_naming_the_entry_never_its_password(
    entries: str, says: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_databases({}, {"RELAY_DATABASES": entries})
    assert says in str(caught.value) and str(caught.value).startswith("RELAY_DATABASES: ")
    assert PASSWORD not in str(caught.value)


def test_the_list_with_listen_database_url_points_at_the_listen_entries() -> None:
    with pytest.raises(ConfigError) as caught:
        load_databases(
            {},
            {
                "RELAY_DATABASES": "s1=postgresql://u@h/a",
                "RELAY_LISTEN_DATABASE_URL": "postgresql://u@d/a",
            },
        )
    assert "its listen URL a NAME.listen=URL entry" in str(caught.value)


@pytest.fixture
def two(pg_url: str) -> Iterator[dict[str, str]]:
    """Two databases in the embedded cluster with the relay's schema: name -> URL."""
    made = {name: unique(f"fleetops_{name}") for name in ("s0", "s1")}
    with psycopg.connect(pg_url, autocommit=True) as conn:
        for dbname in made.values():
            conn.execute(sql.SQL("create database {}").format(sql.Identifier(dbname)))
    urls = {name: urlunsplit(urlsplit(pg_url)._replace(path=f"/{d}")) for name, d in made.items()}
    try:
        for url in urls.values():
            migrate(url, "relay")
        yield urls
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            for dbname in made.values():
                conn.execute(
                    sql.SQL("drop database if exists {} with (force)").format(
                        sql.Identifier(dbname)
                    )
                )


@pytest.mark.anyio
async def test_each_database_listens_through_its_own_listen_url(two: dict[str, str]) -> None:
    """Gap 4 against real databases: s0's listen URL leads through a TCP proxy, s1's to a port
    where nothing listens. s0's LISTEN session goes through the proxy (its pools do not: a reset
    there reconnects its LISTEN alone) and s0 is up; s1's listener is down, so s1 alone reads
    `database_up` 0, while it still delivers by polling. While s1's relay waited for its LISTEN
    connection, before its first probe, its backlog gauges had no sample (gap 2)."""
    ids = {name: enqueue_in(url, name) for name, url in two.items()}
    s0 = urlsplit(two["s0"])
    nowhere = urlunsplit(urlsplit(two["s1"])._replace(netloc=f"127.0.0.1:{closed_port()}"))
    metrics = f"127.0.0.1:{closed_port()}"
    async with ingress() as (sink, url), anyio.create_task_group() as proxies:
        proxy = FaultProxy(s0.hostname or "127.0.0.1", s0.port or 5432, "s0-listen")
        await proxy.start(proxies)
        listed = (
            f"s0={two['s0']} s0.listen={via(two['s0'], proxy.port)} "
            f"s1={two['s1']} s1.listen={nowhere}"
        )
        f = fleet(
            two,
            url,
            {
                "RELAY_DATABASES": listed,
                "RELAY_METRICS_ADDR": metrics,
                "RELAY_STATEMENT_TIMEOUT": "4s",  # how long s1's relay waits for its LISTEN
            },
        )
        async with anyio.create_task_group() as tg, httpx.AsyncClient() as http:
            await tg.start(f.run)

            async def scrape() -> dict[str, dict[str, float]]:
                return by_database((await http.get(f"http://{metrics}/metrics")).text)

            await wait_for(lambda: "s1" in f.relay_metrics(), what="s1's relay metrics")
            assert f.states()["s1"] == "starting"  # waiting for its LISTEN connection
            early = await scrape()
            await wait_for(
                lambda: all(delivered(sink, i) for i in ids.values()), what="both delivered"
            )
            await wait_for(lambda: f.up()["s0"], what="s0 up")
            assert proxy.connections >= 1  # its LISTEN session came through its listen URL
            assert f.up() == {"s0": True, "s1": False}

            async def s0_reconnected() -> bool:
                reconnects = (await scrape())["ledger_relay_listen_reconnects"]
                return reconnects.get("s0", 0.0) >= 1 and f.up()["s0"]

            proxy.reset()  # s0's LISTEN session, and only it, goes through the proxy
            await wait_for(s0_reconnected, what="s0's LISTEN reconnected through the proxy")
            late = await scrape()
            f.stop()
        proxies.cancel_scope.cancel()
    assert "s1" not in early["ledger_relay_blocked_runs"], early["ledger_relay_blocked_runs"]
    assert "s1" not in early["ledger_relay_outbox_part_age_seconds"]
    assert early["ledger_relay_backlog_refresh_timestamp_seconds"]["s1"] == 0.0
    assert late["ledger_relay_database_up"] == {"s0": 1.0, "s1": 0.0}
    assert late["ledger_relay_listen_up"] == {"s0": 1.0, "s1": 0.0}
    assert late["ledger_relay_blocked_runs"] == {"s0": 0.0, "s1": 0.0}  # probed since


@pytest.mark.anyio
async def test_relay_check_listens_through_each_databases_listen_url(
    two: dict[str, str], sink: tuple[Sink, str]
) -> None:
    """`relay check` over the list checks LISTEN through each database's listen URL: s1's,
    which leads nowhere, fails its own listen line alone."""
    _, url = sink
    nowhere = urlunsplit(urlsplit(two["s1"])._replace(netloc=f"127.0.0.1:{closed_port()}"))
    settings, databases = load_all(
        {},
        {
            "RELAY_DATABASES": f"s0={two['s0']} s1={two['s1']} s1.listen={nowhere}",
            "RELAY_INGRESS_URL": url + "/runs/{run_id}/events",
        },
    )
    results = await run_checks(settings, 3.0, databases=databases)
    listen = {r.database: r.ok for r in results if r.name == "listen"}
    assert listen == {"s0": True, "s1": False}, [r.line() for r in results]
    assert {r.database: r.ok for r in results if r.name == "database"} == {"s0": True, "s1": True}


def test_a_set_aside_reason_never_quotes_the_listen_urls_password() -> None:
    """A relay's failure as its database's set-aside reason is scrubbed of the passwords of
    both its URLs: an error may quote its listen URL's as well as its pools' URL's."""
    from relay.fleet import failure

    settings, databases = load_all(
        {},
        {
            "RELAY_DATABASES": "s1=postgresql://u:pools-pw@h/a "
            f"s1.listen=postgresql://u:{PASSWORD}@d/a",
            "RELAY_INGRESS_URL": "http://in/runs/{run_id}",
        },
    )
    assert databases is not None
    exc = ConnectionError(f"password {PASSWORD} refused; password pools-pw refused")
    reason = failure(exc, for_database(settings, databases[0]))
    assert reason.startswith("failed: ConnectionError") and reason.count("***") == 2, reason
    assert PASSWORD not in reason and "pools-pw" not in reason
