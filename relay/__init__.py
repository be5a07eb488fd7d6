"""ledger-relay: a transactional-outbox relay from PostgreSQL to an HTTP ingress.

The public face: `relay.enqueue` and its siblings for producers (relay/producer.py), and, for an
application that embeds the relay, `relay.Relay` (relay/runner.py) with its `relay.Settings`.
The two are loaded on first use, so a producer's `import relay` loads no HTTP client and no
event loop library. How the package is laid out: docs/architecture.md.
"""

from typing import TYPE_CHECKING, Any

from relay.producer import Event, enqueue, enqueue_async, enqueue_many, enqueue_many_async

if TYPE_CHECKING:
    from relay.runner import Relay
    from relay.settings import Settings

__version__ = "0.6.0"  # pyproject.toml says the same; CHANGELOG.md says what changed

__all__ = [
    "Event",
    "Relay",
    "Settings",
    "__version__",
    "enqueue",
    "enqueue_async",
    "enqueue_many",
    "enqueue_many_async",
]


def __getattr__(name: str) -> Any:
    if name == "Relay":
        from relay.runner import Relay

        return Relay
    if name == "Settings":
        from relay.settings import Settings

        return Settings
    raise AttributeError(f"module 'relay' has no attribute {name!r}")
