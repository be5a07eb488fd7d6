"""The one HTTP client the relay POSTs to its ingress with (DESIGN §5): an `httpx.AsyncClient`,
used through httpx's public API only.

What httpx gives, the relay takes as it is: proxies (`HTTP_PROXY`, `HTTPS_PROXY`, `ALL_PROXY`,
`NO_PROXY` by httpx's rules, or the `ingress_proxy` setting: read by the client's `trust_env`
under httpx's own transport, written out by `proxy_routes` for the default's; SOCKS with httpx's
`socks` extra), TLS (verified always, against `ingress_ca_file` or the operating system's trust
store), timeouts per phase, connection limits, HTTP/2 (the `http2` setting, httpx's `http2`
extra), never following redirects. Under the client sits a published transport, one setting
choosing (`http_transport`):

- `aiohttp` (the default): `httpx_aiohttp.AiohttpTransport`, httpx's client over aiohttp's
  connection pool and its C parser, every route (straight, and one per proxy: `proxy_routes`)
  over a session of the relay's own (`aiohttp_session`). Its connector (`FreshConnector`) hands
  out no connection holding bytes no request asked for: an ingress that writes one answer twice,
  at once or while the connection sits idle, never has the copy read as the next POST's
  (issue 48 item 1; tests/test_stale_answer.py). A third of httpx's own transport's CPU per POST
  (docs/performance.md).
- `httpx`: httpx's own transport (httpcore). The only one that speaks HTTP/2, so `http2=true`
  uses it, and so does a SOCKS proxy (aiohttp takes HTTP proxies only). It drops a connection on
  which bytes arrived while idle, but over HTTP/1.1 reads a copy that came in the same segment as
  the answer as the next POST's (docs/security.md), so under it no connection carries a second
  POST unless `ingress_keepalive=true` is set (`keepalive_for`).

`ingress_keepalive=false` uses no connection twice, on either: what no reuse check can see (an
answer arriving after it) cannot be read as another POST's.

What the relay adds over httpx is small and written here once: at most `READ_LIMIT` bytes of an
answer are read (then the connection is dropped, not drained); the answer's body is read raw
(`accept-encoding: identity`, so no decompression bomb); no cookie is kept (a hostile ingress
could grow the jar without bound); every error of one request (httpx's, or aiohttp's that the
transport passes through unmapped, such as a malformed status line) becomes a
`TransportFailure` naming it, and naming what it was (refused, DNS, TLS, reset, timed out) from
the chain of errors under it, since httpx-aiohttp raises every aiohttp connection error as
`httpx.ConnectTimeout` (issue 49 item 4). The whole-request deadline against slow-drip answers
is the ingress client's (relay/edges/ingress.py `Deadlines`): httpx's timeouts are per phase.
"""

from __future__ import annotations

import base64
import errno
import ipaddress
import os
import socket
import ssl
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from http.cookiejar import CookieJar, DefaultCookiePolicy
from importlib.util import find_spec
from typing import Any, Protocol
from urllib.parse import unquote_to_bytes
from urllib.request import getproxies

import aiohttp  # its errors: httpx_aiohttp passes some through unmapped (a bad status line)
import httpx
from aiohttp.connector import Connection
from httpx_aiohttp import AiohttpTransport

from relay import logs
from relay.logs import redact_text
from relay.settings import ConfigError, Settings, configured_secrets, redact_url

MAX_BODY = 64 * 1024
READ_LIMIT = MAX_BODY + 1  # what is read of an answer: one byte more than is kept
KEEPALIVE_EXPIRY = 5.0  # seconds an idle connection is kept: httpx's default
TRANSPORTS = ("aiohttp", "httpx")
# What httpx's own transport does over HTTP/1.1 keep-alive that no public API lets the relay
# prevent (`keepalive_for`): said where keep-alive is chosen or refused.
KEEPALIVE_HAZARD = (
    "over HTTP/1.1 reads an answer the ingress wrote twice in one segment as the next POST's "
    "(docs/security.md)"
)
# `http_transport` values of earlier releases, and what now does their job. They still start (a
# rolling upgrade never fails on a setting it used to accept), with one warning.
RETIRED_TRANSPORTS = {"httptools": "aiohttp", "httpcore": "httpx"}
PROXY_VARIABLES = frozenset({"http_proxy", "https_proxy", "all_proxy"})
# Statuses whose answer has no body whatever its headers say (RFC 9110 §6.4.1).
NO_BODY_STATUSES = frozenset({204, 304})
# What httpx and aiohttp raise about one request.
REQUEST_ERRORS = (httpx.HTTPError, httpx.InvalidURL, aiohttp.ClientError, ssl.SSLError, OSError)
TIMED_OUT = "timed out"
IDENTITY = "identity"  # the only content coding asked for: an answer is read as sent
# What a request's failure was, read from the errors under it (`failure_kind`): the first row
# one of them matches, by type or by an OSError's errno (aiohttp re-raises the OS's error as its
# own ClientOSError, keeping the errno). A timeout is named only when no row matches: under
# httpx-aiohttp every connection error wears a timeout's type.
FAILURE_KINDS: tuple[tuple[str, tuple[type[BaseException], ...], frozenset[int]], ...] = (
    ("DNS: name not resolved", (socket.gaierror, aiohttp.ClientConnectorDNSError), frozenset()),
    ("TLS failure", (ssl.SSLError, ssl.CertificateError, aiohttp.ClientSSLError), frozenset()),
    ("connection refused", (ConnectionRefusedError,), frozenset({errno.ECONNREFUSED})),
    (
        "connection reset",
        (ConnectionResetError, ConnectionAbortedError, BrokenPipeError),
        frozenset({errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE}),
    ),
    ("disconnected before an answer", (aiohttp.ServerDisconnectedError,), frozenset()),
)


class TransportFailure(Exception):
    """No HTTP answer: connection refused/reset, timeout, reply lost, a malformed answer.
    `timed_out`: the request ran out of time, which the adaptive POST limit reads as an
    overloaded ingress (relay/admission/limit.py); the other failures say nothing about its load."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


@dataclass(frozen=True, slots=True)
class Reply:
    """What one POST got back, as read: the status, at most READ_LIMIT bytes of the body (one
    byte past MAX_BODY tells the caller it was cut), its Retry-After, and whether only the
    connection's close marked the body's end (no Content-Length, no final `chunked` coding)."""

    status: int
    body: bytes
    retry_after: str | None
    unframed: bool = False
    location: str | None = None  # a redirect's target (never followed): for the operator


class Sender(Protocol):
    """How a POST goes out: `send` returns a `Reply` or raises TransportFailure."""

    async def send(self, url: str, body: bytes, headers: dict[str, str]) -> Reply: ...


def transport_for(settings: Settings, environ: Mapping[str, str]) -> tuple[str, str | None]:
    """The transport that carries the POSTs, and why it is not the configured one (None when it
    is). Pure: decided once per client, at start."""
    configured = settings.http_transport
    name = RETIRED_TRANSPORTS.get(configured, configured)
    if settings.http2 and name != "httpx":
        return "httpx", "http2=true: only httpx's own transport speaks HTTP/2"
    if name == "aiohttp" and _socks_proxy(settings, environ):
        return "httpx", "a SOCKS proxy is configured: aiohttp's transport takes HTTP proxies only"
    if configured in RETIRED_TRANSPORTS:
        return name, f"http_transport={configured} is retired: {name} replaces it"
    return name, None


def keepalive_for(settings: Settings, transport: str) -> tuple[bool, str]:
    """Whether a connection to the ingress carries more than one POST under `transport` (the one
    `transport_for` chose), and why, as the `http_transport_chosen` line and `relay check` say
    it. `ingress_keepalive` as the operator set it; unset, on with aiohttp's transport, whose
    connector hands out no connection holding bytes (`FreshConnector`), and off with httpx's
    own: over HTTP/1.1 (chosen, or `http2=true` towards an ingress that does not take HTTP/2, or
    a SOCKS proxy) it reads a copy that came in the answer's segment as the next POST's, held in
    h11's buffer where no check and no public API reaches (issue 48 item 1, docs/security.md)."""
    if settings.ingress_keepalive is False:
        return False, "ingress_keepalive=false: one POST a connection"
    if transport != "httpx":
        if settings.ingress_keepalive:
            return True, "ingress_keepalive=true"
        return True, "the default: aiohttp's transport reuses no connection holding bytes"
    if settings.ingress_keepalive:
        return True, f"ingress_keepalive=true: {KEEPALIVE_HAZARD}"
    return False, (
        f"the default with httpx's own transport, which {KEEPALIVE_HAZARD}; "
        "ingress_keepalive=true keeps connections with that hazard"
    )


def configured_proxies(settings: Settings, environ: Mapping[str, str]) -> list[str]:
    """The proxies the client may use: `ingress_proxy` alone when it is set (httpx then reads no
    variable), else the variables httpx's `trust_env` reads (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY,
    either case). Which URL one applies to is httpx's to decide; here only whether there are
    any, and their schemes, matter."""
    if settings.ingress_proxy is not None:
        return [settings.ingress_proxy.reveal()]
    return [value for name, value in environ.items() if name.lower() in PROXY_VARIABLES and value]


def _socks_proxy(settings: Settings, environ: Mapping[str, str]) -> bool:
    return any(p.strip().lower().startswith("socks") for p in configured_proxies(settings, environ))


def require_extras(settings: Settings, environ: Mapping[str, str]) -> None:
    """A ConfigError at start, before any connection, when the client would need an extra that
    is not installed: `h2` for HTTP/2, `socksio` for a SOCKS proxy (httpx would otherwise fail
    every POST with the missing import)."""
    if settings.http2 and find_spec("h2") is None:
        raise ConfigError("http2: needs httpx's http2 extra: pip install 'ledger-relay[http2]'")
    if _socks_proxy(settings, environ) and find_spec("socksio") is None:
        raise ConfigError(
            "a SOCKS proxy is configured (ingress_proxy or ALL_PROXY / HTTP(S)_PROXY) and needs "
            "httpx's socks extra: pip install 'ledger-relay[socks]'"
        )


def build_client(
    settings: Settings,
    connections: int,
    environ: Mapping[str, str] | None = None,
    *,
    announce: bool = True,
) -> CookielessClient:
    """A client for one lane, `connections` wide; raises ConfigError when an extra it needs
    (`h2` for HTTP/2, `socksio` for a SOCKS proxy) is not installed. `announce`: log the
    transport and keep-alive chosen once (`http_transport_chosen`), where they need saying;
    `relay check` says them on its configuration line instead."""
    env = os.environ if environ is None else environ
    require_extras(settings, env)
    name, why = transport_for(settings, env)
    keepalive, keepalive_why = keepalive_for(settings, name)
    told = why is not None or (name == "httpx" and settings.ingress_keepalive is not False)
    if announce and told:
        _say_once(
            "http_transport_chosen",
            configured=settings.http_transport,
            using=name,
            why=why or "as configured",
            keepalive="on" if keepalive else "off",
            keepalive_why=keepalive_why,
        )
    # Keep-alive off: no idle connection is kept, so none is used for a second POST.
    limits = httpx.Limits(
        max_connections=connections,
        max_keepalive_connections=connections if keepalive else 0,
        keepalive_expiry=KEEPALIVE_EXPIRY,
    )
    # TLS is verified always: against `ingress_ca_file` when given, else the operating system's
    # store (OpenSSL's default paths; SSL_CERT_FILE / SSL_CERT_DIR honoured). `verify=True` would
    # load certifi's bundle instead and refuse an ingress whose CA the OS trusts (issue 30).
    verify = ssl.create_default_context(cafile=settings.ingress_ca_file)
    # The default transport's routes are the relay's own (`aiohttp_routes`); httpx's own transport
    # is built by httpx, proxies read by its `trust_env` (given a transport, it reads none).
    try:
        direct, mounts = (
            aiohttp_routes(settings, verify, limits, connections, keepalive=keepalive)
            if name == "aiohttp"
            else (None, None)
        )
        proxy = settings.ingress_proxy if direct is None else None
        return CookielessClient(
            verify=verify,
            http2=settings.http2,
            limits=limits,
            timeout=httpx.Timeout(settings.http_timeout),
            proxy=None if proxy is None else proxy.reveal(),
            trust_env=True,
            follow_redirects=False,
            transport=direct,
            mounts=mounts,
        )
    except ValueError as exc:  # httpx.Proxy: an unknown scheme
        raise ConfigError(f"proxy: {redact_url(str(exc))}") from None


def aiohttp_routes(
    settings: Settings,
    verify: ssl.SSLContext,
    limits: httpx.Limits,
    connections: int,
    *,
    keepalive: bool,
) -> tuple[AiohttpTransport, dict[str, httpx.AsyncBaseTransport | None]]:
    """The default transport's routes, every one built here over an aiohttp session of the
    relay's own (`aiohttp_session`: its connector hands out no connection holding bytes, its jar
    keeps no cookie): the transport straight to the ingress, and a mount per URL pattern the
    proxies take elsewhere (`proxy_routes`; None: straight). Left to httpx-aiohttp, a proxied
    route got a session it built itself, which neither reached (issue 48 item 1). Raises
    ValueError for a proxy URL httpx does not take."""

    def route(proxy: str | None) -> AiohttpTransport:
        return AiohttpTransport(
            verify=verify,
            limits=limits,
            proxy=None if proxy is None else httpx.Proxy(proxy),
            client=lambda: aiohttp_session(verify, connections, keepalive=keepalive),
        )

    mounts: dict[str, httpx.AsyncBaseTransport | None] = {
        pattern: None if proxy is None else route(proxy)
        for pattern, proxy in proxy_routes(settings).items()
    }
    return route(None), mounts


def proxy_routes(settings: Settings) -> dict[str, str | None]:
    """The proxy each URL pattern goes through (None: straight, as NO_PROXY says), decided by
    httpx's rules (its client's proxy map): `ingress_proxy` for every URL, else the environment
    as `urllib.request.getproxies()` reads it (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY, NO_PROXY,
    either case). Written out here because given its transports, as the default transport's
    routes are (`aiohttp_transports`), httpx reads no proxy variable; `NO_PROXY` entries become
    patterns as httpx makes them (curl's rules: `*` bypasses every proxy, `.example.com`
    matches its subdomains, `example.com` the domain and its subdomains)."""
    if settings.ingress_proxy is not None:
        return {"all://": settings.ingress_proxy.reveal()}
    found = getproxies()
    routes: dict[str, str | None] = {
        f"{scheme}://": url if "://" in url else f"http://{url}"
        for scheme in ("http", "https", "all")
        if (url := found.get(scheme))
    }
    for host in (entry.strip() for entry in found.get("no", "").split(",")):
        if host == "*":
            return {}
        if host:
            routes[_bypass_pattern(host)] = None
    return routes


def _bypass_pattern(host: str) -> str:
    """The URL pattern of one NO_PROXY entry, as httpx makes it."""
    if "://" in host:
        return host
    if _is_address(host, ipaddress.IPv4Address):
        return f"all://{host}"
    if _is_address(host, ipaddress.IPv6Address):
        return f"all://[{host}]"
    if host.lower() == "localhost":
        return f"all://{host}"
    return f"all://*{host}"


def _is_address(host: str, kind: type[ipaddress.IPv4Address | ipaddress.IPv6Address]) -> bool:
    try:
        kind(host.split("/")[0])  # an address, or a network's (`10.0.0.0/8`)
    except ValueError:
        return False
    return True


class FreshConnector(aiohttp.TCPConnector):
    """aiohttp's connector, except that it never hands out a pooled connection holding bytes no
    request asked for. aiohttp reuses an idle connection as long as it is open and young; an
    ingress that wrote an answer a second time while the connection sat idle (issue 48 item 1)
    left that copy parsed in the connection's buffer, and the next POST read it as its own
    answer, its body never read by the ingress. Such a connection is closed and the next one
    taken (a new one at the latest). A connection whose peer has closed is gone already:
    aiohttp closes it when the end arrives, and does not reuse a closed one.

    The check is `Connection.protocol.should_close` (aiohttp's own test at release: anything
    buffered, a broken parse, a body still coming, `connection: close`), read when
    `connect` (aiohttp's documented way to a connection) hands the connection out: attribute
    reads, no system call. What it cannot see is an answer arriving after it: docs/security.md."""

    async def connect(self, *args: Any, **kwargs: Any) -> Connection:
        for _ in range(max(self.limit, 1) + 1):  # each stale one leaves the pool: a new one
            connection = await super().connect(*args, **kwargs)
            protocol = connection.protocol
            if protocol is None or not protocol.should_close:
                return connection
            connection.close()
        raise aiohttp.ServerConnectionError("every connection held bytes no request asked for")


def aiohttp_session(
    verify: ssl.SSLContext, connections: int, *, keepalive: bool = True
) -> aiohttp.ClientSession:
    """aiohttp's session under the default transport, as httpx-aiohttp would build it (its
    connection limit, keep-alive and TLS context), but with a connector that hands out no
    connection holding a stale answer (`FreshConnector`) and a jar that keeps no cookie.
    `keepalive=False` (`ingress_keepalive=false`): every connection is closed after its answer."""
    connector = FreshConnector(
        limit=connections,
        keepalive_timeout=KEEPALIVE_EXPIRY if keepalive else None,
        force_close=not keepalive,
        ssl=verify,
    )
    return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar())


class NoCookies(CookieJar):
    """A jar that takes no cookie from an answer, and does not read an answer's cookies either:
    httpx's client hands every answer to its jar (`CookieJar.extract_cookies`), and a jar
    that refuses each cookie by policy still parsed the answer's headers to find them, about
    10 µs of a POST's CPU (docs/performance.md, issue 52 item 3). The policy refuses every
    domain too, for a cookie set on the jar any other way."""

    def extract_cookies(self, response: Any, request: Any) -> None:
        return None


def no_cookies() -> CookieJar:
    """A jar that takes no cookie: the ingress's answers never grow the client's state."""
    return NoCookies(policy=DefaultCookiePolicy(allowed_domains=[]))


class _AnswersSetNone(httpx.Cookies):
    """A client's cookies that no answer adds to. httpx's client hands every answer to its
    cookies (`Cookies.extract_cookies`), which wrap the request and the answer for the standard
    library's jar (a `urllib.request.Request`, its URL parsed again) before the jar looks for a
    Set-Cookie: about 5% of the relay's CPU per POST at a fast ingress, for cookies the relay
    never keeps (docs/performance.md, issue 52 item 3)."""

    def extract_cookies(self, response: httpx.Response) -> None:
        return None  # an answer's cookies are never read


class CookielessClient(httpx.AsyncClient):
    """httpx's client, keeping no cookie: its cookies (the public `cookies` property, which
    httpx's own request and answer paths read) are an `_AnswersSetNone` of its own. Built with
    `cookies=no_cookies()` as well, a jar that refuses every cookie, should httpx ever read
    its jar another way.

    Its default headers ask for every answer unencoded (`accept-encoding: identity`, in the place
    and spelling `HttpxSender` used to write on each request), so a request built on it needs no
    header written of its own: about 4 µs of a POST (issue 52 item 3). The relay builds these
    clients and never changes their headers."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cookies=no_cookies(), **kwargs)
        self._relay_cookies = _AnswersSetNone()
        # Set in place: httpx's `Headers` keeps the default's position, so the head sent is the
        # one a per-request write gave, byte for byte.
        self.headers["accept-encoding"] = IDENTITY

    @property
    def cookies(self) -> httpx.Cookies:
        return self._relay_cookies

    @cookies.setter
    def cookies(self, cookies: Any) -> None:
        raise AttributeError("the relay's HTTP client keeps no cookies")


_said: set[tuple[str, ...]] = set()


def _say_once(event: str, **fields: str) -> None:
    key = (event, *fields.values())
    if key not in _said:
        _said.add(key)
        logs.warning(event, **fields)


class HttpxSender:
    """POSTs over one `httpx.AsyncClient`: the relay's own (closed with it) or the application's
    (`Relay(client=...)`: used as it is, never closed here). Every POST asks for its answer
    unencoded: the relay's own clients say so in their default headers (`CookielessClient`), and
    on an application's client, whose defaults are its own, each request says it."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.identity_by_default = isinstance(client, CookielessClient)

    async def send(self, url: str, body: bytes, headers: dict[str, str]) -> Reply:
        if "@" in url:
            url, headers = without_userinfo(url, headers)
        request = self.client.build_request("POST", url, content=body, headers=headers)
        if not self.identity_by_default:
            request.headers["accept-encoding"] = IDENTITY
        try:
            response = await self.client.send(request, stream=True)
            try:
                read, framed = await _read_some(response)
            finally:
                await response.aclose()
        except REQUEST_ERRORS as exc:
            kind = failure_kind(exc)
            raise TransportFailure(_describe(exc, kind), timed_out=kind == TIMED_OUT) from exc
        return Reply(
            response.status_code,
            read,
            response.headers.get("retry-after"),
            unframed=not framed,
            location=response.headers.get("location"),
        )


def without_userinfo(url: str, headers: dict[str, str]) -> tuple[str, dict[str, str]]:
    """Userinfo never travels in the URL: it becomes Basic auth (as httpx does), unless the
    request already carries its credentials (the configured bearer token), which win. Done
    here rather than by httpx, whose client would put the userinfo's Basic auth in place of
    the token (issue 40: `relay check` did)."""
    parsed = httpx.URL(url)
    if not parsed.userinfo:
        return url, headers
    if "authorization" not in headers:
        headers = headers | {"authorization": "Basic " + basic_credentials(parsed.userinfo)}
    return str(parsed.copy_with(userinfo=b"")), headers


def basic_credentials(userinfo: bytes) -> str:
    """A URL's userinfo (`user:password`, percent-encoded) as HTTP Basic credentials: base64
    of the decoded pair, as sent for the ingress here and for a proxy by httpx."""
    user, _, password = userinfo.partition(b":")
    return base64.b64encode(unquote_to_bytes(user) + b":" + unquote_to_bytes(password)).decode()


def sent_secrets(settings: Settings, environ: Mapping[str, str] | None = None) -> list[str]:
    """What of the secrets an answer or an error may quote back: every secret the settings
    hold, and each form an http URL's credentials travel in (the ingress's and the proxies':
    the password as written and percent-decoded, the Basic credentials). An ingress or proxy
    that echoes the request's headers echoes these (issue 48 item 4)."""
    env = os.environ if environ is None else environ
    out = configured_secrets(settings)
    urls = [settings.ingress_url, settings.ingress_batch_url, *configured_proxies(settings, env)]
    for url in filter(None, urls):
        try:
            userinfo = httpx.URL(url.strip()).userinfo
        except httpx.InvalidURL:  # a proxy variable httpx will refuse as well: nothing is sent
            continue
        if userinfo:
            password = userinfo.partition(b":")[2]
            out += [password.decode(), unquote_to_bytes(password).decode(errors="replace")]
            out.append(basic_credentials(userinfo))
    return [x for x in out if x]


async def _read_some(response: httpx.Response) -> tuple[bytes, bool]:
    """At most READ_LIMIT bytes of the answer, as sent (no decoding), and whether its length is
    known for sure. The rest is never read: closing the response then drops its connection."""
    if response.is_stream_consumed:  # built already read (an app's transport, httpx's mock)
        return response.content[:READ_LIMIT], True
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_raw():
        chunks.append(chunk)
        size += len(chunk)
        if size >= READ_LIMIT:
            break
    return b"".join(chunks)[:READ_LIMIT], _framed(response)


def _framed(response: httpx.Response) -> bool:
    """Whether the wire said where the body ends (a length, chunks, a status without a body,
    HTTP/2's frames) rather than only the connection's close, which a reset mimics.

    RFC 9112 §6.3: a Transfer-Encoding overrides any Content-Length, and only a final
    `chunked` coding frames the body; with any other last coding (`chunked, gzip`, `xchunked`)
    the body runs to the connection's close, and aiohttp reads it so (issue 48 item 2)."""
    if response.status_code in NO_BODY_STATUSES or response.http_version == "HTTP/2":
        return True
    if "transfer-encoding" in response.headers:
        return transfer_codings(response.headers)[-1:] == ["chunked"]
    return "content-length" in response.headers


def transfer_codings(headers: httpx.Headers) -> list[str]:
    """The transfer codings an answer names, in the order applied: every Transfer-Encoding
    header's values joined by commas (RFC 9110 §5.3, as a second header counts), each trimmed
    and lower-cased (codings are case-insensitive), empty list elements dropped."""
    joined = ",".join(headers.get_list("transfer-encoding"))
    return [coding for part in joined.split(",") if (coding := part.strip().lower())]


def failure_kind(exc: BaseException) -> str | None:
    """What a request's failure was (`FAILURE_KINDS`, or TIMED_OUT), None when no error under
    it says. Read from the errors the request's error was raised from, not from its type:
    httpx-aiohttp raises a refused, reset, TLS or DNS failure and a disconnect alike as
    `httpx.ConnectTimeout` (its table maps aiohttp's ClientConnectionError so, and every
    connection error is one), so taken at its word a dead ingress reads as an overloaded one to
    the adaptive POST limit (relay/admission/limit.py, issue 48 item 5)."""
    chain = list(_causes(exc))
    for kind, types, errnos in FAILURE_KINDS:
        for error in chain:
            if isinstance(error, types) or (isinstance(error, OSError) and error.errno in errnos):
                return kind
    if any(_timed_out(error) for error in chain):
        return TIMED_OUT
    return None


def _timed_out(error: BaseException) -> bool:
    """A timeout: the OS's, asyncio's and aiohttp's (`ServerTimeoutError` is a TimeoutError), or
    an httpx timeout that httpx-aiohttp did not make out of an aiohttp error that is none."""
    if isinstance(error, TimeoutError):
        return True
    return isinstance(error, httpx.TimeoutException) and not isinstance(
        error.__cause__, aiohttp.ClientError
    )


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """The error and those under it: its `__cause__`, its `__context__` even where a traceback
    would not show it (httpcore's pool re-raises a connection's error `from None`, which hides
    the OS's error under it but keeps it as the context), and an exception group's members
    (anyio raises one when every address of a name failed). Nearest first."""
    seen: set[int] = set()
    todo = [exc]
    for error in todo:  # grows as it goes: breadth first
        if id(error) in seen:
            continue
        seen.add(id(error))
        yield error
        if isinstance(error, BaseExceptionGroup):
            todo.extend(error.exceptions)
        todo.extend(below for below in (error.__cause__, error.__context__) if below is not None)


def _describe(exc: BaseException, kind: str | None = None) -> str:
    """An error of one request, named: what it was (`failure_kind`), then its type and message,
    URLs' credentials redacted. An httpx error that httpx-aiohttp raised from an aiohttp one is
    named by the aiohttp one: its type is the truer (the message is the same). Without a message
    of its own (httpx's ReadError over a reset), the nearest error under it that has one says
    it."""
    if isinstance(exc, httpx.HTTPError) and isinstance(exc.__cause__, aiohttp.ClientError):
        exc = exc.__cause__
    text = next((said for error in _causes(exc) if (said := str(error).strip())), "")
    name = type(exc).__name__
    described = f"{name}: {text}" if text else name
    return redact_text(f"{kind}: {described}" if kind else described)


@asynccontextmanager
async def open_sender(
    settings: Settings,
    connections: int,
    app: httpx.AsyncClient | httpx.AsyncBaseTransport | None = None,
    *,
    announce: bool = True,
) -> AsyncIterator[HttpxSender]:
    """A lane's sender, `connections` wide, closed on exit. An application's own client (or
    transport, e.g. an in-process ASGI app) is used as it is and left open: it is the
    application's to close. `announce`: as `build_client`'s."""
    if isinstance(app, httpx.AsyncClient):
        yield HttpxSender(app)
        return
    if app is not None:
        client = CookielessClient(transport=app, follow_redirects=False)
        yield HttpxSender(client)
        return
    client = build_client(settings, connections, announce=announce)
    try:
        yield HttpxSender(client)
    finally:
        await client.aclose()
