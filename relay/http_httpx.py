"""POSTs through httpx at its transport level (`http_transport=httpx`), and through a transport
the application owns (`Relay(transport=...)`, e.g. an in-process ASGI app).

The relay builds one `httpx.Request` per POST and hands it straight to
`AsyncHTTPTransport.handle_async_request`: no `AsyncClient` in between, so none of the client
layer the relay does not use (URL merging with a base URL, cookie jars, auth and redirect
flows, default headers, event hooks) runs per POST. What the client did that the relay needs is
done here, once:

- **Proxies.** A transport either uses a proxy or does not; the client picks one per URL from
  `HTTP_PROXY`, `HTTPS_PROXY`, `ALL_PROXY` and `NO_PROXY` (its `trust_env`). This sender makes
  the same choice with httpx's own rules (`get_environment_proxies`, `URLPattern`), read once at
  start, and remembers it per origin. An app-owned transport is used as it is, never proxied
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

import ssl

import httpx
from httpx._utils import URLPattern, get_environment_proxies

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
    ) -> None:
        self._owned: list[httpx.AsyncBaseTransport] = []
        # The proxy rules, most specific first (httpx's order): (pattern, transport or None =
        # direct). Empty for an app-owned transport, or when the environment names no proxy.
        self._mounts: list[tuple[URLPattern, httpx.AsyncBaseTransport | None]] = []
        if transport is not None:
            self._direct = transport
        else:
            limits = httpx.Limits(
                max_connections=connections, max_keepalive_connections=connections
            )

            def pool(proxy: httpx.Proxy | None = None) -> httpx.AsyncBaseTransport:
                t = httpx.AsyncHTTPTransport(
                    verify=verify, http1=True, http2=False, limits=limits, proxy=proxy
                )
                self._owned.append(t)
                return t

            self._direct = pool()
            rules = sorted(
                (URLPattern(pattern), None if url is None else httpx.Proxy(url))
                for pattern, url in get_environment_proxies().items()
            )
            self._mounts = [(p, None if proxy is None else pool(proxy)) for p, proxy in rules]
        t = float(timeout)
        self._extensions = {"timeout": {"connect": t, "read": t, "write": t, "pool": t}}
        # Per origin: (the transport it goes through, its Host header); the relay POSTs to one
        # or two origins (ingress_url, ingress_batch_url), so this stays tiny.
        self._routes: dict[Origin, tuple[httpx.AsyncBaseTransport, tuple[bytes, bytes]]] = {}

    def _route(self, origin: Origin, url: httpx.URL) -> tuple[httpx.AsyncBaseTransport, bytes]:
        transport = self._direct
        for pattern, mounted in self._mounts:
            if pattern.matches(url):
                transport = self._direct if mounted is None else mounted
                break
        route = (transport, (b"host", url.netloc))
        if len(self._routes) < 64:  # a caller POSTing to many origins does not grow it forever
            self._routes[origin] = route
        return route[0], route[1][1]

    async def send(
        self, url: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes, str | None]:
        try:
            target = httpx.URL(url)
            origin = _origin(url)
            route = self._routes.get(origin)
            if route is None:
                transport, host = self._route(origin, target)
            else:
                transport, host = route[0], route[1][1]
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
            return response.status_code, b"".join(chunks)[:READ_LIMIT], _retry_after(response)
        except (httpx.HTTPError, OSError) as exc:
            raise TransportFailure(f"{type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        # Only what this sender opened: an app-owned transport is the application's to close.
        for transport in self._owned:
            await transport.aclose()


def _retry_after(response: httpx.Response) -> str | None:
    value: str | None = response.headers.get("retry-after")
    return value
