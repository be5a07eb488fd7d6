"""Issue 48 item 1: an answer an ingress writes again while the connection sits idle is never
read as the next POST's, on every route (straight, through HTTP_PROXY, through a CONNECT tunnel
to a TLS ingress) and both transports. Real servers on real sockets; end to end, a relay and a
real database.

The ingress answers run a's POST `200` and writes the same `200` again 50 ms later, on the
kept-alive connection; it refuses every later POST (`503`). Run b's POST must reach the ingress
(its body read) and be refused, so b stays pending. Before the fix the default transport
(aiohttp) reused the connection holding the copy: b read `200`, the ingress never received b's
body, and b was marked delivered. httpx's own transport checks an idle connection at reuse.

Also: an ingress that closes its side after an answer without saying so (a connection at EOF
is not reused), and `ingress_keepalive=false`, which uses no connection twice, against the copy
that comes in the same segment as the answer (which httpx's own transport reads as the next
POST's at keep-alive: docs/security.md).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.lowlevel
import psycopg
import pytest
import trustme

from relay.edges.http_client import open_sender, proxy_routes
from relay.runner import Relay
from tests.servers import TaskServer
from tests.support import HTTP_TRANSPORTS, count, q, settings, wait_for
from tests.test_http_client import OK_EMPTY, REFUSED, client_settings, settled
from tests.test_security import ForwardingProxy, RawIngress, enqueue_some, proxy_environment

pytestmark = [pytest.mark.anyio, pytest.mark.both_loops]  # issue 52: asyncio and uvloop

ROUTES = ["direct", "http_proxy", "connect"]
LATE = 0.05  # seconds between run a's answer and its copy


class LateCopy:
    """An ingress's answers: the first POST gets `200`, and the same `200` again `LATE` seconds
    later on the same connection (`copied` is set once it is written); every later POST `503`."""

    def __init__(self) -> None:
        self.answered = 0
        self.copied = anyio.Event()

    async def __call__(self, writer: asyncio.StreamWriter) -> None:
        self.answered += 1
        if self.answered > 1:
            writer.write(REFUSED)
            await writer.drain()
            return
        writer.write(OK_EMPTY)
        await writer.drain()
        await asyncio.sleep(LATE)  # the copy comes while the connection sits idle
        writer.write(OK_EMPTY)
        await writer.drain()
        self.copied.set()


async def copy_arrived(late: LateCopy) -> None:
    """Until the copy is written, then a few turns of the one event loop the ingress, the proxy
    and the client share: enough for the bytes to cross the loopback (and the proxy) into the
    client's connection, so the next POST finds them there, as in the reproduction. Bytes that
    arrive after the next POST is sent no reuse check sees (docs/security.md)."""
    await wait_for(lambda: late.copied.is_set(), what="the ingress wrote its copy")
    await loop_turns()


async def loop_turns(n: int = 50) -> None:
    """`n` turns of the event loop, each polling the sockets: what is already on the loopback
    is read (every server here runs in the test's own loop)."""
    for _ in range(n):
        await anyio.lowlevel.checkpoint()


class KeepAliveProxy(TaskServer):
    """A forwarding proxy that keeps the client's connection: the first request's origin is
    dialled and the connection piped both ways from then on, the request line left in absolute
    form (the ingress here takes any target). What the origin writes, a late copy included,
    reaches the client as written. ForwardingProxy answers `connection: close`, so no proxied
    connection is ever reused there, and the stale answer could not be read."""

    def __init__(self) -> None:
        super().__init__()
        self.forwarded: list[str] = []  # each proxied connection's first request target

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: asyncio.StreamWriter | None = None
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            target = head.split(b" ", 2)[1].decode()
            origin = urlsplit(target)
            assert origin.hostname and origin.port, target
            up_reader, upstream = await asyncio.open_connection(origin.hostname, origin.port)
            self.forwarded.append(target)
            upstream.write(head)
            await ForwardingProxy._pipe(reader, writer, up_reader, upstream)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            if upstream is not None:
                upstream.close()
            writer.close()


@asynccontextmanager
async def routed(
    route: str,
    answer: Callable[[asyncio.StreamWriter], Awaitable[None]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> AsyncIterator[tuple[RawIngress, str, dict[str, str]]]:
    """The ingress serving `answer`, reached by `route`: its base URL and the settings the
    route needs (a TLS ingress's CA file), the proxy variable set. `connect`: an https ingress
    (a private CA) through ForwardingProxy's CONNECT tunnel, a byte pipe for the TLS inside."""
    flags: dict[str, str] = {}
    server_ctx = None
    if route == "connect":
        ca = trustme.CA()
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
        ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
        flags["ingress_ca_file"] = str(tmp_path / "ca.pem")
    ingress = RawIngress(answer, server_ctx)
    proxy = KeepAliveProxy() if route == "http_proxy" else ForwardingProxy()
    async with proxy.serving() as proxy_url, ingress.serving() as url:
        variable = {"http_proxy": "HTTP_PROXY", "connect": "HTTPS_PROXY"}.get(route)
        proxy_environment(monkeypatch, **({variable: proxy_url} if variable else {}))
        yield ingress, url, flags
        assert bool(getattr(proxy, "forwarded", None) or getattr(proxy, "connects", None)) == (
            route != "direct"
        ), "the route did not go through the proxy"


@pytest.mark.parametrize("http_transport", HTTP_TRANSPORTS)
@pytest.mark.parametrize("route", ROUTES)
async def test_a_run_is_not_acked_by_an_answer_written_again_while_idle(
    pg_url: str,
    schema: str,
    conn: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    route: str,
    http_transport: str,
) -> None:
    """End to end, one POST at a time: run a is answered `200`, and again 50 ms later; run b,
    claimed once the copy has arrived, must reach the ingress and be refused, so it stays
    pending, rescheduled. Red before the fix on the default transport, every route: b read
    the copy, the ingress saw one POST, and b was marked delivered."""
    late = LateCopy()
    async with routed(route, late, monkeypatch, tmp_path) as (ingress, url, flags):
        cfg = settings(
            pg_url,
            schema,
            url,
            http_transport=http_transport,
            concurrency="1",
            critical_concurrency="1",
            max_backoff="60s",
            **flags,
        )
        async with Relay(cfg).running():
            enqueue_some(conn, schema, 1, 1, prefix="a")
            await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 1, what="a")
            await copy_arrived(late)
            enqueue_some(conn, schema, 1, 1, prefix="b")
            await wait_for(lambda: settled(conn, schema, "b0"), what="b rescheduled or acked")
    rows = conn.execute(
        q(schema, "select run_id, state from {s}.events order by run_id")
    ).fetchall()
    assert rows == [("a0", "delivered"), ("b0", "pending")], (rows, ingress.requests)
    posted = [urlsplit(target).path.split("/")[2] for _, target in ingress.requests]
    assert posted[:2] == ["a0", "b0"], "the ingress never received b's body"


@pytest.mark.parametrize("http_transport", HTTP_TRANSPORTS)
@pytest.mark.parametrize("route", ROUTES)
async def test_the_next_post_reads_its_own_answer_after_a_late_copy(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, route: str, http_transport: str
) -> None:
    """The same probe at the client, POST after POST on one lane's client: the second POST goes
    out on a connection without the copy (a new one) and reads its own `503`."""
    late = LateCopy()
    async with routed(route, late, monkeypatch, tmp_path) as (ingress, url, flags):
        cfg = client_settings(http_transport=http_transport, **flags)
        async with open_sender(cfg, 1) as sender:
            first = await sender.send(url + "/runs/a", b"{}", {})
            await copy_arrived(late)
            second = await sender.send(url + "/runs/b", b"{}", {})
    assert first.status == 200
    assert (second.status, second.body) == (503, b"busy"), "the copy was read as b's answer"
    assert len(ingress.requests) == 2


@pytest.mark.parametrize("http_transport", HTTP_TRANSPORTS)
async def test_a_connection_the_ingress_closed_while_idle_is_not_reused(
    http_transport: str,
) -> None:
    """The ingress answers, then closes its side without `connection: close`: the next POST
    goes out on a new connection (a connection at EOF is not reused) and reaches the ingress."""
    closed = anyio.Event()

    async def answer_then_close(writer: asyncio.StreamWriter) -> None:
        writer.write(OK_EMPTY)
        await writer.drain()
        writer.close()
        closed.set()

    ingress = RawIngress(answer_then_close)
    async with ingress.serving() as url:
        async with open_sender(client_settings(http_transport=http_transport), 1) as sender:
            assert (await sender.send(url + "/runs/a", b"{}", {})).status == 200
            await wait_for(lambda: closed.is_set(), what="the ingress closed")
            await loop_turns()  # the end crosses the loopback into the client's connection
            assert (await sender.send(url + "/runs/b", b"{}", {})).status == 200
    assert [path for _, path in ingress.requests] == ["/runs/a", "/runs/b"]


@pytest.mark.parametrize("http_transport", HTTP_TRANSPORTS)
@pytest.mark.parametrize("route", ROUTES)
async def test_without_keepalive_no_copy_is_read_even_in_the_answers_segment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, route: str, http_transport: str
) -> None:
    """`ingress_keepalive=false`: no connection carries a second POST, so neither a copy that
    came with the answer (which httpx's own transport reads as the next POST's at keep-alive) nor
    one that comes later can be read as another POST's answer."""
    first_twice = [OK_EMPTY + OK_EMPTY]

    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(first_twice.pop() if first_twice else REFUSED)
        await writer.drain()

    async with routed(route, answer, monkeypatch, tmp_path) as (ingress, url, flags):
        cfg = client_settings(http_transport=http_transport, ingress_keepalive="false", **flags)
        async with open_sender(cfg, 1) as sender:
            assert (await sender.send(url + "/runs/a", b"{}", {})).status == 200
            second = await sender.send(url + "/runs/b", b"{}", {})
    assert (second.status, second.body) == (503, b"busy"), "the copy was read as b's answer"
    assert len(ingress.requests) == 2


def test_proxy_routes_are_httpxs_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default transport's routes are written out by the relay (given transports, httpx
    reads no proxy variable): the patterns httpx makes of the same environment."""
    proxy_environment(
        monkeypatch,
        HTTP_PROXY="proxy:3128",
        HTTPS_PROXY="http://tunnel:3128",
        NO_PROXY="example.com, .internal,10.0.0.0/8,::1,localhost,http://plain.test",
    )
    assert proxy_routes(client_settings()) == {
        "http://": "http://proxy:3128",
        "https://": "http://tunnel:3128",
        "all://*example.com": None,
        "all://*.internal": None,
        "all://10.0.0.0/8": None,
        "all://[::1]": None,
        "all://localhost": None,
        "http://plain.test": None,
    }
    proxy_environment(monkeypatch, ALL_PROXY="http://all:1", NO_PROXY="a.test,*")
    assert proxy_routes(client_settings()) == {}
    proxy_environment(monkeypatch, HTTP_PROXY="http://ignored:1")
    assert proxy_routes(client_settings(ingress_proxy="http://p:2")) == {"all://": "http://p:2"}
