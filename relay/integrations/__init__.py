"""Optional integrations: each needs an extra, and the production wing loads one only when its
configuration asks for it. Nothing here is in the core install.

otel.py: the OpenTelemetry implementation of the tracing port (relay/edges/tracing.py), `[otel]`
extra. An integration observes what the delivery pipeline decided (its `Outcome` values), so it
may import the delivery pipeline, the edges, relay/core/, settings and logs; only the CLI loads
it, by name, when an OTLP endpoint is set.
"""

from __future__ import annotations

from collections.abc import Mapping

from relay import logs
from relay.edges.tracing import NO_TRACING, Tracer, config_from_env


def start_tracing(environ: Mapping[str, str]) -> Tracer:
    """The tracer the process environment `environ` asks for (relay/edges/tracing.py): NO_TRACING
    when tracing is off or the `otel` extra is missing (said once in the log), OpenTelemetry's
    otherwise, whose SDK reads its own variables from `os.environ`. Raises ConfigError for a
    variable it cannot honour."""
    config = config_from_env(environ)
    if config is None:
        return NO_TRACING
    try:
        from relay.integrations.otel import OtelTracer
    except ImportError as exc:
        logs.warning(
            "tracing_unavailable",
            error=logs.error_text(exc),
            hint="pip install 'ledger-relay[otel]' to export traces",
        )
        return NO_TRACING
    tracer = OtelTracer()
    logs.info("tracing_on", endpoint=config.endpoint, sampler=config.sampler)
    return tracer
