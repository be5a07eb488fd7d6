"""An httpx transport over aiohttp's connection pool and HTTP parser (`http_transport=aiohttp`).

The relay speaks httpx's interface everywhere (requests, responses, exceptions, MockTransport
in tests); underneath, aiohttp costs about half the client CPU per POST of httpcore's pool,
which scans every pooled connection (a `poll` per connection) on each request and on each
release (docs/performance.md). Only what the relay uses is supported: HTTP/1.1, a bytes body,
a streamed answer, no redirects, no proxies.

Two details matter for correctness, and are why this is not the `httpx-aiohttp` package:
- The URL is handed over **encoded**: aiohttp would otherwise re-quote it and resolve dot
  segments, so a run id of `..` (sent as `%2E%2E`) would change the path (issue 8).
- aiohttp's errors become httpx's (`ConnectError`, `ReadError`, `TimeoutException`, ...), so the
  relay's "transport failure" path sees the same exceptions whichever transport is in use.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import aiohttp
import httpx
from yarl import URL


@contextmanager
def _httpx_errors(request: httpx.Request) -> Iterator[None]:
    try:
        yield
    except httpx.HTTPError:
        raise
    except (aiohttp.ServerTimeoutError, TimeoutError) as exc:
        raise httpx.TimeoutException(str(exc) or type(exc).__name__, request=request) from exc
    except aiohttp.ClientConnectorError as exc:
        raise httpx.ConnectError(str(exc), request=request) from exc
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
        raise httpx.ReadError(str(exc) or type(exc).__name__, request=request) from exc
    except aiohttp.ClientResponseError as exc:  # e.g. a malformed status line or header
        raise httpx.RemoteProtocolError(str(exc), request=request) from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise httpx.NetworkError(str(exc) or type(exc).__name__, request=request) from exc


class _Body(httpx.AsyncByteStream):
    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _httpx_errors(self._request):
            async for chunk in self._response.content.iter_any():
                yield chunk

    async def aclose(self) -> None:
        # Unread body left: aiohttp closes the connection instead of reusing it.
        self._response.release()


class AiohttpTransport(httpx.AsyncBaseTransport):
    def __init__(self, *, verify: ssl.SSLContext | bool, connections: int) -> None:
        # The same context httpx would build (system CAs, or the given context as is).
        self._ssl = httpx.create_ssl_context(verify=verify)
        self._connections = connections
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._connections, ssl=self._ssl)
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
            )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeout = request.extensions.get("timeout", {})
        with _httpx_errors(request):
            response = await self._client().request(
                request.method,
                URL(str(request.url), encoded=True),
                headers=request.headers.multi_items(),
                data=request.content or None,
                allow_redirects=False,
                compress=False,
                timeout=aiohttp.ClientTimeout(
                    sock_connect=timeout.get("connect"), sock_read=timeout.get("read")
                ),
            )
        return httpx.Response(
            status_code=response.status,
            headers=response.raw_headers,
            stream=_Body(response, request),
            request=request,
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
