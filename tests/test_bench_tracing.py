"""`relay bench --only tracing` (issues 31, 40): tracing off and on in paired reps, the spans
counted at the bench's own OTLP/HTTP receiver, and `tracing_on_ratio ≥ 0.6` judged.

As in tests/test_bench.py, no timing assertion: the smoke run checks that both figures, the
spans and the target come out, and that the target judges the scenario's own ratio.
"""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path

import anyio
import httpx
import orjson
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from relay.tools.bench import SCENARIOS, tracing_cost
from relay.tools.bench.main import targets

KEYS = [
    "tracing_off_eps",
    "tracing_on_eps",
    "tracing_on_ratio",
    "tracing_spans",
    "tracing_spans_per_post",
]
TARGET = "tracing_on_ratio ≥ 0.6"
CLI = "import sys; from relay.cli import main; sys.exit(main(sys.argv[1:]))"
PB2 = "opentelemetry.proto.collector.trace.v1.trace_service_pb2"


def test_the_scenario_declares_its_keys() -> None:
    assert set(SCENARIOS["tracing"].keys) == set(KEYS)


def test_smoke_measures_off_and_on_counts_the_spans_and_judges_the_ratio(
    tmp_path: Path, pg_url: str
) -> None:
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RELAY_", "OTEL_"))}
    proc = subprocess.run(
        [
            *(sys.executable, "-c", CLI, "bench", "--only", "tracing", "--smoke"),
            *("--database-url", pg_url, "--json", str(out)),
        ],
        env=env | {"COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = orjson.loads(out.read_bytes())
    assert report["failed"] == {}
    metrics = report["metrics"]
    for key in KEYS:
        value = metrics.get(key)
        assert isinstance(value, int | float) and value > 0, (key, value, sorted(metrics))
    # Every delivery of the traced rep arrived as two spans (deliver <lane> and its POST).
    assert metrics["tracing_spans_per_post"] == 2.0
    (rep,) = report["scenarios"]["tracing"]["rows"]
    assert rep["spans"] == metrics["tracing_spans"] == 2 * rep["posts"] > 0
    assert rep["on_over_off"] == metrics["tracing_on_ratio"]
    assert metrics["tracing_on_ratio"] == pytest.approx(
        metrics["tracing_on_eps"] / metrics["tracing_off_eps"], abs=0.002
    )
    # The target judges this ratio against 0.6, in the JSON and in the printed table.
    (judged,) = [t for t in report["targets"] if t["target"].startswith(TARGET)]
    assert judged["measured"] == metrics["tracing_on_ratio"]
    assert judged["needed"] == 0.6
    assert judged["verdict"] == ("met" if metrics["tracing_on_ratio"] >= 0.6 else "MISSED")
    assert TARGET in proc.stdout
    assert f"target {TARGET}: " in proc.stdout


def test_the_target_is_met_at_0_6_and_missed_below() -> None:
    def verdict(ratio: float) -> str:
        (t,) = [t for t in targets({"tracing_on_ratio": ratio}) if t["target"].startswith(TARGET)]
        assert t["needed"] == 0.6
        return str(t["verdict"])

    assert verdict(0.6) == "met"
    assert verdict(0.95) == "met"
    assert verdict(0.599) == "MISSED"
    assert not [t for t in targets({"e2e_eps": 1000.0}) if t["target"].startswith(TARGET)]


def _export(spans: int) -> bytes:
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    for i in range(spans):
        span = scope.spans.add()
        span.name = f"span {i}"
        span.trace_id = bytes(16)
        span.span_id = i.to_bytes(8, "big")
    return request.SerializeToString()


@pytest.mark.anyio
async def test_the_receiver_answers_at_once_and_counts_spans_between_reps() -> None:
    async with (
        tracing_cost.otlp_receiver() as receiver,
        httpx.AsyncClient(base_url=receiver.endpoint) as client,
    ):
        headers = {"content-type": "application/x-protobuf"}
        plain = await client.post("/v1/traces", content=_export(3), headers=headers)
        zipped = await client.post(
            "/v1/traces",
            content=gzip.compress(_export(4)),
            headers=headers | {"content-encoding": "gzip"},
        )
        other = await client.post("/v1/metrics", content=b"x", headers=headers)
        assert (plain.status_code, zipped.status_code, other.status_code) == (200, 200, 404)
        got = receiver.take()
        assert (got.requests, got.spans) == (2, 7)
        assert got.bytes == len(_export(3)) + len(gzip.compress(_export(4)))
        assert receiver.take() == tracing_cost.Received(0, 0, 0)


def test_without_the_otel_extra_the_scenario_is_skipped_and_says_why() -> None:
    """The bench imports and runs without OpenTelemetry: the scenario says why it did not run
    (opentelemetry made unimportable in a fresh interpreter)."""
    code = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "import argparse, anyio\n"
        "from relay.tools.bench.main import SCENARIOS\n"
        "r = anyio.run(SCENARIOS['tracing'].run, None, argparse.Namespace())\n"
        "print(r.rows, r.metrics)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "the otel extra is not installed" in proc.stdout
    assert "'skipped'" in proc.stdout and proc.stdout.rstrip().endswith("{}")


def test_a_missing_proto_counts_exports_and_bytes_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        sys.modules, "opentelemetry.proto.collector.trace.v1.trace_service_pb2", None
    )
    assert tracing_cost.count_spans([(_export(2), "")]) is None
    receiver = tracing_cost.OtlpReceiver()
    receiver.add(b"abc", "")
    assert receiver.take() == tracing_cost.Received(1, 3, None)


def test_the_receivers_thread_stops_with_the_block() -> None:
    async def serve() -> str:
        async with tracing_cost.otlp_receiver() as receiver:
            return receiver.endpoint

    endpoint = anyio.run(serve)
    with pytest.raises(httpx.ConnectError):
        httpx.post(endpoint + "/v1/traces", content=b"", timeout=2)


def test_the_options_and_their_smoke_values() -> None:
    from relay.tools.bench.main import parse_args

    a = parse_args(["--only", "tracing"])
    assert (a.tracing_runs, a.tracing_reps) == (None, 4)
    smoke = parse_args(["--only", "tracing", "--smoke"])
    assert smoke.tracing_reps == 1
