"""POSTs through httpcore, httpx's transport layer (`http_transport=httpx`), and through an httpx
transport the application owns (`Relay(transport=...)`, e.g. an in-process ASGI app).

The relay's own POSTs go to httpcore's connections (`httpcore.AsyncHTTP11Connection`) kept
here, or through a proxy to `httpcore.AsyncConnectionPool`, all of it httpcore's public API: no
`httpx.AsyncClient` (URL merging with a base URL, cookie jars, auth and redirect flows, default
headers, event hooks) and no `httpx.AsyncHTTPTransport` (a request and a response model wrapped
around httpcore's per POST) in between. What they did that the relay needs is done here, once:

- **Proxies.** The environment's proxy for each origin (`HTTP_PROXY`, `HTTPS_PROXY`,
  `ALL_PROXY`, `NO_PROXY`, read as httpx's client reads them with `trust_env`:
  relay/proxies.py), decided once per origin, with pools per proxy (`httpcore.Proxy`; userinfo
  in the proxy's URL becomes its Basic auth, a TLS proxy is verified against the system's
  store). An app-owned transport is used as it is, never proxied (as httpx's client does with
  an explicit `transport=`).
- **Headers.** `Host` (computed once per origin) and `Content-Length` are set here; the URL
  is parsed once per origin, and each POST's request target is the rest of its URL.
- **Connections.** Straight to the ingress, a lane's POSTs take a kept connection (the most
  recently used) or open one, at most `connections` at once, one request at a time on each:
  httpcore's pool, with its lock, its shielded scopes and a scan of every connection it holds
  on each request and each release, cost a fifth of this sender's CPU per POST
  (docs/performance.md, "The httpx path without httpcore's pool"). A kept connection is
  reused only if httpcore left it idle (its answer read whole, keep-alive) and it has not
  expired: idle over 5 s (httpx's default), or closed by the server meanwhile. Through a
  proxy, httpcore's pools do it (tunnelling and forwarding are theirs), a lane's `connections`
  split over pools of at most `POOL_WIDTH`, each POST taking the least busy: their scans grow
  with the square of their size (docs/performance.md, "The httpx path at 32 POST slots").
- **Limits.** HTTP/1.1; connect, read and write timeouts (and the pools' wait) from
  `http_timeout` (the whole request is bounded by IngressClient's own deadline); at most
  `READ_LIMIT` bytes of an answer read, after which the connection is closed rather than
  drained.

Every httpcore or httpx error (refused, reset, TLS, a malformed answer, a timeout of one phase)
becomes a `TransportFailure` naming it: a failure of this request, never of the relay.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import typing
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

import httpcore
import httpx

from relay.http_network import Backend
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


@dataclass(slots=True)
class _Route:
    """Where POSTs to one origin go: straight to it over connections kept here (`idle`), or
    through a proxy's pools."""

    prefix: int  # characters of the URL up to its path: scheme://netloc
    scheme: bytes
    host: bytes
    port: int | None
    host_header: bytes
    pools: _Pools | None  # through a proxy
    keeps: bool  # whether its connections are kept (the sender remembers the route)
    idle: list[httpcore.AsyncHTTP11Connection] = field(default_factory=list)


class HttpxSender:
    """The `Sender` over httpcore connections of its own (through the environment's proxies,
    httpcore's pools), or over the application's httpx transport."""

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
        self._ssl.set_alpn_protocols(["http/1.1"])  # as httpcore's connections say: HTTP/1.1
        self._connections = connections
        self._proxy_rules = NO_PROXIES
        if transport is None:
            self._proxy_rules = proxy_rules(os.environ) if rules is None else rules
        self._pools: dict[str, _Pools] = {}  # per proxy URL
        self._timeout = t = float(timeout)
        self._extensions = {"timeout": {"connect": t, "read": t, "write": t, "pool": t}}
        self._slots = asyncio.Semaphore(connections)  # POSTs in flight on direct connections
        self._network = Backend()
        # Per origin; the relay POSTs to one or two (ingress_url, ingress_batch_url).
        self._routes: dict[Origin, _Route] = {}

    def _pools_for(self, proxy: str) -> _Pools:
        if proxy not in self._pools:

            def make(width: int) -> httpcore.AsyncConnectionPool:
                return httpcore.AsyncConnectionPool(
                    ssl_context=self._ssl,
                    proxy=_proxy(proxy),
                    max_connections=width,
                    max_keepalive_connections=width,
                    keepalive_expiry=KEEPALIVE_EXPIRY,
                    http1=True,
                    http2=False,
                    network_backend=self._network,
                )

            self._pools[proxy] = _Pools(make, self._connections)
        return self._pools[proxy]

    def _route(self, url: str) -> _Route:
        origin = _origin(url)
        route = self._routes.get(origin)
        if route is None:
            parsed = httpx.URL(url)
            if parsed.raw_scheme not in (b"http", b"https") or not parsed.raw_host:
                raise httpcore.UnsupportedProtocol(f"not an http(s) URL with a host: {url}")
            proxy = self._proxy_rules.for_url(url)
            route = _Route(
                len(origin[0]) + 3 + len(origin[1]),
                parsed.raw_scheme,
                parsed.raw_host,
                parsed.port,
                parsed.netloc,
                None if proxy is None else self._pools_for(proxy),
                keeps=len(self._routes) < 64,  # a caller POSTing to many origins: not forever
            )
            if route.keeps:
                self._routes[origin] = route
        return route

    async def send(
        self, url: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes, str | None]:
        if self._app is not None:
            return await self._send_app(self._app, url, body, headers)
        try:
            route = self._route(url)
            raw = [(b"host", route.host_header), (b"content-length", b"%d" % len(body))]
            raw += [(k.encode("ascii"), v.encode("ascii")) for k, v in headers.items()]
            request = httpcore.Request(
                b"POST",
                httpcore.URL(
                    scheme=route.scheme,
                    host=route.host,
                    port=route.port,
                    target=_target(url, route.prefix),
                ),
                headers=raw,
                content=body,
                extensions=self._extensions,
            )
            if route.pools is None:
                async with self._slots:
                    return await self._direct(route, request)
            return await self._proxied(route.pools, request)
        except (*HTTPCORE_ERRORS, OSError) as exc:
            raise TransportFailure(_failure(exc)) from exc

    async def _direct(
        self, route: _Route, request: httpcore.Request
    ) -> tuple[int, bytes, str | None]:
        """On a kept connection to the origin (a new one if none is idle), kept again if its
        answer was read whole and it stays open (httpcore closes it otherwise)."""
        conn = await self._kept(route) or await self._connect(route)
        answer = await _exchange(conn, request)
        if conn.is_idle():
            if route.keeps:
                route.idle.append(conn)
            else:
                await conn.aclose()
        return answer

    async def _kept(self, route: _Route) -> httpcore.AsyncHTTP11Connection | None:
        while route.idle:
            conn = route.idle.pop()  # the most recently used: the least likely to be closing
            if not conn.has_expired():  # idle past KEEPALIVE_EXPIRY, or the server closed it
                return conn
            await conn.aclose()
        return None

    async def _connect(self, route: _Route) -> httpcore.AsyncHTTP11Connection:
        host = route.host.decode("ascii")
        port = route.port or (443 if route.scheme == b"https" else 80)
        stream = await self._network.connect_tcp(host, port, timeout=self._timeout)
        if route.scheme == b"https":
            stream = await stream.start_tls(self._ssl, server_hostname=host, timeout=self._timeout)
        origin = httpcore.Origin(route.scheme, route.host, port)
        return httpcore.AsyncHTTP11Connection(origin, stream, keepalive_expiry=KEEPALIVE_EXPIRY)

    async def _proxied(
        self, pools: _Pools, request: httpcore.Request
    ) -> tuple[int, bytes, str | None]:
        i = pools.pick()
        pools.in_flight[i] += 1
        try:
            return await _exchange(pools.pools[i], request)
        finally:
            pools.in_flight[i] -= 1

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
        for route in self._routes.values():
            while route.idle:
                await route.idle.pop().aclose()
        for pools in self._pools.values():
            for pool in pools.pools:
                await pool.aclose()


async def _exchange(
    via: httpcore.AsyncHTTP11Connection | httpcore.AsyncConnectionPool, request: httpcore.Request
) -> tuple[int, bytes, str | None]:
    response = await via.handle_async_request(request)
    try:
        chunks = await _read(response.aiter_stream())
    finally:
        await response.aclose()
    retry_after = next(
        (v.decode("latin-1") for k, v in response.headers if k.lower() == b"retry-after"), None
    )
    return response.status, chunks, retry_after


def _target(url: str, prefix: int) -> bytes:
    """The request target: the URL past its origin (`prefix` characters), without fragment."""
    target = url[prefix:].partition("#")[0]
    if not target.startswith("/"):
        target = "/" + target  # no path: the origin's root
    return target.encode("ascii")


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
