"""POSTs through aiohttp (`http_transport=aiohttp`; the default before the httptools sender):
aiohttp's connection pool and C HTTP parser, called directly. Needs the `aiohttp` extra (out of
the core install since issue 30: settings refuse the choice without it, naming the install), and
is loaded only when chosen (relay/ingress.py `open_sender`).

Per POST this costs well under half the client CPU of httpx over httpcore: httpcore's pool
scans every pooled connection (a `poll` per connection) on each request and each release, and
httpx's client layer (URL merging, cookie extraction, auth and redirect plumbing, its request
and response models) ran on every POST although the relay uses none of it
(docs/performance.md). Only what the relay needs is supported: HTTP/1.1, a bytes body, at most
`READ_LIMIT` bytes of the answer read, no redirects, no cookies, no proxies.

Two details matter for correctness:
- The URL is handed over **encoded**: aiohttp would otherwise re-quote it and resolve dot
  segments, so a run id of `..` (sent as `%2E%2E`) would change the path (issue 8).
- Every aiohttp error (refused, reset, TLS, a malformed answer, a socket timeout) becomes a
  `TransportFailure` naming it: a failure of this request, never of the relay.
"""

from __future__ import annotations

import ssl

import aiohttp
import httpx
from aiohttp.http_exceptions import LineTooLong
from yarl import URL

from relay.transport import READ_LIMIT, TransportFailure


class AiohttpSender:
    def __init__(self, *, verify: ssl.SSLContext | bool, connections: int, timeout: float) -> None:
        # The same context httpx would build (system CAs, or the given context as is).
        self._ssl = httpx.create_ssl_context(verify=verify)
        self._connections = connections
        # Per phase, like httpx's; the whole request is bounded by IngressClient's deadline.
        self._timeout = aiohttp.ClientTimeout(sock_connect=timeout, sock_read=timeout)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # built inside the event loop, on first use
            connector = aiohttp.TCPConnector(limit=self._connections, ssl=self._ssl)
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
                cookie_jar=aiohttp.DummyCookieJar(),
                timeout=self._timeout,
            )
        return self._session

    async def send(
        self, url: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes, str | None]:
        try:
            async with self._client().post(
                URL(url, encoded=True),
                headers=headers,
                data=body,
                allow_redirects=False,
                compress=False,
            ) as resp:
                chunks: list[bytes] = []
                size = 0
                while size < READ_LIMIT:
                    chunk = await resp.content.readany()
                    if not chunk:
                        break
                    chunks.append(chunk)
                    size += len(chunk)
                # Leaving the block with the answer unread closes the connection instead of
                # returning it to the pool.
                return resp.status, b"".join(chunks)[:READ_LIMIT], resp.headers.get("retry-after")
        except TimeoutError:
            raise  # the caller names its deadline
        except (aiohttp.ClientError, OSError) as exc:
            raise TransportFailure(_failure(exc)) from exc
        except Exception as exc:
            # Anything else aiohttp raises about an answer is still this request's failure.
            if type(exc).__module__.partition(".")[0] != "aiohttp":
                raise
            raise TransportFailure(f"{type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def _failure(exc: BaseException) -> str:
    """The failure's text; an over-long line of the answer's head (aiohttp's parser refuses one
    over `max_line_size`/`max_field_size`, 8190 bytes, as it arrives) says so first."""
    text = f"{type(exc).__name__}: {exc}"
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, LineTooLong):
            return f"answer head: a line over {cause.args[1]} bytes ({text[:200]})"
        cause = cause.__cause__ or cause.__context__
    return text
