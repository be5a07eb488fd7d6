"""The httpx sender (relay/http_httpx.py) on what is its own, beside the contract, hostile-answer,
TLS and proxy suites that run it with the other senders: its connections (kept and reused, not
once the server closed them; every one of a lane's usable at once, straight or through a
proxy's pools of at most POOL_WIDTH), its leaner network layer (still asked by httpcore whether
an idle connection is readable; its read and write timeouts; its flow control), the request
target, and a proxy's userinfo sent as its Basic auth."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from relay import http_httpx, http_network
from relay.http_httpx import POOL_WIDTH, HttpxSender, _target
from relay.http_network import Stream
from relay.proxies import proxy_rules
from relay.transport import TransportFailure
from tests.support import wait_for
from tests.test_http_httptools import OK, Scripted

pytestmark = pytest.mark.anyio


def test_a_lanes_connections_through_a_proxy_are_split_over_narrow_pools() -> None:
    def widths(n: int) -> list[int]:
        sender = HttpxSender(connections=n)
        pools = sender._pools_for("http://proxy.test:3128")
        assert len(pools.pools) == len(pools.widths)
        return pools.widths

    assert widths(1) == [1]
    assert widths(POOL_WIDTH) == [POOL_WIDTH]
    assert widths(32) == [POOL_WIDTH] * (32 // POOL_WIDTH)
    assert widths(2 * POOL_WIDTH + 1) == [POOL_WIDTH, POOL_WIDTH, 1]
    pools = HttpxSender(connections=32)._pools_for("http://proxy.test:3128")
    pools.in_flight[:] = [3, 1, 2, 1] + [POOL_WIDTH] * (len(pools.pools) - 4)
    assert pools.pick() == 1  # the least busy (the first of equals)


class Gate:
    """A server that answers no request until `n` are open at once, then all of them."""

    def __init__(self, n: int) -> None:
        self.n, self.open, self.most = n, 0, 0
        self.all_in = asyncio.Event()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            self.open += 1
            self.most = max(self.most, self.open)
            if self.open >= self.n:
                self.all_in.set()
            await self.all_in.wait()
            writer.write(OK)
            await writer.drain()
        finally:
            writer.close()

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        try:
            yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/runs/r/events"
        finally:
            server.close()


@pytest.mark.parametrize("route", ["direct", "proxied"])
async def test_every_connection_of_the_lane_is_usable_at_once(route: str) -> None:
    """The sender holds `connections` requests in flight together (the server answers none until
    all 32 are in), straight to the ingress or split over a proxy's pools: no POST waits for a
    connection while another has room."""
    gate = Gate(32)
    async with gate.serving() as url:
        rules = proxy_rules({})
        if route == "proxied":  # the gate as a forwarding proxy: it reads and answers the same
            rules = proxy_rules({"HTTP_PROXY": url.split("/runs/")[0]})
            url = "http://ingress.test/runs/r/events"
        sender = HttpxSender(connections=32, rules=rules)
        answers: list[Any] = []

        async def one() -> None:
            answers.append(await sender.send(url, b"{}", {}))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for _ in range(32):
                    tg.start_soon(one)
        await sender.aclose()
    assert gate.most == 32 and [a[0] for a in answers] == [200] * 32


async def test_httpcore_still_asks_the_lean_stream_about_idle_connections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The leaner network layer answers httpcore's "is the idle connection readable?" with one
    kept poll object; the key is httpcore's convention, not its documented API, so an upgrade
    that stops asking it must fail here, not go quietly slower."""
    asked: list[str] = []
    original = Stream.get_extra_info

    def recording(self: Stream, info: str) -> Any:
        asked.append(info)
        return original(self, info)

    monkeypatch.setattr(Stream, "get_extra_info", recording)
    server = Scripted(lambda n: [OK])
    async with server.serving() as url:
        sender = HttpxSender(connections=1, rules=proxy_rules({}))
        for _ in range(3):
            assert (await sender.send(url, b"{}", {}))[0] == 200
        await sender.aclose()
    assert server.connections == 1, "the kept connection was reused"
    assert "is_readable" in asked, asked


async def test_a_proxys_userinfo_is_its_basic_auth() -> None:
    proxy = Scripted(lambda n: [OK])  # a forwarding proxy's side of the exchange
    async with proxy.serving() as proxy_url:
        address = proxy_url.split("/runs/")[0].removeprefix("http://")
        rules = proxy_rules({"HTTP_PROXY": f"http://relay:p%40ss@{address}"})
        sender = HttpxSender(connections=1, rules=rules)
        assert (await sender.send("http://ingress.test/runs/1", b"{}", {}))[0] == 200
        await sender.aclose()
    (head,) = proxy.requests
    assert head.startswith(b"POST http://ingress.test/runs/1 HTTP/1.1\r\n"), head
    fields = {
        k.strip().lower(): v.strip()
        for k, _, v in (f.partition(b":") for f in head.split(b"\r\n")[1:])
    }
    assert fields[b"proxy-authorization"] == b"Basic " + base64.b64encode(b"relay:p@ss"), head
    assert http_httpx.KEEPALIVE_EXPIRY == 5.0


async def test_a_kept_connection_the_server_closed_is_not_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server answers keep-alive and then closes: once that close has arrived, the sender
    sees it on the idle connection (its stream says readable) and opens a new one, rather than
    sending the next POST into a closed connection (which would fail: no answer)."""
    protocols: list[http_network.Received] = []

    class Recorded(http_network.Received):
        def __init__(self) -> None:
            super().__init__()
            protocols.append(self)

    monkeypatch.setattr(http_network, "Received", Recorded)
    server = Scripted(lambda n: [OK, None])
    async with server.serving() as url:
        sender = HttpxSender(connections=1, rules=proxy_rules({}))
        assert (await sender.send(url, b"{}", {}))[0] == 200
        await wait_for(lambda: protocols[0].ended, timeout=10, what="the server's close")
        assert (await sender.send(url, b"{}", {}))[0] == 200
        await sender.aclose()
    assert server.connections == 2


async def test_an_answer_that_never_comes_is_a_read_timeout() -> None:
    never = Scripted(lambda n: [])  # reads the request, answers nothing
    async with never.serving() as url:
        sender = HttpxSender(connections=1, timeout=0.2, rules=proxy_rules({}))
        with anyio.fail_after(30), pytest.raises(TransportFailure, match="ReadTimeout"):
            await sender.send(url, b"{}", {})
        await sender.aclose()


async def test_a_body_the_server_does_not_read_is_a_write_timeout() -> None:
    """Past the transport's high-water mark the stream waits for the body to drain, under the
    write timeout, instead of waiting for an answer to a request still unsent."""
    unread = asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await unread.wait()  # never reads: the body fills the socket buffers
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/runs/r/events"
    try:
        sender = HttpxSender(connections=1, timeout=0.2, rules=proxy_rules({}))
        with anyio.fail_after(30), pytest.raises(TransportFailure, match="WriteTimeout"):
            await sender.send(url, b"x" * (64 * 1024 * 1024), {})
        await sender.aclose()
    finally:
        unread.set()
        server.close()


def test_the_request_target_is_the_url_past_its_origin() -> None:
    prefix = len("http://ingress.test:8080")
    assert _target("http://ingress.test:8080/runs/a%2Fb/events?x=1#mine", prefix) == (
        b"/runs/a%2Fb/events?x=1"  # the fragment is the client's own: never sent
    )
    assert _target("http://ingress.test:8080", prefix) == b"/"
    assert _target("http://ingress.test:8080?x=1", prefix) == b"/?x=1"


class Reading:
    """The transport side the stream's flow control drives: whether it reads."""

    def __init__(self) -> None:
        self.reading = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


async def test_the_stream_stops_reading_while_too_much_waits_unread() -> None:
    """Past BUFFERED unread bytes the socket is no longer read, until reads bring it back under;
    a read returns at most what it asked for, keeping the rest in order."""
    transport = Reading()
    protocol = http_network.Received()
    protocol.connection_made(transport)  # type: ignore[arg-type]  # only its flow control
    stream = Stream(protocol)
    protocol.data_received(b"x" * http_network.BUFFERED)
    assert transport.reading
    protocol.data_received(b"y")
    assert not transport.reading
    assert stream.get_extra_info("is_readable")
    assert await stream.read(65536) == b"x" * 65536
    assert transport.reading
    assert await stream.read(http_network.BUFFERED) == b"x" * (http_network.BUFFERED - 65536)
    assert await stream.read(65536) == b"y"
    assert not stream.get_extra_info("is_readable")
    protocol.eof_received()
    assert stream.get_extra_info("is_readable")  # the server's close: not to be reused
    assert await stream.read(65536) == b""
