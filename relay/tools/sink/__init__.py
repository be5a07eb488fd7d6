"""The reference ingress (`relay sink`); see `relay.tools.sink.app`."""

from relay.tools.sink.app import (
    JSON,
    Fault,
    Receive,
    Scope,
    Send,
    Sink,
    SinkState,
    SinkThread,
    main,
    serve_sink,
    signing_keys,
    verify_signature,
)

__all__ = [
    "JSON",
    "Fault",
    "Receive",
    "Scope",
    "Send",
    "Sink",
    "SinkState",
    "SinkThread",
    "main",
    "serve_sink",
    "signing_keys",
    "verify_signature",
]
