"""Operating a fleet over several outbox databases (issue 51, the gaps of its last stop): each
database's backlog gauges say nothing before its first probe rather than 0."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from relay.serving.metrics import FleetMetrics, Metrics

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
