"""Monitoring as code (issue 15 item 4): deploy/monitoring/'s alert rules pass promtool's unit
tests, and every metric the rules and the dashboard query exists in a real scrape of a running
relay; build_info, the process/platform collectors and `relay --version`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from relay import __version__
from relay.runner import Relay
from relay.serving import build
from relay.tools.sink import Sink, serve_sink
from tests.support import FLEET_ONLY, count, settings, wait_for
from tests.test_metrics import get, relay_port
from tests.test_relay import enqueue_runs

yaml = pytest.importorskip("yaml")

MONITORING = Path(__file__).resolve().parent.parent / "deploy" / "monitoring"
RULES = MONITORING / "alerts.yaml"
RULE_TESTS = MONITORING / "alerts.test.yaml"
DASHBOARD = MONITORING / "dashboard.json"
PODMONITOR = MONITORING / "podmonitor.yaml"
DEPLOYMENT = MONITORING.parent / "k8s" / "deployment.yaml"
# Our metrics and the standard collectors' (`up` is Prometheus' own, not the relay's).
METRIC = re.compile(r"\b((?:ledger_relay|process|python)_[a-z0-9_]+)\b")

EXPECTED_ALERTS = {
    "LedgerRelayBacklogGrowing",
    "LedgerRelayCriticalEventsWaiting",
    "LedgerRelayOldestPendingAge",
    "LedgerRelayBlockedRuns",
    "LedgerRelayIngressMisconfigured",
    "LedgerRelayIngressFailing",
    "LedgerRelayLeaseLosses",
    "LedgerRelayReplicaDown",
    "LedgerRelayAllReplicasDown",
    "LedgerRelayDatabaseNotServed",
    "LedgerRelayReplicaNotReady",
    "LedgerRelayDeliveryStalled",
    "LedgerRelayAckLag",
    "LedgerRelayDatabaseProbeFailing",
    "LedgerRelayRetentionBehind",
    "LedgerRelayPostLimitAtFloor",
}


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for panel in dash["panels"] for t in panel["targets"]]
    queries += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    return queries


def used_metrics() -> set[str]:
    texts = [r["expr"] for r in rules()] + dashboard_queries()
    return {m for text in texts for m in METRIC.findall(text)}


# -- the files ----------------------------------------------------------------------------------


def test_every_alert_of_the_issue_is_there_and_tested() -> None:
    names = {r["alert"] for r in rules()}
    assert names == EXPECTED_ALERTS
    tested = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
    }
    assert tested == EXPECTED_ALERTS
    for rule in rules():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_the_dashboard_has_a_panel_per_question() -> None:
    dash = json.loads(DASHBOARD.read_text())
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    titles = " ".join(p["title"].lower() for p in panels)
    for word in ("throughput", "backlog", "oldest", "lag", "latency", "statuses", "blocked",
                 "leases", "retries", "database"):  # fmt: skip
        assert word in titles, word
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_the_podmonitor_selects_the_deployment_pods_on_their_metrics_port() -> None:
    pm = yaml.safe_load(PODMONITOR.read_text())
    assert pm["apiVersion"] == "monitoring.coreos.com/v1" and pm["kind"] == "PodMonitor"
    deployment = next(
        d for d in yaml.safe_load_all(DEPLOYMENT.read_text()) if d and d["kind"] == "Deployment"
    )
    pod = deployment["spec"]["template"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics"


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (Debian package `prometheus`; scripts/test.sh tries)")
    return path


def test_promtool_checks_the_rules() -> None:
    got = subprocess.run(
        [_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, check=False
    )
    assert got.returncode == 0, got.stdout + got.stderr


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    got = subprocess.run(
        [_promtool(), "test", "rules", RULE_TESTS.name],
        cwd=MONITORING,
        capture_output=True,
        text=True,
        check=False,
    )
    assert got.returncode == 0, got.stdout + got.stderr


# -- against a real relay -----------------------------------------------------------------------


def scraped_names(text: str) -> set[str]:
    """Family names and sample names (`_total`, `_bucket`, ... included) of an exposition."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


@pytest.mark.anyio
async def test_every_metric_of_the_rules_and_dashboard_is_in_a_real_scrape(
    pg_url: str, schema: str, conn: psycopg.Connection[Any]
) -> None:
    sink = Sink()
    # A poisoned run (422 for its batch, then for its first event alone): blocked_runs.
    sink.faults.fail(422, times=2, run_id="m1")
    enqueue_runs(conn, schema, 3, 2, prefix="m", terminal=False)
    async with serve_sink(sink) as url:
        cfg = settings(pg_url, schema, url, metrics_addr="127.0.0.1:0")
        async with Relay(cfg).running() as r:
            await wait_for(lambda: count(conn, schema, "state = 'failed'") == 1, what="poison")
            await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 4, what="4")
            assert r.endpoints is not None
            await r.endpoints.probe()  # the backlog gauges, now
            text = (await get(relay_port(r), "/metrics")).text
            r.stop()
    names = scraped_names(text)
    missing = sorted(used_metrics() - FLEET_ONLY - names)
    assert not missing, f"queried but not exported: {missing}"
    assert (
        f'ledger_relay_build_info{{commit="{build.commit()}",python="{sys.version.split()[0]}",'
        f'version="{__version__}"}} 1.0' in text
    )
    assert "process_resident_memory_bytes" in names and "python_info" in names
    assert re.search(r"^ledger_relay_blocked_runs 1\.0$", text, re.M), text


def test_relay_version_prints_the_version() -> None:
    got = subprocess.run(
        [sys.executable, "-m", "relay.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    want = f"ledger-relay {__version__} (commit {build.commit()})"
    assert got.returncode == 0 and got.stdout.strip() == want, got
