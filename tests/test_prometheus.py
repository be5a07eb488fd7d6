"""A real Prometheus scraping a running relay (issue 15 item 4): every dashboard query returns
series and the blocked-run alert goes off for a poisoned run. Skipped without the `prometheus`
binary (Debian package `prometheus`, which scripts/test.sh installs best effort)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import anyio
import httpx
import psycopg
import pytest

from relay.runner import Relay
from relay.tools.sink import Sink, serve_sink
from tests.support import count, q, settings, wait_for
from tests.test_logs import dead_port
from tests.test_metrics import relay_port
from tests.test_monitoring import DASHBOARD, RULES
from tests.test_relay import enqueue_runs

pytestmark = pytest.mark.anyio


def concrete(expr: str) -> str:
    """A dashboard query with Grafana's variables filled in as Grafana would."""
    return expr.replace("$__rate_interval", "1m").replace('"$job"', '".+"')


def prometheus_config(tmp: Path, relay_port: int) -> Path:
    rules = tmp / "alerts.yaml"
    rules.write_text(RULES.read_text())
    config = tmp / "prometheus.yml"
    config.write_text(
        json.dumps(  # JSON is YAML
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(rules)],
                "scrape_configs": [
                    {
                        "job_name": "ledger-relay",
                        "static_configs": [{"targets": [f"127.0.0.1:{relay_port}"]}],
                    }
                ],
            }
        )
    )
    return config


async def test_a_real_prometheus_answers_every_dashboard_query_and_alerts_on_a_blocked_run(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed (Debian package `prometheus`)")
    sink = Sink()
    sink.faults.fail(422, times=2, run_id="p1")  # a poisoned run: blocked_runs 1
    enqueue_runs(conn, schema, 3, 2, prefix="p", terminal=False)
    web = dead_port()
    async with serve_sink(sink) as url:
        cfg = settings(pg_url, schema, url, metrics_addr="127.0.0.1:0")
        async with Relay(cfg).running() as r:
            log = (tmp_path / "prometheus.log").open("wb")
            prom = await anyio.open_process(
                [binary, f"--config.file={prometheus_config(tmp_path, relay_port(r))}",
                 f"--storage.tsdb.path={tmp_path / 'data'}",
                 f"--web.listen-address=127.0.0.1:{web}"],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            try:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{web}") as api:

                    async def query(expr: str) -> list[Any]:
                        try:
                            got = await api.get("/api/v1/query", params={"query": expr})
                        except httpx.TransportError:
                            return []  # not listening yet
                        if got.status_code == 503:
                            return []  # listening, not ready yet ("Service Unavailable", text)
                        body = got.json()
                        assert body["status"] == "success", (expr, body)
                        result: list[Any] = body["data"]["result"]
                        return result

                    async def has_series(expr: str) -> bool:
                        return bool(await query(expr))

                    await wait_for(
                        lambda: count(conn, schema, "state = 'failed'") == 1, what="the poison"
                    )
                    await wait_for(lambda: has_series("up == 1"), what="the first scrapes")
                    # More traffic while Prometheus watches: rates and quantiles have data.
                    enqueue_runs(conn, schema, 5, 2, prefix="q", terminal=False)
                    # A tenant's run due in an hour: the backlog by fairness key has a series.
                    with conn.transaction():
                        conn.execute(
                            q(schema, "select {s}.enqueue('keyed', 'keyed-e', 'step', '{{}}',"
                                      " p_fairness_key => 'tenant-a')"),
                        )  # fmt: skip
                        conn.execute(
                            q(schema, "update {s}.runs set next_attempt_at = now() + interval"
                                      " '1 hour' where run_id = 'keyed'"),
                        )  # fmt: skip
                    dashboard = json.loads(DASHBOARD.read_text())
                    for panel in dashboard["panels"]:
                        for target in panel["targets"]:
                            expr = concrete(target["expr"])
                            await wait_for(
                                lambda e=expr: has_series(e),  # type: ignore[misc]
                                timeout=60,
                                what=f"series for {panel['title']!r}: {expr}",
                            )

                    async def blocked_alert() -> bool:
                        got = await api.get("/api/v1/alerts")
                        if got.status_code == 503:
                            return False
                        alerts = got.json()["data"]["alerts"]
                        return any(
                            a["labels"]["alertname"] == "LedgerRelayBlockedRuns"
                            and a["state"] in ("pending", "firing")
                            for a in alerts
                        )

                    # `for: 1m` keeps it pending first: the rule matched the poisoned run.
                    await wait_for(blocked_alert, timeout=60, what="LedgerRelayBlockedRuns")
            finally:
                prom.terminate()
                with anyio.fail_after(30):
                    await prom.wait()
                log.close()
            r.stop()
