"""ledger-relay: a transactional-outbox relay from PostgreSQL to an HTTP ingress."""

from relay.producer import Event, enqueue, enqueue_async, enqueue_many, enqueue_many_async

__version__ = "0.1.0"

__all__ = ["Event", "__version__", "enqueue", "enqueue_async", "enqueue_many", "enqueue_many_async"]
