"""OpenTelemetry behind relay/edges/tracing.py's port (the `otel` extra): the relay decides what a
span says and when, the SDK does the rest.

The delivery span is a CONSUMER span named `deliver <lane>`: a child of the first event's
producer trace when it carries a `traceparent`, with links to the other events' traces. The POST
is a CLIENT span inside it, and its context is the `traceparent` header the ingress receives, so
the ingress's own span is a child of the relay's; a POST that carries several runs' batches sits
in the first run's delivery span and links to the others'. Attribute names follow
OpenTelemetry's semantic conventions where they have one (messaging, HTTP client); the relay's
own are under `relay.`. The observer (`OtelTracer.observe`) adds what the delivery came to (its
outcome, the ack) and ends the span.

Everything else is the SDK's, through its public API: the tracer of a `TracerProvider`
(`start_span`), its sampler (`OTEL_TRACES_SAMPLER`, read by the provider), its span limits
(`SpanLimits`, which reads the `OTEL_*_LIMIT` variables; a bad one is a ConfigError here), its
ids, a resource from the environment (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`), the W3C
trace-context propagator for the events' `traceparent` and the POST's, and the OTLP/HTTP
exporter under a batch span processor, each configured by its own `OTEL_*` variables.

What the exporter reads of a collector's answer is bounded (issue 48 item 3): the SDK looks only
at an answer's status, but the `requests` session under it reads the whole body into memory
first, however long a collector makes it (an endless chunked 200 grew a relay from 783 MB to
2.4 GB in 25 s). The exporter takes a session (its public `session` argument); the relay's
(`collector_session`) asks for no content coding and cuts every answer's body at
`ANSWER_LIMIT` bytes, raw, through a response hook of requests' public API: past the limit the
connection is closed, not drained, and the rest is never read.

Shutdown is bounded: the SDK's `force_flush` does not honour its timeout and the exporter waits
on a collector that drips its answer for as long as it drips (a stopping relay was held 718 s),
so the flush and the provider's shutdown run in a daemon thread of their own that the relay
waits for at most the given time and then leaves behind (a daemon thread never holds the
process's exit).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from functools import lru_cache
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import requests
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import (
    Link,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    format_span_id,
    format_trace_id,
    get_current_span,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from relay import __version__
from relay.core.policy import Ack, Pause, Poison, Retry
from relay.delivery.execute import Deferred, LeaseLost, Outcome
from relay.edges.ingress import Answer
from relay.edges.store import AckResult
from relay.edges.tracing import SERVICE_NAME, Delivery, DeliverySpan, Observed, PostSpan, Tracer
from relay.settings import ConfigError, redact_url

PROPAGATOR = TraceContextTextMapPropagator()
_ROOT = Context()  # a root delivery's parent context: none (never whatever is current)
OUTCOME_NAMES = {Ack: "accepted", Retry: "transient", Pause: "misconfigured", Poison: "poison"}
# The bytes of a collector's answer the exporter reads: an OTLP answer is a small protobuf (a
# partial success and its message at most), and the SDK does not even look at it.
ANSWER_LIMIT = 64 * 1024


def span_limits() -> SpanLimits:
    """The SDK's span limits, as the `OTEL_*_LIMIT` variables set them; a bad one is refused at
    start rather than at the first span."""
    try:
        return SpanLimits()
    except ValueError as exc:  # "<VARIABLE> must be a non-negative integer but got <value>"
        raise ConfigError(str(exc)) from None


def resource() -> Resource:
    """The SDK's resource, named `ledger-relay` unless the environment names the service."""
    return Resource.create({"service.name": SERVICE_NAME}).merge(OTELResourceDetector().detect())


@lru_cache(maxsize=1024)
def _remote(traceparent: str) -> Context | None:
    """An event's stored `traceparent` as the propagator reads it (None: not a valid one).
    Cached: the events of a run mostly carry their producer's one header."""
    context = PROPAGATOR.extract({"traceparent": traceparent}, _ROOT)
    return context if get_current_span(context).get_span_context().is_valid else None


def _span_context(traceparent: str | None) -> SpanContext | None:
    context = _remote(traceparent) if traceparent else None
    return None if context is None else get_current_span(context).get_span_context()


def _links(traceparents: Sequence[str | None], parent: SpanContext | None) -> list[Link]:
    """A link to each other trace among the events' (the parent's is not linked)."""
    seen = {parent.trace_id} if parent else set()
    links = []
    for tp in traceparents[1:]:
        other = _span_context(tp)
        if other is not None and other.trace_id not in seen:
            seen.add(other.trace_id)
            links.append(Link(other))
    return links


def _url_attributes(url: str) -> dict[str, Any]:
    """The POST span's attributes of its URL: `url.full` without query, fragment or userinfo
    (a credential: OpenTelemetry's HTTP conventions say the same), and the server."""
    parts = urlsplit(url)
    attributes: dict[str, Any] = {
        "http.request.method": "POST",
        "server.address": parts.hostname or "",
        "url.full": redact_url(urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))),
    }
    if parts.port:
        attributes["server.port"] = parts.port
    return attributes


def said(outcome: Outcome) -> tuple[dict[str, Any], str | None]:
    """What a delivery span says of its outcome: its attributes, and the error status's
    description when the ingress did not take the batch (None: it did)."""
    decision = outcome.decision
    if isinstance(decision, LeaseLost):
        return {"relay.outcome": "lease_lost", "relay.where": decision.where}, "lease_lost"
    if isinstance(decision, Deferred):  # the retry budget held it back: nothing was sent
        return {"relay.outcome": "deferred", "relay.retry_in": decision.delay}, "deferred"
    name = OUTCOME_NAMES[type(decision)]
    attributes: dict[str, Any] = {"relay.outcome": name}
    if isinstance(outcome.answer, Answer):
        attributes["relay.status"] = outcome.answer.status
    error: str | None = None
    match decision:
        case Retry(error=text, retry_after=retry_after, delay=delay):
            error = text[:200]
            attributes["relay.retry_in"] = delay
            if retry_after is not None:
                attributes["relay.retry_after"] = retry_after
        case Pause(excerpt=text):
            error = text[:200]
        case Poison(excerpt=text, rejected_event_id=named):
            error = text[:200]
            if named is not None:
                attributes["relay.rejected_event_id"] = named
    if error:
        attributes["relay.error"] = error
    return attributes, None if isinstance(decision, Ack) else error or name


class _CutBody:
    """A collector's answer's body as requests reads it (through `stream`, which requests calls
    when the raw response has one, turning its errors into requests' own): at most `left` bytes,
    never decompressed; past them the underlying response is closed, dropping the connection.
    Everything else is the urllib3 response's (its close, its connection, its cookies)."""

    def __init__(self, raw: Any, left: int) -> None:
        self.raw = raw
        self.left = left

    def stream(self, amt: int | None = None, decode_content: bool | None = None) -> Iterator[bytes]:
        for chunk in self.raw.stream(amt, decode_content=False):
            yield chunk[: self.left]
            self.left -= len(chunk)
            if self.left <= 0:
                self.raw.close()  # the rest is never read
                return

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


def _cut_answer(response: requests.Response, *args: Any, **kwargs: Any) -> None:
    """requests' `response` hook: runs before the body is read (requests reads it only after
    its hooks), so the body it then reads is the cut one."""
    response.raw = _CutBody(response.raw, ANSWER_LIMIT)


def collector_session() -> requests.Session:
    """The session the exporter POSTs with: no content coding asked for, every answer's body cut
    at ANSWER_LIMIT bytes (the module says why). The exporter sets its TLS options on it."""
    session = requests.Session()
    session.headers["Accept-Encoding"] = "identity"
    session.hooks["response"].append(_cut_answer)
    return session


def exporter() -> OTLPSpanExporter:
    """The SDK's OTLP/HTTP exporter as its `OTEL_EXPORTER_OTLP_*` variables configure it, over
    the relay's session."""
    return OTLPSpanExporter(session=collector_session())


class _OtelPost(PostSpan):
    """The POST: a CLIENT span, a child of its delivery's."""

    __slots__ = ("span", "traceparent")

    def __init__(self, span: Span) -> None:
        self.span = span
        carrier: dict[str, str] = {}
        PROPAGATOR.inject(carrier, set_span_in_context(span, _ROOT))
        self.traceparent = carrier.get("traceparent")

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.span.end()

    def answered(self, status: int) -> None:
        self.span.set_attribute("http.response.status_code", status)
        if status >= 400:
            self.span.set_attribute("error.type", str(status))
            self.span.set_status(StatusCode.ERROR)

    def failed(self, error: str) -> None:
        self.span.set_attribute("error.type", error.split(":", 1)[0])
        self.span.set_status(Status(StatusCode.ERROR, error))


class _OtelDelivery(DeliverySpan):
    """One delivery: the SDK's CONSUMER span, ended by the observer."""

    __slots__ = ("span", "tracer")

    def __init__(self, tracer: trace.Tracer, span: Span) -> None:
        self.tracer = tracer
        self.span = span

    @property
    def trace_id(self) -> str:
        return format_trace_id(self.span.get_span_context().trace_id)

    @property
    def span_id(self) -> str:
        return format_span_id(self.span.get_span_context().span_id)

    def post(self, url: str, others: Sequence[DeliverySpan] = ()) -> PostSpan:
        links = [Link(o.span.get_span_context()) for o in others if isinstance(o, _OtelDelivery)]
        span = self.tracer.start_span(
            "POST",
            context=set_span_in_context(self.span, _ROOT),
            kind=SpanKind.CLIENT,
            attributes=_url_attributes(url),
            links=links or None,
        )
        return _OtelPost(span)


class OtelTracer(Tracer):
    """The SDK's tracer provider with one processor: the batch processor over the OTLP/HTTP
    exporter, or the one given (tests record into memory)."""

    enabled = True

    def __init__(self, processor: SpanProcessor | None = None) -> None:
        # The provider reads OTEL_TRACES_SAMPLER itself; its exit hook is not installed, since
        # its shutdown waits on the exporter without a bound (`shutdown` bounds it instead).
        self.provider = TracerProvider(
            resource=resource(), span_limits=span_limits(), shutdown_on_exit=False
        )
        self.provider.add_span_processor(processor or BatchSpanProcessor(exporter()))
        self.tracer = self.provider.get_tracer("ledger-relay", __version__)
        self._stopping: threading.Thread | None = None

    def delivery(self, d: Delivery) -> DeliverySpan:
        first = d.traceparents[0] if d.traceparents else None
        parent = _remote(first) if first else None
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
        links = _links(d.traceparents, _span_context(first)) if len(d.traceparents) > 1 else None
        span = self.tracer.start_span(
            f"deliver {d.lane}",
            context=_ROOT if parent is None else parent,
            kind=SpanKind.CONSUMER,
            attributes=attributes,
            links=links or None,
        )
        return _OtelDelivery(self.tracer, span)

    def observe(self, outcome: Observed, ack: AckResult | None) -> None:
        delivery = outcome.span
        if not isinstance(delivery, _OtelDelivery) or not isinstance(outcome, Outcome):
            return
        span = delivery.span
        if span.is_recording():
            attributes, error = said(outcome)
            span.set_attributes(attributes)
            if ack is not None:
                acked: dict[str, Any] = {"status": ack.status, "events": ack.acked}
                if ack.last_seq is not None:
                    acked["last_seq"] = ack.last_seq
                span.add_event("acked", acked)
            if error is not None:
                span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def shutdown(self, timeout: float) -> bool:
        """Flush and shut the provider down in a daemon thread, waiting for it at most
        `timeout` seconds (see the module). Once: a second call only waits again."""
        if self._stopping is None:
            self._stopping = threading.Thread(
                target=self._flush_and_stop,
                args=(int(timeout * 1000),),
                name="relay-tracing-shutdown",
                daemon=True,
            )
            self._stopping.start()
        self._stopping.join(timeout)
        return not self._stopping.is_alive()

    def _flush_and_stop(self, millis: int) -> None:
        self.provider.force_flush(millis)
        self.provider.shutdown()
