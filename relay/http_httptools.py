"""POSTs over kept-alive asyncio connections with llhttp's C parser (`http_transport=httptools`).

The relay's POST is one fixed shape: HTTP/1.1, a bytes body, at most `READ_LIMIT` bytes of the
answer, its status and Retry-After, no redirects, cookies or proxies. aiohttp's request machinery
costs about four times the client CPU of that shape written directly onto an asyncio transport
(docs/performance.md, "The POST client"): on runs of one event, one POST each, the client was
the largest part of the relay's cost. This module writes the request itself and hands every
byte of the answer to `httptools` (the MagicStack binding of llhttp, Node's parser, which
uvicorn uses): the parsing of hostile input is llhttp's, not ours.

What is ours, and tested like the other senders (the contract, hostile-answer and TLS suites run
on every transport):
- **The request head.** The URL comes encoded (`render_url`); its path and every header are
  refused (ValueError, naming the header) if they hold a byte that could end a line.
- **The answer's bounds.** A head over `MAX_HEAD` bytes in all (counted as bytes arrive, interim
  answers included, so a header line that never ends is cut there), or a malformed answer, is a
  `TransportFailure`; a body is read to `READ_LIMIT` bytes and the connection then closed, as
  aiohttp's sender does. A body with a length that ends early is a failure; a body without one
  (HTTP/1.0 style) ends at the close.
- **Connections.** One request at a time on each, kept when the answer says keep-alive and was
  read whole, dropped after `IDLE_FOR` seconds idle (before the server's own keep-alive timer
  can race a request). A request that is cancelled (the lane's deadline, a lost lease) aborts
  its connection: its state is unknown.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import urlsplit

import anyio
import httptools
import httpx

from relay.transport import READ_LIMIT, TransportFailure

MAX_HEAD = 64 * 1024  # bytes of the answer's header lines, in all
# Seconds a kept connection may sit idle before it is dropped rather than reused: under the
# shortest keep-alive timers of common servers (gunicorn 2 s, uvicorn 5 s), so a request is
# rarely sent on a connection the server is closing at that moment (that request fails, and
# the relay's retries send it again on a new one).
IDLE_FOR = 1.0
_BAD_PATH = re.compile(r"[\x00-\x20\x7f-\U0010ffff]")  # encoded already: no space, no CR/LF
_BAD_HEADER = re.compile(r"[\x00\r\n]")


@dataclass(frozen=True, slots=True)
class Origin:
    scheme: str
    host: str
    port: int
    host_header: bytes


@lru_cache(maxsize=64)
def _origin(scheme: str, netloc: str) -> Origin:
    parts = urlsplit(f"{scheme}://{netloc}")
    if scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {scheme}://{netloc}")
    port = parts.port or (443 if scheme == "https" else 80)
    host = parts.hostname
    shown = f"[{host}]" if ":" in host else host
    default = (scheme == "http" and port == 80) or (scheme == "https" and port == 443)
    return Origin(scheme, host, port, (shown if default else f"{shown}:{port}").encode())


def request_head(origin: Origin, target: str, body: bytes, headers: dict[str, str]) -> bytes:
    """The request line and headers of one POST, refusing anything that could split them."""
    if _BAD_PATH.search(target):
        raise ValueError(f"the request path holds a character that must be encoded: {target!r}")
    lines = [b"POST ", target.encode(), b" HTTP/1.1\r\nhost: ", origin.host_header]
    lines.append(b"\r\ncontent-length: %d" % len(body))
    for name, value in headers.items():
        if _BAD_HEADER.search(name) or _BAD_HEADER.search(value) or ":" in name:
            raise ValueError(f"header {name!r} holds a character that would end its line")
        lines += (b"\r\n", name.encode(), b": ", value.encode())
    lines.append(b"\r\n\r\n")
    return b"".join(lines)


class _Connection(asyncio.Protocol):
    """One kept-alive connection; one request on it at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[tuple[int, bytes, str | None]] | None = None
        self.closed = False
        self.idle_since = 0.0
        self.parser = httptools.HttpResponseParser(self)
        self.received_before_head = 0  # bytes fed to llhttp before the final headers were done
        self._reset()

    def _reset(self) -> None:
        """Forget the answer read so far (a new request, or after an interim answer)."""
        self.head_bytes = 0
        self.retry_after: str | None = None
        self.has_length = False
        self.headers_done = False
        self.chunks: list[bytes] = []
        self.size = 0
        self.reusable = False

    # -- asyncio's side --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport: TCP

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():
            self.close()  # an answer nobody asked for: the connection is not in a known state
            return
        try:
            self.parser.feed_data(data)
            if not self.headers_done:
                # The head is capped by what arrives, not by what llhttp hands back: a header
                # line that never ends (no CRLF) reaches no callback, and the binding grows it
                # in memory until the line is done (issue 32, item 6). Every byte fed before
                # the final answer's headers are complete is head (interim answers included),
                # so at most one read (asyncio's 256 KiB) passes the cap.
                self.received_before_head += len(data)
                if self.received_before_head > MAX_HEAD:
                    raise TransportFailure(f"answer head over {MAX_HEAD} bytes")
        except httptools.HttpParserUpgrade:
            self._fail("the ingress answered with a protocol upgrade")
        except httptools.HttpParserError as exc:
            cause = exc.__context__ if isinstance(exc.__context__, TransportFailure) else exc
            self._fail(f"malformed answer: {cause}")
        except TransportFailure as exc:
            self._fail(str(exc))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            if self.headers_done and not self.has_length:
                self._answer()  # a body without a length ends at the close (RFC 9112 §6.3)
            else:
                self._fail(
                    "connection closed before the whole answer" + (f": {exc}" if exc else "")
                )

    # -- llhttp's callbacks ----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_bytes += len(name) + len(value) + 4
        if self.head_bytes > MAX_HEAD:
            raise TransportFailure(f"answer head over {MAX_HEAD} bytes")
        lower = name.lower()
        if lower == b"retry-after":
            self.retry_after = value.decode("latin-1")[:100]
        elif lower in (b"content-length", b"transfer-encoding"):
            self.has_length = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # interim (100 Continue, 103 Early Hints): the answer follows
            return
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        if not self.headers_done:
            return
        self.chunks.append(body)
        self.size += len(body)
        if self.size >= READ_LIMIT:
            self._answer()  # enough to know the answer was cut: the rest is not read
            self.close()

    def on_message_complete(self) -> None:
        if not self.headers_done:  # the end of an interim answer
            self._reset()
            return
        self.reusable = self.parser.should_keep_alive()
        self._answer()

    # -- ours ------------------------------------------------------------------------------

    def _answer(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            body = b"".join(self.chunks)[:READ_LIMIT]
            self.waiter.set_result((self.parser.get_status_code(), body, self.retry_after))

    def _fail(self, why: str) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(TransportFailure(why))
        self.close()

    def close(self) -> None:
        self.closed = True
        self.reusable = False
        if self.transport is not None:
            self.transport.abort()

    async def request(self, data: bytes) -> tuple[int, bytes, str | None]:
        assert self.transport is not None
        self._reset()  # the parser stays: llhttp reads one answer after another on a connection
        self.received_before_head = 0  # not reset by interim answers: they count as head too
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        try:
            return await self.waiter
        except BaseException:
            self.close()  # cancelled or failed mid-request: the wire's state is unknown
            raise
        finally:
            self.waiter = None


class HttptoolsSender:
    def __init__(self, *, verify: ssl.SSLContext | bool, connections: int, timeout: float) -> None:
        # The same context httpx would build (system CAs, or the given context as is).
        self._ssl = httpx.create_ssl_context(verify=verify)
        self._timeout = timeout  # connecting; the whole request is bounded by IngressClient
        self._slots = asyncio.Semaphore(connections)
        self._idle: dict[Origin, list[_Connection]] = {}

    async def send(
        self, url: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes, str | None]:
        scheme, _, rest = url.partition("://")
        rest = rest.partition("#")[0]  # a fragment is the client's own: never sent
        end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
        target = rest[end:]
        origin = _origin(scheme.lower(), rest[:end])
        if not target.startswith("/"):
            target = "/" + target  # no path: the origin's root
        data = request_head(origin, target, body, headers) + body
        async with self._slots:
            conn = self._kept(origin) or await self._connect(origin)
            answer = await conn.request(data)
            if conn.reusable and not conn.closed:
                conn.idle_since = time.monotonic()
                self._idle.setdefault(origin, []).append(conn)
            else:
                conn.close()
            return answer

    def _kept(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_FOR:
                return conn
            conn.close()
        return None

    async def _connect(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = self._ssl if origin.scheme == "https" else None
        try:
            # anyio's deadline, not asyncio.timeout: the caller's anyio cancel scopes (the
            # request's deadline, a lost lease) may cancel this task too, and one task takes one
            # cancellation scheme. The protocol itself is asyncio's: the relay runs on anyio's
            # asyncio backend only (README).
            with anyio.fail_after(self._timeout):
                transport, conn = await loop.create_connection(
                    _Connection,
                    origin.host,
                    origin.port,
                    ssl=tls,
                    server_hostname=origin.host if tls else None,
                )
        except TimeoutError:
            raise TransportFailure(f"connect timed out after {self._timeout:g}s") from None
        except (OSError, ssl.SSLError) as exc:
            raise TransportFailure(f"{type(exc).__name__}: {exc}") from exc
        conn.transport = transport  # uvloop calls connection_made only after this returns
        return conn

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
