"""The reference ingress (`relay sink`): the receiving side of DESIGN §5, for tests, the demo and
benchmarks.

- `state`: `SinkState`, the pure bookkeeping (dedupe by event_id, per-run order of first
  deliveries, stale lease epochs), and `Faults`, the injected misbehaviour;
- `verify`: Standard Webhooks signature verification (`signing_keys`, `verify_signature`);
- `app`: `Sink`, the ASGI app joining them;
- `server`: `serve_sink` (uvicorn inside the caller's event loop) and `SinkThread` (a loop in a
  background thread, for blocking code);
- `cli`: `main`, the `relay sink` command (also `python -m relay.tools.sink`).

The names callers use are re-exported here. The modules of this package import one another
directly, never through this file, so it stays free of import circles.
"""

from relay.tools.sink.app import BadRequest, Receive, Reply, Scope, Send, Sink, parse_batch
from relay.tools.sink.cli import main
from relay.tools.sink.server import SinkThread, serve_sink
from relay.tools.sink.state import JSON, Fault, FaultKind, Faults, Header, SinkState
from relay.tools.sink.verify import SIGNATURE_TOLERANCE, signing_keys, verify_signature

__all__ = [
    "JSON",
    "SIGNATURE_TOLERANCE",
    "BadRequest",
    "Fault",
    "FaultKind",
    "Faults",
    "Header",
    "Receive",
    "Reply",
    "Scope",
    "Send",
    "Sink",
    "SinkState",
    "SinkThread",
    "main",
    "parse_batch",
    "serve_sink",
    "signing_keys",
    "verify_signature",
]
