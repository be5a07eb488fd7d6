"""OpenTelemetry behind relay/tracing.py's port (the `otel` extra).

The delivery span is a CONSUMER span named `deliver <lane>`: a child of the first event's
producer trace when it carries a `traceparent`, with links to the other events' traces. The POST
is a CLIENT span inside it, and its context is the `traceparent` header the ingress receives, so
the ingress's own span is a child of the relay's. Attribute names follow OpenTelemetry's semantic
conventions where they have one (messaging, HTTP client); the relay's own are under `relay.`.

The spans are the SDK's and go out the SDK's way: its sampler decides (a static one, always on or
off, parent-based or not, once per kind of parent: `_Recorder.sample`), its random ids, a resource
from `Resource.create` (so `OTEL_RESOURCE_ATTRIBUTES` applies), its batch span processor and
OTLP/HTTP exporter (whose protobuf body relay/integrations/otlp.py writes, at about a fifth of
the SDK encoder's cost). What the relay does not use is the SDK's *live* span (`Tracer.start_span`,
`Span`): a lock, a context, `BoundedAttributes` checking every value, the tracer's metrics hooks,
per span, which cost the event loop about 85 µs per delivery against 12 µs this way (issue 31;
docs/performance.md, "Tracing"). A delivery's two spans are known in full when they end and
nothing but this module touches them, so each is a few plain fields until then, and is handed to
the processor once, as the `ReadableSpan` the SDK would have built (`SpanProcessor.on_end`).
Every value is the relay's own str, int or float, so there is nothing to check. The span limits
(`OTEL_*_LIMIT`, read once by relay/tracing.py) apply when a span is handed on: links beyond the
link count (a batch whose events come from many traces reaches it), events beyond the event
count, attributes beyond a count, string values cut to a length, each counted as dropped on the
span as the SDK's own would be (an event's attributes as the event is added, as the SDK's
`add_event` does). Within the defaults (128 of each, no length limit) the relay's
spans reach none of them, and what is checked per span is a length or two. `on_start` is not
called: the processors the relay runs (batch, and simple in tests) do nothing there.

A delivery the sampler drops builds no attributes or links and hands nothing on, but its POST
still sends a `traceparent` with a span id of its own and the sampled flag off, as the SDK's
non-recording span did, so the ingress follows the decision.
"""

from __future__ import annotations

import atexit
import re
from collections.abc import Mapping, Sequence
from functools import lru_cache
from time import time_ns
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    set_span_in_context,
)

from relay import __version__
from relay.integrations.otlp import RelayOTLPSpanExporter
from relay.settings import redact_url
from relay.tracing import (
    Delivery,
    DeliverySpan,
    PostSpan,
    SpanLimits,
    Tracer,
    TracingConfig,
    bounded,
)

SHUTDOWN_MILLIS = 5_000
# Outcomes of policy.decide that end a delivery without the ingress taking it.
ERROR_OUTCOMES = frozenset({"transient", "misconfigured", "poison", "lease_lost"})

_UNSET = Status(StatusCode.UNSET)
_ERROR = Status(StatusCode.ERROR)
_SAMPLED = TraceFlags.SAMPLED
_RANDOM = TraceFlags.RANDOM_TRACE_ID
# W3C trace context's traceparent, as opentelemetry's TraceContextTextMapPropagator reads it.
_TRACEPARENT = re.compile(
    r"[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:(-.*)|[ \t]*)"
)
_MAX_TRACEPARENT = 512
_ROOT = Context()  # a root delivery's parent context: none (never whatever is current)


# The samplers whose decision depends on the parent's flags alone (never on the trace id, the
# span's name or its attributes): `_Recorder.sample` asks them once per kind of parent.
STATIC_SAMPLERS = frozenset(
    {"always_on", "always_off", "parentbased_always_on", "parentbased_always_off"}
)


def _hex_trace_id(trace_id: int) -> str:
    """The id as W3C trace context writes it (lower-case hex, zero-padded): through bytes, three
    times as fast as a format spec on a 128-bit int."""
    return trace_id.to_bytes(16, "big").hex()


def _hex_span_id(span_id: int) -> str:
    return span_id.to_bytes(8, "big").hex()


_FLAGS = [f"{flags:02x}" for flags in range(256)]


def sampler_of(config: TracingConfig) -> Sampler:
    ratio = 1.0 if config.sampler_arg is None else config.sampler_arg
    root: Sampler = {
        "always_on": ALWAYS_ON,
        "always_off": ALWAYS_OFF,
        "traceidratio": TraceIdRatioBased(ratio),
    }[config.sampler.removeprefix("parentbased_")]
    return ParentBased(root) if config.sampler.startswith("parentbased_") else root


@lru_cache(maxsize=1024)
def _context_of(traceparent: str) -> SpanContext | None:
    """An event's stored `traceparent` as a remote span context, or None when it is not a
    valid one (the propagator's rules; tracestate is not stored with events). Cached: the events
    of a run mostly carry their producer's one header."""
    if len(traceparent) > _MAX_TRACEPARENT:
        return None
    match = _TRACEPARENT.fullmatch(traceparent)
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    if trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return SpanContext(
        int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=TraceFlags(int(flags, 16))
    )


def _url_attributes(url: str) -> dict[str, Any]:
    """The POST span's attributes of its URL: `url.full` without query or fragment, and the
    server. `urllib.parse` reads only the origin (scheme://host:port), once per origin: the
    ingress URL usually holds the run id, so the whole URL is new on every POST."""
    full = url.partition("#")[0].partition("?")[0]
    slash = full.find("/", full.find("://") + 3)
    origin = full if slash < 0 else full[:slash]
    normal, server = _origin(origin)
    attributes = server.copy()
    attributes["url.full"] = normal + full[len(origin) :]
    return attributes


@lru_cache(maxsize=64)
def _origin(origin: str) -> tuple[str, dict[str, Any]]:
    parts = urlsplit(origin)
    server: dict[str, Any] = {
        "http.request.method": "POST",
        "server.address": parts.hostname or "",
    }
    if parts.port:
        server["server.port"] = parts.port
    # userinfo in the ingress URL is a credential: never in a span (OpenTelemetry's HTTP
    # conventions say the same of url.full)
    return redact_url(parts.geturl()), server


class _Resource(Resource):
    """`Resource` with its hash computed once. The OTLP encoder groups every span it encodes by
    resource, and `Resource.__hash__` serializes the attributes to JSON each time (about 3 µs a
    span)."""

    def __init__(self, resource: Resource) -> None:
        super().__init__(resource.attributes, resource.schema_url)
        self._hash = super().__hash__()

    def __hash__(self) -> int:
        return self._hash


def _attributes(attributes: Mapping[str, Any], count: int | None, length: int | None) -> Any:
    """`attributes` within the limits, as the SDK's `BoundedAttributes` that carries the number
    dropped (which is where the OTLP encoder reads it)."""
    kept, dropped = bounded(attributes, count, length)
    result = BoundedAttributes(None, kept)
    result.dropped = dropped
    return result


class _Limits:
    """The span limits as `_Recorder.finish` applies them: nothing but a comparison or two per
    span while a span is within them. Each returns what is kept and how many were dropped."""

    def __init__(self, limits: SpanLimits) -> None:
        self.limits = limits

    def attributes(self, attributes: Mapping[str, Any]) -> tuple[Mapping[str, Any], int]:
        count, length = self.limits.attribute_count, self.limits.attribute_length
        if length is None and (count is None or len(attributes) <= count):
            return attributes, 0
        return bounded(attributes, count, length)

    def event(self, name: str, attributes: dict[str, Any], timestamp: int) -> Event:
        """An event, its attributes within their limits (applied as it is added, as the SDK's
        `add_event` does)."""
        count, length = self.limits.event_attribute_count, self.limits.event_attribute_length
        if length is None and (count is None or len(attributes) <= count):
            return Event(name, attributes, timestamp)
        return Event(name, _attributes(attributes, count, length), timestamp)

    def events(self, events: list[Event]) -> tuple[Sequence[Event], int]:
        limit = self.limits.event_count
        if limit is not None and len(events) > limit:
            # the first ones (a `BoundedList` would keep the last)
            return events[:limit], len(events) - limit
        return events, 0

    def links(self, links: Sequence[Link]) -> tuple[Sequence[Link], int]:
        limit = self.limits.link_count
        if limit is not None and len(links) > limit:
            # the first ones: the traces of the batch's first events
            return links[:limit], len(links) - limit
        return links, 0


class _Span(ReadableSpan):
    """The `ReadableSpan` the SDK would have built, with its dropped counts as plain fields: the
    SDK's properties test the type of each collection (an ABC check apiece), and the OTLP
    encoder reads all three for every span."""

    dropped_attributes: int = 0
    dropped_events: int = 0
    dropped_links: int = 0


class _Recorder:
    """What the tracer's spans share: where they go and what they are from."""

    def __init__(self, config: TracingConfig, processor: SpanProcessor) -> None:
        self.sampler = sampler_of(config)
        self.processor = processor
        self.resource = _Resource(Resource.create({"service.name": config.service_name}))
        self.scope = InstrumentationScope("ledger-relay", __version__)
        self.ids = RandomIdGenerator()
        self.limits = _Limits(config.limits)
        self.static = config.sampler in STATIC_SAMPLERS
        self._decisions: dict[int | None, SamplingResult] = {}

    def sample(self, parent: SpanContext | None, trace_id: int, name: str) -> SamplingResult:
        """The sampler's decision for a delivery span. A static sampler's is asked once per kind
        of parent (none, sampled, not sampled) and kept: the parents are the events' remote
        contexts, which carry no trace state, so it would answer each of a kind alike."""
        key = None if parent is None else parent.trace_flags & _SAMPLED
        if self.static and key in self._decisions:
            return self._decisions[key]
        # The sampler sees no attributes or links: none of the six it can be looks at them, and
        # a dropped delivery is not worth building them for.
        context = _ROOT if parent is None else set_span_in_context(NonRecordingSpan(parent))
        sampling = self.sampler.should_sample(context, trace_id, name, SpanKind.CONSUMER)
        if self.static:
            self._decisions[key] = sampling
        return sampling

    def finish(
        self,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        attributes: Mapping[str, Any],
        start: int,
        status: Status,
        events: list[Event] | None = None,
        links: Sequence[Link] | None = None,
    ) -> None:
        limits = self.limits
        attributes, dropped_attributes = limits.attributes(attributes)
        kept_events, dropped_events = limits.events(events) if events else ((), 0)
        kept_links, dropped_links = limits.links(links) if links else ((), 0)
        span = _Span(
            name=name,
            context=context,
            parent=parent,
            resource=self.resource,
            attributes=attributes,
            events=kept_events,
            links=kept_links,
            kind=kind,
            status=status,
            start_time=start,
            end_time=time_ns(),
            instrumentation_scope=self.scope,
        )
        if dropped_attributes:
            span.dropped_attributes = dropped_attributes
        if dropped_events:
            span.dropped_events = dropped_events
        if dropped_links:
            span.dropped_links = dropped_links
        self.processor.on_end(span)


class _OtelPost(PostSpan):
    """The POST: a CLIENT span, recorded when it ends (a sampled delivery's only)."""

    __slots__ = ("_delivery", "_error", "_span_id", "_start", "_status_code", "_url", "traceparent")

    def __init__(self, delivery: _OtelDelivery, url: str) -> None:
        self._delivery = delivery
        self._url = url
        context = delivery.context
        self._span_id = span_id = delivery.recorder.ids.generate_span_id()
        self.traceparent = (
            f"00-{_hex_trace_id(context.trace_id)}-{_hex_span_id(span_id)}"
            f"-{_FLAGS[context.trace_flags]}"
        )
        self._status_code: int | None = None
        self._error: str | None = None
        self._start = time_ns()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        delivery = self._delivery
        if not delivery.sampled:
            return
        attributes = _url_attributes(self._url)
        status = _UNSET
        code = self._status_code
        if code is not None:
            attributes["http.response.status_code"] = code
            if code >= 400:
                attributes["error.type"] = str(code)
                status = _ERROR
        elif self._error is not None:
            attributes["error.type"] = self._error.split(":", 1)[0]
            status = Status(StatusCode.ERROR, self._error)
        parent = delivery.context
        context = SpanContext(
            parent.trace_id,
            self._span_id,
            is_remote=False,
            trace_flags=parent.trace_flags,
            trace_state=parent.trace_state,
        )
        delivery.recorder.finish(
            "POST", context, parent, SpanKind.CLIENT, attributes, self._start, status
        )

    def answered(self, status: int) -> None:
        self._status_code = status

    def failed(self, error: str) -> None:
        self._error = error


class _OtelDelivery(DeliverySpan):
    """One delivery: a CONSUMER span, its attributes gathered in one dict of the relay's own
    values and recorded when it ends. Not sampled: only its context, for the POST's header."""

    __slots__ = (
        "_attributes",
        "_ended",
        "_events",
        "_links",
        "_name",
        "_parent",
        "_start",
        "_status",
        "context",
        "recorder",
        "sampled",
    )

    def __init__(
        self,
        recorder: _Recorder,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        attributes: dict[str, Any] | None,
        links: Sequence[Link] | None,
    ) -> None:
        self.recorder = recorder
        self.context = context
        self.sampled = attributes is not None
        self._name = name
        self._parent = parent
        self._attributes = attributes
        self._links = links
        self._events: list[Event] | None = None
        self._status = _UNSET
        self._ended = False
        self._start = time_ns()

    @property
    def trace_id(self) -> str:
        return _hex_trace_id(self.context.trace_id)

    @property
    def span_id(self) -> str:
        return _hex_span_id(self.context.span_id)

    def post(self, url: str) -> PostSpan:
        return _OtelPost(self, url)

    def outcome(self, outcome: str, **attributes: Any) -> None:
        record = self._attributes
        if record is None:
            return
        record["relay.outcome"] = outcome
        for key, value in attributes.items():
            if value is not None:
                record[f"relay.{key}"] = value
        if outcome in ERROR_OUTCOMES:
            self._status = Status(StatusCode.ERROR, str(attributes.get("error") or outcome))

    def event(self, name: str, **attributes: Any) -> None:
        if self._attributes is None:
            return
        event = self.recorder.limits.event(
            name, {k: v for k, v in attributes.items() if v is not None}, time_ns()
        )
        if self._events is None:
            self._events = [event]
        else:
            self._events.append(event)

    def end(self) -> None:
        if self._ended or self._attributes is None:
            return
        self._ended = True
        self.recorder.finish(
            self._name,
            self.context,
            self._parent,
            SpanKind.CONSUMER,
            self._attributes,
            self._start,
            self._status,
            self._events,
            self._links,
        )


class OtelTracer(Tracer):
    enabled = True

    def __init__(self, config: TracingConfig, processor: SpanProcessor | None = None) -> None:
        self.processor = processor or BatchSpanProcessor(RelayOTLPSpanExporter(config.endpoint))
        self.recorder = _Recorder(config, self.processor)
        self._shut = False
        # As the SDK's TracerProvider does: what is still buffered is exported at exit even if
        # the relay did not get to stop in order.
        atexit.register(self.shutdown)

    def delivery(self, d: Delivery) -> DeliverySpan:
        recorder = self.recorder
        first = d.traceparents[0] if d.traceparents else None
        parent = _context_of(first) if first else None
        name = f"deliver {d.lane}"
        if parent is None:
            trace_id = recorder.ids.generate_trace_id()
            flags = _RANDOM  # the id generator's trace ids are random
        else:
            trace_id = parent.trace_id
            flags = parent.trace_flags & _RANDOM
        sampling = recorder.sample(parent, trace_id, name)
        sampled = sampling.decision is Decision.RECORD_AND_SAMPLE
        context = SpanContext(
            trace_id,
            recorder.ids.generate_span_id(),
            is_remote=False,
            trace_flags=TraceFlags(flags | _SAMPLED if sampled else flags),
            trace_state=sampling.trace_state,
        )
        if not sampled:
            return _OtelDelivery(recorder, name, context, parent, None, None)
        attributes: dict[str, Any] = {
            "messaging.system": "ledger_relay",
            "messaging.operation.type": "process",
            "messaging.operation.name": "deliver",
            "messaging.destination.name": d.lane,
            "messaging.batch.message_count": d.events,
            "relay.run_id": d.run_id,
            "relay.epoch": d.epoch,
            "relay.seq.first": d.first_seq,
            "relay.seq.last": d.last_seq,
            "relay.attempt": d.attempt,
        }
        if d.outbox_wait_seconds is not None:
            attributes["relay.outbox_wait_seconds"] = d.outbox_wait_seconds
        if sampling.attributes:
            attributes.update(sampling.attributes)
        links = self._links(d, parent) if len(d.traceparents) > 1 else None
        return _OtelDelivery(recorder, name, context, parent, attributes, links)

    def _links(self, d: Delivery, parent: SpanContext | None) -> Sequence[Link] | None:
        """A link to each other trace among the events' (the parent's is not linked)."""
        seen = {parent.trace_id} if parent else set()
        links: list[Link] | None = None
        for tp in d.traceparents[1:]:
            other = _context_of(tp) if tp else None
            if other is not None and other.trace_id not in seen:
                seen.add(other.trace_id)
                if links is None:
                    links = []
                links.append(Link(other))
        return links  # within OTEL_SPAN_LINK_COUNT_LIMIT when the span is handed on

    def shutdown(self) -> None:
        """Export what is still buffered and stop the processor; once (the runner calls it when
        a run ends, and atexit if the process ends first)."""
        if self._shut:
            return
        self._shut = True
        atexit.unregister(self.shutdown)
        self.processor.force_flush(SHUTDOWN_MILLIS)
        self.processor.shutdown()
