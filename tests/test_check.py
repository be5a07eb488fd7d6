"""`relay check`: one line per check and an exit code that says which failed, run as the real
CLI in a subprocess against real PostgreSQL and a real HTTP ingress."""

from __future__ import annotations

import base64
import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import anyio
import httpx
import orjson
import pytest

from relay.core.policy import Outcome, classify
from relay.ops.checks import (
    DATABASE,
    INGRESS,
    LISTEN,
    SCHEMA,
    Result,
    check_ingress,
    exit_code,
    scrub,
    transport_line,
)
from relay.settings import Settings, load
from relay.tools.sink import Sink, serve_sink
from tests.test_cli import RELAY, relay_env

pytestmark = pytest.mark.anyio

UNREACHABLE_DB = "postgresql://nobody@127.0.0.1:1/none"
UNREACHABLE_HTTP = "http://127.0.0.1:9"
URL = UNREACHABLE_HTTP + "/runs/{run_id}"


async def check(env: dict[str, str], *args: str) -> tuple[int, list[str]]:
    got = await anyio.run_process([*RELAY, "check", "--timeout", "3", *args], env=env, check=False)
    lines = got.stdout.decode().splitlines()
    assert got.stderr.decode().strip() == "", got.stderr.decode()
    return got.returncode, lines


def marks(lines: list[str]) -> dict[str, str]:
    return {line.split()[1]: line.split()[0] for line in lines}


def test_exit_code_is_a_sum_of_bits() -> None:
    results = [
        Result("configuration", True, ""),
        Result("database", False, ""),
        Result("schema", None, ""),
        Result("listen", None, ""),
        Result("ingress", False, ""),
    ]
    assert exit_code(results) == DATABASE | INGRESS == 36
    assert exit_code([Result("schema", False, ""), Result("listen", False, "")]) == 24
    assert exit_code([Result("configuration", True, "")]) == 0
    assert scrub("pw=s3cret tok=abc", ["s3cret", "abc"]) == "pw=*** tok=***"


async def test_all_checks_pass(pg_url: str, schema: str, sink: tuple[Sink, str]) -> None:
    _, url = sink
    code, lines = await check(relay_env(pg_url, schema, url))
    assert code == 0, lines
    assert [line.split()[:2] for line in lines] == [
        ["ok", "configuration"],
        ["ok", "database"],
        ["ok", "schema"],
        ["ok", "listen"],
        ["ok", "ingress"],
    ]


async def test_invalid_configuration_is_one_line_and_code_2(pg_url: str) -> None:
    env = relay_env(pg_url, "relay", UNREACHABLE_HTTP, RELAY_BATCH_SIZE="lots")
    code, lines = await check(env)
    assert code == 2
    assert (
        len(lines) == 1 and lines[0].startswith("FAIL configuration") and "batch_size" in lines[0]
    )


@pytest.mark.parametrize(
    ("setting", "running"), [("asyncio", "asyncio"), ("uvloop", "uvloop"), ("auto", "uvloop")]
)
async def test_the_event_loop_setting_chooses_the_loop_the_checks_run_on(
    setting: str, running: str
) -> None:
    """The configuration line names the loop the checks ran on, the one `relay run` would
    choose (uvloop is installed here: `auto` takes it). Issue 52 item 1."""
    env = relay_env(UNREACHABLE_DB, "relay", UNREACHABLE_HTTP, RELAY_EVENT_LOOP=setting)
    _, lines = await check(env)
    assert marks(lines)["configuration"] == "ok", lines
    assert lines[0].endswith(f" event_loop={running}"), lines


@pytest.mark.parametrize(
    ("variables", "said"),
    [
        ({}, "transport=aiohttp keepalive=on (the default: aiohttp's"),
        (
            {"RELAY_HTTP_TRANSPORT": "httpx"},
            "transport=httpx keepalive=off (the default with httpx's own transport",
        ),
        (
            {"RELAY_HTTP_TRANSPORT": "httpx", "RELAY_INGRESS_KEEPALIVE": "false"},
            "transport=httpx keepalive=off (ingress_keepalive=false",
        ),
    ],
)
async def test_the_configuration_line_names_the_keepalive_in_force(
    variables: dict[str, str], said: str
) -> None:
    """The configuration line says which transport carries the POSTs and whether a connection
    carries more than one, and why, as `relay run` decides (issue 48 item 1); the client's own
    line about it (`http_transport_chosen`) is not said on stderr as well (`check` holds it
    empty)."""
    env = relay_env(UNREACHABLE_DB, "relay", UNREACHABLE_HTTP, **variables)
    _, lines = await check(env)
    assert said in lines[0], lines


def test_over_httpxs_own_transport_keepalive_is_off_unless_set() -> None:
    """What the configuration line says over httpx's own transport: off by default, naming the
    hazard; on when set, naming it too; and `http2=true` takes that transport."""
    for flags, said in [
        ({"http_transport": "httpx"}, "keepalive=off (the default with httpx's own transport"),
        ({"http2": "true"}, "transport=httpx keepalive=off"),
        ({"http_transport": "httpx", "ingress_keepalive": "true"}, "keepalive=on (ingress_kee"),
    ]:
        cfg = load({"database_url": UNREACHABLE_DB, "ingress_url": URL, **flags}, {})
        line = transport_line(cfg)
        assert said in line and "docs/security.md" in line, line


async def test_a_bad_event_loop_is_refused_by_name() -> None:
    env = relay_env(UNREACHABLE_DB, "relay", UNREACHABLE_HTTP, RELAY_EVENT_LOOP="trio")
    code, lines = await check(env)
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("FAIL configuration"), lines
    assert "event_loop" in lines[0] and "trio" in lines[0], lines


async def test_database_and_ingress_down(pg_url: str) -> None:
    env = relay_env(UNREACHABLE_DB, "relay", UNREACHABLE_HTTP)
    code, lines = await check(env)
    assert code == DATABASE | INGRESS, lines
    assert marks(lines) == {
        "configuration": "ok",
        "database": "FAIL",
        "schema": "skip",
        "listen": "skip",
        "ingress": "FAIL",
    }


async def test_schema_missing(pg_url: str, sink: tuple[Sink, str]) -> None:
    _, url = sink
    code, lines = await check(relay_env(pg_url, "t_not_migrated", url))
    assert code == SCHEMA, lines
    assert "run `relay migrate`" in lines[2]


async def test_listen_connection_unusable(pg_url: str, schema: str, sink: tuple[Sink, str]) -> None:
    _, url = sink
    env = relay_env(pg_url, schema, url, RELAY_LISTEN_DATABASE_URL=UNREACHABLE_DB)
    code, lines = await check(env)
    assert code == LISTEN, lines
    assert marks(lines)["listen"] == "FAIL"


async def test_ingress_rejecting_credentials() -> None:
    seen: list[httpx.Request] = []

    def app(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(401)

    s = load(
        {"database_url": UNREACHABLE_DB, "ingress_url": "https://ingress.test/runs/{run_id}/e",
         "ingress_token": "tok-wrong"},
        environ={},
    )  # fmt: skip
    got = await check_ingress(s, 3.0, transport=httpx.MockTransport(app))
    assert got.ok is False and "401" in got.detail and "tok-wrong" not in got.line()
    assert "fix ingress_token" in got.detail
    # A POST like relay run's, of an empty batch: nothing is delivered by a check.
    assert seen[0].method == "POST"
    assert orjson.loads(seen[0].content) == {"run_id": "relay-check", "epoch": 0, "events": []}
    assert seen[0].headers["authorization"] == "Bearer tok-wrong"
    assert seen[0].headers["relay-lease-epoch"] == "0"
    assert seen[0].url.path == "/runs/relay-check/e"


# --- issue 41 item 3: what relay run would pause its lane for fails the check ------------------


@dataclass
class Answering:
    """A real HTTP server on a socket that answers every request with one status."""

    url: str
    requests: list[tuple[str, str, bytes]]  # method, path, body


@contextmanager
def answering(status: int, location: str | None = None) -> Iterator[Answering]:
    requests: list[tuple[str, str, bytes]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            requests.append((self.command, self.path, self.rfile.read(length)))
            self.send_response(status)
            if location is not None:
                self.send_header("location", location)
            self.send_header("content-length", "0")
            self.end_headers()

        do_HEAD = do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Answering(f"http://127.0.0.1:{server.server_address[1]}", requests)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def probe_settings(ingress: str, **more: str) -> Settings:
    flags = {"database_url": UNREACHABLE_DB, "ingress_url": ingress + "/runs/{run_id}/events"}
    return load({**flags, **more}, environ={})


MISCONFIGURED = {
    301: "set ingress_url to where it points",
    302: "set ingress_url to where it points",
    307: "set ingress_url to where it points",
    308: "set ingress_url to where it points",
    401: "fix ingress_token",
    403: "fix ingress_token",
    404: "fix ingress_url",
    405: "fix ingress_url",
    410: "fix ingress_url",
}


@pytest.mark.parametrize("status", sorted(MISCONFIGURED))
async def test_an_answer_relay_run_pauses_for_fails_the_check(status: int) -> None:
    assert classify(status) is Outcome.MISCONFIGURED  # the one table relay run decides by
    with answering(status, location="https://u:pw@elsewhere.internal/x") as server:
        got = await check_ingress(probe_settings(server.url), 3.0)
    assert got.ok is False, got.line()
    assert f"answered {status}" in got.detail and MISCONFIGURED[status] in got.detail
    assert "pw" not in got.detail
    ((method, path, _),) = server.requests  # the redirect not followed
    assert (method, path) == ("POST", "/runs/relay-check/events")


@pytest.mark.parametrize("status", [200, 202, 204, 400, 409, 422, 429, 500, 503])
async def test_any_other_answer_proves_the_endpoint(status: int) -> None:
    assert classify(status) is not Outcome.MISCONFIGURED
    with answering(status) as server:
        got = await check_ingress(probe_settings(server.url), 3.0)
    assert got.ok is True, got.line()
    assert f"answered {status}" in got.detail


async def test_a_signed_probe_verifies_at_the_sink() -> None:
    """The reference ingress checks signatures before it judges the (empty) batch: the probe is
    signed like relay run's POSTs, and a wrong secret fails naming it."""
    secret = "whsec_" + base64.b64encode(b"k" * 32).decode()
    wrong = "whsec_" + base64.b64encode(b"w" * 32).decode()
    async with serve_sink(Sink(signing_secrets=[secret])) as url:
        ok = await check_ingress(probe_settings(url, signing_secret=secret), 3.0)
        bad = await check_ingress(probe_settings(url, signing_secret=wrong), 3.0)
    assert ok.ok is True and "answered 400" in ok.detail, ok.line()  # the empty batch, judged
    assert bad.ok is False and "answered 401" in bad.detail, bad.line()
    assert "fix ingress_token or signing_secret" in bad.detail


async def test_relay_check_fails_a_wrong_ingress_path(
    pg_url: str, schema: str, sink: tuple[Sink, str]
) -> None:
    """The reported case: the right host, the wrong path (the sink answers 404)."""
    _, url = sink
    env = relay_env(pg_url, schema, RELAY_INGRESS_URL=url + "/v2/runs/{run_id}/events")
    code, lines = await check(env)
    assert code == INGRESS, lines
    assert marks(lines)["ingress"] == "FAIL"
    assert "answered 404" in lines[-1] and "fix ingress_url" in lines[-1], lines


async def test_relay_check_fails_a_wrong_batch_url(
    pg_url: str, schema: str, sink: tuple[Sink, str]
) -> None:
    _, url = sink
    env = relay_env(pg_url, schema, url, RELAY_INGRESS_BATCH_URL=url + "/batches")
    code, lines = await check(env)
    assert code == INGRESS, lines
    assert marks(lines) == {
        "configuration": "ok",
        "database": "ok",
        "schema": "ok",
        "listen": "ok",
        "ingress": "ok",
        "ingress_batch": "FAIL",
    }
    assert "fix ingress_batch_url" in lines[-1], lines
    # The right one passes.
    code, lines = await check(
        relay_env(pg_url, schema, url, RELAY_INGRESS_BATCH_URL=url + "/batch")
    )
    assert code == 0, lines


@pytest.mark.parametrize("token", [None, "tok-123"])
async def test_the_check_sends_the_configured_token_not_the_urls_userinfo(
    token: str | None,
) -> None:
    """Issue 40: `relay check` sent a URL's userinfo as Basic auth in place of the configured
    token (httpx's client on its path, the relay's senders on the other). It now goes through
    the relay's one client: the token when one is set, else the userinfo as Basic auth; the URL
    sent never carries the userinfo."""
    seen: list[httpx.Request] = []

    def app(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200)

    flags = {
        "database_url": UNREACHABLE_DB,
        "ingress_url": "https://us%40er:p%3Ass@ingress.test/runs/{run_id}/e",
    }
    if token:
        flags["ingress_token"] = token
    got = await check_ingress(load(flags, environ={}), 3.0, transport=httpx.MockTransport(app))
    assert got.ok, got.line()
    (request,) = seen
    assert request.url.userinfo == b""
    basic = "Basic " + base64.b64encode(b"us@er:p:ss").decode()
    assert request.headers["authorization"] == (f"Bearer {token}" if token else basic)


async def test_an_ingress_whose_answers_relay_run_cannot_trust_fails_the_check() -> None:
    """Issue 40: an empty 200 ended only by the connection's close cannot be told from a reset
    (relay/core/policy.py), so `relay run` would retry every batch and deliver none; `relay check`
    says so rather than `ok`."""
    import asyncio

    from tests.test_security import RawIngress

    async def unframed(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n")
        await writer.drain()
        writer.close()

    async with RawIngress(unframed).serving() as url:
        s = load(
            {"database_url": UNREACHABLE_DB, "ingress_url": url + "/runs/{run_id}/e"}, environ={}
        )
        got = await check_ingress(s, 5.0)
    assert got.ok is False, got.line()
    assert "frame the answers" in got.detail
