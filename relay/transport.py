"""What every way of sending a POST shares (DESIGN §5): the contract of a sender, the failure it
raises when there is no HTTP answer, and how much of an answer it reads.

A leaf module: relay/ingress.py (the client) and the senders, relay/http_httptools.py,
relay/http_aiohttp.py and relay/http_httpx.py, import it, and no sender imports another's module
for it.
"""

from __future__ import annotations

from typing import Protocol

MAX_BODY = 64 * 1024
READ_LIMIT = MAX_BODY + 1  # what a sender reads: one byte more than is kept


class TransportFailure(Exception):
    """No HTTP answer: connection refused/reset, timeout, reply lost."""


class Sender(Protocol):
    """How a POST goes out: `send` returns (status, at most MAX_BODY + 1 bytes of the answer, its
    Retry-After) or raises TransportFailure. Never follows redirects. The one byte past the
    limit tells the client that the answer was cut (DESIGN §5: a cut 2xx body is transient)."""

    async def send(
        self, url: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes, str | None]: ...

    async def aclose(self) -> None: ...
