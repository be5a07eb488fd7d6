"""POSTs through httpx at its transport level (`http_transport=httpx`), and through a transport
the application owns (`Relay(transport=...)`, e.g. an in-process ASGI app).

The relay builds one `httpx.Request` per POST and hands it straight to
`AsyncHTTPTransport.handle_async_request`: no `AsyncClient` in between, so none of the client
layer the relay does not use (URL merging with a base URL, cookie jars, auth and redirect
flows, default headers, event hooks) runs per POST. What the client did that the relay needs is
done here, once:

- **Proxies.** A transport either uses a proxy or does not; the client picks one per URL from
  `HTTP_PROXY`, `HTTPS_PROXY`, `ALL_PROXY` and `NO_PROXY` (its `trust_env`). This sender makes
  the same choice with the same rules (relay/proxies.py), read once at start, and remembers it
  per origin, with one pool per proxy. An app-owned transport is used as it is, never proxied
  (as httpx's client does with an explicit `transport=`).
- **Headers.** `Host` and `Content-Length` are set here (a request built from a stream gets no
  automatic headers), with `Host` computed once per origin.
- **Limits.** One pool per lane, sized to the lane's POST slots; HTTP/1.1; connect, read, write
  and pool timeouts from `http_timeout` (the whole request is bounded by IngressClient's own
  deadline); at most `READ_LIMIT` bytes of an answer read, after which the connection is closed
  rather than drained.

Every httpx error (refused, reset, TLS, a malformed answer, a timeout of one phase) becomes a
`TransportFailure` naming it: a failure of this request, never of the relay.
"""

from __future__ import annotations

import os
import select
import ssl
import typing

import httpcore
import httpx

from relay.proxies import NO_PROXIES, ProxyRules, proxy_rules
from relay.transport import READ_LIMIT, TransportFailure

Origin = tuple[str, str]  # (scheme, netloc) as written in the URL


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


class HttpxSender:
    """The `Sender` over httpx transports: its own pool (and, per the environment, proxy
    pools), or the application's transport."""

    def __init__(
        self,
        *,
        verify: ssl.SSLContext | bool = True,
        connections: int = 1,
        timeout: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
        rules: ProxyRules | None = None,
    ) -> None:
        self._owned: list[httpx.AsyncBaseTransport] = []
        # The proxy rules of the environment (none for an app-owned transport), and a pool per
        # proxy, opened when an origin first needs it.
        self._proxy_rules = NO_PROXIES
        self._proxied: dict[str, httpx.AsyncBaseTransport] = {}
        self._limits = httpx.Limits(
            max_connections=connections, max_keepalive_connections=connections
        )
        self._verify = verify
        if transport is not None:
            self._direct = transport
        else:
            self._direct = self._pool()
            self._proxy_rules = proxy_rules(os.environ) if rules is None else rules
        t = float(timeout)
        self._extensions = {"timeout": {"connect": t, "read": t, "write": t, "pool": t}}
        # Per origin: (the transport it goes through, its Host header); the relay POSTs to one
        # or two origins (ingress_url, ingress_batch_url), so this stays tiny.
        self._routes: dict[Origin, tuple[httpx.AsyncBaseTransport, bytes]] = {}

    def _pool(self, proxy: str | None = None) -> httpx.AsyncBaseTransport:
        t = httpx.AsyncHTTPTransport(
            verify=self._verify,
            http1=True,
            http2=False,
            limits=self._limits,
            proxy=None if proxy is None else httpx.Proxy(proxy),
        )
        _lean(t)
        self._owned.append(t)
        return t

    def _route(
        self, origin: Origin, url: str, target: httpx.URL
    ) -> tuple[httpx.AsyncBaseTransport, bytes]:
        transport = self._direct
        proxy = self._proxy_rules.for_url(url)
        if proxy is not None:
            if proxy not in self._proxied:
                self._proxied[proxy] = self._pool(proxy)
            transport = self._proxied[proxy]
        if len(self._routes) < 64:  # a caller POSTing to many origins does not grow it forever
            self._routes[origin] = (transport, target.netloc)
        return transport, target.netloc

    async def send(
        self, url: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes, str | None]:
        try:
            target = httpx.URL(url)
            origin = _origin(url)
            route = self._routes.get(origin)
            transport, host = self._route(origin, url, target) if route is None else route
            raw = [(b"host", host), (b"content-length", b"%d" % len(body))]
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
                chunks: list[bytes] = []
                size = 0
                async for chunk in response.stream:  # type: ignore[union-attr]
                    chunks.append(chunk)
                    size += len(chunk)
                    if size >= READ_LIMIT:
                        break  # closing the unread answer closes its connection
            finally:
                await response.aclose()
            retry_after: str | None = response.headers.get("retry-after")
            return response.status_code, b"".join(chunks)[:READ_LIMIT], retry_after
        except (httpx.HTTPError, OSError) as exc:
            raise TransportFailure(_failure(exc)) from exc

    async def aclose(self) -> None:
        # Only what this sender opened: an app-owned transport is the application's to close.
        for transport in self._owned:
            await transport.aclose()


# The head of an answer is bounded by h11 as bytes arrive: httpcore reads 64 KiB at a time into
# h11, which refuses a head still incomplete past `max_incomplete_event_size` (httpcore passes
# this class attribute, 100 KiB) with "Receive buffer too long" (issue 32, item 6; tested with
# an endless header line in tests/test_security.py).
HEAD_LIMIT: int = httpcore.AsyncHTTP11Connection.MAX_INCOMPLETE_EVENT_SIZE


def _failure(exc: Exception) -> str:
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, httpx.RemoteProtocolError) and "Receive buffer too long" in str(exc):
        return f"answer head over {HEAD_LIMIT} bytes ({text})"
    return text


# -- a leaner network layer under httpcore ---------------------------------------------------
#
# Measured on the relay's path (docs/performance.md), two costs of httpcore's default network
# layer sit on every POST: its pool asks each idle pooled connection whether the server closed
# it, and each asking builds anyio's table of socket attributes (a `getpeername` call and a
# dozen closures) and a new `poll` object; and the request head and body go out in two
# `send` calls, each waking the ingress. httpcore takes any network backend (its public
# `AsyncNetworkBackend` interface); httpx's transport does not pass one through, so it is set
# on the transport's pool before its first connection. If a later httpx moves that attribute,
# the transport runs on httpcore's own backend, unchanged in behaviour.


def _lean(transport: httpx.AsyncHTTPTransport) -> None:
    pool = getattr(transport, "_pool", None)
    inner = getattr(pool, "_network_backend", None)
    if isinstance(inner, httpcore.AsyncNetworkBackend):
        pool._network_backend = _Backend(inner)  # type: ignore[union-attr]


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
