"""The OTLP/HTTP traces exporter of the relay's spans: the SDK's, with the protobuf body written
directly (the `otel` extra; issue 31).

The SDK's exporter builds the body as protobuf message objects, a `KeyValue` and an `AnyValue`
per attribute, a `Span` per span, each copied into its parent, then serializes them: about 35 µs
a span for the relay's two span shapes, on the batch processor's thread, which shares the GIL
with the event loop (docs/performance.md, "Tracing"). `encode` writes the same
`ExportTraceServiceRequest` (opentelemetry-proto's trace_service.proto) as bytes in one pass.
tests/test_tracing.py parses what it writes and compares it with the SDK encoder's message, for
spans with and without parents, links, events, errors and every attribute type.

Everything else is the SDK exporter's own: its endpoint, headers, compression, timeout, TLS and
retries (`OTEL_EXPORTER_OTLP_*`), its size limit and its metrics. What `export` reuses of it is
not public (`_client`, `_metrics`, `_max_request_size`); when an SDK release changes them the
exporter falls back to the SDK's own `export` (checked once, at construction), so an upgrade
costs speed, never spans.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.trace import SpanKind

_logger = logging.getLogger(__name__)

_SMALL = [bytes([i]) for i in range(128)]
_DOUBLE = struct.Struct("<d").pack
_FIXED64 = struct.Struct("<Q").pack
_FIXED32 = struct.Struct("<I").pack
_KINDS = {
    SpanKind.INTERNAL: b"\x30\x01",
    SpanKind.SERVER: b"\x30\x02",
    SpanKind.CLIENT: b"\x30\x03",
    SpanKind.PRODUCER: b"\x30\x04",
    SpanKind.CONSUMER: b"\x30\x05",
}
# Span.flags: the parent's is-remote bit is known (0x100), and set (0x200) for a remote parent.
_LOCAL_PARENT = b"\x85\x01" + _FIXED32(0x100)
_REMOTE_PARENT = b"\x85\x01" + _FIXED32(0x300)


def _varint(n: int) -> bytes:
    if n < 128:
        return _SMALL[n]
    out = bytearray()
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag byte(s), the length, the payload."""
    n = len(payload)
    return tag + (_SMALL[n] if n < 128 else _varint(n)) + payload


def _text(tag: bytes, text: str) -> bytes:
    return _field(tag, text.encode())


def _value(value: Any) -> bytes:
    """An AnyValue's fields, as the SDK's `_encode_value` chooses them."""
    if isinstance(value, bool):  # before int: a bool is an int
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _text(b"\x0a", value)
    if isinstance(value, int):
        return b"\x18" + _varint(value & 0xFFFFFFFFFFFFFFFF)  # int64: two's complement
    if isinstance(value, float):
        return b"\x21" + _DOUBLE(value)
    if value is None:
        return b""
    if isinstance(value, bytes):
        return _field(b"\x3a", value)
    if isinstance(value, Sequence):
        return _field(b"\x2a", b"".join(_field(b"\x0a", _value(v)) for v in value))
    if isinstance(value, Mapping):
        return _field(b"\x32", _attributes(b"\x0a", {str(k): v for k, v in value.items()}))
    raise TypeError(f"invalid attribute value type {type(value).__name__}: {value!r}")


_KEYS: dict[str, bytes] = {}  # KeyValue.key fields: the relay's attribute names, a few dozen


def _attributes(tag: bytes, attributes: Mapping[str, Any] | None) -> bytes:
    """Each attribute as a KeyValue field numbered by `tag`."""
    if not attributes:
        return b""
    out = []
    keys = _KEYS
    for key, value in attributes.items():
        head = keys.get(key)
        if head is None:
            head = _text(b"\x0a", key)
            if len(keys) < 1024:
                keys[key] = head
        if type(value) is str:  # most of them: AnyValue.string_value, inline
            text = value.encode()
            n = len(text)
            any_value = b"\x0a" + (_SMALL[n] if n < 128 else _varint(n)) + text
        else:
            any_value = _value(value)
        n = len(any_value)
        pair = head + b"\x12" + (_SMALL[n] if n < 128 else _varint(n)) + any_value
        n = len(pair)
        out.append(tag + (_SMALL[n] if n < 128 else _varint(n)) + pair)
    return b"".join(out)


def _count(tag: bytes, n: int) -> bytes:
    return tag + _varint(n) if n else b""


def _span(span: ReadableSpan) -> bytes:
    context = span.context
    assert context is not None
    parent = span.parent
    trace_state = context.trace_state
    state = ",".join(f"{k}={v}" for k, v in trace_state.items()) if trace_state else ""
    status = span.status
    parts = [
        b"\x0a\x10" + context.trace_id.to_bytes(16, "big"),
        b"\x12\x08" + context.span_id.to_bytes(8, "big"),
        _text(b"\x1a", state) if state else b"",
        b"\x22\x08" + parent.span_id.to_bytes(8, "big") if parent else b"",
        _text(b"\x2a", span.name),
        _KINDS[span.kind],
        b"\x39" + _FIXED64(span.start_time or 0),
        b"\x41" + _FIXED64(span.end_time or 0),
        _attributes(b"\x4a", span.attributes),
        _count(b"\x50", span.dropped_attributes),
    ]
    for event in span.events:
        parts.append(
            _field(
                b"\x5a",
                b"\x09"
                + _FIXED64(event.timestamp)
                + _text(b"\x12", event.name)
                + _attributes(b"\x1a", event.attributes)
                + _count(b"\x20", event.dropped_attributes),
            )
        )
    parts.append(_count(b"\x60", span.dropped_events))
    for link in span.links:
        linked = link.context
        parts.append(
            _field(
                b"\x6a",
                b"\x0a\x10"
                + linked.trace_id.to_bytes(16, "big")
                + b"\x12\x08"
                + linked.span_id.to_bytes(8, "big")
                + _attributes(b"\x22", link.attributes)
                + _count(b"\x28", link.dropped_attributes)
                + b"\x35"
                + _FIXED32(0x300 if linked.is_remote else 0x100),
            )
        )
    parts.append(_count(b"\x70", span.dropped_links))
    code = status.status_code.value
    parts.append(
        _field(
            b"\x7a",
            (_text(b"\x12", status.description) if status.description else b"")
            + (b"\x18" + _SMALL[code] if code else b""),
        )
    )
    parts.append(_REMOTE_PARENT if parent is not None and parent.is_remote else _LOCAL_PARENT)
    return _field(b"\x12", b"".join(parts))  # as ScopeSpans.spans (2)


def encode(spans: Sequence[ReadableSpan]) -> bytes:
    """An ExportTraceServiceRequest of `spans`, grouped by resource and then scope in the order
    first seen, as the SDK's `encode_spans` groups them."""
    groups: dict[Any, dict[Any, list[bytes]]] = {}
    for span in spans:
        by_scope = groups.setdefault(span.resource, {})
        by_scope.setdefault(span.instrumentation_scope, []).append(_span(span))
    out = []
    for resource, by_scope in groups.items():
        body = [_field(b"\x0a", _attributes(b"\x0a", resource.attributes))]
        for scope, encoded in by_scope.items():
            head = b"\x0a\x00"  # no scope: an empty one, as the SDK writes it
            if scope is not None:
                head = _field(
                    b"\x0a",
                    (_text(b"\x0a", scope.name) if scope.name else b"")
                    + (_text(b"\x12", scope.version) if scope.version else b"")
                    + _attributes(b"\x1a", scope.attributes),
                )
            schema = scope.schema_url if scope is not None else ""
            body.append(
                _field(
                    b"\x12", head + b"".join(encoded) + (_text(b"\x1a", schema) if schema else b"")
                )
            )
        if resource.schema_url:
            body.append(_text(b"\x1a", resource.schema_url))
        out.append(_field(b"\x0a", b"".join(body)))
    return b"".join(out)


class RelayOTLPSpanExporter(OTLPSpanExporter):
    """The SDK's OTLP/HTTP span exporter with `encode` writing its body."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint=endpoint)
        client = getattr(self, "_client", None)
        self._direct = (
            callable(getattr(client, "export", None))
            and hasattr(self, "_metrics")
            and hasattr(self, "_max_request_size")
        )

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not self._direct or self._shutdown:
            return super().export(spans)
        with self._metrics.export_operation(len(spans)) as result:
            try:
                body = encode(spans)
            except Exception as error:  # as the SDK's exporter: a batch lost, said in the log
                _logger.error("Failed to encode span batch: %s", error)
                result.error = error
                return SpanExportResult.FAILURE
            if 0 < self._max_request_size < len(body):
                _logger.warning(
                    "Dropping span batch: serialized size %d bytes exceeds max_request_size %d",
                    len(body),
                    self._max_request_size,
                )
                result.error = ValueError(f"span batch of {len(body)} bytes over the limit")
                return SpanExportResult.FAILURE
            sent = self._client.export(body)
            if not sent.success:
                result.error = sent.error
                if sent.status_code is not None:
                    result.error_attrs = {"http.response.status_code": sent.status_code}
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS
