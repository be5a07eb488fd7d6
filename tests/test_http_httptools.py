"""The httptools sender (relay/http_httptools.py) against a raw socket server that answers each
request with whatever bytes a test scripts: what is ours in that client (the request head, the
answer's bounds, the reuse of connections) is checked here; the contract, hostile-answer and
TLS suites run it beside the other senders (tests/support.py HTTP_TRANSPORTS)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest

from relay.http_httptools import MAX_HEAD, HttptoolsSender, _origin, request_head
from relay.transport import READ_LIMIT, TransportFailure
from tests.support import wait_for

pytestmark = pytest.mark.anyio

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 14\r\n\r\n" + b'{"accepted":1}'
Script = Callable[[int], list[bytes | None]]  # request number -> chunks to write; None: close


class Scripted:
    """Reads each request whole, then writes the chunks its script gives for it."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[bytes] = []  # heads, in order
        self.connections = 0
        self.ended = 0  # connections whose client closed them (or the script did)
        self._tasks: set[asyncio.Task[Any]] = set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                self.requests.append(head)
                for chunk in self.script(len(self.requests)):
                    if chunk is None:
                        writer.close()
                        return
                    writer.write(chunk)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.ended += 1
            writer.close()
            self._tasks.discard(task)

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}/runs/r1/events"
        finally:
            server.close()
            for task in list(self._tasks):
                task.cancel()
            await server.wait_closed()


async def post(script: Script, times: int = 1) -> tuple[list[Any], Scripted]:
    server = Scripted(script)
    answers: list[Any] = []
    async with server.serving() as url:
        sender = HttptoolsSender(verify=True, connections=2, timeout=5)
        try:
            for _ in range(times):
                with anyio.fail_after(10):
                    try:
                        answers.append(await sender.send(url, b"{}", {"x-a": "1"}))
                    except TransportFailure as exc:
                        answers.append(exc)
        finally:
            await sender.aclose()
    return answers, server


async def test_a_plain_answer_and_the_request_it_answers() -> None:
    (answer,), server = await post(lambda n: [OK])
    assert answer == (200, b'{"accepted":1}', None)
    head = server.requests[0]
    assert head.startswith(b"POST /runs/r1/events HTTP/1.1\r\n"), head
    assert b"\r\nhost: 127.0.0.1:" in head and b"\r\ncontent-length: 2\r\n" in head
    assert b"\r\nx-a: 1\r\n" in head


async def test_a_fragment_is_not_sent_and_a_url_without_a_path_posts_to_the_root() -> None:
    server = Scripted(lambda n: [OK])
    async with server.serving() as url:
        sender = HttptoolsSender(verify=True, connections=1, timeout=5)
        assert (await sender.send(url + "?a=1#part", b"{}", {}))[0] == 200
        origin = url.removesuffix("/runs/r1/events")
        assert (await sender.send(origin + "?b=2#part", b"{}", {}))[0] == 200
        assert (await sender.send(origin, b"{}", {}))[0] == 200
        await sender.aclose()
    assert [head.split(b"\r\n", 1)[0] for head in server.requests] == [
        b"POST /runs/r1/events?a=1 HTTP/1.1",
        b"POST /?b=2 HTTP/1.1",
        b"POST / HTTP/1.1",
    ]


async def test_a_kept_alive_connection_is_reused_and_a_closing_one_is_not() -> None:
    _, kept = await post(lambda n: [OK], times=3)
    assert kept.connections == 1, "keep-alive answers: one connection for every request"
    closing = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
    answers, closed = await post(lambda n: [closing], times=3)
    assert [a[0] for a in answers] == [200, 200, 200]
    assert closed.connections == 3, "`connection: close` answers: a new connection each time"


async def test_a_connection_idle_too_long_is_not_used_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("relay.http_httptools.IDLE_FOR", 0.0)  # every kept one is too old
    _, server = await post(lambda n: [OK], times=2)
    assert server.connections == 2


async def test_a_connection_the_server_closed_while_idle_is_not_used_again() -> None:
    server = Scripted(lambda n: [OK, None])
    async with server.serving() as url:
        sender = HttptoolsSender(verify=True, connections=1, timeout=5)
        assert (await sender.send(url, b"{}", {}))[0] == 200
        (kept,) = sender._idle.values()
        await wait_for(lambda: kept[0].closed, what="the server's close reaching the idle one")
        assert (await sender.send(url, b"{}", {}))[0] == 200
        await sender.aclose()
    assert server.connections == 2


async def test_interim_answers_are_skipped_and_chunked_bodies_joined() -> None:
    chunked = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 202 Accepted\r\nretry-after: 7\r\ntransfer-encoding: chunked\r\n\r\n"
        b'5\r\n{"acc\r\n9\r\nepted":1}\r\n0\r\n\r\n'
    )
    (answer,), _ = await post(lambda n: [chunked[:30], chunked[30:70], chunked[70:]])
    assert answer == (202, b'{"accepted":1}', "7")


async def test_a_body_without_a_length_ends_at_the_close() -> None:
    (answer,), _ = await post(lambda n: [b'HTTP/1.0 200 OK\r\n\r\n{"accep', b'ted":1}', None])
    assert answer == (200, b'{"accepted":1}', None)


@pytest.mark.parametrize(
    ("chunks", "why"),
    [
        ([b'HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\n{"acc', None], "closed before"),
        ([b'HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\n{"acc', None], "closed"),
        ([b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n"], None),  # then silence: the deadline
        ([b"HTTP/1.1 2x0 OK\r\n\r\n"], "malformed answer"),
        ([b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * MAX_HEAD + b"\r\n\r\n"], f"over {MAX_HEAD}"),
        ([None], "closed before"),
    ],
    ids=["short-length", "short-chunked", "silent", "garbled", "huge-head", "no-answer"],
)
async def test_a_broken_answer_is_a_transport_failure(
    chunks: list[bytes | None], why: str | None
) -> None:
    if why is None:  # a silent server: the caller's deadline cancels the request
        server = Scripted(lambda n: chunks)
        async with server.serving() as url:
            sender = HttptoolsSender(verify=True, connections=1, timeout=5)
            with anyio.move_on_after(0.3) as scope:
                await sender.send(url, b"{}", {})
            assert scope.cancelled_caught
            # the cancelled request's connection is closed at once (not left open, not kept)
            await wait_for(
                lambda: server.ended == 1, timeout=10, what="the close of the cancelled one"
            )
            # the cancelled connection is not kept: the next request opens a new one
            server.script = lambda n: [OK]
            assert (await sender.send(url, b"{}", {}))[0] == 200
            assert server.connections == 2
            await sender.aclose()
        return
    (answer,), _ = await post(lambda n: chunks)
    assert isinstance(answer, TransportFailure), answer
    assert why in str(answer), answer


async def test_an_endless_body_is_read_to_the_limit_and_the_connection_dropped() -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 10000000\r\n\r\n"
    answers, server = await post(lambda n: [head] + [b" " * 65536] * 4, times=2)
    status, body, _ = answers[0]
    assert status == 200 and len(body) == READ_LIMIT
    assert answers[1][0] == 200 and server.connections == 2


def test_the_request_head_refuses_what_would_split_it() -> None:
    origin = _origin("http", "ingress:8080")
    assert origin.host_header == b"ingress:8080"
    assert (
        _origin("https", "ingress").port == 443
        and _origin("https", "ingress").host_header == b"ingress"
    )
    assert _origin("http", "[::1]:81").host_header == b"[::1]:81"
    for target in ["/runs/a b/events", "/runs/a\r\nx: y/events", "/runs/é/events"]:
        with pytest.raises(ValueError, match="must be encoded"):
            request_head(origin, target, b"", {})
    for name, value in [("x-a", "1\r\nx-b: 2"), ("x-a\n", "1"), ("x:a", "1"), ("x-a", "\x00")]:
        with pytest.raises(ValueError, match="would end its line"):
            request_head(origin, "/ok", b"", {name: value})
    with pytest.raises(ValueError, match="not an http"):
        _origin("ftp", "ingress")
