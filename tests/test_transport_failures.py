"""A POST that got no answer, named as what it was (issue 49 item 4, issue 48 item 5): a refused
port, a name that does not resolve, a TLS handshake that fails, a reset, a disconnect and a real
timeout, each against a real socket and over both transports. httpx-aiohttp raises every aiohttp
connection error as `httpx.ConnectTimeout`, so the logs and `relay check` said ConnectTimeout
for a refused connection, and the adaptive POST limit (which reads `timed_out`) took a dead
ingress for an overloaded one.

And a proxy's 407: the operator's configuration, not the events', so the lane pauses
(`ingress_misconfigured`) rather than blocking runs one at a time as poison.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
from typing import Any

import anyio
import psycopg
import pytest
import trustme

from relay.edges.http_client import open_sender
from relay.edges.ingress import TransportFailure
from relay.runner import Relay
from tests.support import HTTP_TRANSPORTS, LogLines, count, q, settings, wait_for
from tests.test_check import UNREACHABLE_DB, check, marks
from tests.test_cli import relay_env
from tests.test_http_client import client_settings
from tests.test_relay import enqueue_runs
from tests.test_security import RawIngress, proxy_environment

pytestmark = [pytest.mark.anyio, pytest.mark.both_loops]  # issue 52: asyncio and uvloop

OK_EMPTY = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"


@pytest.fixture(params=HTTP_TRANSPORTS)
def http_transport(request: pytest.FixtureRequest) -> str:
    """Each test runs over every HTTP client (`http_transport`)."""
    return str(request.param)


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Straight to the address under test: no proxy variable of the machine's in the way."""
    proxy_environment(monkeypatch)


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on: bound, then closed."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def failure(url: str, http_transport: str, **flags: str) -> TransportFailure:
    """What one POST to `url` over `http_transport` failed with."""
    cfg = client_settings(http_transport=http_transport, **flags)
    async with open_sender(cfg, 1) as sender:
        with anyio.fail_after(120), pytest.raises(TransportFailure) as failed:
            await sender.send(url + "/runs/r", b"{}", {})
    return failed.value


def assert_named(failed: TransportFailure, kind: str, *, timed_out: bool = False) -> None:
    text = str(failed)
    assert text.startswith(kind + ": "), text
    assert "ConnectTimeout" not in text, text
    assert failed.timed_out is timed_out, text


async def test_a_refused_connection_is_named_refused(http_transport: str) -> None:
    failed = await failure(f"http://127.0.0.1:{closed_port()}", http_transport)
    assert_named(failed, "connection refused")


async def test_a_name_that_does_not_resolve_is_named_dns(http_transport: str) -> None:
    """`.invalid` never resolves (RFC 2606). Where the machine has no resolver to ask, the lookup
    fails all the same, as a DNS failure; the generous `http_timeout` lets a slow resolver give
    its own answer before the client's connect timeout would."""
    failed = await failure(
        "http://relay-test.invalid", http_transport, http_timeout="60s", lease_ttl="300s"
    )
    assert_named(failed, "DNS: name not resolved")


class PlainHttp:
    """A plain-TCP HTTP server's connection handler that answers a TLS client's hello as a bad
    request, then waits for the client to hang up (closing with the hello unread would reset
    the connection instead)."""

    def __init__(self) -> None:
        self.left = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.read(65536)
            writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
            with contextlib.suppress(ConnectionError):
                while await reader.read(65536):
                    pass
        finally:
            writer.close()
            self.left.set()


@pytest.mark.parametrize("server", ["untrusted CA", "plain TCP"])
async def test_a_tls_failure_is_named_tls(http_transport: str, server: str) -> None:
    """https:// to a server whose certificate no trusted CA signed, and to one that speaks no TLS
    at all (an `http://` ingress configured as `https://`)."""
    if server == "plain TCP":
        plain = PlainHttp()
        listening = await asyncio.start_server(plain.handle, "127.0.0.1", 0)
        port = listening.sockets[0].getsockname()[1]
        async with listening:
            failed = await failure(f"https://127.0.0.1:{port}", http_transport)
            with anyio.fail_after(60):
                await plain.left.wait()
    else:
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        trustme.CA().issue_cert("127.0.0.1").configure_cert(server_ctx)
        async with RawIngress(ok, server_ctx).serving() as url:
            failed = await failure(url, http_transport)
    assert_named(failed, "TLS failure")


async def ok(writer: asyncio.StreamWriter) -> None:
    writer.write(OK_EMPTY)
    await writer.drain()


async def reset(writer: asyncio.StreamWriter) -> None:
    """The request read, then a TCP reset (SO_LINGER 0) in place of an answer."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def hang_up(writer: asyncio.StreamWriter) -> None:
    """The request read, then the connection closed cleanly without an answer."""
    writer.close()
    await writer.wait_closed()


async def test_a_reset_is_named_reset(http_transport: str) -> None:
    async with RawIngress(reset).serving() as url:
        failed = await failure(url, http_transport)
    assert_named(failed, "connection reset")


async def test_a_disconnect_without_an_answer_is_no_timeout(http_transport: str) -> None:
    """aiohttp names it `ServerDisconnectedError`, httpx's own transport `RemoteProtocolError:
    Server disconnected without sending a response.`: either way it says so, not a timeout."""
    async with RawIngress(hang_up).serving() as url:
        failed = await failure(url, http_transport)
    assert "disconnected" in str(failed).lower(), str(failed)
    assert "ConnectTimeout" not in str(failed) and not failed.timed_out, str(failed)


async def test_a_real_timeout_is_named_and_marked_timed_out(http_transport: str) -> None:
    """The request read and no answer until the client has given up (its read timeout)."""
    given_up = asyncio.Event()

    async def answer_too_late(writer: asyncio.StreamWriter) -> None:
        await given_up.wait()

    async with RawIngress(answer_too_late).serving() as url:
        failed = await failure(url, http_transport, http_timeout="0.3s")
        given_up.set()
    assert_named(failed, "timed out", timed_out=True)


async def test_relay_check_names_a_refused_ingress_refused(http_transport: str) -> None:
    env = relay_env(
        UNREACHABLE_DB,
        "relay",
        f"http://127.0.0.1:{closed_port()}",
        RELAY_HTTP_TRANSPORT=http_transport,
    )
    _, lines = await check(env)
    assert marks(lines)["ingress"] == "FAIL", lines
    (line,) = [line for line in lines if line.split()[1] == "ingress"]
    assert "connection refused" in line and "ConnectTimeout" not in line, line


# --- a proxy's 407 -----------------------------------------------------------------------------


async def proxy_wants_credentials(writer: asyncio.StreamWriter) -> None:
    writer.write(
        b"HTTP/1.1 407 Proxy Authentication Required\r\n"
        b'proxy-authenticate: Basic realm="egress"\r\ncontent-length: 13\r\n\r\nwho are you?\n'
    )
    await writer.drain()


async def test_a_proxys_407_pauses_the_lane_and_blocks_no_run(
    monkeypatch: pytest.MonkeyPatch,
    pg_url: str,
    schema: str,
    conn: psycopg.Connection[Any],
    http_transport: str,
    log_lines: LogLines,
) -> None:
    """A server standing in as `HTTP_PROXY` answers every forwarded POST 407: nothing is failed
    or blocked and no attempt is charged (as poison, the runs were blocked one at a time); once
    the proxy lets the POSTs through, every event is delivered."""
    proxy = RawIngress(proxy_wants_credentials)
    enqueue_runs(conn, schema, 3, 2, terminal=False)
    async with proxy.serving() as proxy_url:
        proxy_environment(monkeypatch, HTTP_PROXY=proxy_url)
        # The ingress is the proxy's to reach: this port is never connected to by the relay.
        cfg = settings(pg_url, schema, "http://127.0.0.1:9", http_transport=http_transport)
        async with Relay(cfg).running() as r:
            await wait_for(
                lambda: not r.health.ingress_ok or count(conn, schema, "state <> 'pending'") > 0,
                what="the lane paused (or an event failed)",
            )
            assert count(conn, schema, "state <> 'pending'") == 0, "a 407 failed an event"
            assert count(conn, schema, "attempts > 0") == 0
            blocked = conn.execute(
                q(schema, "select count(*) from {s}.runs where blocked_seq is not null")
            ).fetchone()
            assert blocked == (0,)
            proxy.answer = ok  # the operator fixes the proxy's credentials
            await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 6, what="recovery")
    assert proxy.requests and all(
        path.startswith("http://127.0.0.1:9/") for _, path in proxy.requests
    )
    line = next(x for x in log_lines() if x["event"] == "ingress_misconfigured")
    assert (line["level"], line["status"]) == ("error", 407)
    assert not [x for x in log_lines() if x["event"] in ("run_blocked", "poison_narrowing")]


async def test_relay_check_names_a_proxys_407_a_proxy_credential(http_transport: str) -> None:
    """`relay check` through a proxy answering 407: the proxy's credentials are what to fix, not
    the ingress URL's path (it said "no such endpoint")."""
    async with RawIngress(proxy_wants_credentials).serving() as proxy_url:
        env = relay_env(
            UNREACHABLE_DB,
            "relay",
            "http://127.0.0.1:9",
            RELAY_HTTP_TRANSPORT=http_transport,
            RELAY_INGRESS_PROXY=proxy_url,
        )
        _, lines = await check(env)
    (line,) = [line for line in lines if line.split()[1] == "ingress"]
    assert line.split()[0] == "FAIL" and "answered 407" in line, line
    assert "proxy wants credentials" in line and "no such endpoint" not in line, line
