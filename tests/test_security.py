"""Secure by default (issue 8, docs/security.md), each point against the real thing: the real
relay and PostgreSQL, the reference ingress and small misbehaving servers on real sockets.

- Signatures: the reference ingress verifies Standard Webhooks signatures by the rules the
  relay signs with (rotation: two secrets signed, either one verifies) and answers 401 to a
  tampered body, a wrong secret, missing headers and a timestamp outside tolerance.
- Transport: TLS verified by default (a self-signed ingress fails until its CA file is given),
  no redirect followed, an endless answer read only up to the cap, a slow drip cut at the total
  deadline.
- Least privilege: a producer and the relay run under the two roles of `relay migrate
  --grant-roles`; the producer cannot read or change delivery state, the relay cannot insert
  events; nothing in the schema is executable by PUBLIC.
- Hostile input: ids with `/`, `..`, `%`, quotes, unicode and control characters never change
  the URL path; LISTEN quotes its channel; a running relay ignores (and logs) malformed and
  oversized notifications and keeps delivering. Oversized payloads and over-long ids are
  rejected at enqueue: tests/test_enqueue.py (test_bad_input_is_rejected_and_inserts_nothing,
  test_payload_size_limit_is_configurable_and_exact); invalid schema names:
  tests/test_schema.py (test_invalid_schema_names_are_rejected).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import signal
import ssl
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import anyio
import httpx
import orjson
import psycopg
import pytest
import trustme
from psycopg import errors, sql
from psycopg.conninfo import make_conninfo

import relay
from relay import logs
from relay.edges.http_client import Reply, open_sender
from relay.edges.ingress import MAX_BODY, TransportFailure, sign
from relay.edges.listener import Listener
from relay.maintenance.migrate import migrate
from relay.maintenance.roles import Roles, validate_role_name
from relay.runner import Relay
from relay.settings import ConfigError, Secret
from relay.tools.sink import Receive, Scope, Send, Sink, serve_sink, signing_keys, verify_signature
from tests.servers import TaskServer
from tests.support import HTTP_TRANSPORTS, count, q, settings, wait_for
from tests.test_cli import RELAY, relay_env
from tests.test_sink import body as sink_body

# A failed attempt is counted on its run (schema version 7), with its error: an event of a run
# that was rescheduled, and the state and error of the one event a test enqueued.
RESCHEDULED = "exists (select 1 from {s}.runs r where r.run_id = events.run_id and r.attempts >= 1)"
LAST_ATTEMPT = "select e.state, r.last_error from {s}.events e join {s}.runs r using (run_id)"

pytestmark = pytest.mark.anyio


def new_secret() -> str:
    return "whsec_" + base64.b64encode(os.urandom(32)).decode()


def body_of(run_id: str, seqs: list[int], epoch: int = 1) -> bytes:
    return orjson.dumps(sink_body(run_id, seqs, epoch))


def enqueue_some(
    conn: psycopg.Connection[Any], schema: str, runs: int, per_run: int, prefix: str
) -> None:
    with conn.transaction():
        for r in range(runs):
            relay.enqueue_many(
                conn,
                f"{prefix}{r}",
                [relay.Event(f"{prefix}{r}-{i}", "step", {"i": i}) for i in range(per_run)],
                schema=schema,
            )


class RecordingSink(Sink):
    """The reference ingress, also keeping the raw path and query of every request it got."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.raw: list[tuple[bytes, bytes]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.raw.append((scope.get("raw_path") or b"", scope.get("query_string", b"")))
        await super().__call__(scope, receive, send)


@asynccontextmanager
async def sink_at(**kwargs: Any) -> AsyncIterator[tuple[RecordingSink, str]]:
    s = RecordingSink(**kwargs)
    async with serve_sink(s) as url:
        yield s, url


# --- signatures: the reference ingress verifies them --------------------------------------------


def test_verify_accepts_the_standard_webhooks_test_vector() -> None:
    keys = signing_keys(["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"])
    headers = {
        "webhook-id": "msg_p5jXN8AQM9LWM0D4loKWxJek",
        "webhook-timestamp": "1614265330",
        "webhook-signature": "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
    }
    body = b'{"test": 2432232314}'
    assert verify_signature(keys, headers, body, 1614265330, 300) is None
    assert verify_signature(keys, headers, body + b" ", 1614265330, 300) == "bad_signature"
    # Any of several signatures; other versions are not v1 signatures.
    several = {**headers, "webhook-signature": "v2,xyz v1,bm90IGl0 " + headers["webhook-signature"]}
    assert verify_signature(keys, several, body, 1614265330, 300) is None
    as_v2 = {**headers, "webhook-signature": headers["webhook-signature"].replace("v1,", "v2,")}
    assert verify_signature(keys, as_v2, body, 1614265330, 300) == "bad_signature"


def test_verify_rejects_each_broken_rule() -> None:
    secret = new_secret()
    keys = signing_keys([secret])
    body, now = b'{"a":1}', 1_700_000_000

    def headers(ts: int | str = now, secret_: str = secret) -> dict[str, str]:
        stamp = int(ts) if str(ts).isdigit() else 0
        return {
            "webhook-id": "msg_1",
            "webhook-timestamp": str(ts),
            "webhook-signature": sign([Secret(secret_)], "msg_1", stamp, body),
        }

    assert verify_signature(keys, headers(), body, now, 300) is None
    assert verify_signature(keys, headers(now - 300), body, now, 300) is None  # at the edge
    assert verify_signature(keys, headers(now - 301), body, now, 300) == (
        "timestamp_out_of_tolerance"
    )
    assert verify_signature(keys, headers(now + 301), body, now, 300) == (
        "timestamp_out_of_tolerance"
    )
    assert verify_signature(keys, headers("soon"), body, now, 300) == "bad_timestamp"
    assert verify_signature(keys, headers(secret_=new_secret()), body, now, 300) == (
        "bad_signature"
    )
    for name in ("webhook-id", "webhook-timestamp", "webhook-signature"):
        partial = {k: v for k, v in headers().items() if k != name}
        assert verify_signature(keys, partial, body, now, 300) == "missing_headers"
    # The id is signed too: the same signature under another id does not verify.
    assert verify_signature(keys, {**headers(), "webhook-id": "msg_2"}, body, now, 300) == (
        "bad_signature"
    )
    with pytest.raises(ValueError, match="whsec_"):
        signing_keys(["whsec_not base64!"])


@pytest.mark.parametrize("sink_holds", ["old", "new"])
async def test_relay_signs_with_two_secrets_and_the_sink_verifies_with_either(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink_holds: str
) -> None:
    """Secret rotation: the relay signs with both the old and the new secret, so an ingress
    holding either one accepts every request."""
    old, new = new_secret(), new_secret()
    async with sink_at(signing_secrets=[old if sink_holds == "old" else new]) as (s, url):
        enqueue_some(conn, schema, 3, 2, prefix="sig")
        cfg = settings(pg_url, schema, url, signing_secret=f"{old},{new}")
        async with Relay(cfg).running():
            await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 6, what="6")
    assert s.state.unauthorized == {}
    assert len(s.state.deliveries) == 6
    for request in s.state.received:
        assert len(request["headers"]["webhook-signature"].split(" ")) == 2


async def test_relay_signing_with_a_secret_the_ingress_lacks_delivers_nothing(
    pg_url: str, schema: str, conn: psycopg.Connection[Any]
) -> None:
    """A wrong secret is a misconfiguration (401): nothing is accepted, acked or failed."""
    async with sink_at(signing_secrets=[new_secret()]) as (s, url):
        enqueue_some(conn, schema, 1, 2, prefix="wrong")
        cfg = settings(pg_url, schema, url, signing_secret=new_secret(), max_backoff="0.5s")
        async with Relay(cfg).running() as r:
            await wait_for(lambda: not r.health.ingress_ok, what="the 401 to be handled")
            await wait_for(lambda: s.state.unauthorized.get("bad_signature", 0) >= 2, what="2")
    assert s.state.requests == 0 and not s.state.deliveries
    assert count(conn, schema, "state = 'pending'") == 2  # not failed: not the events' fault


async def test_sink_rejects_tampered_unsigned_old_and_wrongly_signed_requests() -> None:
    secret, now = new_secret(), 1_700_000_000
    async with (
        sink_at(signing_secrets=[secret], tolerance=300, clock=lambda: float(now)) as (s, url),
        httpx.AsyncClient(base_url=url) as client,
    ):

        async def post(
            body: bytes,
            *,
            signed: bytes | None = None,
            key: str = secret,
            ts: int = now,
            drop: str | None = None,
            path: str = "/runs/r1/events",
        ) -> httpx.Response:
            headers = {
                "content-type": "application/json",
                "relay-lease-epoch": "1",
                "webhook-id": "msg_x",
                "webhook-timestamp": str(ts),
                "webhook-signature": sign(
                    [Secret(key)], "msg_x", ts, body if signed is None else signed
                ),
            }
            if drop:
                del headers[drop]
            return await client.post(path, content=body, headers=headers)

        good = body_of("r1", [1])
        tampered = good.replace(b'"n":1', b'"n":2')
        assert tampered != good
        assert (await post(tampered, signed=good)).status_code == 401
        assert (await post(good, key=new_secret())).status_code == 401
        assert (await post(good, drop="webhook-signature")).status_code == 401
        assert (await post(good, ts=now - 301)).status_code == 401
        assert (await post(good, ts=now + 301)).status_code == 401
        multi = orjson.dumps({"batches": [orjson.loads(body_of("r2", [1]))]})
        assert (await post(multi, key=new_secret(), path="/batch")).status_code == 401
        assert s.state.requests == 0  # nothing unverified reached the bookkeeping
        denied = await post(good, drop="webhook-id")
        assert denied.status_code == 401
        assert "missing_headers" in denied.json()["error"]
        # And a good one goes through, on both routes.
        assert (await post(good)).json() == {"accepted": 1}
        assert (await post(multi, path="/batch")).status_code == 200
        stats = (await client.get("/_sink/stats")).json()
    assert stats["unauthorized"] == 7
    assert stats["unauthorized_by_reason"] == {
        "bad_signature": 3,
        "missing_headers": 2,
        "timestamp_out_of_tolerance": 2,
    }
    assert stats["requests"] == 2


async def test_relay_sink_command_verifies_with_a_secret_from_a_file(tmp_path: Path) -> None:
    secret = new_secret()
    path = tmp_path / "secret"
    path.write_text(secret + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env["RELAY_SIGNING_SECRET_FILE"] = str(path)
    command = [sys.executable, "-m", "relay.tools.sink", "--port", "0"]
    with anyio.fail_after(30):
        async with await anyio.open_process(command, env=env) as process:
            assert process.stderr is not None and process.stdout is not None
            line = b""
            while not line.endswith(b"\n"):
                line += await process.stderr.receive(1)
            url = line.decode().split()[-1]
            body = body_of("r1", [1])
            async with httpx.AsyncClient(base_url=url) as client:
                unsigned = await client.post(
                    "/runs/r1/events", content=body, headers={"relay-lease-epoch": "1"}
                )
                assert unsigned.status_code == 401
                ts = int(time.time())
                signed = await client.post(
                    "/runs/r1/events",
                    content=body,
                    headers={
                        "relay-lease-epoch": "1",
                        "webhook-id": "msg_1",
                        "webhook-timestamp": str(ts),
                        "webhook-signature": sign([Secret(secret)], "msg_1", ts, body),
                    },
                )
                assert signed.json() == {"accepted": 1}
            process.send_signal(signal.SIGTERM)
            output = b"".join([chunk async for chunk in process.stdout])
            assert await process.wait() == 0
    stats = json.loads(output)
    assert (stats["requests"], stats["unauthorized"]) == (1, 1)
    bad = await anyio.run_process(
        [*command, "--signing-secret", "not-a-whsec"], env=env, check=False
    )
    assert bad.returncode == 2
    assert b"signing_secret" in bad.stderr


# --- transport ------------------------------------------------------------------------------------


@pytest.fixture(params=HTTP_TRANSPORTS)
def http_transport(request: pytest.FixtureRequest) -> str:
    """Each transport test runs over every HTTP client (`http_transport`)."""
    return str(request.param)


Answerer = Callable[[asyncio.StreamWriter], Awaitable[None]]


class RawIngress(TaskServer):
    """A tiny HTTP/1.1 server on a real socket that reads each request and then answers with
    `answer(writer)`: whatever misbehaviour a test needs (redirects, endless or dripping bodies,
    TLS). Counts requests, and body bytes a misbehaving answer wrote before the client left."""

    def __init__(self, answer: Answerer, ssl_context: ssl.SSLContext | None = None) -> None:
        super().__init__(ssl_context)
        self.answer = answer
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self.sent = 0
        self.client_left = 0

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                await reader.readexactly(length)
                self.requests.append((method, path))
                await self.answer(writer)
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError, OSError):
            self.client_left += 1
        finally:
            writer.close()


def redirect_to(location: str, status: int) -> Answerer:
    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(
            f"HTTP/1.1 {status} Redirect\r\nlocation: {location}\r\n"
            "content-length: 0\r\n\r\n".encode()
        )
        await writer.drain()

    return answer


@pytest.mark.parametrize("status", [302, 307, 308])
async def test_a_redirect_is_not_followed(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], http_transport: str, status: int
) -> None:
    async with sink_at() as (s, sink_url):
        raw = RawIngress(redirect_to(f"{sink_url}/runs/redir0/events", status))
        async with raw.serving() as url:
            enqueue_some(conn, schema, 1, 1, prefix="redir")
            cfg = settings(pg_url, schema, url, http_transport=http_transport, max_backoff="0.5s")
            async with Relay(cfg).running() as r:
                await wait_for(lambda: not r.health.ingress_ok, what="the 3xx to be handled")
    assert raw.requests and all(m == "POST" for m, _ in raw.requests)
    assert s.raw == []  # the Location target never heard of it
    assert count(conn, schema, "state = 'pending'") == 1  # a misconfiguration, not a failure


def endless_body(status: int, raw: list[RawIngress]) -> Answerer:
    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(
            f"HTTP/1.1 {status} Whatever\r\ncontent-type: text/plain\r\n"
            "transfer-encoding: chunked\r\n\r\n".encode()
        )
        chunk = b"x" * 65536
        framed = b"10000\r\n" + chunk + b"\r\n"
        while True:  # forever, until the client goes away
            writer.write(framed)
            await writer.drain()
            raw[0].sent += len(chunk)

    return answer


@pytest.mark.parametrize(("status", "state"), [(200, "pending"), (422, "failed"), (503, "pending")])
async def test_an_endless_answer_is_read_only_up_to_the_cap(
    pg_url: str,
    schema: str,
    conn: psycopg.Connection[Any],
    http_transport: str,
    status: int,
    state: str,
) -> None:
    """The ingress streams a body that never ends. The relay reads at most MAX_BODY of it,
    hangs up, and acts on the status: failed with a short excerpt (poison 4xx), rescheduled
    (5xx, and a 2xx whose body was cut at the read limit: DESIGN §5 makes that transient, as
    nobody can tell what it accepted). Reading the whole body would never finish: the deadline
    would turn every answer into a timeout."""
    holder: list[RawIngress] = []
    raw = RawIngress(endless_body(status, holder))
    holder.append(raw)
    async with raw.serving() as url:
        enqueue_some(conn, schema, 1, 1, prefix="endless")
        cfg = settings(
            pg_url, schema, url, http_transport=http_transport, http_timeout="5s", max_backoff="60s"
        )
        async with Relay(cfg).running():
            if state == "pending":
                where = "state = 'pending' and " + RESCHEDULED
            else:
                where = f"state = '{state}'"
            await wait_for(lambda: count(conn, schema, where) == 1, what=state)
            await wait_for(lambda: raw.client_left >= 1, what="the relay to hang up")
    # Bounded: what the server managed to write is the cap plus socket buffers, not a stream.
    assert raw.sent < 64 * 1024 * 1024
    # a failed event's error is its own (event_failures); a rescheduled one's is its run's
    row = conn.execute(
        q(
            schema,
            "select coalesce(e.last_error, r.last_error), coalesce(e.last_status, r.last_status)"
            " from {s}.events e join {s}.runs r using (run_id)",
        )
    ).fetchone()
    assert row is not None
    if state == "delivered":
        assert row == (None, None)
    else:
        assert row[1] == status
        assert "xxxx" in row[0] and len(row[0]) < MAX_BODY  # an excerpt


ENDLESS_HEAD_STOP = 64 * 1024 * 1024  # the hostile server gives up here (a red run still ends)


def endless_header(raw: list[RawIngress]) -> Answerer:
    """A status line, then one header line that never ends (no CRLF), 64 KiB at a time."""

    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nx-endless: ")
        chunk = b"a" * 65536
        while raw[0].sent < ENDLESS_HEAD_STOP:  # until the client goes away
            writer.write(chunk)
            await writer.drain()
            raw[0].sent += len(chunk)
        writer.close()

    return answer


async def test_an_endless_header_line_is_cut_at_the_head_cap_as_it_arrives(
    http_transport: str,
) -> None:
    """Issue 32 item 6: an answer whose header line never ends is refused once the line has
    passed its transport's cap (aiohttp's 8 KiB a line, httpcore's h11 100 KiB a head), counted
    as bytes arrive, not when a header is complete: the POST fails naming it, and the server
    manages to send no more than the cap plus the sockets' buffers before the client leaves
    (the first hand-written sender held all 64 MiB in one growing header value)."""
    cfg = relay.settings.load(
        {
            "database_url": "postgresql://x/y",
            "ingress_url": "http://i/runs/{run_id}",
            "http_transport": http_transport,
            "http_timeout": "20s",  # per phase for the senders; the test's own deadline below
        },
        {},
    )
    holder: list[RawIngress] = []
    raw = RawIngress(endless_header(holder))
    holder.append(raw)
    async with raw.serving() as url, open_sender(cfg, 1) as sender:
        with anyio.fail_after(120), pytest.raises(TransportFailure) as failed:
            await sender.send(url + "/runs/h1", b"{}", {})
        await wait_for(lambda: raw.client_left >= 1, what="the client to hang up")
    assert re.search(r"head|header|line|more than \d+ bytes|buffer", str(failed.value), re.I), (
        failed.value
    )
    # The cap plus socket buffers (loopback autotuning: a few MiB), not the stream.
    assert raw.sent < 16 * 1024 * 1024, raw.sent


async def test_a_slow_drip_is_cut_at_the_total_deadline(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], http_transport: str
) -> None:
    """One byte every 100 ms keeps every per-phase httpx timeout happy; only the total
    deadline ends the request: the error is the relay's own "timed out after", not a
    ReadTimeout, and the event is rescheduled, not lost."""

    async def drip(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n")
        while True:
            writer.write(b" ")
            await writer.drain()
            await asyncio.sleep(0.1)  # the server's pace, not a wait for an effect

    raw = RawIngress(drip)
    async with raw.serving() as url:
        enqueue_some(conn, schema, 1, 1, prefix="drip")
        cfg = settings(
            pg_url, schema, url, http_transport=http_transport, http_timeout="1s", max_backoff="60s"
        )
        async with Relay(cfg).running():
            await wait_for(
                lambda: count(conn, schema, RESCHEDULED) == 1, what="a rescheduled attempt"
            )
            await wait_for(lambda: raw.client_left >= 1, what="the relay to hang up")
    row = conn.execute(q(schema, LAST_ATTEMPT)).fetchone()
    assert row == ("pending", "timed out after 1s")


@pytest.fixture(scope="module")
def tls() -> tuple[trustme.CA, trustme.LeafCert]:
    ca = trustme.CA()
    return ca, ca.issue_cert("127.0.0.1", "localhost")


async def test_tls_is_verified_and_a_ca_file_makes_a_private_ingress_trusted(
    pg_url: str,
    schema: str,
    conn: psycopg.Connection[Any],
    http_transport: str,
    tmp_path: Path,
    tls: tuple[trustme.CA, trustme.LeafCert],
) -> None:
    ca, cert = tls
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server_ctx)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))

    async def ok(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()

    raw = RawIngress(ok, server_ctx)
    async with raw.serving() as url:
        enqueue_some(conn, schema, 1, 1, prefix="tls")
        # Verification is on by default: the self-signed ingress is refused (transient).
        async with Relay(
            settings(pg_url, schema, url, http_transport=http_transport, max_backoff="0.5s")
        ).running():
            await wait_for(lambda: count(conn, schema, RESCHEDULED) == 1, what="a refused attempt")
        row = conn.execute(q(schema, LAST_ATTEMPT)).fetchone()
        assert row is not None and row[0] == "pending"
        assert "CERTIFICATE_VERIFY_FAILED" in row[1]
        assert raw.requests == []  # no request went out over the unverified connection
        conn.execute(q(schema, "update {s}.runs set next_attempt_at = clock_timestamp()"))
        cfg = settings(
            pg_url, schema, url, http_transport=http_transport, ingress_ca_file=str(ca_file)
        )
        async with Relay(cfg).running():
            await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 1, what="ack")
    assert raw.requests == [("POST", "/runs/tls0/events")]


def test_ingress_ca_file_is_checked_at_start(tmp_path: Path) -> None:
    base = {"database_url": "postgresql://x/y", "ingress_url": "https://i/runs/{run_id}"}
    with pytest.raises(ConfigError, match=r"^ingress_ca_file \(--ingress-ca-file"):
        relay.settings.load({**base, "ingress_ca_file": str(tmp_path / "missing.pem")}, {})
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="ingress_ca_file"):
        relay.settings.load({**base, "ingress_ca_file": str(junk)}, {})


async def test_the_sender_verifies_without_a_ca_file_too(
    tls: tuple[trustme.CA, trustme.LeafCert],
    http_transport: str,
) -> None:
    """The sender itself, outside the relay loop: without `ingress_ca_file` it verifies
    against the system's CAs, so a certificate from an unknown CA is refused."""
    cfg = relay.settings.load(
        {
            "database_url": "postgresql://x/y",
            "ingress_url": "https://i/runs/{run_id}",
            "http_transport": http_transport,
        },
        {},
    )
    _ca, cert = tls
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server_ctx)

    async def ok(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()

    async with RawIngress(ok, server_ctx).serving() as url, open_sender(cfg, 1) as sender:
        with pytest.raises(TransportFailure, match="CERTIFICATE_VERIFY_FAILED"):
            await sender.send(url + "/x", b"{}", {})


class ForwardingProxy(TaskServer):
    """A small real HTTP proxy on 127.0.0.1: `CONNECT host:port` opens a tunnel to the origin; a
    request in absolute form is forwarded to its origin in origin form with `connection: close`
    (so one request per proxy connection), its body and answer piped through. Records both."""

    def __init__(self) -> None:
        self.connects: list[str] = []  # CONNECT targets
        super().__init__()
        self.forwarded: list[tuple[str, str]] = []  # (method, absolute URL)

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: asyncio.StreamWriter | None = None
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            line, _, rest = head.partition(b"\r\n")
            method, target, version = line.split(b" ", 2)
            if method == b"CONNECT":
                host, _, port = target.decode().rpartition(":")
                up_reader, upstream = await asyncio.open_connection(host, int(port))
                self.connects.append(target.decode())
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                url = urlsplit(target.decode())
                assert url.hostname, target
                up_reader, upstream = await asyncio.open_connection(url.hostname, url.port or 80)
                self.forwarded.append((method.decode(), target.decode()))
                path = (url.path or "/") + (f"?{url.query}" if url.query else "")
                keep = [
                    h
                    for h in rest.split(b"\r\n")
                    if h and not h.lower().startswith((b"connection:", b"proxy-connection:"))
                ]
                length = sum(
                    int(h.partition(b":")[2])
                    for h in keep
                    if h.lower().startswith(b"content-length:")
                )
                upstream.write(
                    b" ".join([method, path.encode(), version])
                    + b"\r\n"
                    + b"\r\n".join([*keep, b"connection: close"])
                    + b"\r\n\r\n"
                    + await reader.readexactly(length)
                )
                # The answer is passed on with `connection: close`: the client's next request
                # comes on a new proxy connection, forwarded (and recorded) like this one.
                answer = await up_reader.readuntil(b"\r\n\r\n")
                status, _, fields = answer.partition(b"\r\n")
                kept = [
                    f
                    for f in fields.split(b"\r\n")
                    if f and not f.lower().startswith(b"connection:")
                ]
                writer.write(b"\r\n".join([status, *kept, b"connection: close"]) + b"\r\n\r\n")
            await self._pipe(reader, writer, up_reader, upstream)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            if upstream is not None:
                upstream.close()
            writer.close()

    @staticmethod
    async def _pipe(
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        upstream: asyncio.StreamWriter,
    ) -> None:
        """Bytes both ways until either side closes."""

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()

        ways = [
            asyncio.ensure_future(copy(reader, upstream)),
            asyncio.ensure_future(copy(up_reader, writer)),
        ]
        try:
            await asyncio.wait(ways, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for way in ways:
                way.cancel()
            await asyncio.gather(*ways, return_exceptions=True)


def proxy_environment(monkeypatch: pytest.MonkeyPatch, **values: str) -> None:
    """Exactly these proxy variables (uppercase names) in the environment, no others."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("route", ["forward", "connect", "bypass"])
async def test_every_transport_goes_through_the_proxy_the_environment_names(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    http_transport: str,
    route: str,
    tmp_path: Path,
    tls: tuple[trustme.CA, trustme.LeafCert],
) -> None:
    """Issue 30 item 3: HTTP_PROXY / HTTPS_PROXY / NO_PROXY are honoured whatever
    `http_transport` says. Through a real proxy: an http:// ingress gets the request forwarded
    (absolute form to the proxy), an https:// one through a CONNECT tunnel (TLS end to end,
    verified against the ingress's CA); NO_PROXY naming the ingress keeps it direct. Each
    transport under httpx's client takes the route httpx's `trust_env` chose (issue 40)."""

    async def ok(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()

    ca, cert = tls
    server_ctx = None
    flags = {"database_url": "postgresql://x/y", "http_transport": http_transport}
    if route == "connect":
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(server_ctx)
        ca_file = tmp_path / "ca.pem"
        ca.cert_pem.write_to_path(str(ca_file))
        flags["ingress_ca_file"] = str(ca_file)
    proxy, ingress = ForwardingProxy(), RawIngress(ok, server_ctx)
    caplog.set_level("INFO", logger="relay")
    async with proxy.serving() as proxy_url, ingress.serving() as url:
        variable = "HTTPS_PROXY" if route == "connect" else "HTTP_PROXY"
        bypass = {"NO_PROXY": "example.com,127.0.0.1"} if route == "bypass" else {}
        proxy_environment(monkeypatch, **{variable: proxy_url}, **bypass)
        cfg = relay.settings.load({**flags, "ingress_url": url + "/runs/{run_id}"}, {})
        async with open_sender(cfg, 2) as sender:
            for _ in range(2):
                assert await sender.send(url + "/runs/p1", b"{}", {}) == Reply(200, b"ok", None)
    assert ingress.requests == [("POST", "/runs/p1")] * 2  # the ingress got each POST
    port = url.rpartition(":")[2]
    if route == "forward":
        assert (proxy.forwarded, proxy.connects) == ([("POST", url + "/runs/p1")] * 2, [])
    elif route == "connect":
        assert proxy.forwarded == [] and set(proxy.connects) == {f"127.0.0.1:{port}"}
    else:
        assert (proxy.forwarded, proxy.connects) == ([], [])
    # One client for every route: nothing is handed to another sender, nothing said about it.
    assert not [r for r in caplog.records if r.getMessage() == "http_transport_chosen"]


async def test_the_relay_delivers_through_a_proxy_with_the_default_sender(
    pg_url: str,
    schema: str,
    conn: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """End to end with the default settings: `relay run`'s POSTs reach the reference ingress
    through the proxy HTTP_PROXY names, every one of them."""
    proxy = ForwardingProxy()
    async with sink_at() as (s, sink_url), proxy.serving() as proxy_url:
        proxy_environment(monkeypatch, HTTP_PROXY=proxy_url)
        enqueue_some(conn, schema, 3, 2, prefix="px")
        async with Relay(settings(pg_url, schema, sink_url)).running():
            await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 6, what="acks")
    assert s.state.first_order == {f"px{r}": [1, 2] for r in range(3)}
    assert len(proxy.forwarded) == len(s.raw) >= 3
    assert {m for m, _ in proxy.forwarded} == {"POST"}


# --- least privilege: the producer and relay roles ---------------------------------------------


class RoleSet:
    def __init__(self, pg_url: str, roles: Roles) -> None:
        self.pg_url, self.roles = pg_url, roles
        self.logins: dict[str, str] = {}  # group role -> conninfo of a login role in it

    def url(self, group: str) -> str:
        return self.logins[group]


@pytest.fixture
def granted(pg_url: str, schema: str, conn: psycopg.Connection[Any]) -> Iterator[RoleSet]:
    """`relay migrate --grant-roles` on the test's schema, and one login role in each group
    role (with a password, in case the server is not the embedded trusting one)."""
    tag = uuid.uuid4().hex[:8]
    roles = Roles.for_schema(schema, f"prod_{tag}", f"rly_{tag}")
    result = migrate(pg_url, schema, roles=roles)
    assert result.granted == roles
    rs = RoleSet(pg_url, roles)
    created = [roles.producer, roles.relay]
    try:
        for group in (roles.producer, roles.relay):
            login, password = f"{group}_login", uuid.uuid4().hex
            conn.execute(
                sql.SQL("create role {} login password {} in role {}").format(
                    sql.Identifier(login), sql.Literal(password), sql.Identifier(group)
                )
            )
            created.insert(0, login)
            rs.logins[group] = make_conninfo(pg_url, user=login, password=password)
        yield rs
    finally:
        for role in created:
            conn.execute(sql.SQL("drop owned by {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("drop role {}").format(sql.Identifier(role)))


def denied(c: psycopg.Connection[Any], statement: sql.Composable, *params: Any) -> bool:
    try:
        c.execute(statement, params or None)
    except errors.InsufficientPrivilege:
        return True
    return False


def test_grant_roles_creates_group_roles_without_login_or_password(
    granted: RoleSet, conn: psycopg.Connection[Any]
) -> None:
    for role in (granted.roles.producer, granted.roles.relay):
        row = conn.execute(
            "select rolcanlogin, rolpassword is null, rolsuper, rolcreaterole, rolcreatedb"
            " from pg_authid where rolname = %s",
            (role,),
        ).fetchone()
        assert row == (False, True, False, False, False), role


def test_the_producer_can_enqueue_and_nothing_else(
    granted: RoleSet, schema: str, queue: str, conn: psycopg.Connection[Any]
) -> None:
    with psycopg.connect(granted.url(granted.roles.producer), autocommit=True) as p:
        with p.transaction():
            assert relay.enqueue(p, "pr1", "pr1-a", "run_created", {"a": 1}, schema=schema) == 1
            seqs = relay.enqueue_many(
                p,
                "pr1",
                [
                    relay.Event("pr1-b", "step", {}, wake_queue=queue, wake_event="w:pr1"),
                    relay.Event("pr1-c", "done", {}, terminal=True),
                ],
                schema=schema,
            )
            assert seqs == [2, 3]
        # Idempotent re-enqueue works without reading the table.
        assert relay.enqueue(p, "pr1", "pr1-a", "run_created", {"a": 1}, schema=schema) == 1
        for table in (
            "events",
            "outbox",
            "event_failures",
            "event_skips",
            "pending_terminals",
            "runs",
            "run_seqs",
            "settings",
            "schema_migrations",
        ):
            assert denied(p, q(schema, f"select 1 from {{s}}.{table} limit 1")), table
        assert denied(p, q(schema, "update {s}.outbox set event_type = 'x'"))
        assert denied(p, q(schema, "update {s}.runs set delivered_seq = 99"))
        assert denied(p, q(schema, "update {s}.runs set blocked_seq = 1"))
        assert denied(p, q(schema, "delete from {s}.outbox"))
        assert denied(p, q(schema, "update {s}.settings set value = '99999999'"))
        assert denied(
            p,
            q(
                schema,
                "insert into {s}.events (run_id, seq, event_id, event_type, payload)"
                " values ('x', 1, 'x', 't', '{{}}')",
            ),
        )
        assert denied(p, q(schema, "select * from {s}.claim('me', 1, 10, '30s', 'ordinary')"))
        assert denied(p, q(schema, "select * from {s}.ack('[]')"))
        assert denied(p, q(schema, "select * from {s}.renew('{{}}', '{{}}', '30s')"))
        assert denied(p, q(schema, "select {s}.release('pr1', gen_random_uuid())"))
        assert denied(p, q(schema, "select {s}.fail_event('pr1', null, 1, 422, 'x')"))
        assert denied(p, q(schema, "select {s}.prune('0', 10)"))
        assert denied(p, q(schema, "select {s}.replica_stopped('me')"))
        assert denied(p, q(schema, "select * from {s}.backlog()"))
        assert denied(p, q(schema, "select {s}.settle_run('pr1')"))
        assert denied(p, q(schema, "select {s}.setting('max_payload_bytes')"))
        assert denied(p, q(schema, "select * from {s}.retry_event('pr1-a', 'me')"))
        assert denied(p, q(schema, "create table {s}.mine (i int)"))
    assert count(conn, schema) == 3
    assert count(conn, schema, "state = 'pending'") == 3


async def test_the_relay_role_delivers_end_to_end_and_cannot_write_events(
    granted: RoleSet, schema: str, queue: str, conn: psycopg.Connection[Any]
) -> None:
    """Producer and relay each under their own role: delivery, the engine wake (ack calls
    absurd.emit_event with no grant in the Absurd schema), retention (prune), the version
    check and the backlog behind /readyz and /metrics."""
    with psycopg.connect(granted.url(granted.roles.producer), autocommit=True) as p:
        with p.transaction():
            for r in range(3):
                relay.enqueue_many(
                    p,
                    f"lp{r}",
                    [
                        relay.Event(
                            f"lp{r}-0", "run_created", {}, wake_queue=queue, wake_event=f"w:lp{r}"
                        ),
                        relay.Event(f"lp{r}-1", "done", {}, terminal=True),
                    ],
                    schema=schema,
                )
    relay_url = granted.url(granted.roles.relay)
    async with sink_at() as (s, url):
        cfg = settings(relay_url, schema, url, retention="1ms", metrics_addr="127.0.0.1:0")
        async with Relay(cfg, prune_interval=0.05).running() as r:
            await wait_for(lambda: len(s.state.deliveries) == 6, what="6 deliveries")
            # Pruned: acked (only delivered rows are pruned) and deleted, by the relay role.
            await wait_for(lambda: count(conn, schema) == 0, what="the events to be pruned")
            assert r.endpoints is not None
            base = f"http://127.0.0.1:{r.endpoints.port}"
            async with httpx.AsyncClient(base_url=base) as client:
                await wait_for(lambda: _ok(client, "/readyz"), what="/readyz under the relay role")
                await wait_for(
                    lambda: _gauge_above_zero(client, "backlog_refresh_timestamp_seconds"),
                    what="backlog() under the relay role",
                )
                await wait_for(
                    lambda: _gauge_above_zero(client, "outbox_part_age_seconds"),
                    what="outbox_part_age() under the relay role",
                )
    wakes = conn.execute(
        sql.SQL("select event_name from absurd.{} order by 1").format(sql.Identifier(f"e_{queue}"))
    ).fetchall()
    assert [w[0] for w in wakes] == ["w:lp0", "w:lp1", "w:lp2"]
    # Its clean stop, said under the relay role (replica_stopped, issue 41): not left as dead.
    assert conn.execute(q(schema, "select owner from {s}.replicas")).fetchall() == []
    with psycopg.connect(relay_url, autocommit=True) as rc:
        assert denied(
            rc,
            q(
                schema,
                "insert into {s}.events (run_id, seq, event_id, event_type, payload)"
                " values ('x', 1, 'x', 't', '{{}}')",
            ),
        )
        assert denied(rc, q(schema, "select {s}.enqueue('x', 'x', 't', '{{}}')"))
        assert denied(rc, q(schema, "select {s}.enqueue_many('x', '[]')"))
        assert denied(rc, q(schema, "update {s}.runs set delivered_seq = 99"))
        assert denied(rc, q(schema, "update {s}.outbox set payload = '{{}}'"))
        assert denied(rc, q(schema, "delete from {s}.outbox"))
        assert denied(rc, q(schema, "insert into {s}.event_skips values ('x', 1, 'me', null, 'y')"))
        assert denied(rc, q(schema, "update {s}.runs set lease_token = null"))
        assert denied(rc, q(schema, "delete from {s}.runs"))
        assert denied(rc, q(schema, "insert into {s}.run_seqs values ('x', 1)"))
        assert denied(rc, q(schema, "update {s}.settings set value = 'off'"))
        assert denied(rc, q(schema, "select payload from {s}.events"))
        assert denied(rc, q(schema, "select * from {s}.skip_event('x', 'me', 'why')"))
        assert denied(rc, q(schema, "select {s}.settle_run('x')"))
        assert denied(rc, q(schema, "create table {s}.mine (i int)"))
        # What it may read directly: the ack-committed probe and the version.
        rc.execute(q(schema, "select run_id, seq, state from {s}.events limit 1"))
        rc.execute(q(schema, "select max(version) from {s}.schema_migrations"))


async def _ok(client: httpx.AsyncClient, path: str) -> bool:
    return (await client.get(path)).status_code == 200


async def _gauge_above_zero(client: httpx.AsyncClient, name: str) -> bool:
    metrics = (await client.get("/metrics")).text
    value = re.search(rf"^\w*{name} (\S+)$", metrics, re.M)
    return value is not None and float(value.group(1)) > 0


def public_grants(conn: psycopg.Connection[Any], schema: str) -> list[str]:
    """Functions of `schema` that PUBLIC may execute (a NULL acl means the default: PUBLIC)."""
    rows = conn.execute(
        "select p.proname from pg_proc p where p.pronamespace = %s::regnamespace"
        " and (p.proacl is null or exists (select 1 from aclexplode(p.proacl) a"
        " where a.grantee = 0))",
        (schema,),
    ).fetchall()
    return sorted(r[0] for r in rows)


def test_no_function_is_executable_by_public(schema: str, conn: psycopg.Connection[Any]) -> None:
    assert public_grants(conn, schema) == []


def test_migrate_keeps_the_grants_exact_after_drift_and_extra_grants(
    granted: RoleSet, pg_url: str, schema: str, conn: psycopg.Connection[Any]
) -> None:
    roles = granted.roles
    claim_sig = f"{schema}.claim(text, integer, integer, interval, text, text, bigint, uuid)"

    def may(role: str, what: str, obj: str, priv: str) -> bool:
        row = conn.execute(f"select has_{what}_privilege(%s, %s, %s)", (role, obj, priv))
        got = row.fetchone()
        assert got is not None
        return bool(got[0])

    assert may(roles.relay, "function", claim_sig, "execute")
    # A function re-created by a later migrate (dropped here) gets the relay role's grant back
    # and no PUBLIC grant, without --grant-roles.
    conn.execute(sql.SQL(f"drop function {claim_sig}"))
    assert migrate(pg_url, schema).functions_reapplied is True
    assert may(roles.relay, "function", claim_sig, "execute")
    assert not may(roles.producer, "function", claim_sig, "execute")
    assert public_grants(conn, schema) == []
    # Privileges granted by hand are taken away by the next --grant-roles.
    conn.execute(q(schema, "grant insert, update on {s}.events to ").as_string(conn) + roles.relay)
    conn.execute(q(schema, "grant select on {s}.runs to ").as_string(conn) + roles.producer)
    assert may(roles.relay, "table", f"{schema}.events", "insert")
    migrate(pg_url, schema, roles=roles)
    assert not may(roles.relay, "table", f"{schema}.events", "insert")
    assert not may(roles.relay, "table", f"{schema}.events", "update")
    assert not may(roles.producer, "table", f"{schema}.runs", "select")
    assert may(roles.producer, "function", f"{schema}.enqueue_many(text, jsonb, text)", "execute")


def test_role_names_are_validated() -> None:
    assert Roles.for_schema("relay") == Roles("relay_producer", "relay_relay")
    for bad in ("", "Upper", "pg_x", "public", "a-b", "x" * 64, 'q"uote'):
        with pytest.raises(ValueError):
            validate_role_name(bad)
    with pytest.raises(ValueError, match="different"):
        Roles.for_schema("relay", "same", "same")


async def test_relay_migrate_grant_roles_command(
    pg_url: str, schema: str, conn: psycopg.Connection[Any]
) -> None:
    tag = uuid.uuid4().hex[:8]
    producer, relay_role = f"cp_{tag}", f"cr_{tag}"
    env = relay_env(pg_url, schema)
    try:
        got = await anyio.run_process(
            [
                *RELAY,
                "migrate",
                "--grant-roles",
                "--producer-role",
                producer,
                "--relay-role",
                relay_role,
            ],
            env=env,
            check=False,
        )
        assert got.returncode == 0, got.stderr.decode()
        assert f"producer {producer}" in got.stdout.decode()
        row = conn.execute(
            "select count(*) from pg_roles where rolname = any(%s) and not rolcanlogin",
            ([producer, relay_role],),
        ).fetchone()
        assert row == (2,)
        for args in (["--producer-role", "x_y"], ["--grant-roles", "--relay-role", "Bad-Name"]):
            bad = await anyio.run_process([*RELAY, "migrate", *args], env=env, check=False)
            assert bad.returncode == 2
            assert b"role" in bad.stderr
    finally:
        for role in (producer, relay_role):
            if conn.execute("select 1 from pg_roles where rolname = %s", (role,)).fetchone():
                conn.execute(sql.SQL("drop owned by {}").format(sql.Identifier(role)))
                conn.execute(sql.SQL("drop role {}").format(sql.Identifier(role)))


# --- hostile input -------------------------------------------------------------------------------

HOSTILE_IDS = [
    "a/b",
    "...",
    "../../etc/passwd",
    "%2F%2e%2E",
    "100%",
    "it's",
    'say "hi"',
    "back\\slash",
    "q?x=1#frag",
    "ünï€😀",
    "tab\there",
    "new\nline\r",
    "bell\x07del\x7f",
    " spaced ",
    "+plus&amp;=;semi:colon@at",
]


async def test_hostile_ids_never_change_the_url_path(
    pg_url: str, schema: str, conn: psycopg.Connection[Any]
) -> None:
    with conn.transaction():
        for i, run_id in enumerate(HOSTILE_IDS):
            relay.enqueue(conn, run_id, f"{run_id}|e{i}/../%", "step", {"i": i}, schema=schema)
    async with sink_at() as (s, url):
        async with Relay(settings(pg_url, schema, url)).running():
            await wait_for(
                lambda: len(s.state.deliveries) == len(HOSTILE_IDS), what="every hostile id"
            )
    assert set(s.state.deliveries) == {f"{r}|e{i}/../%" for i, r in enumerate(HOSTILE_IDS)}
    assert {r["run_id"] for r in s.state.received if r["status"] == 200} == set(HOSTILE_IDS)
    seen = set()
    for raw_path, query in s.raw:
        assert query == b""
        parts = raw_path.split(b"/")
        assert len(parts) == 4 and parts[:2] == [b"", b"runs"] and parts[3] == b"events", raw_path
        segment = parts[2]
        assert segment not in (b"", b".", b".."), raw_path
        # (Sub-delimiters such as ' ; = & may be sent as they are: aiohttp's URL canonicalises
        # them, RFC 3986 allows them in a segment, and the segment decodes the same.)
        assert not set(segment.decode("ascii")) & set('?#/\\ "\t\r\n'), raw_path
        seen.add(unquote(segment.decode("ascii"), errors="strict"))
    assert seen == set(HOSTILE_IDS)


async def test_listen_quotes_its_channel_names(pg_url: str, conn: psycopg.Connection[Any]) -> None:
    """A channel that only works quoted (upper case, a space, a quote, a semicolon): LISTEN
    built by string pasting would fail or listen elsewhere."""
    channel = 'Odd "Chan"; select 1'
    got: list[str] = []
    listener = Listener(
        pg_url,
        channel,
        on_terminal=got.append,
        on_delivered=lambda run_id: None,
        on_wake=lambda: None,
        on_connected=lambda: None,
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.run)
        await wait_for(lambda: listener.up, what="LISTEN")
        conn.execute(
            "select pg_notify(%s, %s)",
            (channel, '{"kind": "terminal_committed", "run_id": "r1"}'),
        )
        await wait_for(lambda: got == ["r1"], what="the notification")
        tg.cancel_scope.cancel()
    assert listener.state.reconnects == 1 and listener.state.malformed == 0


MALFORMED_NOTIFICATIONS = [
    "",
    "not json",
    "[]",
    "null",
    "42",
    '{"kind": "terminal_committed"}',
    '{"kind": "terminal_committed", "run_id": 7}',
    '{"kind": "terminal_committed", "run_id": ""}',
    '{"kind": ["terminal_committed"], "run_id": "x"}',
    "[" * 3000 + "]" * 3000,  # deeper than any JSON parser's recursion limit
    "x" * 7999,  # the largest payload NOTIFY carries
]


async def test_a_running_relay_ignores_malformed_notifications_and_keeps_delivering(
    pg_url: str, schema: str, conn: psycopg.Connection[Any]
) -> None:
    stream = io.StringIO()
    logs.configure("json", "debug", stream)
    try:
        async with sink_at() as (s, url):
            async with Relay(settings(pg_url, schema, url)).running() as r:
                listener = r.listener
                assert listener is not None
                await wait_for(lambda: listener.up, what="LISTEN")
                pid = listener.state.backend_pid
                channel = f"{schema}_terminal"
                for payload in MALFORMED_NOTIFICATIONS:
                    conn.execute("select pg_notify(%s, %s)", (channel, payload))
                # Hostile but well formed: a huge unknown run id, someone else's delivery.
                big = json.dumps(
                    {"kind": "terminal_committed", "run_id": "€" * 2500}, ensure_ascii=False
                )
                conn.execute("select pg_notify(%s, %s)", (channel, big))
                conn.execute(
                    "select pg_notify(%s, %s)",
                    (channel, '{"kind": "outbox_delivered", "run_id": "nope"}'),
                )
                await wait_for(
                    lambda: listener.state.malformed == len(MALFORMED_NOTIFICATIONS),
                    what="every malformed notification",
                )
                # Still the same LISTEN session, and still delivering: a terminal drain too.
                with conn.transaction():
                    relay.enqueue(conn, "after", "after-1", "step", {}, schema=schema)
                    relay.enqueue(
                        conn, "after", "after-2", "done", {}, terminal=True, schema=schema
                    )
                await wait_for(lambda: "after-2" in s.state.deliveries, what="delivery after")
                assert (listener.state.backend_pid, listener.state.reconnects) == (pid, 1)
    finally:
        logs.configure("json", "warning")
    ignored = [
        line
        for line in map(json.loads, stream.getvalue().splitlines())
        if line.get("event") == "notification_ignored"
    ]
    assert len(ignored) == len(MALFORMED_NOTIFICATIONS)
    assert all(len(line["payload"]) <= 200 for line in ignored)
