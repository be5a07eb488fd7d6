"""The tracing port (issue 31): what the delivery path tells a tracer, and when tracing is on.

The relay records one span per delivery of a prefix (its lane, run, epoch, seq range, attempt
and outcome), the POST inside it as an HTTP client span whose context is the `traceparent`
header sent, and the acknowledgement after it. The port is this module: `Tracer` and
`DeliverySpan` with no-op bodies, which is all the relay runs without tracing (a method call
per delivery, nothing allocated). The OpenTelemetry implementation lives in
relay/integrations/otel.py and needs the `otel` extra; `relay.integrations.start_tracing`
chooses between the two.

Tracing is turned on by OpenTelemetry's standard variables alone, as operators expect of any
instrumented service (https://opentelemetry.io/docs/specs/otel/configuration/sdk-environment-variables/):
an OTLP endpoint set (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`)
means export there, unless `OTEL_SDK_DISABLED=true`. `OTEL_SERVICE_NAME` names the service
(default `ledger-relay`); `OTEL_TRACES_SAMPLER` and `OTEL_TRACES_SAMPLER_ARG` choose the
sampler; the protocol is OTLP over HTTP with protobuf (`OTEL_EXPORTER_OTLP_PROTOCOL`,
`..._TRACES_PROTOCOL`: `http/protobuf`, the only one the `otel` extra installs). The span
limits (`OTEL_ATTRIBUTE_COUNT_LIMIT`, `OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT`, their `OTEL_SPAN_`
forms, `OTEL_SPAN_EVENT_COUNT_LIMIT`, `OTEL_SPAN_LINK_COUNT_LIMIT`,
`OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT`, `OTEL_LINK_ATTRIBUTE_COUNT_LIMIT`) are read here too and
applied by `bounded` as the specification's attribute limits say. A value the relay cannot
honour is a `ConfigError` at start, naming the variable (the specification would have a bad
number warned about and ignored; the Python SDK raises, and a relay that silently ran with other
limits than asked would be harder to notice).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from relay.settings import ConfigError

SERVICE_NAME = "ledger-relay"
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
PROTOCOLS = ("http/protobuf",)


# The specification's defaults (sdk-environment-variables.md, "Span Limits"); no length limit.
DEFAULT_COUNT_LIMIT = 128


@dataclass(frozen=True, slots=True)
class SpanLimits:
    """How much a span may carry; None is no limit. What is beyond a count is dropped (and
    counted on the span), a longer string value is cut (see `bounded`)."""

    attribute_count: int | None = DEFAULT_COUNT_LIMIT  # a span's attributes
    attribute_length: int | None = None  # a span attribute's string value, in characters
    event_count: int | None = DEFAULT_COUNT_LIMIT
    link_count: int | None = DEFAULT_COUNT_LIMIT
    event_attribute_count: int | None = DEFAULT_COUNT_LIMIT
    event_attribute_length: int | None = None  # OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT only
    # OTEL_LINK_ATTRIBUTE_COUNT_LIMIT is checked, not kept: the relay's links carry no attributes.


@dataclass(frozen=True, slots=True)
class TracingConfig:
    endpoint: (
        str  # the OTLP/HTTP traces URL (a base URL from OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces)
    )
    service_name: str
    sampler: str
    sampler_arg: float | None
    limits: SpanLimits = SpanLimits()


def _flag(environ: Mapping[str, str], name: str) -> bool:
    """A boolean variable as the specification reads it: only "true" (any case) is true."""
    return environ.get(name, "").strip().lower() == "true"


def _endpoint(environ: Mapping[str, str]) -> str | None:
    """The traces URL: the signal's own variable as given, or the base one + `/v1/traces`."""
    for name, suffix in (
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", ""),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "/v1/traces"),
    ):
        value = environ.get(name, "").strip()
        if value:
            parts = urlsplit(value)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(f"{name}: an http:// or https:// URL, got {value!r}")
            return value.rstrip("/") + suffix if suffix else value
    return None


def _protocol(environ: Mapping[str, str]) -> None:
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = environ.get(name, "").strip()
        if value:
            if value not in PROTOCOLS:
                raise ConfigError(
                    f"{name}: the relay exports OTLP over {' or '.join(PROTOCOLS)}, got {value!r}"
                )
            return


def _sampler(environ: Mapping[str, str]) -> tuple[str, float | None]:
    sampler = environ.get("OTEL_TRACES_SAMPLER", "").strip().lower() or "parentbased_always_on"
    if sampler not in SAMPLERS:
        raise ConfigError(f"OTEL_TRACES_SAMPLER: one of {', '.join(SAMPLERS)}, got {sampler!r}")
    raw = environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if not sampler.endswith("traceidratio") or not raw:
        return sampler, None
    try:
        ratio = float(raw)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG: a ratio from 0 to 1, got {raw!r}")
    return sampler, ratio


def _limit(environ: Mapping[str, str], name: str, default: int | None) -> int | None:
    """A limit variable: a non-negative integer. Empty is unset, as the specification says of
    every variable (the Python SDK reads an empty one as "no limit")."""
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isascii() or not raw.isdigit():
        raise ConfigError(f"{name}: a non-negative integer, got {raw!r}")
    return int(raw)


def limits_from_env(environ: Mapping[str, str]) -> SpanLimits:
    """The span limits the variables set: a model's own variable (`OTEL_SPAN_...`,
    `OTEL_EVENT_...`) over the general one (`OTEL_ATTRIBUTE_...`) over the default."""
    count = _limit(environ, "OTEL_ATTRIBUTE_COUNT_LIMIT", DEFAULT_COUNT_LIMIT)
    length = _limit(environ, "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", None)
    _limit(environ, "OTEL_LINK_ATTRIBUTE_COUNT_LIMIT", None)
    return SpanLimits(
        attribute_count=_limit(environ, "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", count),
        attribute_length=_limit(environ, "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", length),
        event_count=_limit(environ, "OTEL_SPAN_EVENT_COUNT_LIMIT", DEFAULT_COUNT_LIMIT),
        link_count=_limit(environ, "OTEL_SPAN_LINK_COUNT_LIMIT", DEFAULT_COUNT_LIMIT),
        event_attribute_count=_limit(environ, "OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT", count),
        event_attribute_length=length,
    )


def bounded(
    attributes: Mapping[str, Any], count: int | None, length: int | None
) -> tuple[dict[str, Any], int]:
    """`attributes` within the limits, and how many were dropped. As the specification's
    attribute limits say: the first `count` are kept (one added beyond the limit is discarded),
    a string (or byte string) value longer than `length` characters (bytes) is cut to it, and
    so is each one in a sequence value; no other value is changed."""
    kept = dict(attributes) if count is None else dict(list(attributes.items())[:count])
    if length is not None:
        for key, value in kept.items():
            if isinstance(value, str | bytes):
                if len(value) > length:
                    kept[key] = value[:length]
            elif isinstance(value, Sequence):
                kept[key] = tuple(v[:length] if isinstance(v, str | bytes) else v for v in value)
    return kept, len(attributes) - len(kept)


def config_from_env(environ: Mapping[str, str]) -> TracingConfig | None:
    """The tracing configuration the variables ask for, or None when tracing is off."""
    if _flag(environ, "OTEL_SDK_DISABLED"):
        return None
    endpoint = _endpoint(environ)
    if endpoint is None:
        return None
    _protocol(environ)
    sampler, arg = _sampler(environ)
    service = environ.get("OTEL_SERVICE_NAME", "").strip() or SERVICE_NAME
    return TracingConfig(endpoint, service, sampler, arg, limits_from_env(environ))


# -- the port -----------------------------------------------------------------------------------


class Delivery(NamedTuple):
    """What one delivery of a prefix is, for its span. A named tuple, not a frozen dataclass:
    one is built for every delivery when tracing, and a frozen dataclass's `__init__` sets each
    field through `object.__setattr__` (2.7 against 1.0 µs)."""

    lane: str
    run_id: str
    epoch: int
    first_seq: int
    last_seq: int
    events: int
    attempt: int
    traceparents: Sequence[str | None]  # each event's, in seq order (the first is the parent)
    outbox_wait_seconds: float | None  # the first event's created_at to the claim


class PostSpan:
    """The HTTP POST of a delivery, a context manager of itself (`with span.post(url) as p`;
    it ends on leaving): `traceparent` is the header to send (None: send the event's own, as
    without tracing)."""

    traceparent: str | None = None

    def __enter__(self) -> PostSpan:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """The POST is over (answered, failed or cancelled)."""

    def answered(self, status: int) -> None:
        """The ingress answered with `status`."""

    def failed(self, error: str) -> None:
        """No answer: a connection error or a timeout."""


class DeliverySpan:
    """One delivery. Without tracing every method does nothing."""

    @property
    def trace_id(self) -> str | None:
        """For log lines: the span's own trace id, hex (None: not tracing)."""
        return None

    @property
    def span_id(self) -> str | None:
        return None

    def post(self, url: str) -> PostSpan:
        return _NO_POST

    def outcome(self, outcome: str, **attributes: Any) -> None:
        """`policy.decide`'s verdict and what led to it (status, retry_after, error...)."""

    def event(self, name: str, **attributes: Any) -> None:
        """Something on the way: `lease_lost`, `poison_narrowed`, `acked`."""

    def end(self) -> None:
        """The delivery is over (acknowledged, rescheduled, failed or abandoned)."""


class Tracer:
    """Starts delivery spans. This base class is the relay without tracing."""

    enabled = False

    def delivery(self, d: Delivery) -> DeliverySpan:
        return NO_SPAN

    def shutdown(self) -> None:
        """Export what is still buffered, within a bounded time."""


_NO_POST = PostSpan()
NO_SPAN = DeliverySpan()
NO_TRACING = Tracer()
