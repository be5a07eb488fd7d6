"""OpenTelemetry behind relay/tracing.py's port (the `otel` extra).

A tracer provider of its own (never the process-global one), a batch span processor and the
OTLP/HTTP exporter. The delivery span is a CONSUMER span named `deliver <lane>`: a child of the
first event's producer trace when it carries a `traceparent`, with links to the other events'
traces. The POST is a CLIENT span inside it, and its context is the `traceparent` header the
ingress receives, so the ingress's own span is a child of the relay's. Attribute names follow
OpenTelemetry's semantic conventions where they have one (messaging, HTTP client); the relay's
own are under `relay.`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from relay import __version__
from relay.tracing import Delivery, DeliverySpan, PostSpan, Tracer, TracingConfig

SHUTDOWN_MILLIS = 5_000
# Outcomes of policy.decide that end a delivery without the ingress taking it.
ERROR_OUTCOMES = {"transient", "misconfigured", "poison", "lease_lost"}

_PROPAGATOR = TraceContextTextMapPropagator()


def sampler_of(config: TracingConfig) -> Sampler:
    ratio = 1.0 if config.sampler_arg is None else config.sampler_arg
    root: Sampler = {
        "always_on": ALWAYS_ON,
        "always_off": ALWAYS_OFF,
        "traceidratio": TraceIdRatioBased(ratio),
    }[config.sampler.removeprefix("parentbased_")]
    return ParentBased(root) if config.sampler.startswith("parentbased_") else root


def _context_of(traceparent: str | None) -> trace.SpanContext | None:
    if not traceparent:
        return None
    ctx = trace.get_current_span(_PROPAGATOR.extract({"traceparent": traceparent}))
    span_context = ctx.get_span_context()
    return span_context if span_context.is_valid else None


class _OtelPost(PostSpan):
    def __init__(self, span: trace.Span) -> None:
        self.span = span
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        self.traceparent = carrier.get("traceparent")

    def answered(self, status: int) -> None:
        self.span.set_attribute("http.response.status_code", status)
        if status >= 400:
            self.span.set_attribute("error.type", str(status))
            self.span.set_status(Status(StatusCode.ERROR))

    def failed(self, error: str) -> None:
        self.span.set_attribute("error.type", error.split(":", 1)[0])
        self.span.set_status(Status(StatusCode.ERROR, error))


class _OtelDelivery(DeliverySpan):
    def __init__(self, tracer: trace.Tracer, span: trace.Span) -> None:
        self._tracer = tracer
        self.span = span
        sc = span.get_span_context()
        self.trace_id = trace.format_trace_id(sc.trace_id)
        self.span_id = trace.format_span_id(sc.span_id)

    @contextmanager
    def post(self, url: str) -> Iterator[PostSpan]:
        parts = urlsplit(url)
        attributes: dict[str, Any] = {
            "http.request.method": "POST",
            "url.full": parts._replace(query="", fragment="").geturl(),
            "server.address": parts.hostname or "",
        }
        if parts.port:
            attributes["server.port"] = parts.port
        with self._tracer.start_as_current_span(
            "POST",
            context=trace.set_span_in_context(self.span),
            kind=SpanKind.CLIENT,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            yield _OtelPost(span)

    def outcome(self, outcome: str, **attributes: Any) -> None:
        self.span.set_attribute("relay.outcome", outcome)
        for key, value in attributes.items():
            if value is not None:
                self.span.set_attribute(f"relay.{key}", value)
        if outcome in ERROR_OUTCOMES:
            self.span.set_status(Status(StatusCode.ERROR, str(attributes.get("error") or outcome)))

    def event(self, name: str, **attributes: Any) -> None:
        self.span.add_event(name, {k: v for k, v in attributes.items() if v is not None})

    def end(self) -> None:
        self.span.end()


class OtelTracer(Tracer):
    enabled = True

    def __init__(self, config: TracingConfig, processor: SpanProcessor | None = None) -> None:
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": config.service_name}),
            sampler=sampler_of(config),
        )
        self.provider.add_span_processor(
            processor or BatchSpanProcessor(OTLPSpanExporter(endpoint=config.endpoint))
        )
        self._tracer = self.provider.get_tracer("ledger-relay", __version__)

    def delivery(self, d: Delivery) -> DeliverySpan:
        parent = _context_of(d.traceparents[0] if d.traceparents else None)
        context = trace.set_span_in_context(trace.NonRecordingSpan(parent)) if parent else None
        seen = {parent.trace_id} if parent else set()
        links = []
        for tp in d.traceparents[1:]:
            other = _context_of(tp)
            if other is not None and other.trace_id not in seen:
                seen.add(other.trace_id)
                links.append(Link(other))
        attributes: dict[str, Any] = {
            "messaging.system": "ledger_relay",
            "messaging.operation.type": "process",
            "messaging.operation.name": "deliver",
            "messaging.destination.name": d.lane,
            "messaging.batch.message_count": d.events,
            "relay.lane": d.lane,
            "relay.run_id": d.run_id,
            "relay.epoch": d.epoch,
            "relay.seq.first": d.first_seq,
            "relay.seq.last": d.last_seq,
            "relay.attempt": d.attempt,
        }
        if d.outbox_wait_seconds is not None:
            attributes["relay.outbox_wait_seconds"] = d.outbox_wait_seconds
        span = self._tracer.start_span(
            f"deliver {d.lane}",
            context=context,
            kind=SpanKind.CONSUMER,
            links=links,
            attributes=attributes,
        )
        return _OtelDelivery(self._tracer, span)

    def shutdown(self) -> None:
        self.provider.force_flush(SHUTDOWN_MILLIS)
        self.provider.shutdown()
