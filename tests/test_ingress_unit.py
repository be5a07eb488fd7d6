"""Unit tests for the pure parts of relay.edges.ingress (DESIGN §5): URL rendering, the body, the
Standard Webhooks id and signature, and the request headers. No network: the one request test
goes through an in-process httpx.MockTransport."""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from urllib.parse import unquote, urlsplit

import anyio
import httpx
import orjson
import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from relay import __version__
from relay.edges.http_client import HttpxSender, Reply, open_sender
from relay.edges.ingress import (
    MAX_BODY,
    USER_AGENT,
    Answer,
    Batch,
    IngressClient,
    TransportFailure,
    encode_body,
    encode_group,
    group_webhook_id,
    render_url,
    sign,
    webhook_id,
)
from relay.edges.store import ClaimedEvent
from relay.settings import ConfigError, Secret, Settings, load

TEMPLATE = "https://ingress.internal/runs/{run_id}/events"
CLAIMED_AT = datetime(2024, 5, 17, 12, 0, 0, tzinfo=UTC)
WHSEC = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def event(
    seq: int,
    *,
    payload: str = '{"n": 1}',
    terminal: bool = False,
    traceparent: str | None = None,
    event_type: str = "step.finished",
) -> ClaimedEvent:
    return ClaimedEvent(
        seq=seq,
        event_id=f"ev-{seq}",
        event_type=event_type,
        payload=payload,
        terminal=terminal,
        created_at=CLAIMED_AT - timedelta(seconds=100 - seq, microseconds=123),
        traceparent=traceparent,
        wake_queue=None,
    )


def batch(
    run_id: str = "run-1",
    events: list[ClaimedEvent] | None = None,
    *,
    epoch: int = 3,
    timestamp: datetime = CLAIMED_AT,
) -> Batch:
    return Batch(run_id, epoch, events if events is not None else [event(1), event(2)], timestamp)


def settings(**env: str) -> Settings:
    return load(
        {},
        {
            "RELAY_DATABASE_URL": "postgresql://app:pw@db/ledger",
            "RELAY_INGRESS_URL": TEMPLATE,
            **env,
        },
    )


# --- render_url ---------------------------------------------------------------------------------

HOSTILE_RUN_IDS = [
    "run-1",
    "a/b",
    "/",
    "../../admin",
    "..",
    ".",
    "...",
    "a/../b",
    "%2F",
    "%",
    "100%",
    "a?b=c",
    "?",
    "a#frag",
    "#",
    "a;b",
    "a&b=c",
    "'\"`",
    "a b",
    " ",
    "+",
    "\\..\\",
    "é",
    "日本語",
    "🚀",
    "\x00",
    "a\x01\x1f\x7fb",
    "line\r\nHost: evil",
    "\t",
    "@evil.example",
    "{run_id}",
    "~user",
]


def run_id_from(url: str, template: str = TEMPLATE) -> str:
    """The run id back out of a rendered URL, checking nothing else of the URL moved."""
    expected = urlsplit(template.replace("{run_id}", "X"))
    parts = urlsplit(url)
    assert (parts.scheme, parts.netloc, parts.query, parts.fragment) == (
        expected.scheme,
        expected.netloc,
        expected.query,
        expected.fragment,
    )
    segments = parts.path.split("/")
    assert len(segments) == len(expected.path.split("/"))
    i = expected.path.split("/").index("X")
    assert [s for j, s in enumerate(segments) if j != i] == [
        s for j, s in enumerate(expected.path.split("/")) if j != i
    ]
    return unquote(segments[i], errors="strict")


@pytest.mark.parametrize("run_id", HOSTILE_RUN_IDS)
def test_render_url_never_changes_the_path(run_id: str) -> None:
    url = render_url(TEMPLATE, run_id)
    assert url.isascii()
    assert not any(c in url for c in " \t\r\n\x00\x7f")
    assert run_id_from(url) == run_id


@pytest.mark.parametrize("run_id", HOSTILE_RUN_IDS)
def test_httpx_sends_the_path_unchanged(run_id: str) -> None:
    # httpx removes "." and ".." segments (RFC 3986 §5.2.4): a run id may never be one.
    url = httpx.URL(render_url(TEMPLATE, run_id))
    assert url.host == "ingress.internal"
    raw = url.raw_path.decode("ascii")
    assert raw.startswith("/runs/")
    assert raw.endswith("/events")
    assert unquote(raw[len("/runs/") : -len("/events")], errors="strict") == run_id


@hsettings(deadline=None)  # no wall-clock threshold: the machine may be busy
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30))
def test_render_url_roundtrips_any_run_id(run_id: str) -> None:
    url = render_url(TEMPLATE, run_id)
    assert run_id_from(url) == run_id
    raw = httpx.URL(url).raw_path.decode("ascii")
    assert unquote(raw[len("/runs/") : -len("/events")], errors="strict") == run_id


def test_render_url_keeps_plain_ids_readable() -> None:
    assert render_url(TEMPLATE, "run-42_a.b~c") == (
        "https://ingress.internal/runs/run-42_a.b~c/events"
    )


def test_render_url_fills_every_placeholder() -> None:
    url = render_url("https://i/runs/{run_id}/events?run={run_id}", "a/b")
    assert url == "https://i/runs/a%2Fb/events?run=a%2Fb"


# --- encode_body --------------------------------------------------------------------------------


def test_body_has_the_design_shape_in_seq_order() -> None:
    events = [event(5), event(6), event(7, terminal=True, event_type="run.completed")]
    c = batch("run-9", events, epoch=12)
    body = orjson.loads(encode_body(c))
    assert list(body) == ["run_id", "epoch", "events"]
    assert body["run_id"] == "run-9"
    assert body["epoch"] == 12
    assert [e["seq"] for e in body["events"]] == [5, 6, 7]
    for got, sent in zip(body["events"], events, strict=True):
        assert list(got) == ["event_id", "seq", "type", "terminal", "payload", "created_at"]
        assert got["event_id"] == sent.event_id
        assert got["type"] == sent.event_type
        assert got["terminal"] is sent.terminal
        assert got["payload"] == {"n": 1}
        assert datetime.fromisoformat(got["created_at"]) == sent.created_at
    assert body["events"][-1]["terminal"] is True


def test_a_naive_created_at_is_sent_as_utc() -> None:
    """The store reads created_at in UTC without a zone (a timestamptz costs ~3 us a value to
    load into the session's zone): the body still carries it with its offset, +00:00."""
    naive = datetime(2026, 12, 2, 12, 56, 42, 450426)
    events = [event(1)._replace(created_at=naive)]
    body = orjson.loads(encode_body(batch(events=events)))
    assert body["events"][0]["created_at"] == "2026-12-02T12:56:42.450426+00:00"


@pytest.mark.parametrize(
    "payload",
    [
        "{}",
        '{"n": 1}',
        '{"a": [1, 2.50, 1e400], "b": {"c": null}}',  # numbers jsonb keeps, Python would not
        '{"text": "é \\u00e9 \\ud83d\\ude80 \\"q\\" \\n"}',
        '{"big": 123456789012345678901234567890}',
        '{"z": 1, "a": 2}',
    ],
)
def test_payload_is_embedded_verbatim(payload: str) -> None:
    events = [event(1, payload=payload)]
    body = encode_body(batch(events=events))
    assert b'"payload":' + payload.encode() + b',"created_at"' in body


def test_body_is_stable_for_a_retry() -> None:
    events = [event(1), event(2)]
    assert encode_body(batch(events=events)) == encode_body(batch(events=events))


def test_body_run_id_is_plain_json_text() -> None:
    run_id = 'a/"b"\\\n\x00é'
    events = [event(1)]
    assert orjson.loads(encode_body(batch(run_id, events)))["run_id"] == run_id


# --- webhook_id ---------------------------------------------------------------------------------


def test_webhook_id_is_stable_across_retries_of_the_same_batch() -> None:
    a = batch("run-1", [event(3), event(4)], epoch=1)
    later = CLAIMED_AT + timedelta(seconds=99)
    b = batch("run-1", [event(3, payload='{"x": 2}'), event(4)], epoch=2, timestamp=later)
    assert webhook_id(a) == webhook_id(b)
    assert webhook_id(a).startswith("msg_")


@pytest.mark.parametrize(
    ("run_id", "seqs"),
    [("run-2", [3, 4]), ("run-1", [3]), ("run-1", [4]), ("run-1", [2, 4]), ("run-1", [3, 5])],
)
def test_webhook_id_differs_for_another_run_or_seq_range(run_id: str, seqs: list[int]) -> None:
    base = batch("run-1", [event(3), event(4)])
    other = batch(run_id, [event(s) for s in seqs])
    assert webhook_id(other) != webhook_id(base)


@hsettings(deadline=None)  # no wall-clock threshold: the machine may be busy
@given(
    st.tuples(st.text(max_size=8), st.integers(0, 99), st.integers(0, 99)),
    st.tuples(st.text(max_size=8), st.integers(0, 99), st.integers(0, 99)),
)
def test_webhook_id_is_injective(
    a: tuple[str, int, int],
    b: tuple[str, int, int],
) -> None:
    # Separators inside run ids ("\x1f") must not make two batches share an id.
    ca = batch(a[0], [event(a[1]), event(a[2])])
    cb = batch(b[0], [event(b[1]), event(b[2])])
    assert (webhook_id(ca) == webhook_id(cb)) == (a == b)


# --- sign: Standard Webhooks --------------------------------------------------------------------


def test_sign_reproduces_the_standard_webhooks_test_vector() -> None:
    # From the Standard Webhooks specification and its reference libraries.
    signature = sign(
        [Secret(WHSEC)], "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, b'{"test": 2432232314}'
    )
    assert signature == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_sign_with_two_secrets_gives_two_signatures() -> None:
    other = "whsec_" + base64.b64encode(b"a rotated-in key, 32 bytes long!").decode()
    args = ("msg_1", 1700000000, b'{"run_id":"r"}')
    both = sign([Secret(WHSEC), Secret(other)], *args)
    first, second = both.split(" ")
    assert first == sign([Secret(WHSEC)], *args)
    assert second == sign([Secret(other)], *args)
    assert first != second
    expected = hmac.new(
        base64.b64decode(other.removeprefix("whsec_")),
        b'msg_1.1700000000.{"run_id":"r"}',
        hashlib.sha256,
    ).digest()
    assert second == "v1," + base64.b64encode(expected).decode()


def test_sign_without_secrets_is_empty() -> None:
    assert sign([], "msg_1", 1, b"{}") == ""


@asynccontextmanager
async def mock(
    handler: Callable[[httpx.Request], httpx.Response] | None = None,
) -> AsyncIterator[HttpxSender]:
    """The httpx sender over an in-process transport (what `Relay(transport=...)` uses)."""
    transport = httpx.MockTransport(handler or (lambda r: httpx.Response(200)))
    async with httpx.AsyncClient(transport=transport) as client:
        yield HttpxSender(client)


# --- IngressClient.headers ----------------------------------------------------------------------


def test_user_agent_carries_the_version() -> None:
    assert USER_AGENT == f"ledger-relay/{__version__}"


@pytest.mark.anyio
async def test_headers_minimal() -> None:
    async with mock() as http:
        client = IngressClient(settings(), http)
        events = [event(1), event(2, traceparent=TRACEPARENT)]
        c = batch(events=events, epoch=41)
        h = client.headers(c, encode_body(c))
    assert h == {
        "content-type": "application/json",
        "user-agent": f"ledger-relay/{__version__}",
        "relay-lease-epoch": "41",
    }  # no authorization, no traceparent (only the first event's counts), no webhook-*


@pytest.mark.anyio
async def test_headers_with_token_traceparent_and_signature() -> None:
    async with mock() as http:
        client = IngressClient(
            settings(RELAY_INGRESS_TOKEN="tok-123", RELAY_SIGNING_SECRET=WHSEC), http
        )
        events = [event(1, traceparent=TRACEPARENT), event(2)]
        c = batch(events=events, epoch=2)
        body = encode_body(c)
        h = client.headers(c, body)
    assert h["authorization"] == "Bearer tok-123"
    assert h["traceparent"] == TRACEPARENT
    assert h["relay-lease-epoch"] == "2"
    assert h["webhook-id"] == webhook_id(c)
    ts = int(CLAIMED_AT.timestamp())
    assert h["webhook-timestamp"] == str(ts)
    assert h["webhook-signature"] == sign([Secret(WHSEC)], h["webhook-id"], ts, body)
    key = base64.b64decode(WHSEC.removeprefix("whsec_"))
    mac = hmac.new(key, f"{h['webhook-id']}.{ts}.".encode() + body, hashlib.sha256).digest()
    assert h["webhook-signature"] == "v1," + base64.b64encode(mac).decode()


@pytest.mark.anyio
async def test_webhook_timestamp_is_the_batch_s_database_time() -> None:
    """The caller says what the database's clock reads (relay.edges.store.Claim.database_time): the
    client signs that, and never reads a lease."""
    async with mock() as http:
        client = IngressClient(settings(RELAY_SIGNING_SECRET=WHSEC), http)
        c = batch(events=[event(1)], timestamp=CLAIMED_AT + timedelta(seconds=120.9))
        h = client.headers(c, encode_body(c))
    assert h["webhook-timestamp"] == str(int(CLAIMED_AT.timestamp()) + 120)


@pytest.mark.anyio
async def test_headers_token_only() -> None:
    async with mock() as http:
        client = IngressClient(settings(RELAY_INGRESS_TOKEN="tok-123"), http)
        events = [event(1)]
        c = batch(events=events)
        h = client.headers(c, encode_body(c))
    assert h["authorization"] == "Bearer tok-123"
    assert not any(k.startswith("webhook-") for k in h)


# --- one request, in process --------------------------------------------------------------------


@pytest.mark.anyio
async def test_post_sends_the_rendered_url_body_and_headers() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        request.read()
        seen.append(request)
        return httpx.Response(200, json={"accepted": 1}, headers={"retry-after": "5"})

    async with mock(handler) as http:
        client = IngressClient(settings(RELAY_INGRESS_TOKEN="tok-123"), http)
        events = [event(1), event(2)]
        c = batch("../a b", events)
        answer = await client.post(c)
    assert answer.status == 200
    assert orjson.loads(answer.body) == {"accepted": 1}
    assert answer.retry_after == "5"
    (request,) = seen
    assert request.method == "POST"
    assert request.url.raw_path == b"/runs/..%2Fa%20b/events"
    assert request.content == encode_body(c)
    assert request.headers["authorization"] == "Bearer tok-123"
    assert request.headers["relay-lease-epoch"] == "3"


@pytest.mark.anyio
@pytest.mark.parametrize("token", [None, "tok-123"])
async def test_url_userinfo_becomes_basic_auth_unless_a_token_is_set(token: str | None) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200)

    env = {"RELAY_INGRESS_URL": "http://us%40er:p%3Ass@ingress.test/runs/{run_id}/events"}
    if token:
        env["RELAY_INGRESS_TOKEN"] = token
    async with mock(handler) as http:
        client = IngressClient(settings(**env), http)
        events = [event(1)]
        assert (await client.post(batch(events=events))).status == 200
    (request,) = seen
    assert request.url.userinfo == b""  # never in the URL sent
    expected = "Bearer tok-123" if token else "Basic " + base64.b64encode(b"us@er:p:ss").decode()
    assert request.headers["authorization"] == expected


class _Drip(httpx.AsyncByteStream):
    """A streamed answer far longer than the relay will read."""

    def __init__(self) -> None:
        self.sent = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for _ in range(1000):
            self.sent += 1
            yield b"x" * 1024


@pytest.mark.anyio
@pytest.mark.parametrize("streamed", [True, False])
async def test_post_reads_at_most_max_body(streamed: bool) -> None:
    drip = _Drip()

    def handler(request: httpx.Request) -> httpx.Response:
        if streamed:
            return httpx.Response(400, stream=drip)
        return httpx.Response(400, content=b"y" * (MAX_BODY * 4))

    async with mock(handler) as http:
        client = IngressClient(settings(), http)
        events = [event(1)]
        answer = await client.post(batch(events=events))
    assert answer.status == 400
    assert len(answer.body) == MAX_BODY
    if streamed:
        assert drip.sent < 1000  # stopped reading, did not drain the rest


@pytest.mark.anyio
async def test_an_app_owned_transport_is_taken_as_is_and_left_open() -> None:
    """IngressClient takes an httpx transport in place of a sender; the relay POSTs through it
    (never through a proxy from the environment) and does not close what it does not own."""
    seen: list[httpx.Request] = []
    closed: list[bool] = []

    class Transport(httpx.MockTransport):
        async def aclose(self) -> None:
            closed.append(True)

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200)

    transport = Transport(handler)
    events = [event(1)]
    async with open_sender(settings(), 1, transport) as sender:
        client = IngressClient(settings(), sender)
        assert (await client.post(batch(events=events))).status == 200
    (request,) = seen
    assert request.headers["host"] == "ingress.internal"
    assert request.headers["content-length"] == str(len(request.content))
    assert closed == []


# --- the multi-run POST (ingress_batch_url) -----------------------------------------------------

BATCH_URL = "https://ingress.internal/batches"


@pytest.mark.anyio
@pytest.mark.parametrize("signed", [False, True])
async def test_post_group_sends_the_same_headers_as_a_single_run_post_but_the_epoch(
    signed: bool,
) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        request.read()
        seen.append(request)
        return httpx.Response(200, json={"results": []})

    env = {"RELAY_INGRESS_BATCH_URL": BATCH_URL, "RELAY_INGRESS_TOKEN": "tok-123"}
    if signed:
        env["RELAY_SIGNING_SECRET"] = WHSEC
    later = CLAIMED_AT + timedelta(seconds=7)  # the second batch's: the first one's counts
    batches = [
        batch("a", [event(1)]),
        batch("b", [event(1, traceparent=TRACEPARENT), event(2)], timestamp=later),
    ]
    async with mock(handler) as http:
        answer = await IngressClient(settings(**env), http).post_group(batches)
    assert answer.status == 200
    (request,) = seen
    assert str(request.url) == BATCH_URL
    body = encode_group(batches)
    assert request.content == body
    h = request.headers
    assert h["content-type"] == "application/json"
    assert h["user-agent"] == USER_AGENT
    assert h["authorization"] == "Bearer tok-123"
    assert h["traceparent"] == TRACEPARENT  # the first batch that carries one
    assert "relay-lease-epoch" not in h  # one per run, in the body
    if signed:
        ts = int(CLAIMED_AT.timestamp())
        assert h["webhook-id"] == group_webhook_id(batches)
        assert h["webhook-timestamp"] == str(ts)
        assert h["webhook-signature"] == sign([Secret(WHSEC)], h["webhook-id"], ts, body)
    else:
        assert not any(k.startswith("webhook-") for k in h)


@pytest.mark.anyio
async def test_post_group_answers_run_by_run_from_a_2xx_reply_else_as_a_whole() -> None:
    """DESIGN §5: a 2xx multi-run reply's `results` answer run by run (a run it does not answer,
    or answers malformed, was not answered); any other reply is one answer for every run."""
    results = [
        {"run_id": "a", "status": 200, "accepted": 1},
        {"run_id": "b", "status": "200"},  # malformed: b was not answered
        {"run_id": "c", "status": 422, "rejected_event_id": "ev-1"},
        {"run_id": "x", "status": 200},  # not a run of this request
    ]
    status = 200

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json={"results": results})

    batches = [batch(r, [event(1)]) for r in ("a", "b", "c")]
    async with mock(handler) as http:
        client = IngressClient(settings(RELAY_INGRESS_BATCH_URL=BATCH_URL), http)
        split = await client.post_group(batches)
        status = 503
        failed = await client.post_group(batches)
    assert (split.status, split.whole) == (200, False)
    a, b, c = (split.per_run[r] for r in ("a", "b", "c"))
    assert isinstance(a, Answer) and (a.status, orjson.loads(a.body)) == (200, {"accepted": 1})
    assert isinstance(b, TransportFailure) and "no result for this run" in str(b)
    assert isinstance(c, Answer)
    assert (c.status, orjson.loads(c.body)) == (422, {"rejected_event_id": "ev-1"})
    assert (failed.status, failed.whole) == (503, True)
    assert failed.per_run == dict.fromkeys(["a", "b", "c"], failed.answer)


# --- the request observer (metrics hook in here, DESIGN §8.2) -----------------------------------


class _Refusing:
    """A sender with no answer (connection refused)."""

    async def send(self, url: str, body: bytes, headers: dict[str, str]) -> Reply:
        raise TransportFailure("ConnectError: refused")

    async def aclose(self) -> None:
        pass


class _Hanging:
    async def send(self, url: str, body: bytes, headers: dict[str, str]) -> Reply:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        pass


@pytest.mark.anyio
async def test_every_post_is_observed_once_single_and_multi_run() -> None:
    seen: list[tuple[int | None, float]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503 if request.url.path == "/batches" else 200)

    cfg = settings(RELAY_INGRESS_BATCH_URL=BATCH_URL)
    async with mock(handler) as http:
        client = IngressClient(cfg, http, on_request=lambda s, t: seen.append((s, t)))
        events = [event(1)]
        single = await client.post(batch(events=events))
        group = await client.post_group([batch("a", [event(1)]), batch("b", [event(1)])])
    assert [status for status, _ in seen] == [200, 503]
    assert [seconds for _, seconds in seen] == [single.seconds, group.answer.seconds]


@pytest.mark.anyio
async def test_a_post_without_an_answer_is_observed_as_none() -> None:
    seen: list[tuple[int | None, float]] = []
    events = [event(1)]
    refusing = IngressClient(settings(), _Refusing(), on_request=lambda s, t: seen.append((s, t)))
    with pytest.raises(TransportFailure, match="refused"):
        await refusing.post(batch(events=events))
    hanging = IngressClient(
        settings(RELAY_HTTP_TIMEOUT="0.05"), _Hanging(), on_request=lambda s, t: seen.append((s, t))
    )
    with pytest.raises(TransportFailure, match="timed out"):
        await hanging.post(batch(events=events))
    assert [status for status, _ in seen] == [None, None]
    assert seen[1][1] >= 0.05


# --- the request deadline (one timer for every request in flight) -------------------------------


class Stalling:
    """A sender that never answers a URL ending in /stall and answers 200 at once otherwise."""

    async def send(self, url: str, body: bytes, headers: dict[str, str]) -> Reply:
        if url.endswith("/stall"):
            await anyio.sleep_forever()
        return Reply(200, b"{}", None)

    async def aclose(self) -> None:
        pass


@pytest.mark.anyio
async def test_every_request_in_flight_is_cut_at_its_own_deadline() -> None:
    """Requests started at different times under one timer: each stalled one fails at its own
    deadline (the timer is armed again for the next after it fires, and again once the table
    was empty); answered ones leave the table at once and are never cut."""
    client = IngressClient(settings(RELAY_HTTP_TIMEOUT="0.3s"), Stalling())
    ended: dict[str, float] = {}

    async def post(name: str, url: str, after: float) -> None:
        await anyio.sleep(after)
        started = anyio.current_time()
        try:
            await client._send(url, b"{}", {})
        except TransportFailure as exc:
            assert str(exc) == "timed out after 0.3s"
            ended[name] = anyio.current_time() - started
        else:
            ended[name] = -1.0  # answered

    with anyio.fail_after(10):  # a hang (a deadline never enforced) fails here, not forever
        async with anyio.create_task_group() as tg:
            tg.start_soon(post, "a", "http://i/stall", 0.0)
            tg.start_soon(post, "b", "http://i/stall", 0.1)
            tg.start_soon(post, "ok", "http://i/ok", 0.15)
            tg.start_soon(post, "c", "http://i/stall", 0.2)
        async with anyio.create_task_group() as tg:  # after the table emptied
            tg.start_soon(post, "d", "http://i/stall", 0.0)
    assert ended["ok"] == -1.0
    for name in "abcd":
        assert ended[name] >= 0.3, (name, ended)  # never cut before its deadline
    assert not client.deadlines._scopes


def test_a_client_used_again_under_a_new_event_loop_still_cuts_its_requests() -> None:
    """The first loop ends with the deadline timer armed (its request was answered at once);
    that timer never fires. A stalled request under the next loop is cut all the same."""
    client = IngressClient(settings(RELAY_HTTP_TIMEOUT="0.3s"), Stalling())

    async def answered() -> None:
        await client._send("http://i/ok", b"{}", {})

    async def stalled() -> str:
        with anyio.fail_after(10):  # a hang fails here, not forever
            try:
                await client._send("http://i/stall", b"{}", {})
            except TransportFailure as exc:
                return str(exc)
        return "answered"

    anyio.run(answered)
    assert anyio.run(stalled) == "timed out after 0.3s"


@pytest.mark.anyio
@pytest.mark.parametrize("run_id", [".", ".."])
async def test_a_dot_segment_run_id_is_never_posted(run_id: str) -> None:
    """Enqueue refuses them (issue 40); one written before fails its POST, naming why and what
    to do, instead of going to another path (`..` removes the segment before it)."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200)

    async with mock(handler) as http:
        client = IngressClient(settings(), http)
        with pytest.raises(TransportFailure, match=r"dot segment.*relay skip"):
            await client.post(batch(run_id, [event(1)]))
    assert seen == []


# --- a fleet's POST names its database (issue 51 item 3) ----------------------------------------


@pytest.mark.anyio
async def test_a_fleet_post_names_its_database_in_a_header_the_signature_covers() -> None:
    async with mock() as http:
        alone = IngressClient(settings(RELAY_SIGNING_SECRET=WHSEC), http)
        shard = IngressClient(settings(RELAY_SIGNING_SECRET=WHSEC), http, database="shard-2")
        other = IngressClient(settings(RELAY_SIGNING_SECRET=WHSEC), http, database="shard-3")
        c = batch()
        body = encode_body(c)
        plain, named, named_other = (x.headers(c, body) for x in (alone, shard, other))
        group = [batch("a"), batch("b")]
        group_body = encode_group(group)
        group_named = shard.group_headers(group, group_body)
    assert "relay-database" not in plain  # the one-database form: as before
    assert plain["webhook-id"] == webhook_id(c)
    assert named["relay-database"] == "shard-2"
    assert group_named["relay-database"] == "shard-2"
    # One run id and seq range in two databases: two messages, and the id the signature covers
    # binds the name, so a verifier that recomputes it from the header sees a changed header.
    assert named["webhook-id"] == webhook_id(c, "shard-2") != webhook_id(c)
    assert named_other["webhook-id"] != named["webhook-id"]
    assert group_named["webhook-id"] == group_webhook_id(group, "shard-2")
    assert group_named["webhook-id"] != group_webhook_id(group)
    ts = int(CLAIMED_AT.timestamp())
    assert named["webhook-signature"] == sign([Secret(WHSEC)], named["webhook-id"], ts, body)


@pytest.mark.anyio
async def test_the_ingress_url_may_name_the_database() -> None:
    template = "https://ingress.internal/{database}/runs/{run_id}/events?db={database}"
    async with mock() as http:
        shard = IngressClient(settings(RELAY_INGRESS_URL=template), http, database="s1")
        alone = IngressClient(settings(RELAY_INGRESS_URL=template), http)
        assert shard.url(batch("r/1")) == "https://ingress.internal/s1/runs/r%2F1/events?db=s1"
        assert alone.url(batch("r")) == "https://ingress.internal/default/runs/r/events?db=default"
    assert render_url(TEMPLATE, "r", "s1") == "https://ingress.internal/runs/r/events"
    for refused in (
        "https://{database}.ingress.internal/runs/{run_id}/events",
        "https://ingress.internal/{db}/runs/{run_id}/events",
    ):
        with pytest.raises(ConfigError):
            settings(RELAY_INGRESS_URL=refused)
