"""POSTs through httpcore, httpx's transport layer (`http_transport=httpx`), and through an httpx
transport the application owns (`Relay(transport=...)`, e.g. an in-process ASGI app).

The relay's own POSTs go straight to `httpcore.AsyncConnectionPool.handle_async_request`, all of
it httpcore's public API: no `httpx.AsyncClient` (URL merging with a base URL, cookie jars, auth
and redirect flows, default headers, event hooks) and no `httpx.AsyncHTTPTransport` (a request
and a response model wrapped around httpcore's per POST) in between. What they did that the
relay needs is done here, once:

- **Proxies.** The environment's proxy for each origin (`HTTP_PROXY`, `HTTPS_PROXY`,
  `ALL_PROXY`, `NO_PROXY`, read as httpx's client reads them with `trust_env`:
  relay/proxies.py), decided once per origin, with pools per proxy (`httpcore.Proxy`; userinfo
  in the proxy's URL becomes its Basic auth, a TLS proxy is verified against the system's
  store). An app-owned transport is used as it is, never proxied (as httpx's client does with
  an explicit `transport=`).
- **Headers.** `Host` (computed once per origin) and `Content-Length` are set here.
- **Limits.** A lane's `connections` are split over pools of at most `POOL_WIDTH` connections,
  and each POST takes the pool with the fewest in flight: httpcore's pool scans every
  connection it holds on each request and each release (quadratically), so one pool of 32 cost
  the relay 40% of its events/s against pools of 8 (docs/performance.md, "The httpx path at
  32 POST slots").
  HTTP/1.1; connect, read, write and pool timeouts from `http_timeout` (the whole request is
  bounded by IngressClient's own deadline); keep-alive connections idle 5 s at most (httpx's
  default); at most `READ_LIMIT` bytes of an answer read, after which the connection is closed
  rather than drained.

Every httpcore or httpx error (refused, reset, TLS, a malformed answer, a timeout of one phase)
becomes a `TransportFailure` naming it: a failure of this request, never of the relay.
"""

from __future__ import annotations

import os
import select
import ssl
import typing
from urllib.parse import unquote, urlsplit

import httpcore
import httpx

from relay.proxies import NO_PROXIES, ProxyRules, proxy_rules
from relay.transport import READ_LIMIT, TransportFailure

Origin = tuple[str, str]  # (scheme, netloc) as written in the URL
# Connections per httpcore pool. httpcore 1.0.9 scans its connections on each request and each
# release, and the scan's idle-connection test is quadratic (`len([c.is_idle() for c in
# connections])` for every idle one): 32 connections cost ~1,000 `is_idle` calls a scan, 4 cost
# 16. Client CPU per POST at 32 in flight, pools of 8 / 4 / 2 / 1: 331 / 293 / 286 / 277 µs.
POOL_WIDTH = 4
KEEPALIVE_EXPIRY = 5.0  # seconds, httpx's default
# Everything httpcore raises about one request (its exceptions share no base of their own).
HTTPCORE_ERRORS = (
    httpcore.ConnectionNotAvailable,
    httpcore.ProxyError,
    httpcore.UnsupportedProtocol,
    httpcore.ProtocolError,
    httpcore.TimeoutException,
    httpcore.NetworkError,
)


def _origin(url: str) -> Origin:
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "", url
    end = len(rest)
    for mark in "/?#":
        i = rest.find(mark)
        if i != -1:
            end = min(end, i)
    return scheme.lower(), rest[:end]


def _proxy(url: str) -> httpcore.Proxy:
    """httpcore's proxy for `url`; its userinfo (as httpx.Proxy reads it) becomes Basic auth."""
    parts = urlsplit(url)
    auth = None
    if parts.username is not None:
        auth = (unquote(parts.username), unquote(parts.password or ""))
        url = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
    return httpcore.Proxy(url, auth=auth, ssl_context=ssl.create_default_context())


class _Pools:
    """A lane's connections over pools of at most POOL_WIDTH; a POST takes the least busy."""

    def __init__(self, make: typing.Callable[[int], httpcore.AsyncConnectionPool], n: int):
        widths = [POOL_WIDTH] * (n // POOL_WIDTH) + ([n % POOL_WIDTH] if n % POOL_WIDTH else [])
        self.widths = widths or [1]
        self.pools = [make(width) for width in self.widths]
        self.in_flight = [0] * len(self.pools)

    def pick(self) -> int:
        counts = self.in_flight
        return counts.index(min(counts)) if len(counts) > 1 else 0


class HttpxSender:
    """The `Sender` over httpcore pools of its own (per the environment, proxied ones too), or
    over the application's httpx transport."""

    def __init__(
        self,
        *,
        verify: ssl.SSLContext | bool = True,
        connections: int = 1,
        timeout: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
        rules: ProxyRules | None = None,
    ) -> None:
        self._app = transport
        if isinstance(verify, ssl.SSLContext):
            self._ssl = verify
        else:
            self._ssl = httpx.create_ssl_context(verify=verify)
        self._connections = connections
        self._proxy_rules = NO_PROXIES
        if transport is None:
            self._proxy_rules = proxy_rules(os.environ) if rules is None else rules
        self._pools: dict[str | None, _Pools] = {}  # per proxy URL (None: direct)
        t = float(timeout)
        self._extensions = {"timeout": {"connect": t, "read": t, "write": t, "pool": t}}
        # Per origin: (its pools, its Host header); the relay POSTs to one or two origins
        # (ingress_url, ingress_batch_url), so this stays tiny.
        self._routes: dict[Origin, tuple[_Pools, bytes]] = {}

    def _pools_for(self, proxy: str | None) -> _Pools:
        if proxy not in self._pools:

            def make(width: int) -> httpcore.AsyncConnectionPool:
                return httpcore.AsyncConnectionPool(
                    ssl_context=self._ssl,
                    proxy=None if proxy is None else _proxy(proxy),
                    max_connections=width,
                    max_keepalive_connections=width,
                    keepalive_expiry=KEEPALIVE_EXPIRY,
                    http1=True,
                    http2=False,
                    network_backend=_Backend(httpcore.AnyIOBackend()),
                )

            self._pools[proxy] = _Pools(make, self._connections)
        return self._pools[proxy]

    def _route(self, url: str) -> tuple[_Pools, bytes]:
        origin = _origin(url)
        route = self._routes.get(origin)
        if route is None:
            route = (self._pools_for(self._proxy_rules.for_url(url)), httpx.URL(url).netloc)
            if len(self._routes) < 64:  # a caller POSTing to many origins: not kept forever
                self._routes[origin] = route
        return route

    async def send(
        self, url: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes, str | None]:
        if self._app is not None:
            return await self._send_app(self._app, url, body, headers)
        try:
            pools, host = self._route(url)
            raw = [(b"host", host), (b"content-length", b"%d" % len(body))]
            raw += [(k.encode("ascii"), v.encode("ascii")) for k, v in headers.items()]
            request = httpcore.Request(
                b"POST", url, headers=raw, content=body, extensions=self._extensions
            )
            i = pools.pick()
            pools.in_flight[i] += 1
            try:
                response = await pools.pools[i].handle_async_request(request)
                try:
                    chunks = await _read(response.aiter_stream())
                finally:
                    await response.aclose()
            finally:
                pools.in_flight[i] -= 1
            retry_after = next(
                (v.decode("latin-1") for k, v in response.headers if k.lower() == b"retry-after"),
                None,
            )
            return response.status, chunks, retry_after
        except (*HTTPCORE_ERRORS, OSError) as exc:
            raise TransportFailure(_failure(exc)) from exc

    async def _send_app(
        self, transport: httpx.AsyncBaseTransport, url: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes, str | None]:
        """Through the application's httpx transport, as httpx's client would hand it over."""
        try:
            target = httpx.URL(url)
            raw = [(b"host", target.netloc), (b"content-length", b"%d" % len(body))]
            raw += [(k.encode("ascii"), v.encode("ascii")) for k, v in headers.items()]
            request = httpx.Request(
                "POST",
                target,
                headers=raw,
                stream=httpx.ByteStream(body),
                extensions=self._extensions,
            )
            response = await transport.handle_async_request(request)
            try:
                chunks = await _read(response.stream)  # type: ignore[arg-type]
            finally:
                await response.aclose()
            retry_after: str | None = response.headers.get("retry-after")
            return response.status_code, chunks, retry_after
        except (httpx.HTTPError, OSError) as exc:
            raise TransportFailure(_failure(exc)) from exc

    async def aclose(self) -> None:
        # Only what this sender opened: an app-owned transport is the application's to close.
        for pools in self._pools.values():
            for pool in pools.pools:
                await pool.aclose()


async def _read(stream: typing.AsyncIterable[bytes]) -> bytes:
    """At most READ_LIMIT bytes of an answer: closing the rest unread closes its connection."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in stream:
        chunks.append(chunk)
        size += len(chunk)
        if size >= READ_LIMIT:
            break
    return b"".join(chunks)[:READ_LIMIT]


# The head of an answer is bounded by h11 as bytes arrive: httpcore reads 64 KiB at a time into
# h11, which refuses a head still incomplete past `max_incomplete_event_size` (httpcore passes
# this class attribute, 100 KiB) with "Receive buffer too long" (issue 32, item 6; tested with
# an endless header line in tests/test_security.py).
HEAD_LIMIT: int = httpcore.AsyncHTTP11Connection.MAX_INCOMPLETE_EVENT_SIZE


def _failure(exc: Exception) -> str:
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, httpcore.RemoteProtocolError | httpx.RemoteProtocolError) and (
        "Receive buffer too long" in str(exc)
    ):
        return f"answer head over {HEAD_LIMIT} bytes ({text})"
    return text


# -- a leaner network layer under httpcore ---------------------------------------------------
#
# Measured on the relay's path (docs/performance.md), two costs of httpcore's default network
# layer sit on every POST: its pool asks each idle pooled connection whether the server closed
# it, and each asking builds anyio's table of socket attributes (a `getpeername` call and a
# dozen closures) and a new `poll` object; and the request head and body go out in two
# `send` calls, each waking the ingress. httpcore takes any network backend (its public
# `AsyncNetworkBackend` interface, the pool's `network_backend=`). The pool's question about an
# idle connection is `get_extra_info("is_readable")`, a key httpcore's own backends answer but
# its docs do not name: tests/test_http_httpx.py fails if an upgrade stops asking it (the
# cheaper answer here would then go unused, silently).


class _Backend(httpcore.AsyncNetworkBackend):
    def __init__(self, inner: httpcore.AsyncNetworkBackend) -> None:
        self._inner = inner

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        local_address: str | None = None,
        socket_options: typing.Iterable[typing.Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        return _Stream(
            await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        )

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        socket_options: typing.Iterable[typing.Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        return _Stream(await self._inner.connect_unix_socket(path, timeout, socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class _Stream(httpcore.AsyncNetworkStream):
    """httpcore's stream with (1) what it writes held until it next reads, so a request's
    head and body leave in one `send` (HTTP/1.1: a client always reads after its request;
    closing or upgrading to TLS sends what is held first), and (2) "is the idle connection
    readable?" answered by one `poll` object kept per connection."""

    def __init__(self, inner: httpcore.AsyncNetworkStream) -> None:
        self._inner = inner
        self._held: list[bytes] = []
        self._held_timeout: float | None = None
        self._poll: typing.Any = None
        sock = inner.get_extra_info("socket")
        fd = sock.fileno() if sock is not None else -1
        if fd != -1 and hasattr(select, "poll"):
            self._poll = select.poll()
            self._poll.register(fd, select.POLLIN)

    async def _flush(self) -> None:
        if self._held:
            data = b"".join(self._held)
            self._held.clear()
            await self._inner.write(data, self._held_timeout)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        await self._flush()
        return await self._inner.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        if buffer:
            self._held.append(buffer)
            self._held_timeout = timeout

    async def aclose(self) -> None:
        self._held.clear()  # nobody will read an answer to it
        await self._inner.aclose()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
    ) -> httpcore.AsyncNetworkStream:
        await self._flush()
        return _Stream(await self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> typing.Any:
        if info == "is_readable" and self._poll is not None:
            return bool(self._poll.poll(0))
        return self._inner.get_extra_info(info)
