"""Tracing (issue 31): the standard variables turn it on, the spans' shape and parentage, and
the spans arriving at a real OTLP/HTTP receiver through the real exporter."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anyio
import psycopg
import pytest

import relay
from relay.integrations import start_tracing
from relay.runner import Relay
from relay.settings import ConfigError
from relay.store import Store
from relay.tools.sink import Sink
from relay.tracing import NO_TRACING, Delivery, TracingConfig, bounded, config_from_env
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

# -- the variables -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "want"),
    [
        ({}, None),
        ({"OTEL_SERVICE_NAME": "x"}, None),  # no endpoint: off
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_SDK_DISABLED": "TRUE"}, None),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT + "/"},
            TracingConfig(ENDPOINT + "/v1/traces", "ledger-relay", "parentbased_always_on", None),
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://ignored:1",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://collector:4318/custom",
                "OTEL_SERVICE_NAME": "relay-eu",
                "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                "OTEL_TRACES_SAMPLER_ARG": "0.25",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_SDK_DISABLED": "false",
            },
            TracingConfig(
                "https://collector:4318/custom", "relay-eu", "parentbased_traceidratio", 0.25
            ),
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


@pytest.fixture
def memory() -> Iterator[tuple[Any, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    config = TracingConfig(ENDPOINT + "/v1/traces", "ledger-relay", "parentbased_always_on", None)
    tracer = otel.OtelTracer(config, processor=SimpleSpanProcessor(exporter))
    yield tracer, exporter
    tracer.shutdown()


def test_a_delivery_is_a_child_of_the_first_events_trace_with_links_to_the_others(
    memory: tuple[Any, InMemorySpanExporter],
) -> None:
    tracer, exporter = memory
    span = tracer.delivery(_delivery())
    with span.post("http://ingress.example:8080/runs/run-1/events?sig=secret") as post:
        sent = post.traceparent
        post.answered(200)
    span.outcome("accepted", status=200)
    span.event("acked", wakes=1)
    span.end()
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
    assert [e.name for e in delivery.events] == ["acked"]
    assert span.trace_id == PRODUCER_TRACE and span.span_id == f"{delivery.context.span_id:016x}"

    # The POST: a client span inside the delivery, whose context is the header sent.
    assert post_span.kind == SpanKind.CLIENT and post_span.name == "POST"
    assert post_span.parent is not None and post_span.parent.span_id == delivery.context.span_id
    assert sent == f"00-{PRODUCER_TRACE}-{post_span.context.span_id:016x}-01"
    post_attrs = dict(post_span.attributes or {})
    assert post_attrs["http.response.status_code"] == 200
    assert post_attrs["url.full"] == "http://ingress.example:8080/runs/run-1/events"  # no query
    assert post_attrs["server.port"] == 8080


def test_the_post_span_never_carries_the_ingress_urls_credentials(
    memory: tuple[Any, InMemorySpanExporter],
) -> None:
    tracer, exporter = memory
    span = tracer.delivery(_delivery(traceparents=[None]))
    with span.post("https://relay:s3cret@ingress.example/runs/r/events?k=v") as post:
        post.answered(200)
    span.outcome("accepted")
    span.end()
    spans = exporter.get_finished_spans()
    assert spans, "no span exported"
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
    span.outcome("transient", status=503, retry_after=2.0, error="503 Service Unavailable")
    span.end()
    post_span, delivery = exporter.get_finished_spans()
    assert delivery.parent is None  # no producer trace: a root span
    assert delivery.status.status_code == StatusCode.ERROR
    assert dict(delivery.attributes or {})["relay.retry_after"] == 2.0
    assert post_span.status.status_code == StatusCode.ERROR
    assert dict(post_span.attributes or {})["error.type"] == "503"


def test_a_post_without_an_answer_shows_why(memory: tuple[Any, InMemorySpanExporter]) -> None:
    tracer, exporter = memory
    span = tracer.delivery(_delivery())
    with span.post("http://ingress/x") as post:
        post.failed("ConnectError: connection refused")
    span.outcome("transient", error="ConnectError: connection refused")
    span.end()
    post_span, delivery = exporter.get_finished_spans()
    assert post_span.status.status_code == StatusCode.ERROR
    assert post_span.status.description == "ConnectError: connection refused"
    post_attrs = dict(post_span.attributes or {})
    assert post_attrs["error.type"] == "ConnectError"
    assert "http.response.status_code" not in post_attrs
    assert dict(delivery.attributes or {})["relay.error"] == "ConnectError: connection refused"


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
    span.outcome("accepted", status=200)
    span.event("acked", status="acked")
    span.end()
    assert exporter.get_finished_spans() == ()
    assert sent is not None
    version, trace_id, span_id, flags = sent.split("-")
    assert (version, trace_id, flags) == ("00", PRODUCER_TRACE, "00")
    assert span_id not in (PRODUCER_SPAN, "0" * 16, span.span_id)
    assert span.trace_id == PRODUCER_TRACE and span.span_id is not None


def _sampled_by(sampler: str, traceparents: list[str | None]) -> list[bool]:
    """Whether each delivery (one event, with this traceparent) was recorded, in order."""
    exporter = InMemorySpanExporter()
    config = TracingConfig(ENDPOINT + "/v1/traces", "ledger-relay", sampler, 0.5)
    tracer = otel.OtelTracer(config, processor=SimpleSpanProcessor(exporter))
    recorded = []
    for tp in traceparents:
        span = tracer.delivery(_delivery(traceparents=[tp]))
        span.end()
        recorded.append(bool(exporter.get_finished_spans()))
        exporter.clear()
    tracer.shutdown()
    return recorded


def test_a_samplers_decision_follows_each_deliverys_own_parent() -> None:
    """A static sampler's decision is kept per kind of parent (none, sampled, not sampled), never
    one for all; a ratio sampler's, which depends on the trace id, is asked every time."""
    sampled, unsampled = TP1, f"00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-00"
    order = [sampled, unsampled, None, unsampled, sampled, None]
    assert _sampled_by("parentbased_always_on", order) == [True, False, True, False, True, True]
    assert _sampled_by("parentbased_always_off", order) == [True, False, False, False, True, False]
    # traceidratio 0.5: a trace id whose low 64 bits are small is sampled, a large one is not
    low, high = f"00-{'0' * 31}1-{PRODUCER_SPAN}-01", f"00-{'f' * 32}-{PRODUCER_SPAN}-01"
    assert _sampled_by("traceidratio", [low, high, low, high]) == [True, False, True, False]


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
    span.end()
    (delivery,) = exporter.get_finished_spans()
    assert delivery.parent is None and list(delivery.links) == []
    assert f"{delivery.context.trace_id:032x}" != PRODUCER_TRACE


# -- the span limits (OTEL_*_LIMIT) ----------------------------------------------------------------


def _traced(environ: dict[str, str]) -> tuple[Any, InMemorySpanExporter]:
    """A tracer configured by `environ` (with an endpoint) that records into memory."""
    config = config_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, **environ})
    assert config is not None
    exporter = InMemorySpanExporter()
    return otel.OtelTracer(config, processor=SimpleSpanProcessor(exporter)), exporter


def _failed_delivery(tracer: Any, error: str, **change: Any) -> Any:
    """One delivery whose POST failed with `error`, ended; its (POST, delivery) spans."""
    span = tracer.delivery(_delivery(**change))
    with span.post("http://ingress.example/runs/run-1/events") as post:
        post.failed(error)
    span.outcome("transient", error=error, retry_in=1.5)
    span.event("acked", status="none", events=0, last_seq=0)
    span.end()


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
    environ: dict[str, str], cut: int
) -> None:
    tracer, exporter = _traced(environ)
    error = "ConnectError: " + "x" * 300
    _failed_delivery(tracer, error, run_id="run-" + "r" * 40)
    tracer.shutdown()
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


def test_within_the_default_limits_nothing_is_cut_or_dropped() -> None:
    tracer, exporter = _traced({"OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": ""})  # empty: unset
    error = "ConnectError: " + "x" * 300
    _failed_delivery(tracer, error)
    tracer.shutdown()
    _, delivery = exporter.get_finished_spans()
    assert dict(delivery.attributes or {})["relay.error"] == error
    assert (delivery.dropped_attributes, delivery.dropped_events, delivery.dropped_links) == (
        0,
        0,
        0,
    )


def test_attributes_beyond_the_count_limit_are_dropped_and_counted() -> None:
    tracer, exporter = _traced(
        {"OTEL_ATTRIBUTE_COUNT_LIMIT": "50", "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "4"}
    )
    _failed_delivery(tracer, "ConnectError: refused")
    tracer.shutdown()
    post_span, delivery = exporter.get_finished_spans()
    # The first four set are kept, the rest dropped and counted (the specification's rule).
    assert list(delivery.attributes or {}) == [
        "messaging.system",
        "messaging.operation.type",
        "messaging.operation.name",
        "messaging.destination.name",
    ]
    assert delivery.dropped_attributes > 0
    assert len(delivery.attributes or {}) + delivery.dropped_attributes >= 12
    assert len(post_span.attributes or {}) == 4
    # The event's attributes have their own limit, the general one: 50.
    assert (
        delivery.events[0].dropped_attributes == 0 and len(delivery.events[0].attributes or {}) == 3
    )


def test_event_limits_apply_to_the_events_and_their_attributes() -> None:
    tracer, exporter = _traced(
        {
            "OTEL_SPAN_EVENT_COUNT_LIMIT": "1",
            "OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT": "2",
            "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "2",
        }
    )
    span = tracer.delivery(_delivery())
    span.event("poison_narrowing", named=True, events=4)
    span.event("acked", status="acked", events=4, last_seq=8)
    span.end()
    tracer.shutdown()
    (delivery,) = exporter.get_finished_spans()
    assert [e.name for e in delivery.events] == [
        "poison_narrowing"
    ] and delivery.dropped_events == 1
    (event,) = delivery.events
    assert dict(event.attributes or {}) == {"named": True, "events": 4}
    assert dict(delivery.attributes or {})["relay.run_id"] == "ru"  # the general length limit


def test_bounded_cuts_strings_and_bytes_alone_and_keeps_the_first_attributes() -> None:
    attributes = {"s": "abcdef", "seq": ("abcdef", "xy", 7), "b": b"abcdef", "n": 123456, "x": 1.5}
    assert bounded(attributes, None, 3) == (
        {"s": "abc", "seq": ("abc", "xy", 7), "b": b"abc", "n": 123456, "x": 1.5},
        0,
    )
    assert bounded(attributes, 2, None) == ({"s": "abcdef", "seq": ("abcdef", "xy", 7)}, 3)
    assert bounded(attributes, 0, 0) == ({}, 5)


def test_links_beyond_the_span_limit_are_dropped_and_counted() -> None:
    tracer, exporter = _traced({"OTEL_SPAN_LINK_COUNT_LIMIT": "2"})
    others = [f"00-{i:032x}-{PRODUCER_SPAN}-01" for i in range(1, 5)]
    tracer.delivery(_delivery(traceparents=[TP1, *others])).end()
    tracer.shutdown()
    (delivery,) = exporter.get_finished_spans()
    assert len(delivery.links) == 2 and delivery.dropped_links == 2
    # the first events' traces are kept
    assert [link.context.trace_id for link in delivery.links] == [1, 2]


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
def test_a_bad_limit_is_refused_at_start_naming_the_variable(name: str, bad: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name}: a non-negative integer, got '{bad}'$"):
        start_tracing({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, name: bad})


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
    receiver: tuple[str, list[tuple[str, bytes]]],
) -> None:
    base, got = receiver
    tracer = start_tracing({"OTEL_EXPORTER_OTLP_ENDPOINT": base, "OTEL_SERVICE_NAME": "relay-t"})
    assert tracer.enabled
    span = tracer.delivery(_delivery(lane="ordinary"))
    with span.post(base + "/ingress") as post:
        post.answered(200)
    span.outcome("accepted", status=200)
    span.end()
    tracer.shutdown()  # flushes the batch processor

    assert [path for path, _ in got] == ["/v1/traces"]
    request = ExportTraceServiceRequest()
    request.ParseFromString(got[0][1])
    (resource_spans,) = request.resource_spans
    service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert service["service.name"] == "relay-t"
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
    tracer = start_tracing({"OTEL_EXPORTER_OTLP_ENDPOINT": base})
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
    tracer = start_tracing({"OTEL_EXPORTER_OTLP_ENDPOINT": base})
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
