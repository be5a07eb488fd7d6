"""The relay's OTLP body (relay/integrations/otlp.py): what it writes parses back to the message
the SDK's own encoder builds, for every span shape and attribute type the relay can send, and
the exporter sends it through the SDK exporter's client."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

otlp = pytest.importorskip("relay.integrations.otlp", reason="the otel extra is not installed")
from opentelemetry.attributes import BoundedAttributes  # noqa: E402
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # noqa: E402
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
)
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import Event, ReadableSpan  # noqa: E402
from opentelemetry.sdk.trace.export import SpanExportResult  # noqa: E402
from opentelemetry.sdk.util import BoundedList  # noqa: E402
from opentelemetry.sdk.util.instrumentation import InstrumentationScope  # noqa: E402
from opentelemetry.trace import (  # noqa: E402
    Link,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

RESOURCE = Resource.create({"service.name": "ledger-relay", "host.count": 2})
SCOPE = InstrumentationScope("ledger-relay", "1.2.3")
REMOTE = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=True)
OTHER = SpanContext(1, 2, is_remote=True, trace_flags=TraceFlags(1))


def _span(**change: Any) -> ReadableSpan:
    fields: dict[str, Any] = {
        "name": "deliver ordinary",
        "context": SpanContext(REMOTE.trace_id, 0x1234, is_remote=False, trace_flags=TraceFlags(1)),
        "parent": REMOTE,
        "resource": RESOURCE,
        "attributes": {"messaging.system": "ledger_relay", "relay.epoch": 3},
        "kind": SpanKind.CONSUMER,
        "start_time": 1_700_000_000_000_000_000,
        "end_time": 1_700_000_000_123_456_789,
        "instrumentation_scope": SCOPE,
    }
    return ReadableSpan(**(fields | change))


def _dropped(attributes: dict[str, Any], n: int) -> BoundedAttributes:
    bounded = BoundedAttributes(None, attributes)
    bounded.dropped = n
    return bounded


def _links(n: int, dropped: int) -> BoundedList[Link]:
    links = BoundedList.from_seq(n, [Link(OTHER)] * n)
    links.dropped = dropped
    return links


def _events(n: int, dropped: int) -> BoundedList[Event]:
    events = BoundedList.from_seq(n, [Event("acked", {"events": 1}, 7)] * n)
    events.dropped = dropped
    return events


SPANS = {
    "remote parent": _span(),
    "root": _span(parent=None),
    "local parent, client": _span(
        name="POST", kind=SpanKind.CLIENT, parent=SpanContext(1, 9, False)
    ),
    "every attribute type": _span(
        attributes={
            "s": "text",
            "empty": "",
            "unicode": "Zürich ✓",
            "long": "x" * 300,  # lengths over 127 take a two-byte varint
            "yes": True,
            "no": False,
            "zero": 0,
            "big": 2**62,
            "negative": -5,
            "float": 0.25,
            "bytes": b"\x00\x01",
            "strings": ("a", "b"),
            "ints": [1, 2, 3],
            "empty list": (),
        }
    ),
    "no attributes": _span(attributes=None),
    "error with description": _span(status=Status(StatusCode.ERROR, "503 Service Unavailable")),
    "error without": _span(status=Status(StatusCode.ERROR)),
    "ok": _span(status=Status(StatusCode.OK)),
    "events": _span(
        events=[
            Event("acked", {"status": "acked", "events": 10, "last_seq": 10}, 1_700_000_000_1),
            Event("poison_narrowing", None, 5),
            Event("cut", _dropped({"a": "b"}, 2), 6),
        ]
    ),
    "links": _span(links=[Link(OTHER), Link(SpanContext(3, 4, is_remote=False))]),
    "dropped": _span(attributes=_dropped({"a": 1}, 4), links=_links(2, 7), events=_events(1, 3)),
    "trace state": _span(
        context=SpanContext(
            5, 6, is_remote=False, trace_state=TraceState([("vendor", "x"), ("other", "y=1")])
        )
    ),
    "no scope": _span(instrumentation_scope=None),
}


def _parsed(body: bytes) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    return request


@pytest.mark.parametrize("shape", list(SPANS))
def test_a_span_is_written_as_the_sdk_encodes_it(shape: str) -> None:
    spans = [SPANS[shape]]
    assert _parsed(otlp.encode(spans)) == encode_spans(spans)


def test_a_batch_is_grouped_by_resource_and_scope_as_the_sdk_groups_it() -> None:
    other_resource = Resource.create({"service.name": "other"})
    other_scope = InstrumentationScope("other", schema_url="https://opentelemetry.io/schemas/1.2")
    batch = [
        SPANS["remote parent"],
        _span(resource=other_resource),
        SPANS["events"],
        _span(instrumentation_scope=other_scope),
        _span(resource=Resource({"a": "b"}, "https://opentelemetry.io/schemas/1.1")),
        SPANS["links"],
    ]
    assert _parsed(otlp.encode(batch)) == encode_spans(batch)


def test_one_key_with_values_of_every_length_in_one_batch() -> None:
    """The encoder keeps an attribute's bytes before its value per key and value length: spans
    whose values under the same keys differ in length (across the one- and two-byte varints)
    are each written as the SDK encodes them."""
    batch = [
        _span(attributes={"s": "x" * n, "i": i, "f": float(n)})
        for n, i in [(0, 0), (1, 127), (127, 128), (128, 2**40), (300, -1), (1, 5)]
    ]
    assert _parsed(otlp.encode(batch)) == encode_spans(batch)


def test_an_empty_batch_is_an_empty_request() -> None:
    assert otlp.encode([]) == b"" and encode_spans([]).SerializeToString() == b""


def test_a_value_no_attribute_can_hold_is_refused() -> None:
    with pytest.raises(TypeError, match="invalid attribute value type"):
        otlp.encode([_span(attributes={"x": object()})])


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[bytes]]]:
    """An OTLP/HTTP endpoint that keeps each body and answers 200."""
    got: list[bytes] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            got.append(self.rfile.read(int(self.headers["content-length"])))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", got
    server.shutdown()
    server.server_close()


def test_the_exporter_posts_the_relays_body(receiver: tuple[str, list[bytes]]) -> None:
    url, got = receiver
    exporter = otlp.RelayOTLPSpanExporter(url)
    assert exporter._direct  # the SDK exporter still has what the relay's export uses
    spans = [SPANS["remote parent"], SPANS["events"]]
    assert exporter.export(spans) is SpanExportResult.SUCCESS
    exporter._direct = False  # the SDK's own export, as after an SDK change: the same request
    assert exporter.export(spans) is SpanExportResult.SUCCESS
    exporter.shutdown()
    assert [_parsed(body) for body in got] == [encode_spans(spans)] * 2
