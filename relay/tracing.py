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
`..._TRACES_PROTOCOL`: `http/protobuf`, the only one the `otel` extra installs). A value the
relay cannot honour is a `ConfigError` at start, naming the variable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any
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


@dataclass(frozen=True, slots=True)
class TracingConfig:
    endpoint: (
        str  # the OTLP/HTTP traces URL (a base URL from OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces)
    )
    service_name: str
    sampler: str
    sampler_arg: float | None


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
    return TracingConfig(endpoint, service, sampler, arg)


# -- the port -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Delivery:
    """What one delivery of a prefix is, for its span."""

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
