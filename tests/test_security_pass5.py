"""The fifth hostile pass (issue 48), each finding against a real hostile server on real sockets
and, end to end, a relay and a real database.

- Item 2: an empty 2xx whose Transfer-Encoding does not end in `chunked` (`chunked, gzip`,
  `xchunked`, two headers) runs to the connection's close (RFC 9112 §6.3): it is not framed, so
  it cannot accept a batch. The relay's framing check used to find the substring "chunked".
- Item 4: an ingress that echoes the request's headers, in a malformed head (which the
  transport's error quotes), a 500 and a 400, never gets the relay's credentials (a bearer
  token, an ingress URL's userinfo as Basic credentials) into the stored errors, the log lines,
  `relay inspect` or the status page: every text that came from outside passes `scrub` at the
  ingress client. The OTLP endpoint's password is redacted in the `tracing_on` line and in the
  error for a wrong scheme.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import os
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import anyio
import httpx
import psycopg
import pytest
from psycopg import sql

from relay import logs
from relay.core.policy import BODY_EXCERPT, Ack, decide
from relay.edges.http_client import open_sender
from relay.edges.ingress import Answer, TransportFailure
from relay.edges.tracing import config_from_env
from relay.integrations import start_tracing
from relay.runner import Relay
from relay.settings import ConfigError, Secret
from tests.servers import TaskServer
from tests.support import HTTP_TRANSPORTS, count, q, settings, wait_for
from tests.test_cli import RELAY, relay_env
from tests.test_http_client import client_settings, settled
from tests.test_security import LAST_ATTEMPT, Answerer, RawIngress, enqueue_some

pytestmark = pytest.mark.anyio


# --- item 2: only a final `chunked` frames a body --------------------------------------------

# Transfer-Encoding lines whose last coding is not `chunked`: the body runs to the close.
CLOSE_DELIMITED = {
    "chunked-then-gzip": b"transfer-encoding: chunked, gzip\r\n",
    "xchunked": b"transfer-encoding: xchunked\r\n",
    "two-headers": b"transfer-encoding: chunked\r\ntransfer-encoding: gzip\r\n",
}


def empty_200_then_close(te_lines: bytes) -> Answerer:
    """`200 OK` with the given Transfer-Encoding lines and no body, then the connection closed:
    the body's end is the close's, which a reset mimics for aiohttp."""

    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + te_lines + b"\r\n")
        await writer.drain()
        writer.close()

    return answer


@pytest.mark.parametrize("http_transport", HTTP_TRANSPORTS)
@pytest.mark.parametrize("te_lines", CLOSE_DELIMITED.values(), ids=CLOSE_DELIMITED.keys())
async def test_a_coding_list_not_ending_in_chunked_is_no_framing(
    te_lines: bytes, http_transport: str
) -> None:
    """The sender's own judgement: aiohttp reads such an answer as a 200 with an empty body
    ended by the close, which must come back unframed; h11 (httpx's own transport) refuses the
    head, a transport failure. Neither may be a framed empty 200."""
    ingress = RawIngress(empty_200_then_close(te_lines))
    cfg = client_settings(http_transport=http_transport)
    async with ingress.serving() as url, open_sender(cfg, 1) as sender:
        try:
            reply = await sender.send(url + "/runs/te", b"{}", {})
        except TransportFailure:
            assert http_transport == "httpx", "aiohttp reads these heads"
            return
    assert (reply.status, reply.body) == (200, b"")
    assert reply.unframed, "a coding list that does not end in chunked was taken as framing"


@pytest.mark.parametrize("http_transport", HTTP_TRANSPORTS)
async def test_a_final_chunked_coding_still_frames_an_empty_answer(http_transport: str) -> None:
    """The other side of the rule: `chunked` last, in any case and spacing, frames the body
    (a properly chunked empty 200 accepts the batch as before)."""

    async def chunked_empty(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding:  Chunked \r\n\r\n0\r\n\r\n")
        await writer.drain()

    ingress = RawIngress(chunked_empty)
    cfg = client_settings(http_transport=http_transport)
    async with ingress.serving() as url, open_sender(cfg, 1) as sender:
        reply = await sender.send(url + "/runs/te", b"{}", {})
    assert (reply.status, reply.body, reply.unframed) == (200, b"", False)


@pytest.mark.parametrize("http_transport", HTTP_TRANSPORTS)
@pytest.mark.parametrize("te_lines", CLOSE_DELIMITED.values(), ids=CLOSE_DELIMITED.keys())
async def test_an_empty_2xx_not_framed_by_a_final_chunked_is_not_an_ack(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], te_lines: bytes, http_transport: str
) -> None:
    """End to end (issue 48 item 2): the ingress answers the POST with such a head and closes.
    The event stays pending, rescheduled: aiohttp's empty body is the unframed-2xx rule's
    (relay/core/policy.py), h11's refusal a transport failure. Before the fix aiohttp's answer
    was taken as chunked, and the batch was acked."""
    ingress = RawIngress(empty_200_then_close(te_lines))
    async with ingress.serving() as url:
        cfg = settings(pg_url, schema, url, http_transport=http_transport, max_backoff="60s")
        enqueue_some(conn, schema, 1, 1, prefix="te")
        async with Relay(cfg).running():
            await wait_for(lambda: settled(conn, schema, "te0"), what="rescheduled or acked")
    assert ingress.requests, "the POST never reached the ingress"
    ((state, error),) = conn.execute(q(schema, LAST_ATTEMPT)).fetchall()
    assert state == "pending", error
    assert "Content-Length or chunked" in error or "Transfer-Encoding" in error, error


# --- item 4: what the ingress echoes of the request is scrubbed at the door -------------------

CANARY = "CANARY" + uuid.uuid4().hex[:12]
TOKEN = f"tok-{CANARY}-ingress"
URL_PASSWORD = f"up-{CANARY}-url"
UI_TOKEN = uuid.uuid4().hex


def echoes(auth: str) -> list[bytes]:
    """An ingress's answers to three POSTs, each echoing the request's Authorization header:
    a malformed head (both transports quote its line in their error), a 500, then a 400 (the
    event is poison: its run blocked, the excerpt stored with it)."""
    body = f'{{"error": "rejected", "you sent": {{"authorization": "{auth}"}}}}'.encode()
    framed = f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    return [
        f"HTTP/1.1 200 OK\r\nx-echo authorization={auth}\r\n\r\n".encode(),
        b"HTTP/1.1 500 Internal Server Error\r\n" + framed.encode() + body,
        b"HTTP/1.1 400 Bad Request\r\n" + framed.encode() + body,
    ]


class EchoingIngress(TaskServer):
    """An HTTP/1.1 server on a real socket whose answers quote the request's Authorization
    header (`script(auth)`: one answer per request, in order; the connection is closed after
    each). Keeps each request's Authorization."""

    def __init__(self, script: Callable[[str], list[bytes]]) -> None:
        super().__init__()
        self.script = script
        self.authorizations: list[str] = []

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            fields = dict(
                (name.strip().lower(), value.strip())
                for name, _, value in (line.partition(":") for line in head.split("\r\n")[1:])
            )
            await reader.readexactly(int(fields.get("content-length", "0")))
            auth = fields.get("authorization", "")
            self.authorizations.append(auth)
            answers = self.script(auth)
            writer.write(answers[min(len(self.authorizations), len(answers)) - 1])
            await writer.drain()
        writer.close()


def assert_clean(text: str, where: str, needles: tuple[str, ...]) -> None:
    for needle in needles:
        at = text.find(needle)
        assert at == -1, f"a secret leaked into {where}: ...{text[max(0, at - 200) : at + 60]}..."


def stored(conn: psycopg.Connection[Any], schema: str) -> str:
    """Every row of every table of the schema, as text: wherever an error may be stored."""
    tables = conn.execute(
        "select tablename from pg_tables where schemaname = %s", (schema,)
    ).fetchall()
    rows = []
    for (table,) in tables:
        query = sql.SQL("select to_jsonb(t)::text from {} t").format(sql.Identifier(schema, table))
        rows += [r[0] for r in conn.execute(query).fetchall()]
    return "\n".join(rows)


@pytest.mark.parametrize("http_transport", HTTP_TRANSPORTS)
@pytest.mark.parametrize("credential", ["token", "userinfo"])
async def test_an_ingress_echoing_the_credentials_gets_them_nowhere(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], credential: str, http_transport: str
) -> None:
    """End to end (issue 48 item 4): the ingress quotes the Authorization it got in a malformed
    head, a 500 and a 400. The credential (a bearer token, or an ingress URL's userinfo sent
    as Basic credentials) shows nowhere: not in what the database stores (the run's last
    error, the failed event's), not in any log line (post_failed, retry_scheduled,
    run_blocked), not in `relay inspect` (text and JSON), not in the status page's
    /api/runs/<id>. Each shows the echo, with *** in place of the secret."""
    ingress = EchoingIngress(echoes)
    basic = base64.b64encode(f"relay:{URL_PASSWORD}".encode()).decode()
    needles = (CANARY, basic)
    stream = io.StringIO()
    async with ingress.serving() as url:
        flags: dict[str, str] = {"ingress_token": TOKEN} if credential == "token" else {}
        if credential == "userinfo":
            url = url.replace("http://", f"http://relay:{URL_PASSWORD}@")
        cfg = settings(
            pg_url, schema, url, http_transport=http_transport, max_backoff="0.2s",
            metrics_addr="127.0.0.1:0", ui_token=UI_TOKEN, log_level="debug", **flags,
        )  # fmt: skip
        enqueue_some(conn, schema, 1, 1, prefix="echo")
        logs.configure("json", "debug", stream)
        try:
            async with Relay(cfg).running() as r:
                await wait_for(lambda: count(conn, schema, "state = 'failed'") == 1, what="poison")
                assert r.endpoints is not None
                async with httpx.AsyncClient() as client:
                    page = await client.get(
                        f"http://127.0.0.1:{r.endpoints.port}/api/runs/echo0",
                        headers={"authorization": f"Bearer {UI_TOKEN}"},
                    )
        finally:
            logs.configure("json", "warning")
    # The requests carried the secret, and the ingress echoed it three times.
    assert len(ingress.authorizations) == 3
    sent = {"token": f"Bearer {TOKEN}", "userinfo": f"Basic {basic}"}[credential]
    assert set(ingress.authorizations) == {sent}
    shown = sent.split(" ")[0] + " ***"
    checks = {
        "the database": stored(conn, schema),
        "the logs": stream.getvalue(),
        "/api/runs/echo0": page.text,
    }
    env = relay_env(pg_url, schema)
    for args in (("inspect", "echo0"), ("inspect", "echo0", "--json")):
        with anyio.fail_after(60):
            out = await anyio.run_process([*RELAY, *args], env=env, check=False)
        assert out.returncode == 0, out.stderr.decode()
        checks["relay " + " ".join(args)] = out.stdout.decode() + out.stderr.decode()
    for where, text in checks.items():
        assert_clean(text, where, needles)
        assert shown in text, f"{where} does not show the echo: {text[:2000]}"
    log = checks["the logs"]
    for event in ("post_failed", "run_blocked"):
        assert f'"event":"{event}"' in log, event
    assert "illegal header line" in log or "Invalid header token" in log, "the malformed head"


# --- item 4: a configured endpoint's URL is shown redacted --------------------------------

OTLP_PASSWORD = f"otlp-{uuid.uuid4().hex}-pw"


@pytest.mark.parametrize(
    "variable", ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
)
def test_the_otlp_endpoints_password_is_in_no_error(variable: str) -> None:
    """A collector URL of the wrong scheme is refused naming the variable and showing the URL,
    its password redacted (issue 48 item 4: it was shown as given)."""
    environ = {variable: f"ftp://otel:{OTLP_PASSWORD}@collector:4318"}
    with pytest.raises(ConfigError) as info:
        config_from_env(environ)
    assert variable in str(info.value) and "collector:4318" in str(info.value)
    assert OTLP_PASSWORD not in str(info.value)


def test_the_tracing_on_line_shows_the_endpoint_without_its_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The `tracing_on` line names the collector it exports to, its userinfo redacted; the SDK
    still reads the endpoint as given from the environment."""
    endpoint = f"http://otel:{OTLP_PASSWORD}@127.0.0.1:4318"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    stream = io.StringIO()
    logs.configure("json", "info", stream)
    try:
        tracer = start_tracing(os.environ)
    finally:
        logs.configure("json", "warning")
    assert tracer.shutdown(10)
    line = stream.getvalue()
    assert '"event":"tracing_on"' in line, line
    assert OTLP_PASSWORD not in line, line
    assert "http://***@127.0.0.1:4318/v1/traces" in line, line


def test_the_excerpt_is_scrubbed_whole_and_the_decision_reads_the_body_as_sent() -> None:
    """A secret across the excerpt's cut leaves no prefix behind; and a secret that happens to
    be part of what the answer says (a password `1` and `{"accepted": 1}`) changes only what
    people are shown, never what the answer means."""
    secret = "s3cr3t-" + uuid.uuid4().hex
    body = b"x" * (BODY_EXCERPT - 10) + secret.encode() + b" and more"
    cut = Answer(500, body, None, 0.01, secrets=(Secret(secret),))
    assert secret[:7] not in cut.excerpt and "x***" in cut.excerpt
    partial = Answer(200, b'{"accepted": 1}', None, 0.01, secrets=(Secret("1"),))
    now = datetime.now(UTC)
    assert decide(partial, 3, attempt=0, now=now, rand=0.5, cap=60.0) == Ack(1)
    assert partial.excerpt == '{"accepted": ***}'
