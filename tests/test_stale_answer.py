"""Issue 48 item 1: an answer an ingress writes again while the connection sits idle is never
read as the next POST's, on every route (straight, through HTTP_PROXY, through a CONNECT tunnel
to a TLS ingress) and both transports. Real servers on real sockets; end to end, a relay and a
real database.

The ingress answers run a's POST `200` and writes the same `200` again 50 ms later, on the
kept-alive connection; it refuses every later POST (`503`). Run b's POST must reach the ingress
(its body read) and be refused, so b stays pending. Before the fix the default transport
(aiohttp) reused the connection holding the copy: b read `200`, the ingress never received b's
body, and b was marked delivered. httpx's own transport checks an idle connection at reuse.

These set `ingress_keepalive=true`: the check at reuse is what they test, on either transport.

Also: an ingress that closes its side after an answer without saying so (a connection at EOF
is not reused), and `ingress_keepalive=false`, which uses no connection twice, against the copy
that comes in the same segment as the answer (which httpx's own transport reads as the next
POST's at keep-alive: docs/security.md). Over httpx's own transport keep-alive is off unless
set, for that copy (`keepalive_for`): a run after it stays pending, on every route, whether
that transport was chosen or `http2=true` took it; set on, the start warning names the hazard.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.lowlevel
import psycopg
import pytest
import trustme

from relay.edges import http_client
from relay.edges.http_client import keepalive_for, open_sender, proxy_routes, transport_for
from relay.runner import Relay
from relay.settings import ConfigError
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


async def b_after_a(
    pg_url: str,
    schema: str,
    conn: psycopg.Connection[Any],
    url: str,
    ingress: RawIngress,
    flags: Mapping[str, str],
    after_a: Callable[[], Awaitable[None]] | None = None,
) -> tuple[list[tuple[Any, ...]], list[str]]:
    """End to end, one POST at a time (one slot a lane, a retry a minute away), to the ingress at
    `url`: run a until it is delivered, `after_a()`, then run b until it is rescheduled or
    acked. The events' (run, state) and the runs whose POSTs reached the ingress, in order."""
    cfg = settings(
        pg_url,
        schema,
        url,
        concurrency="1",
        critical_concurrency="1",
        max_backoff="60s",
        **flags,
    )
    async with Relay(cfg).running():
        enqueue_some(conn, schema, 1, 1, prefix="a")
        await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 1, what="a")
        if after_a is not None:
            await after_a()
        enqueue_some(conn, schema, 1, 1, prefix="b")
        await wait_for(lambda: settled(conn, schema, "b0"), what="b rescheduled or acked")
    rows = conn.execute(
        q(schema, "select run_id, state from {s}.events order by run_id")
    ).fetchall()
    return rows, [urlsplit(target).path.split("/")[2] for _, target in ingress.requests]


def copy_in_the_answers_segment() -> Callable[[asyncio.StreamWriter], Awaitable[None]]:
    """The first POST's `200` written twice in one write (one segment), every later POST `503`."""
    first_twice = [OK_EMPTY + OK_EMPTY]

    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(first_twice.pop() if first_twice else REFUSED)
        await writer.drain()

    return answer


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
        # The reuse check is under test, on either transport: keep-alive on.
        kept_alive = flags | {"http_transport": http_transport, "ingress_keepalive": "true"}
        rows, posted = await b_after_a(
            pg_url, schema, conn, url, ingress, kept_alive, lambda: copy_arrived(late)
        )
    assert rows == [("a0", "delivered"), ("b0", "pending")], (rows, ingress.requests)
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
        cfg = client_settings(http_transport=http_transport, ingress_keepalive="true", **flags)
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
        cfg = client_settings(http_transport=http_transport, ingress_keepalive="true")
        async with open_sender(cfg, 1) as sender:
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
    answer = copy_in_the_answers_segment()
    async with routed(route, answer, monkeypatch, tmp_path) as (ingress, url, flags):
        cfg = client_settings(http_transport=http_transport, ingress_keepalive="false", **flags)
        async with open_sender(cfg, 1) as sender:
            assert (await sender.send(url + "/runs/a", b"{}", {})).status == 200
            second = await sender.send(url + "/runs/b", b"{}", {})
    assert (second.status, second.body) == (503, b"busy"), "the copy was read as b's answer"
    assert len(ingress.requests) == 2


# The ways the POSTs go over httpx's own transport: chosen, or taken by `http2=true` (HTTP/2 is
# offered by TLS ALPN only, and these ingresses take HTTP/1.1, so it is spoken). A SOCKS proxy is
# the third (`test_keepalive_follows_the_transport_unless_set`): socksio is not installed here.
HTTPX_WAYS = {"http_transport=httpx": {"http_transport": "httpx"}, "http2=true": {"http2": "true"}}


@pytest.fixture
def said_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's once-only lines said again in this test (each is said once a process)."""
    monkeypatch.setattr(http_client, "_said", set())


def transport_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage() == "http_transport_chosen"]


@pytest.mark.parametrize("way", HTTPX_WAYS)
@pytest.mark.parametrize("route", ROUTES)
async def test_httpxs_own_transport_uses_no_connection_twice_unless_told(
    pg_url: str,
    schema: str,
    conn: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    said_afresh: None,
    route: str,
    way: str,
) -> None:
    """End to end over httpx's own transport, `ingress_keepalive` unset: run a's `200` comes
    twice in one segment, where h11 keeps the copy out of reach of httpcore's reuse check; run
    b must reach the ingress on a connection of its own and be refused, so it stays pending.
    Red with the rule planted out (keep-alive on whatever the transport): b read the copy, the
    ingress saw one POST, and b was marked delivered. The start line says keep-alive is off
    and why."""
    caplog.set_level("WARNING", logger="relay")
    answer = copy_in_the_answers_segment()
    async with routed(route, answer, monkeypatch, tmp_path) as (ingress, url, flags):
        rows, posted = await b_after_a(pg_url, schema, conn, url, ingress, flags | HTTPX_WAYS[way])
    assert rows == [("a0", "delivered"), ("b0", "pending")], (rows, ingress.requests)
    assert posted[:2] == ["a0", "b0"], "the ingress never received b's body"
    told = transport_lines(caplog)
    assert told, "no line says which keep-alive is in force"
    fields = told[0].fields  # type: ignore[attr-defined]
    assert (fields["using"], fields["keepalive"]) == ("httpx", "off"), fields
    assert "docs/security.md" in fields["keepalive_why"], fields


@pytest.mark.parametrize("way", HTTPX_WAYS)
async def test_keepalive_set_on_httpxs_own_transport_is_warned_and_reads_the_copy(
    caplog: pytest.LogCaptureFixture, said_afresh: None, way: str
) -> None:
    """`ingress_keepalive=true` set over httpx's own transport keeps connections, and the start
    warning names what that costs: the documented hazard, which shows (the copy that came in
    the answer's segment is read as the next POST's, which the ingress refused). Should
    httpcore ever drop h11's leftover bytes at reuse, this turns red: docs/security.md, the
    default of `keepalive_for` and this test then change together."""
    caplog.set_level("WARNING", logger="relay")
    ingress = RawIngress(copy_in_the_answers_segment())
    async with ingress.serving() as url:
        cfg = client_settings(ingress_keepalive="true", **HTTPX_WAYS[way])
        async with open_sender(cfg, 1) as sender:
            assert (await sender.send(url + "/runs/a", b"{}", {})).status == 200
            second = await sender.send(url + "/runs/b", b"{}", {})
    # httpcore writes b's whole request, then finds the copy already parsed: the ingress refused
    # b, and b read a's 200.
    assert (second.status, len(ingress.requests)) == (200, 2), "the documented hazard is gone"
    told = transport_lines(caplog)
    assert len(told) == 1 and told[0].levelname == "WARNING", told
    fields = told[0].fields  # type: ignore[attr-defined]
    assert fields["keepalive"] == "on", fields
    assert "twice in one segment" in fields["keepalive_why"], fields
    assert "docs/security.md" in fields["keepalive_why"], fields


def test_keepalive_follows_the_transport_unless_set() -> None:
    """Unset (or `auto`), keep-alive is on over aiohttp's transport and off over httpx's own,
    however it was reached: chosen, by its retired name, `http2=true`, a SOCKS proxy in the
    setting or the environment. Set, it is as set, over either."""

    def decided(environ: Mapping[str, str] | None = None, **flags: str) -> bool:
        cfg = client_settings(**flags)
        return keepalive_for(cfg, transport_for(cfg, environ or {})[0])[0]

    assert decided() and decided(ingress_keepalive="auto")
    assert decided(http_transport="aiohttp") and decided(http_transport="httptools")
    assert decided({"HTTP_PROXY": "http://p:1"})
    assert not decided(http_transport="httpx") and not decided(http_transport="httpcore")
    assert not decided(http2="true") and not decided(
        http_transport="httpx", ingress_keepalive="auto"
    )
    assert not decided(ingress_proxy="socks5://p:1")
    assert not decided({"ALL_PROXY": "socks5h://p:1"})
    for transport in ("aiohttp", "httpx"):
        assert decided(http_transport=transport, ingress_keepalive="true")
        assert not decided(http_transport=transport, ingress_keepalive="false")
    assert client_settings().ingress_keepalive is None
    with pytest.raises(ConfigError, match="true, false or auto"):
        client_settings(ingress_keepalive="sometimes")


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
