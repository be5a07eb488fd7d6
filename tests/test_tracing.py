"""Tracing (issue 31, 40): the standard variables turn it on, the spans' shape and parentage
through the OpenTelemetry SDK, one observer ending each delivery's span after its outcome is
written, the spans arriving at a real OTLP/HTTP receiver through the SDK's exporter, and a
stopping relay that a collector dripping its answer cannot hold past the flush's bound."""

from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anyio
import psycopg
import pytest

import relay
from relay.core.policy import Ack, Decision, Poison, Retry, Trust
from relay.delivery.execute import LeaseLost, Outcome
from relay.edges.ingress import Answer
from relay.edges.store import AckResult, Claim, ClaimedEvent, Held, Store
from relay.edges.tracing import (
    NO_TRACING,
    Delivery,
    DeliverySpan,
    Tracer,
    TracingConfig,
    config_from_env,
    flush_timeout,
)
from relay.integrations import start_tracing
from relay.runner import Relay
from relay.settings import ConfigError
from relay.tools.sink import Sink
from tests.support import count, settings, wait_for

otel = pytest.importorskip("relay.integrations.otel", reason="the otel extra is not installed")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
)
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind, StatusCode  # noqa: E402

PRODUCER_TRACE = "0af7651916cd43dd8448eb211c80319c"
PRODUCER_SPAN = "b7ad6b7169203331"
TP1 = f"00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-01"
TP2 = "00-11111111111111111111111111111111-2222222222222222-01"
ENDPOINT = "http://127.0.0.1:4318"
AT = datetime(2024, 5, 17, 12, 0, 0)


@pytest.fixture(autouse=True)
def _no_otel_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK reads its variables from the process environment: each test sets its own."""
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)


# -- the variables -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "want"),
    [
        ({}, None),
        ({"OTEL_SERVICE_NAME": "x"}, None),  # no endpoint: off
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_SDK_DISABLED": "TRUE"}, None),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT + "/"},
            TracingConfig(ENDPOINT + "/v1/traces", "parentbased_always_on"),
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://ignored:1",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://collector:4318/custom",
                "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                "OTEL_TRACES_SAMPLER_ARG": "0.25",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_SDK_DISABLED": "false",
            },
            TracingConfig("https://collector:4318/custom", "parentbased_traceidratio"),
        ),
    ],
)
def test_the_standard_variables_turn_tracing_on(
    environ: dict[str, str], want: TracingConfig | None
) -> None:
    assert config_from_env(environ) == want


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
        ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"),
        (
            {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.5"},
            "OTEL_TRACES_SAMPLER_ARG",
        ),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
        ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
    ],
)
def test_a_bad_value_is_a_clear_error_naming_the_variable(
    extra: dict[str, str], named: str
) -> None:
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, **extra}
    with pytest.raises(ConfigError, match=named):
        config_from_env(environ)


def test_without_an_endpoint_the_relay_runs_untraced() -> None:
    tracer = start_tracing({"OTEL_SERVICE_NAME": "x"})
    assert tracer is NO_TRACING and not tracer.enabled
    span = tracer.delivery(_delivery())
    with span.post("http://ingress/x") as post:
        assert post.traceparent is None  # the event's own header goes out, as before
    assert span.trace_id is None


def test_the_flush_gets_a_quarter_of_the_grace_period() -> None:
    assert flush_timeout(20.0) == 5.0 and flush_timeout(0.0) == 0.0


# -- the spans, in memory ------------------------------------------------------------------------


def _delivery(**change: Any) -> Delivery:
    fields: dict[str, Any] = {
        "lane": "critical",
        "run_id": "run-1",
        "epoch": 3,
        "first_seq": 5,
        "last_seq": 8,
        "events": 4,
        "attempt": 1,
        "traceparents": [TP1, TP2, TP1, None],
        "outbox_wait_seconds": 0.25,
    }
    return Delivery(**(fields | change))


def _outcome(
    span: DeliverySpan, decision: Decision | LeaseLost, status: int | None = 200
) -> Outcome:
    """What a delivery came to, as the executor hands it to the completer."""
    events = tuple(
        ClaimedEvent(seq, f"e{seq}", "step", "{}", False, AT, None, None) for seq in range(5, 9)
    )
    claim = Claim("run-1", 3, uuid.uuid4(), 1, True, AT, Trust(0.0, 30.0, 5.0), events)
    answer = None if status is None else Answer(status, b"", None, 0.01)
    return Outcome(Held(claim), events, decision, answer, span=span)


ACKED = AckResult("run-1", "acked", 4, 8, 0.5, None)


@pytest.fixture
def memory() -> Iterator[tuple[Any, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    tracer = otel.OtelTracer(processor=SimpleSpanProcessor(exporter))
    yield tracer, exporter
    assert tracer.shutdown(10)


def test_a_delivery_is_a_child_of_the_first_events_trace_with_links_to_the_others(
    memory: tuple[Any, InMemorySpanExporter],
) -> None:
    tracer, exporter = memory
    span = tracer.delivery(_delivery())
    with span.post("http://ingress.example:8080/runs/run-1/events?sig=secret") as post:
        sent = post.traceparent
        post.answered(200)
    assert len(exporter.get_finished_spans()) == 1  # the POST; the delivery waits for its outcome
    tracer.observe(_outcome(span, Ack(4)), ACKED)
    post_span, delivery = exporter.get_finished_spans()

    assert delivery.name == "deliver critical" and delivery.kind == SpanKind.CONSUMER
    assert delivery.parent is not None
    assert f"{delivery.parent.trace_id:032x}" == PRODUCER_TRACE
    assert f"{delivery.parent.span_id:016x}" == PRODUCER_SPAN
    assert [f"{link.context.trace_id:032x}" for link in delivery.links] == ["1" * 32]
    attrs = dict(delivery.attributes or {})
    assert attrs["messaging.destination.name"] == "critical"  # the lane
    assert attrs["relay.run_id"] == "run-1" and attrs["relay.epoch"] == 3
    assert (attrs["relay.seq.first"], attrs["relay.seq.last"]) == (5, 8)
    assert attrs["messaging.batch.message_count"] == 4 and attrs["relay.attempt"] == 1
    assert attrs["relay.outcome"] == "accepted" and attrs["relay.outbox_wait_seconds"] == 0.25
    assert attrs["relay.status"] == 200
    assert delivery.status.status_code == StatusCode.UNSET
    (acked,) = delivery.events
    assert acked.name == "acked"
    assert dict(acked.attributes or {}) == {"status": "acked", "events": 4, "last_seq": 8}
    assert span.trace_id == PRODUCER_TRACE and span.span_id == f"{delivery.context.span_id:016x}"

    # The POST: a client span inside the delivery, whose context is the header sent.
    assert post_span.kind == SpanKind.CLIENT and post_span.name == "POST"
    assert post_span.parent is not None and post_span.parent.span_id == delivery.context.span_id
    assert sent == f"00-{PRODUCER_TRACE}-{post_span.context.span_id:016x}-01"
    post_attrs = dict(post_span.attributes or {})
    assert post_attrs["http.response.status_code"] == 200
    assert post_attrs["url.full"] == "http://ingress.example:8080/runs/run-1/events"  # no query
    assert post_attrs["server.port"] == 8080


def test_a_multi_run_post_sits_in_the_first_runs_delivery_and_links_the_others(
    memory: tuple[Any, InMemorySpanExporter],
) -> None:
    tracer, exporter = memory
    first, second, third = (
        tracer.delivery(_delivery(run_id=f"run-{i}", traceparents=[None])) for i in range(3)
    )
    with first.post("http://ingress.example/batches", [second, third]) as post:
        post.answered(200)
    (post_span,) = exporter.get_finished_spans()
    assert post_span.parent is not None and f"{post_span.parent.span_id:016x}" == first.span_id
    assert [f"{link.context.span_id:016x}" for link in post_span.links] == [
        second.span_id,
        third.span_id,
    ]


def test_the_post_span_never_carries_the_ingress_urls_credentials(
    memory: tuple[Any, InMemorySpanExporter],
) -> None:
    tracer, exporter = memory
    span = tracer.delivery(_delivery(traceparents=[None]))
    with span.post("https://relay:s3cret@ingress.example/runs/r/events?k=v") as post:
        post.answered(200)
    tracer.observe(_outcome(span, Ack(4)), ACKED)
    spans = exporter.get_finished_spans()
    assert len(spans) == 2
    for s in spans:
        text = repr(dict(s.attributes or {}))
        assert "s3cret" not in text and "relay:" not in text, text
    post_span = next(s for s in spans if s.name == "POST")
    assert dict(post_span.attributes or {})["url.full"].endswith("ingress.example/runs/r/events")


def test_failures_show_on_the_spans(memory: tuple[Any, InMemorySpanExporter]) -> None:
    tracer, exporter = memory
    span = tracer.delivery(_delivery(traceparents=[None]))
    with span.post("http://ingress/x") as post:
        post.answered(503)
    retry = Retry(1.5, 503, "503 Service Unavailable", 2.0, quick=False)
    tracer.observe(_outcome(span, retry, 503), None)
    post_span, delivery = exporter.get_finished_spans()
    assert delivery.parent is None  # no producer trace: a root span
    assert delivery.status.status_code == StatusCode.ERROR
    assert delivery.status.description == "503 Service Unavailable"
    attrs = dict(delivery.attributes or {})
    assert attrs["relay.outcome"] == "transient" and attrs["relay.status"] == 503
    assert attrs["relay.retry_after"] == 2.0 and attrs["relay.retry_in"] == 1.5
    assert list(delivery.events) == []  # no ack
    assert post_span.status.status_code == StatusCode.ERROR
    assert dict(post_span.attributes or {})["error.type"] == "503"


@pytest.mark.parametrize(
    ("decision", "outcome", "error"),
    [
        (LeaseLost("renewal_failed"), "lease_lost", "lease_lost"),
        (Poison(422, "bad payload", "e6"), "poison", "bad payload"),
    ],
)
def test_an_outcome_the_ingress_did_not_take_is_an_error(
    memory: tuple[Any, InMemorySpanExporter],
    decision: Decision | LeaseLost,
    outcome: str,
    error: str,
) -> None:
    tracer, exporter = memory
    span = tracer.delivery(_delivery())
    tracer.observe(_outcome(span, decision, None if outcome == "lease_lost" else 422), None)
    (delivery,) = exporter.get_finished_spans()
    assert delivery.status.status_code == StatusCode.ERROR
    assert delivery.status.description == error
    attrs = dict(delivery.attributes or {})
    assert attrs["relay.outcome"] == outcome
    if outcome == "poison":
        assert attrs["relay.rejected_event_id"] == "e6" and attrs["relay.error"] == "bad payload"
    else:
        assert attrs["relay.where"] == "renewal_failed"


def test_a_post_without_an_answer_shows_why(memory: tuple[Any, InMemorySpanExporter]) -> None:
    tracer, exporter = memory
    span = tracer.delivery(_delivery())
    with span.post("http://ingress/x") as post:
        post.failed("ConnectError: connection refused")
    retry = Retry(1.0, None, "ConnectError: connection refused", None, quick=False)
    tracer.observe(_outcome(span, retry, None), None)
    post_span, delivery = exporter.get_finished_spans()
    assert post_span.status.status_code == StatusCode.ERROR
    assert post_span.status.description == "ConnectError: connection refused"
    post_attrs = dict(post_span.attributes or {})
    assert post_attrs["error.type"] == "ConnectError"
    assert "http.response.status_code" not in post_attrs
    attrs = dict(delivery.attributes or {})
    assert attrs["relay.error"] == "ConnectError: connection refused"
    assert "relay.status" not in attrs


def test_a_delivery_the_sampler_drops_records_nothing_but_passes_the_decision_on(
    memory: tuple[Any, InMemorySpanExporter],
) -> None:
    """The producer's trace was not sampled (flags 00) and the sampler follows its parent: no
    span is exported, yet the ingress gets the trace with a span id of the relay's own and the
    sampled flag off, and the log lines still name the trace."""
    tracer, exporter = memory
    unsampled = f"00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-00"
    span = tracer.delivery(_delivery(traceparents=[unsampled, TP2]))
    with span.post("http://ingress/x") as post:
        post.answered(200)
        sent = post.traceparent
    tracer.observe(_outcome(span, Ack(4)), ACKED)
    assert exporter.get_finished_spans() == ()
    assert sent is not None
    version, trace_id, span_id, flags = sent.split("-")
    assert (version, trace_id, flags) == ("00", PRODUCER_TRACE, "00")
    assert span_id not in (PRODUCER_SPAN, "0" * 16, span.span_id)
    assert span.trace_id == PRODUCER_TRACE and span.span_id is not None


def _sampled_by(
    monkeypatch: pytest.MonkeyPatch, sampler: str, traceparents: list[str | None]
) -> list[bool]:
    """Whether each delivery (one event, with this traceparent) was recorded, in order."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.5")
    exporter = InMemorySpanExporter()
    tracer = otel.OtelTracer(processor=SimpleSpanProcessor(exporter))
    recorded = []
    for tp in traceparents:
        span = tracer.delivery(_delivery(traceparents=[tp]))
        tracer.observe(_outcome(span, Ack(4)), ACKED)
        recorded.append(bool(exporter.get_finished_spans()))
        exporter.clear()
    assert tracer.shutdown(10)
    return recorded


def test_the_sdk_samples_as_the_variables_say_following_each_deliverys_own_parent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sampled, unsampled = TP1, f"00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-00"
    order = [sampled, unsampled, None, unsampled, sampled, None]
    on, off = "parentbased_always_on", "parentbased_always_off"
    assert _sampled_by(monkeypatch, on, order) == [True, False, True, False, True, True]
    assert _sampled_by(monkeypatch, off, order) == [True, False, False, False, True, False]
    # traceidratio 0.5: a trace id whose low 64 bits are small is sampled, a large one is not
    low, high = f"00-{'0' * 31}1-{PRODUCER_SPAN}-01", f"00-{'f' * 32}-{PRODUCER_SPAN}-01"
    assert _sampled_by(monkeypatch, "traceidratio", [low, high, low]) == [True, False, True]


@pytest.mark.parametrize(
    "bad",
    [
        "not a traceparent",
        f"ff-{PRODUCER_TRACE}-{PRODUCER_SPAN}-01",  # version ff is invalid
        f"00-{'0' * 32}-{PRODUCER_SPAN}-01",  # all-zero trace id
        f"00-{PRODUCER_TRACE}-{'0' * 16}-01",  # all-zero span id
        f"00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-01-more",  # version 00 has four fields
        f"00-{PRODUCER_TRACE.upper()}-{PRODUCER_SPAN}-01",  # hex is lower case
    ],
)
def test_a_traceparent_that_is_not_w3c_is_neither_parent_nor_link(
    memory: tuple[Any, InMemorySpanExporter], bad: str
) -> None:
    tracer, exporter = memory
    span = tracer.delivery(_delivery(traceparents=[bad, bad]))
    tracer.observe(_outcome(span, Ack(4)), ACKED)
    (delivery,) = exporter.get_finished_spans()
    assert delivery.parent is None and list(delivery.links) == []
    assert f"{delivery.context.trace_id:032x}" != PRODUCER_TRACE


# -- the span limits: the SDK's, from the OTEL_*_LIMIT variables ----------------------------------


def _traced(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str]
) -> tuple[Any, InMemorySpanExporter]:
    """A tracer started by `environ` (with an endpoint) that records into memory."""
    for name, value in {"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, **environ}.items():
        monkeypatch.setenv(name, value)
    assert start_tracing(os.environ).enabled  # the variables pass the start's checks
    exporter = InMemorySpanExporter()
    return otel.OtelTracer(processor=SimpleSpanProcessor(exporter)), exporter


def _failed_delivery(tracer: Any, error: str, **change: Any) -> None:
    """One delivery whose POST failed with `error`, observed."""
    span = tracer.delivery(_delivery(**change))
    with span.post("http://ingress.example/runs/run-1/events") as post:
        post.failed(error)
    tracer.observe(_outcome(span, Retry(1.5, None, error, None, quick=False), None), None)


@pytest.mark.parametrize(
    ("environ", "cut"),
    [
        ({"OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "12"}, 12),
        ({"OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT": "7"}, 7),
        # the span's own variable over the general one
        (
            {
                "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "3",
                "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT": "9",
            },
            9,
        ),
    ],
)
def test_a_long_attribute_value_is_cut_to_the_length_limit(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], cut: int
) -> None:
    tracer, exporter = _traced(monkeypatch, environ)
    error = "ConnectError: " + "x" * 300
    _failed_delivery(tracer, error, run_id="run-" + "r" * 40)
    assert tracer.shutdown(10)
    post_span, delivery = exporter.get_finished_spans()
    attrs = dict(delivery.attributes or {})
    assert attrs["relay.error"] == error[:cut]
    assert attrs["relay.run_id"] == ("run-" + "r" * 40)[:cut]
    assert attrs["relay.epoch"] == 3 and attrs["relay.retry_in"] == 1.5  # numbers are not cut
    assert delivery.dropped_attributes == 0
    assert (
        dict(post_span.attributes or {})["url.full"]
        == "http://ingress.example/runs/run-1/events"[:cut]
    )


def test_attributes_events_and_links_beyond_their_limits_are_dropped_and_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tracer, exporter = _traced(
        monkeypatch,
        {
            "OTEL_ATTRIBUTE_COUNT_LIMIT": "50",
            "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "4",
            "OTEL_SPAN_LINK_COUNT_LIMIT": "2",
            "OTEL_SPAN_EVENT_COUNT_LIMIT": "0",
        },
    )
    others = [f"00-{i:032x}-{PRODUCER_SPAN}-01" for i in range(1, 5)]
    span = tracer.delivery(_delivery(traceparents=[TP1, *others]))
    tracer.observe(_outcome(span, Ack(4)), ACKED)
    assert tracer.shutdown(10)
    (delivery,) = exporter.get_finished_spans()
    assert len(delivery.attributes or {}) == 4 and delivery.dropped_attributes >= 8
    assert len(delivery.links) == 2 and delivery.dropped_links == 2
    assert list(delivery.events) == [] and delivery.dropped_events == 1


def test_within_the_default_limits_nothing_is_cut_or_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tracer, exporter = _traced(monkeypatch, {})
    error = "ConnectError: " + "x" * 300
    _failed_delivery(tracer, error)
    assert tracer.shutdown(10)
    _, delivery = exporter.get_finished_spans()
    assert dict(delivery.attributes or {})["relay.error"] == error[:200]  # the relay's own cut
    dropped = (delivery.dropped_attributes, delivery.dropped_events, delivery.dropped_links)
    assert dropped == (0, 0, 0)


@pytest.mark.parametrize(
    "name",
    [
        "OTEL_ATTRIBUTE_COUNT_LIMIT",
        "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT",
        "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT",
        "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT",
        "OTEL_SPAN_EVENT_COUNT_LIMIT",
        "OTEL_SPAN_LINK_COUNT_LIMIT",
        "OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT",
        "OTEL_LINK_ATTRIBUTE_COUNT_LIMIT",
    ],
)
@pytest.mark.parametrize("bad", ["-1", "ten", "1.5", "1e3"])
def test_a_bad_limit_is_refused_at_start_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, bad: str
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", ENDPOINT)
    monkeypatch.setenv(name, bad)
    with pytest.raises(ConfigError, match=f"^{name} must be a non-negative integer"):
        start_tracing(os.environ)


# -- through the real exporter into a real OTLP/HTTP receiver ------------------------------------


class _Receiver(BaseHTTPRequestHandler):
    got: list[tuple[str, bytes]]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        self.got.append((self.path, body))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
    got: list[tuple[str, bytes]] = []
    handler = type("Handler", (_Receiver,), {"got": got})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", got
    server.shutdown()
    server.server_close()


def test_spans_arrive_at_an_otlp_receiver_with_their_parent_and_service(
    receiver: tuple[str, list[tuple[str, bytes]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    base, got = receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", base)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "relay-t")
    tracer = start_tracing(os.environ)
    assert tracer.enabled
    span = tracer.delivery(_delivery(lane="ordinary"))
    with span.post(base + "/ingress") as post:
        post.answered(200)
    tracer.observe(_outcome(span, Ack(4)), ACKED)
    assert tracer.shutdown(10)  # flushes the batch processor

    assert [path for path, _ in got] == ["/v1/traces"]
    request = ExportTraceServiceRequest()
    request.ParseFromString(got[0][1])
    (resource_spans,) = request.resource_spans
    service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert service["service.name"] == "relay-t"
    assert [s.scope.name for s in resource_spans.scope_spans] == ["ledger-relay"]
    spans = {s.name: s for scope in resource_spans.scope_spans for s in scope.spans}
    assert set(spans) == {"deliver ordinary", "POST"}
    delivery, post_span = spans["deliver ordinary"], spans["POST"]
    assert delivery.trace_id.hex() == PRODUCER_TRACE
    assert delivery.parent_span_id.hex() == PRODUCER_SPAN
    assert post_span.parent_span_id == delivery.span_id
    assert [link.trace_id.hex() for link in delivery.links] == ["1" * 32]


def _spans(got: list[tuple[str, bytes]]) -> list[Any]:
    spans = []
    for _, body in got:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource_spans in request.resource_spans:
            for scope in resource_spans.scope_spans:
                spans.extend(scope.spans)
    return spans


@pytest.mark.anyio
async def test_a_runs_trace_goes_from_the_producer_through_the_relay_to_the_ingress(
    pg_url: str,
    schema: str,
    conn: psycopg.Connection[Any],
    sink: tuple[Sink, str],
    receiver: tuple[str, list[tuple[str, bytes]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The whole path with the real relay: the producer's span (its traceparent, stored with
    the events), the relay's delivery span as its child with the POST inside, exported through
    the real OTLP/HTTP exporter, and the ingress receiving the relay's POST span as parent."""
    s, url = sink
    base, got = receiver
    with conn.transaction():
        for i, tp in enumerate([TP1, TP2, TP1]):
            relay.enqueue(
                conn, "traced", f"t{i}", "step", {"i": i}, traceparent=tp, schema=schema,
                terminal=i == 2,
            )  # fmt: skip
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", base)
    tracer = start_tracing(os.environ)
    async with Relay(settings(pg_url, schema, url), tracer=tracer).running():
        await wait_for(lambda: "t2" in s.state.deliveries, what="the run delivered")
    # The relay flushed its spans on the way out.
    spans = _spans(got)
    (delivery,) = [x for x in spans if x.name.startswith("deliver ")]
    (post,) = [x for x in spans if x.name == "POST"]
    attrs = {a.key: a.value for a in delivery.attributes}
    assert attrs["relay.run_id"].string_value == "traced"
    assert attrs["relay.outcome"].string_value == "accepted"
    assert (attrs["relay.seq.first"].int_value, attrs["relay.seq.last"].int_value) == (1, 3)
    assert delivery.trace_id.hex() == PRODUCER_TRACE
    assert delivery.parent_span_id.hex() == PRODUCER_SPAN
    assert [link.trace_id.hex() for link in delivery.links] == ["1" * 32]
    assert [e.name for e in delivery.events] == ["acked"]
    assert post.parent_span_id == delivery.span_id and post.trace_id == delivery.trace_id
    # The ingress saw the relay's POST span as the parent of whatever it does next.
    (request,) = [r for r in s.state.received if r["run_id"] == "traced"]
    assert request["headers"]["traceparent"] == f"00-{PRODUCER_TRACE}-{post.span_id.hex()}-01"


@pytest.mark.anyio
async def test_a_run_that_ends_with_an_error_still_exports_its_spans(
    pg_url: str,
    schema: str,
    conn: psycopg.Connection[Any],
    sink: tuple[Sink, str],
    receiver: tuple[str, list[tuple[str, bytes]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`relay run` ending in an error (here the retention task's store call fails once the run
    is delivered) exports what the batch processor holds on the way out, as a stop does. The
    processor's schedule is an hour, so nothing arrives but by that flush."""
    _, url = sink
    base, got = receiver
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "3600000")
    with conn.transaction():
        for i in range(3):
            relay.enqueue(
                conn, "crashing", f"c{i}", "step", {"i": i}, traceparent=TP1, schema=schema,
                terminal=i == 2,
            )  # fmt: skip
    broken = False

    async def prune(self: Store, retention: float, limit: int) -> int:
        if broken:
            raise RuntimeError("the store broke")
        return 0

    monkeypatch.setattr(Store, "prune", prune)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", base)
    tracer = start_tracing(os.environ)
    relay_ = Relay(
        settings(pg_url, schema, url, retention=3600), tracer=tracer, prune_interval=0.01
    )
    with pytest.raises(BaseExceptionGroup) as ended:
        async with anyio.create_task_group() as tg:
            await tg.start(relay_.run)
            await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 3, what="acks")
            assert got == []  # nothing exported yet: the batch processor holds the spans
            broken = True
            with anyio.fail_after(60):  # a deadline for the relay to end, not a threshold
                await anyio.sleep_forever()
    assert ended.group_contains(RuntimeError, match="the store broke")
    spans = _spans(got)
    (delivery,) = [x for x in spans if x.name.startswith("deliver ")]
    assert {a.key: a.value for a in delivery.attributes}["relay.run_id"].string_value == "crashing"
    assert [e.name for e in delivery.events] == ["acked"]
    assert [x.parent_span_id for x in spans if x.name == "POST"] == [delivery.span_id]


# -- one observer, after the writes ----------------------------------------------------------------


class _Recording(Tracer):
    """A tracer that records which delivery spans it started and which outcomes it observed,
    with what the database said of the run when each was observed."""

    enabled = True

    def __init__(self, conn: psycopg.Connection[Any], schema: str) -> None:
        self.conn = conn
        self.schema = schema
        self.started: list[DeliverySpan] = []
        self.observed: list[tuple[DeliverySpan, str, str | None, int]] = []

    def delivery(self, d: Delivery) -> DeliverySpan:
        span = DeliverySpan()
        self.started.append(span)
        return span

    def observe(self, outcome: Outcome, ack: AckResult | None) -> None:
        name = type(outcome.decision).__name__
        # what is written of the run by now: its delivered events
        where = f"state = 'delivered' and run_id = '{outcome.run_id}'"
        delivered = count(self.conn, self.schema, where)
        self.observed.append((outcome.span, name, None if ack is None else ack.status, delivered))


@pytest.mark.anyio
async def test_every_outcome_is_observed_once_after_it_is_written(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str]
) -> None:
    """Accepted, transient and poison deliveries (the poison one narrowed one event at a time,
    each resend a delivery of its own): every delivery span the executor started reaches the
    observer exactly once, and an ack is observed only once it is written."""
    s, url = sink
    s.faults.poison("p-1")
    s.faults.fail(503, run_id="t", retry_after="0")  # no quick retry: an outcome
    with conn.transaction():
        for run_id in ("ok", "t", "p"):
            for i in range(3):
                relay.enqueue(conn, run_id, f"{run_id}-{i}", "step", {"i": i}, schema=schema)
    tracer = _Recording(conn, schema)
    async with Relay(settings(pg_url, schema, url), tracer=tracer).running():
        await wait_for(lambda: count(conn, schema, "state = 'failed'") == 1, what="the poison")
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 7, what="the rest")
    observed = [span for span, *_ in tracer.observed]
    assert len(observed) == len(set(map(id, observed)))  # once each
    assert {id(span) for span in observed} == {id(span) for span in tracer.started}
    names = [name for _, name, _, _ in tracer.observed]
    assert {"Ack", "Retry", "Poison"} <= set(names)
    for _, name, ack, delivered in tracer.observed:
        if ack == "acked":
            assert name == "Ack" and delivered > 0  # observed after the ack committed


# -- a stopping relay and a collector that drips its answer --------------------------------------


class _DrippingCollector:
    """An OTLP/HTTP endpoint on a real socket that reads each request and then answers one byte
    at a time, a header line that never ends, until `DRIP_SECONDS` have passed or it is
    stopped: what held a stopping relay for 718 s."""

    DRIP_SECONDS = 40.0

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.answering = threading.Event()  # a request was read; its answer is dripping
        self.done = threading.Event()  # stopped, or a drip ran its whole course
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            answer = self._answer if self.stopping.is_set() else self._drip
            threading.Thread(target=answer, args=(client,), daemon=True).start()

    def _answer(self, client: socket.socket) -> None:
        """Once the drips are stopped, an export the exporter retries is answered at once."""
        with client:
            client.recv(65536)
            client.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")

    def _drip(self, client: socket.socket) -> None:
        with client:
            client.recv(65536)  # the request's head (and some of its body)
            self.answering.set()
            try:
                client.sendall(b"HTTP/1.1 200 OK\r\nx-drip: ")
                # each byte restarts the client's read timeout: the answer never times out
                for _ in range(int(self.DRIP_SECONDS / 0.1)):
                    if self.stopping.wait(0.1):
                        return
                    client.sendall(b"x")
            except OSError:
                return
            self.done.set()  # the whole drip: a relay still waiting now waited too long

    def stop_dripping(self) -> None:
        """End every drip; from now on each request is answered 200 at once."""
        self.stopping.set()

    def close(self) -> None:
        self.stopping.set()
        self.listener.close()


@pytest.fixture
def dripping() -> Iterator[_DrippingCollector]:
    collector = _DrippingCollector()
    yield collector
    collector.close()


@pytest.mark.anyio
async def test_a_collector_that_drips_its_answer_cannot_hold_a_stopping_relay(
    pg_url: str,
    schema: str,
    conn: psycopg.Connection[Any],
    sink: tuple[Sink, str],
    dripping: _DrippingCollector,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The exporter is stuck reading an answer that never ends when the relay is told to stop:
    the relay waits for its spans for at most its flush bound (a quarter of shutdown_timeout)
    and returns while the collector is still dripping."""
    _, url = sink
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", dripping.url)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")  # export each span soon after it ends
    with conn.transaction():
        for i in range(3):
            relay.enqueue(conn, "dripped", f"d{i}", "step", {"i": i}, schema=schema)
    tracer = start_tracing(os.environ)
    relay_ = Relay(settings(pg_url, schema, url, shutdown_timeout=1), tracer=tracer)
    # A hang detector, not a threshold: far beyond the 0.25 s bound, well short of the drip.
    with anyio.fail_after(_DrippingCollector.DRIP_SECONDS / 2):
        async with relay_.running():
            await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 3, what="acks")
            await wait_for(dripping.answering.is_set, what="an export answered drop by drop")
    assert not dripping.done.is_set()  # the relay was back while the collector still dripped
    # The flush the relay left behind must end inside this test: its exporter retries a cut
    # answer, and a retry reaching a later test's HTTP_PROXY was taken for that test's traffic.
    dripping.stop_dripping()
    assert await anyio.to_thread.run_sync(tracer.shutdown, 30.0), "the left flush never ended"
