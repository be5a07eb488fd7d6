"""A leaner network layer under httpcore, for the httpx sender (relay/http_httpx.py).

httpcore takes any network backend (its public `AsyncNetworkBackend` interface; the pools'
`network_backend=`, and the streams this sender connects itself). Its own, over anyio, costs
on every POST: a cancel scope and a timer around every read and write, anyio's stream
wrappers, and (for the pool's question whether an idle connection was closed by the server)
anyio's table of socket attributes and a new `poll` object. This one is an asyncio protocol
(the relay runs on anyio's asyncio backend only): a read returns what already arrived, or
waits for the protocol's next wake-up under one loop timer; the request's head and body
leave in one `send`; "is the idle connection readable?" is answered from what the protocol
has seen (bytes or the end of the stream). That question's key is httpcore's convention, not
its documented API: tests/test_http_httpx.py fails if an upgrade stops asking it (the
cheaper answer would then go unused, silently).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import typing

import anyio
import httpcore

BUFFERED = 256 * 1024  # bytes received and not yet read before the socket is no longer read


class Received(asyncio.Protocol):
    """What arrived on one connection, and who waits for it."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False  # not reading: more than BUFFERED bytes wait unread
        self.ended = False  # the peer's end of the stream, or the connection lost
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None  # a read waiting for data
        self.drained: asyncio.Future[None] | None = None  # set while writing is paused

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)
        self.buffered += len(data)
        if self.buffered > BUFFERED and self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake(self.waiter)

    def eof_received(self) -> bool:
        self.ended = True
        self._wake(self.waiter)
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self.error = exc
        self._wake(self.waiter)
        self._wake(self.drained)

    def pause_writing(self) -> None:
        self.drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        self._wake(self.drained)
        self.drained = None

    @staticmethod
    def _wake(future: asyncio.Future[None] | None) -> None:
        if future is not None and not future.done():
            future.set_result(None)


async def _within(
    future: asyncio.Future[None],
    seconds: float | None,
    error: type[httpcore.TimeoutException],
    what: str,
) -> None:
    """Wait for `future`, under one loop timer: past `seconds` it fails with `error`."""
    timer = None
    if seconds is not None:
        timer = future.get_loop().call_later(seconds, _expire, future, error, what, seconds)
    try:
        await future
    finally:
        if timer is not None:
            timer.cancel()


def _expire(
    future: asyncio.Future[None], error: type[Exception], what: str, seconds: float
) -> None:
    if not future.done():
        future.set_exception(error(f"{what} within {seconds:g}s"))


class Backend(httpcore.AsyncNetworkBackend):
    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        local_address: str | None = None,
        socket_options: typing.Iterable[typing.Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        local = None if local_address is None else (local_address, 0)
        return await _open(
            lambda: loop.create_connection(Received, host, port, local_addr=local),
            timeout,
            socket_options,
        )

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        socket_options: typing.Iterable[typing.Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        return await _open(
            lambda: loop.create_unix_connection(Received, path), timeout, socket_options
        )

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)


async def _open(
    connect: typing.Callable[
        [], typing.Awaitable[tuple[asyncio.BaseTransport, asyncio.BaseProtocol]]
    ],
    timeout: float | None,  # noqa: ASYNC109 - httpcore's interface
    socket_options: typing.Iterable[typing.Any] | None,
) -> Stream:
    try:
        # anyio's deadline: the caller's anyio cancel scopes (the request's deadline, a lost
        # lease) may cancel this task too, and one task takes one cancellation scheme.
        with anyio.fail_after(timeout):
            transport, protocol = await connect()
    except TimeoutError as exc:
        raise httpcore.ConnectTimeout(f"connect timed out after {timeout}s") from exc
    except OSError as exc:
        raise httpcore.ConnectError(exc) from exc
    assert isinstance(protocol, Received)
    protocol.transport = transport  # type: ignore[assignment]  # uvloop: made only after this
    sock = transport.get_extra_info("socket")
    for option in socket_options or ():
        sock.setsockopt(*option)
    return Stream(protocol)


class Stream(httpcore.AsyncNetworkStream):
    """One connection as httpcore reads and writes it. What it writes is held until it next
    reads, so a request's head and body leave in one `send` (HTTP/1.1: a client always reads
    after its request; closing or upgrading to TLS sends what is held first)."""

    def __init__(self, protocol: Received) -> None:
        self._protocol = protocol
        assert protocol.transport is not None
        self._transport: asyncio.Transport = protocol.transport
        self._held: list[bytes] = []
        self._held_timeout: float | None = None

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        await self._flush()
        p = self._protocol
        if not p.chunks and not p.ended:
            await self._wait(timeout)
        if p.chunks:
            chunk = p.chunks.popleft()
            if len(chunk) > max_bytes:
                chunk, rest = chunk[:max_bytes], chunk[max_bytes:]
                p.chunks.appendleft(rest)
            p.buffered -= len(chunk)
            if p.paused and p.buffered <= BUFFERED:
                p.paused = False
                self._transport.resume_reading()
            return chunk
        if p.error is not None:
            raise httpcore.ReadError(p.error)
        return b""  # the end of the stream

    async def _wait(self, timeout: float | None) -> None:  # noqa: ASYNC109
        waiter = asyncio.get_running_loop().create_future()
        self._protocol.waiter = waiter
        try:
            await _within(waiter, timeout, httpcore.ReadTimeout, "no answer")
        finally:
            self._protocol.waiter = None

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        if buffer:
            self._held.append(buffer)
            self._held_timeout = timeout

    async def _flush(self) -> None:
        if not self._held:
            return
        data = b"".join(self._held)
        self._held.clear()
        p = self._protocol
        if p.ended or self._transport.is_closing():
            raise httpcore.WriteError(p.error or "the connection is closed")
        self._transport.write(data)
        drained = p.drained
        if drained is not None:  # over the transport's high-water mark: wait for it to drain
            await _within(drained, self._held_timeout, httpcore.WriteTimeout, "not sent")
            if p.error is not None:
                raise httpcore.WriteError(p.error)

    async def aclose(self) -> None:
        self._held.clear()  # nobody will read an answer to it
        self._transport.abort()  # as the default sender: nothing is owed to the peer

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
    ) -> httpcore.AsyncNetworkStream:
        await self._flush()
        loop = asyncio.get_running_loop()
        p = self._protocol
        try:
            with anyio.fail_after(timeout):
                tls = await loop.start_tls(
                    self._transport, p, ssl_context, server_hostname=server_hostname
                )
        except TimeoutError as exc:
            self._transport.abort()
            raise httpcore.ConnectTimeout(f"TLS handshake timed out after {timeout}s") from exc
        except OSError as exc:  # ssl.SSLError is one
            self._transport.abort()
            raise httpcore.ConnectError(exc) from exc
        assert tls is not None
        p.transport = tls
        return Stream(p)

    def get_extra_info(self, info: str) -> typing.Any:
        if info == "is_readable":
            return bool(self._protocol.chunks) or self._protocol.ended
        if info == "client_addr":
            return self._transport.get_extra_info("sockname")
        if info == "server_addr":
            return self._transport.get_extra_info("peername")
        return self._transport.get_extra_info(info)  # "ssl_object", "socket"
