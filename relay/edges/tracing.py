"""The tracing port (issue 31, 40): what the delivery path tells a tracer, and when tracing is on.

The relay records one span per delivery of a prefix (its lane, run, epoch, seq range, attempt
and outcome) and the POST inside it as an HTTP client span whose context is the `traceparent`
header sent. The port is this module: `Tracer`, `DeliverySpan` and `PostSpan` with no-op bodies,
which is all the relay runs without tracing (a method call per delivery, nothing allocated).
The executor starts a delivery's span and its POST; the completer, once it has written what a
delivery came to, hands the `Outcome` to one observer (`Tracer.observe`), which ends the span:
the tracer never wraps a write. The OpenTelemetry implementation lives in
relay/integrations/otel.py and needs the `otel` extra; `relay.integrations.start_tracing`
chooses between the two.

Tracing is turned on by OpenTelemetry's standard variables alone, as operators expect of any
instrumented service (https://opentelemetry.io/docs/specs/otel/configuration/sdk-environment-variables/):
an OTLP endpoint set (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`)
means export there, unless `OTEL_SDK_DISABLED=true`. Every other variable (the service name and
resource, the sampler, the span limits, the batch processor's and the exporter's settings) is
read by the OpenTelemetry SDK itself. This module checks, before anything starts, the few the
SDK would otherwise warn about and replace with a default (a relay that silently ran with
another sampler than asked would be hard to notice): the endpoint's scheme, the protocol (the
`otel` extra installs OTLP over HTTP with protobuf only), the sampler's name and its ratio. A
bad value is a `ConfigError` naming the variable. So is the Python SDK's credential-provider
variable for OTLP/HTTP: it hands the exporter a `requests` session of its own, which would
replace the relay's (relay/integrations/otel.py: the one that bounds what is read of a
collector's answer, issue 48 item 3), so the relay refuses it rather than ignore it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, NamedTuple, Protocol
from urllib.parse import urlsplit

from relay.settings import ConfigError, redact_url

if TYPE_CHECKING:
    from relay.edges.store import AckResult

SERVICE_NAME = "ledger-relay"  # unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES names one
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
PROTOCOLS = ("http/protobuf",)
# The Python SDK's variables naming an entry point that makes the OTLP/HTTP exporter's session.
CREDENTIAL_PROVIDERS = (
    "OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER",
    "OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER",
)
# The share of `shutdown_timeout` a stopping relay gives the export of the spans it still holds
# (5 s at the default 20 s), after its in-flight batches: a collector that answers slowly or
# not at all costs at most this, never the process's grace period (docs/operations.md).
FLUSH_SHARE = 0.25


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """What the relay reads itself of the variables (for its checks and the `tracing_on` log
    line); the SDK reads the rest."""

    # The traces URL (OTEL_EXPORTER_OTLP_ENDPOINT's + /v1/traces) as shown: its userinfo and
    # credential-named query parameters redacted (issue 48 item 4). The SDK reads the real one.
    endpoint: str
    sampler: str


def _flag(environ: Mapping[str, str], name: str) -> bool:
    """A boolean variable as the specification reads it: only "true" (any case) is true."""
    return environ.get(name, "").strip().lower() == "true"


def _endpoint(environ: Mapping[str, str]) -> str | None:
    """The traces URL, redacted (relay.settings.redact_url: a collector's URL may carry a
    password): the signal's own variable as given, or the base one + `/v1/traces`."""
    for name, suffix in (
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", ""),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "/v1/traces"),
    ):
        value = environ.get(name, "").strip()
        if value:
            parts = urlsplit(value)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(f"{name}: an http:// or https:// URL, got {redact_url(value)!r}")
            return redact_url(value.rstrip("/") + suffix if suffix else value)
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


def _no_credential_provider(environ: Mapping[str, str]) -> None:
    for name in CREDENTIAL_PROVIDERS:
        if environ.get(name, "").strip():
            raise ConfigError(
                f"{name}: not supported; the relay gives the OTLP exporter its own session, "
                "which bounds what it reads of the collector's answer (use "
                "OTEL_EXPORTER_OTLP_HEADERS for credentials)"
            )


def _sampler(environ: Mapping[str, str]) -> str:
    """The sampler's name, checked with its ratio (the SDK would log a warning and sample
    everything instead)."""
    sampler = environ.get("OTEL_TRACES_SAMPLER", "").strip().lower() or "parentbased_always_on"
    if sampler not in SAMPLERS:
        raise ConfigError(f"OTEL_TRACES_SAMPLER: one of {', '.join(SAMPLERS)}, got {sampler!r}")
    raw = environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if sampler.endswith("traceidratio") and raw:
        try:
            ratio = float(raw)
        except ValueError:
            ratio = -1.0
        if not 0.0 <= ratio <= 1.0:
            raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG: a ratio from 0 to 1, got {raw!r}")
    return sampler


def config_from_env(environ: Mapping[str, str]) -> TracingConfig | None:
    """The tracing the variables ask for, or None when tracing is off."""
    if _flag(environ, "OTEL_SDK_DISABLED"):
        return None
    endpoint = _endpoint(environ)
    if endpoint is None:
        return None
    _protocol(environ)
    _no_credential_provider(environ)
    return TracingConfig(endpoint, _sampler(environ))


def flush_timeout(shutdown_timeout: float) -> float:
    """Seconds a stopping relay waits for its spans to be exported (see FLUSH_SHARE)."""
    return shutdown_timeout * FLUSH_SHARE


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
    """One delivery, from its executor to its observer. Without tracing every method does
    nothing."""

    @property
    def trace_id(self) -> str | None:
        """For log lines: the span's own trace id, hex (None: not tracing)."""
        return None

    @property
    def span_id(self) -> str | None:
        return None

    def post(self, url: str, others: Sequence[DeliverySpan] = ()) -> PostSpan:
        """The POST of this delivery; `others`: the deliveries of the other runs that share the
        request (a multi-run POST), linked from it."""
        return _NO_POST


class Observed(Protocol):
    """What the observer is handed: a delivery's `Outcome` (relay/delivery/execute.py), which
    carries the span the executor started (named here as a protocol: execute.py imports this
    module)."""

    @property
    def span(self) -> DeliverySpan: ...


class Tracer:
    """Starts delivery spans and observes what each delivery came to. This base class is the
    relay without tracing."""

    enabled = False

    def delivery(self, d: Delivery) -> DeliverySpan:
        return NO_SPAN

    def observe(self, outcome: Observed, ack: AckResult | None) -> None:
        """The completer has carried `outcome` out (`ack`: the ack's result, when it acked):
        its delivery span says so and ends. Called once per outcome, after its write."""

    def shutdown(self, timeout: float) -> bool:
        """Export what is still buffered and stop, returning within `timeout` seconds whatever
        the collector does. True when everything was exported in time."""
        return True


_NO_POST = PostSpan()
NO_SPAN = DeliverySpan()
NO_TRACING = Tracer()
