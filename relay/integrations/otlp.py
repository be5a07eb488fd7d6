"""The OTLP/HTTP traces exporter of the relay's spans: the SDK's, with the protobuf body written
directly (the `otel` extra; issue 31).

The SDK's exporter builds the body as protobuf message objects, a `KeyValue` and an `AnyValue`
per attribute, a `Span` per span, each copied into its parent, then serializes them: about 35 µs
a span for the relay's two span shapes, on the batch processor's thread, which shares the GIL
with the event loop (docs/performance.md, "Tracing"). `encode` writes the same
`ExportTraceServiceRequest` (opentelemetry-proto's trace_service.proto) as bytes in one pass:
each span's fields appended to one list of byte strings and joined once, an attribute's bytes
up to its value cached per key and value length (`_KeyValues`), the relay's span names and
kinds cached whole. tests/test_tracing_otlp.py parses what it writes and compares it with the
SDK encoder's message, for spans with and without parents, links, events, errors and every
attribute type.

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
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

_logger = logging.getLogger(__name__)

_SMALL = [bytes([i]) for i in range(128)]
_INT64 = 0xFFFFFFFFFFFFFFFF
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
    if n < 16384:  # the lengths of most spans and of most ints the relay sends
        return bytes(((n & 0x7F) | 0x80, n >> 7))
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
        return b"\x18" + _varint(value & _INT64)  # int64: two's complement
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


class _KeyValues:
    """KeyValue fields numbered by one tag (a span's attributes, an event's...), written by
    prefixes cached per key: what comes before a string's text or an integer's varint depends
    only on the key and the value's encoded length, so a typical attribute costs a dict lookup
    and two appends. The relay's keys are a few dozen and its values' lengths vary little; the
    caches stop growing at `LIMIT` entries (what is not cached is computed each time)."""

    LIMIT = 4096

    def __init__(self, tag: bytes) -> None:
        self.tag = tag
        self.strings: dict[tuple[str, int], bytes] = {}  # (key, text length) -> up to the text
        self.ints: dict[tuple[str, int], bytes] = {}  # (key, varint length) -> up to the varint
        self.floats: dict[str, bytes] = {}  # key -> up to the double

    def _prefix(self, key: str, value_head: bytes, n: int) -> bytes:
        """A KeyValue's bytes up to its value's last `n` bytes, `value_head` being the AnyValue
        field's bytes before them."""
        head = _text(b"\x0a", key)
        any_length = len(value_head) + n
        pair_length = len(head) + 1 + len(_varint(any_length)) + any_length
        return self.tag + _varint(pair_length) + head + b"\x12" + _varint(any_length) + value_head

    def _string(self, key: str, n: int) -> bytes:
        prefix = self._prefix(key, b"\x0a" + _varint(n), n)
        if len(self.strings) < self.LIMIT:
            self.strings[key, n] = prefix
        return prefix

    def _int(self, key: str, n: int) -> bytes:
        prefix = self._prefix(key, b"\x18", n)
        if len(self.ints) < self.LIMIT:
            self.ints[key, n] = prefix
        return prefix

    def _float(self, key: str) -> bytes:
        prefix = self._prefix(key, b"\x21", 8)
        if len(self.floats) < self.LIMIT:
            self.floats[key] = prefix
        return prefix

    def write(self, attributes: Mapping[str, Any] | None, out: list[bytes]) -> None:
        """Append each attribute as a KeyValue field to `out`."""
        if not attributes:
            return
        strings, ints, floats = self.strings, self.ints, self.floats
        for key, value in attributes.items():
            kind = type(value)
            if kind is str:  # most of them: AnyValue.string_value
                text = value.encode()
                out.append(strings.get((key, len(text))) or self._string(key, len(text)))
                out.append(text)
            elif kind is int:  # AnyValue.int_value, an int64: two's complement
                number = _SMALL[value] if 0 <= value < 128 else _varint(value & _INT64)
                out.append(ints.get((key, len(number))) or self._int(key, len(number)))
                out.append(number)
            elif kind is float:
                out.append(floats.get(key) or self._float(key))
                out.append(_DOUBLE(value))
            else:
                out.append(_field(self.tag, _text(b"\x0a", key) + _field(b"\x12", _value(value))))


def _attributes(tag: bytes, attributes: Mapping[str, Any] | None) -> bytes:
    """Each attribute as a KeyValue field numbered by `tag` (uncached: the rare fields)."""
    if not attributes:
        return b""
    return b"".join(
        _field(tag, _text(b"\x0a", str(key)) + _field(b"\x12", _value(value)))
        for key, value in attributes.items()
    )


# Span.attributes (9), Event.attributes (3), Link.attributes (4), Resource.attributes (1)
_SPAN_ATTRIBUTES = _KeyValues(b"\x4a")
_EVENT_ATTRIBUTES = _KeyValues(b"\x1a")
_NAMES: dict[tuple[str, SpanKind], bytes] = {}  # Span.name and Span.kind: the relay's few spans
_STATUS_UNSET = b"\x7a\x00"
_TIMES = struct.Struct("<BQBQ").pack  # Span.start_time_unix_nano (7), end_time_unix_nano (8)


def _count(tag: bytes, n: int) -> bytes:
    return tag + _varint(n) if n else b""


def _name(name: str, kind: SpanKind) -> bytes:
    head = _NAMES.get((name, kind))
    if head is None:
        head = _text(b"\x2a", name) + _KINDS[kind]
        if len(_NAMES) < _KeyValues.LIMIT:
            _NAMES[name, kind] = head
    return head


def _event(event: Event) -> bytes:
    parts = [b"\x09" + _FIXED64(event.timestamp), _text(b"\x12", event.name)]
    _EVENT_ATTRIBUTES.write(event.attributes, parts)
    parts.append(_count(b"\x20", event.dropped_attributes))
    return _field(b"\x5a", b"".join(parts))


def _link(link: Link) -> bytes:
    linked = link.context
    return _field(
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


def _status(status: Status) -> bytes:
    code = status.status_code
    if code is StatusCode.UNSET and not status.description:
        return _STATUS_UNSET
    return _field(
        b"\x7a",
        (_text(b"\x12", status.description) if status.description else b"")
        + (b"\x18" + _SMALL[code.value] if code.value else b""),
    )


def _span(span: ReadableSpan, out: list[bytes]) -> None:
    """Append the span as a ScopeSpans.spans field (2) to `out`."""
    context = span.context
    assert context is not None
    parent = span.parent
    parts = [b"\x0a\x10", context.trace_id.to_bytes(16, "big"), b"\x12\x08"]
    parts.append(context.span_id.to_bytes(8, "big"))
    trace_state = context.trace_state
    if trace_state:
        parts.append(_text(b"\x1a", ",".join(f"{k}={v}" for k, v in trace_state.items())))
    if parent is not None:
        parts.append(b"\x22\x08")
        parts.append(parent.span_id.to_bytes(8, "big"))
    parts.append(_name(span.name, span.kind))
    parts.append(_TIMES(0x39, span.start_time or 0, 0x41, span.end_time or 0))
    _SPAN_ATTRIBUTES.write(span.attributes, parts)
    dropped = span.dropped_attributes
    if dropped:
        parts.append(b"\x50" + _varint(dropped))
    for event in span.events:
        parts.append(_event(event))
    dropped = span.dropped_events
    if dropped:
        parts.append(b"\x60" + _varint(dropped))
    for link in span.links:
        parts.append(_link(link))
    dropped = span.dropped_links
    if dropped:
        parts.append(b"\x70" + _varint(dropped))
    parts.append(_status(span.status))
    parts.append(_REMOTE_PARENT if parent is not None and parent.is_remote else _LOCAL_PARENT)
    body = b"".join(parts)
    out.append(b"\x12" + _varint(len(body)))
    out.append(body)


def _scope(scope: InstrumentationScope | None, spans: list[bytes]) -> bytes:
    """A ScopeSpans field (2) of the spans written by `_span`."""
    head = b"\x0a\x00"  # no scope: an empty one, as the SDK writes it
    if scope is not None:
        head = _field(
            b"\x0a",
            (_text(b"\x0a", scope.name) if scope.name else b"")
            + (_text(b"\x12", scope.version) if scope.version else b"")
            + _attributes(b"\x1a", scope.attributes),
        )
    schema = scope.schema_url if scope is not None else ""
    return _field(b"\x12", head + b"".join(spans) + (_text(b"\x1a", schema) if schema else b""))


def encode(spans: Sequence[ReadableSpan]) -> bytes:
    """An ExportTraceServiceRequest of `spans`, grouped by resource and then scope in the order
    first seen, as the SDK's `encode_spans` groups them."""
    groups: dict[Resource, dict[InstrumentationScope | None, list[bytes]]] = {}
    resource: Resource | None = None
    scope: InstrumentationScope | None = None
    current: list[bytes] = []
    for span in spans:
        # The relay's spans all share one resource and one scope: the same objects as the last
        # span's need no lookup (hashing a scope or a resource is a Python call).
        if span.resource is not resource or span.instrumentation_scope is not scope or not current:
            resource, scope = span.resource, span.instrumentation_scope
            current = groups.setdefault(resource, {}).setdefault(scope, [])
        _span(span, current)
    out = []
    for resource_, by_scope in groups.items():
        body = [_field(b"\x0a", _attributes(b"\x0a", resource_.attributes))]
        body.extend(_scope(scope_, encoded) for scope_, encoded in by_scope.items())
        if resource_.schema_url:
            body.append(_text(b"\x1a", resource_.schema_url))
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
