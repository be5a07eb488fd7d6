"""The httpx sender (relay/http_httpx.py) on what is its own, beside the contract, hostile-answer,
TLS and proxy suites that run it with the other senders: its pools (a lane's connections split
over pools of at most POOL_WIDTH, every connection usable at once), its leaner network layer
(still asked by httpcore's pool), and a proxy's userinfo sent as its Basic auth."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from relay import http_httpx
from relay.http_httpx import POOL_WIDTH, HttpxSender, _Stream
from relay.proxies import proxy_rules
from tests.test_http_httptools import OK, Scripted

pytestmark = pytest.mark.anyio


def test_a_lanes_connections_are_split_over_narrow_pools() -> None:
    def widths(n: int) -> list[int]:
        sender = HttpxSender(connections=n)
        pools = sender._pools_for(None)
        assert len(pools.pools) == len(pools.widths)
        return pools.widths

    assert widths(1) == [1]
    assert widths(POOL_WIDTH) == [POOL_WIDTH]
    assert widths(32) == [POOL_WIDTH] * (32 // POOL_WIDTH)
    assert widths(2 * POOL_WIDTH + 1) == [POOL_WIDTH, POOL_WIDTH, 1]
    pools = HttpxSender(connections=32)._pools_for(None)
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


async def test_every_connection_of_the_lane_is_usable_at_once() -> None:
    """Split over pools, the sender still holds `connections` requests in flight together (the
    server answers none until all 32 are in): no POST waits for a pool while another has room."""
    gate = Gate(32)
    async with gate.serving() as url:
        sender = HttpxSender(connections=32, rules=proxy_rules({}))
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
    original = _Stream.get_extra_info

    def recording(self: _Stream, info: str) -> Any:
        asked.append(info)
        return original(self, info)

    monkeypatch.setattr(_Stream, "get_extra_info", recording)
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
