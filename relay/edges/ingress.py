"""The ingress client: one POST per run prefix (DESIGN §5), sent through the relay's one HTTP
client (relay/edges/http_client.py, httpx).

Builds the exact body bytes once (payloads embedded as `orjson.Fragment`, never decoded),
signs them when a Standard Webhooks secret is configured, never follows redirects, reads at
most `MAX_BODY` bytes of the answer, and bounds the whole request with one deadline (httpx's
timeouts are per phase: a slow-drip server could otherwise hold a request open forever). It is
the door outside text comes in through: an answer's excerpt and a failure's text leave it
scrubbed of every secret the request could carry (issue 48 item 4).

The client sends plain request values (`Batch`: a run's id, epoch and events, and the database's
clock as it goes out): it never sees a lease, and imports nothing from relay/edges/store.py.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol
from urllib.parse import quote

import anyio
import httpx
import orjson

from relay import __version__
from relay.core import clock
from relay.core.policy import excerpt
from relay.databases import DEFAULT_NAME
from relay.edges.http_client import (
    MAX_BODY,
    CookielessClient,
    HttpxSender,
    Reply,
    Sender,
    TransportFailure,
    sent_secrets,
)
from relay.settings import Secret, Settings, scrub

__all__ = ["MAX_BODY", "Answer", "Batch", "GroupAnswer", "IngressClient", "TransportFailure"]

USER_AGENT = f"ledger-relay/{__version__}"
DOT_SEGMENTS = frozenset({".", ".."})


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes  # at most MAX_BODY bytes
    retry_after: str | None
    seconds: float
    truncated: bool = False  # the answer went on past MAX_BODY: `body` is cut
    unframed: bool = False  # only the connection's close ended it: a reset cannot be told apart
    # What the request carried that its answer may echo: scrubbed from the excerpt.
    secrets: tuple[Secret, ...] = field(default=(), repr=False, compare=False)

    @property
    def excerpt(self) -> str:
        """The start of the body, for errors, logs and the status page: the ingress's own text,
        which may echo the request's credentials (issue 48 item 4), so scrubbed of them, whole
        before it is cut (no secret straddles the cut). The body itself stays as sent: what the
        answer means never depends on a secret's text."""
        if not self.secrets:
            return excerpt(self.body)
        return excerpt(scrubbed(self.body.decode("utf-8", "replace"), self.secrets).encode())


@dataclass(frozen=True, slots=True)
class GroupAnswer:
    """A multi-run POST's answer (DESIGN §5): the reply to the request (`answer`, observed as one
    request) and what it says for each run (`per_run`). A 2xx reply carries each run's result;
    any other is one answer for the whole request (`whole`), standing for every run in it."""

    answer: Answer
    per_run: dict[str, Answer | TransportFailure]
    whole: bool

    @property
    def status(self) -> int:
        """The request's status, as a single run's answer has it."""
        return self.answer.status


def scrubbed(text: str, secrets: Sequence[Secret]) -> str:
    """Text from outside (an answer, a transport's error) with every secret a request may
    carry replaced by *** (relay.settings.scrub)."""
    return scrub(text, [s.reveal() for s in secrets])


class Event(Protocol):
    """An event as its POST carries it (relay.edges.store.ClaimedEvent is one)."""

    @property
    def seq(self) -> int: ...
    @property
    def event_id(self) -> str: ...
    @property
    def event_type(self) -> str: ...
    @property
    def payload(self) -> str: ...  # JSON text, embedded as it is
    @property
    def terminal(self) -> bool: ...
    @property
    def created_at(self) -> datetime: ...
    @property
    def traceparent(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class Batch:
    """One run's batch as a POST carries it (DESIGN §5): the request value this client sends.
    The lease it was claimed under stays with the caller, who builds it
    (relay/delivery/execute.py)."""

    run_id: str
    epoch: int
    events: Sequence[Event]  # at least one, in seq order
    timestamp: datetime  # the database's clock as the POST goes out: `webhook-timestamp`


def render_url(template: str, run_id: str, database: str = DEFAULT_NAME) -> str:
    """The URL of a run's POST: `{run_id}` and `{database}` (the name of the outbox database it
    came from, issue 51; `default` for the one-database form) filled in."""
    # safe="" encodes '/' too: a run id can never change the path. quote() leaves '.' alone,
    # and httpx removes "." and ".." segments (RFC 3986 dot-segment removal), so an id made
    # only of dots has them percent-encoded too. A database's name is [a-z0-9_-]: safe as it is.
    segment = quote(run_id, safe="")
    if segment and not segment.strip("."):
        segment = segment.replace(".", "%2E")
    return template.replace("{database}", database).replace("{run_id}", segment)


def render_group_url(template: str, database: str = DEFAULT_NAME) -> str:
    """The URL of a multi-run POST (`ingress_batch_url`): `{database}` filled in, as in
    `render_url` (a group's runs are all of one database)."""
    return template.replace("{database}", database)


def encode_body(batch: Batch) -> bytes:
    return orjson.dumps(
        {
            "run_id": batch.run_id,
            "epoch": batch.epoch,
            "events": [
                {
                    "event_id": e.event_id,
                    "seq": e.seq,
                    "type": e.event_type,
                    "terminal": e.terminal,
                    "payload": orjson.Fragment(e.payload),
                    "created_at": e.created_at,
                }
                for e in batch.events
            ],
        },
        option=orjson.OPT_NAIVE_UTC,  # created_at comes from the database naive, in UTC
    )


def webhook_id(batch: Batch, database: str | None = None) -> str:
    """Stable across retries of the same batch: the same run and seq range give the same id.
    A fleet's POSTs (`database` named, issue 51) hash the database's name in too: two databases'
    batches of one run id and seq range are two messages to an ingress that dedupes on the id,
    and the signature, which covers the id, covers the `relay-database` header's name with it."""
    key = f"{batch.run_id}\x1f{batch.events[0].seq}\x1f{batch.events[-1].seq}"
    if database is not None:
        key = f"{database}\x1f{key}"
    return "msg_" + hashlib.sha256(key.encode()).hexdigest()[:32]


def signature(key: bytes, msg_id: str, timestamp: int, body: bytes) -> bytes:
    """One Standard Webhooks signature: base64 HMAC-SHA256 over `{id}.{timestamp}.{body}`
    (the signer here and the verifier in relay/tools/sink/verify.py share it)."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest())


def sign(secrets: Sequence[Secret], msg_id: str, timestamp: int, body: bytes) -> str:
    """Standard Webhooks `webhook-signature`: space-separated `v1,<signature>`, one per secret
    (rotation)."""
    keys = [base64.b64decode(s.reveal().removeprefix("whsec_")) for s in secrets]
    return " ".join("v1," + signature(k, msg_id, timestamp, body).decode() for k in keys)


# Called once per POST, answered or not: the HTTP status (None: no answer) and its seconds.
RequestObserver = Callable[[int | None, float], None]


class Deadlines:
    """Every request's deadline under one timer. `fail_after` armed and cancelled a timer per
    POST: ~30 us of the relay's CPU per POST with 32 in flight (docs/performance.md), where the
    loop's heap of timers, most of them cancelled, is what costs. Here a request's scope is
    registered with its deadline, one timer waits for the earliest, and the requests past
    theirs are cancelled when it fires; a request that ends only leaves the table.

    The loop is asyncio's or uvloop's (relay/core/loop.py); anyio's own deadlines cancel their
    scopes from a loop callback in the same way. The deadlines are the hot paths' clock's
    (relay/core/clock.py), and uvloop's timers keep whole milliseconds of libuv's clock: the
    timer may fire before the earliest deadline has passed on the hot paths' clock, so a scope
    is cancelled only once that clock has reached its deadline, and the timer is armed again
    for what is left (tests/test_clock_loops.py)."""

    def __init__(self) -> None:
        self._scopes: dict[anyio.CancelScope, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, scope: anyio.CancelScope, deadline: float) -> None:
        self._scopes[scope] = deadline
        loop = asyncio.get_running_loop()
        if self._timer is None or deadline < self._timer_at or loop is not self._loop:
            self._loop = loop  # a client used under a new loop: its old timer never fires
            self._arm(deadline)

    def discard(self, scope: anyio.CancelScope) -> None:
        self._scopes.pop(scope, None)

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        assert self._loop is not None
        self._timer = self._loop.call_at(at, self._fire)
        self._timer_at = at

    def _fire(self) -> None:
        self._timer = None
        now = clock.now()
        for scope, deadline in list(self._scopes.items()):
            if deadline <= now:
                del self._scopes[scope]
                scope.cancel()
        if self._scopes:
            self._arm(min(self._scopes.values()))


class IngressClient:
    def __init__(
        self,
        settings: Settings,
        sender: Sender | httpx.AsyncBaseTransport,
        *,
        on_request: RequestObserver | None = None,
        database: str | None = None,
    ) -> None:
        self.settings = settings
        # The outbox database this client's batches come from, in a fleet (relay/fleet.py):
        # each POST names it in `relay-database`. None: the one-database form, no header.
        self.database = database
        if isinstance(sender, httpx.AsyncBaseTransport):  # e.g. an in-process app, in tests
            client = CookielessClient(transport=sender, follow_redirects=False)
            sender = HttpxSender(client)
        self.sender = sender
        # Scrubbed from every answer's excerpt and every failure's text: the one door outside
        # text comes in through on its way to the store, the logs and the page.
        self.secrets = tuple(Secret(x) for x in sent_secrets(settings))
        self.on_request = (
            on_request  # metrics (relay/serving/metrics.py): status class and duration
        )
        self.deadlines = Deadlines()

    def headers(self, batch: Batch, body: bytes, traceparent: str | None = None) -> dict[str, str]:
        """`traceparent`: the relay's own POST span's, when it traces (relay/edges/tracing.py);
        otherwise the first event's goes on as it came."""
        tp = traceparent or batch.events[0].traceparent
        return self._headers(body, batch, batch.epoch, tp, lambda: webhook_id(batch, self.database))

    def group_headers(
        self, batches: Sequence[Batch], body: bytes, traceparent: str | None = None
    ) -> dict[str, str]:
        """A multi-run POST's: each run's epoch is in the body; the trace is the relay's POST
        span's, or else the first run's that has one; the signature's timestamp is the first
        batch's."""
        tp = traceparent or next(
            (b.events[0].traceparent for b in batches if b.events[0].traceparent), None
        )
        return self._headers(
            body, batches[0], None, tp, lambda: group_webhook_id(batches, self.database)
        )

    def _headers(
        self,
        body: bytes,
        first: Batch,
        epoch: int | None,
        traceparent: str | None,
        msg_id: Callable[[], str],
    ) -> dict[str, str]:
        """Every POST's headers (DESIGN §5); `msg_id` is computed only when signing."""
        h = {"content-type": "application/json", "user-agent": USER_AGENT}
        if self.database is not None:
            h["relay-database"] = self.database
        if epoch is not None:
            h["relay-lease-epoch"] = str(epoch)
        if self.settings.ingress_token is not None:
            h["authorization"] = f"Bearer {self.settings.ingress_token.reveal()}"
        if traceparent:
            h["traceparent"] = traceparent
        if self.settings.signing_secret:
            ts = int(first.timestamp.timestamp())
            h["webhook-id"] = msg_id()
            h["webhook-timestamp"] = str(ts)
            h["webhook-signature"] = sign(self.settings.signing_secret, h["webhook-id"], ts, body)
        return h

    def url(self, batch: Batch) -> str:
        if batch.run_id in DOT_SEGMENTS:
            # Enqueue refuses these since issue 40; one written before cannot be carried by
            # any path (normalisation removes the segment, and `..` the one before it): its
            # POST fails, visibly, until an operator skips its events.
            raise TransportFailure(
                f"run id {batch.run_id!r} is a URL dot segment: no ingress path can carry it; "
                "skip its events (relay skip)"
            )
        return render_url(self.settings.ingress_url, batch.run_id, self.database or DEFAULT_NAME)

    def group_url(self) -> str:
        assert self.settings.ingress_batch_url is not None
        return render_group_url(self.settings.ingress_batch_url, self.database or DEFAULT_NAME)

    async def post(self, batch: Batch, traceparent: str | None = None) -> Answer:
        body = encode_body(batch)
        return await self._send(self.url(batch), body, self.headers(batch, body, traceparent))

    async def post_group(
        self, batches: Sequence[Batch], traceparent: str | None = None
    ) -> GroupAnswer:
        """One POST carrying several runs' batches to `ingress_batch_url`, and what its answer
        says for each run (DESIGN §5)."""
        body = encode_group(batches)
        answer = await self._send(
            self.group_url(), body, self.group_headers(batches, body, traceparent)
        )
        run_ids = [b.run_id for b in batches]
        if 200 <= answer.status < 300:
            return GroupAnswer(answer, split_results(answer, run_ids), whole=False)
        return GroupAnswer(answer, dict.fromkeys(run_ids, answer), whole=True)

    async def _send(self, url: str, body: bytes, headers: dict[str, str]) -> Answer:
        """Where every POST goes out, single-run and multi-run: the one place it is observed."""
        started = clock.now()
        scope = anyio.CancelScope()
        self.deadlines.add(scope, started + self.settings.http_timeout)
        try:
            with scope:
                reply = await self.sender.send(url, body, headers)
            if scope.cancelled_caught:
                raise TransportFailure(
                    f"timed out after {self.settings.http_timeout:g}s", timed_out=True
                )
        except TransportFailure as exc:
            self._observe(None, clock.now() - started)
            # A transport's error may quote what the server sent (aiohttp quotes a bad head).
            text = scrubbed(str(exc), self.secrets)
            raise TransportFailure(text, timed_out=exc.timed_out) from None
        finally:
            self.deadlines.discard(scope)
        # (A POST cancelled because its lease was lost is neither answered nor failed: it is
        # not observed.)
        seconds = clock.now() - started
        result = answer_from(reply, seconds, self.secrets)
        self._observe(result.status, result.seconds)
        return result

    def _observe(self, status: int | None, seconds: float) -> None:
        if self.on_request is not None:
            self.on_request(status, seconds)


def answer_from(reply: Reply, seconds: float, secrets: tuple[Secret, ...] = ()) -> Answer:
    body, cut = reply.body[:MAX_BODY], len(reply.body) > MAX_BODY
    return Answer(reply.status, body, reply.retry_after, seconds, cut, reply.unframed, secrets)


def encode_group(batches: Sequence[Batch]) -> bytes:
    """The multi-run body of `ingress_batch_url`: `{"batches": [<one run's body>, ...]}`."""
    return b'{"batches":[' + b",".join(encode_body(b) for b in batches) + b"]}"


def group_webhook_id(batches: Sequence[Batch], database: str | None = None) -> str:
    """A multi-run POST's id: over every run's range (and a fleet's database, as `webhook_id`)."""
    key = "\x1e".join(f"{b.run_id}\x1f{b.events[0].seq}\x1f{b.events[-1].seq}" for b in batches)
    if database is not None:
        key = f"{database}\x1f{key}"
    return "msg_" + hashlib.sha256(key.encode()).hexdigest()[:32]


def split_results(answer: Answer, run_ids: Sequence[str]) -> dict[str, Answer | TransportFailure]:
    """Per-run answers from a 2xx multi-run reply `{"results": [{"run_id", "status",
    "accepted"?}, ...]}`; a run the reply does not mention was not answered (transient)."""
    out: dict[str, Answer | TransportFailure] = {}
    try:
        parsed = orjson.loads(answer.body)
        results = parsed.get("results") if isinstance(parsed, dict) else None
    except orjson.JSONDecodeError:
        results = None
    wanted = set(run_ids)
    for item in results if isinstance(results, list) else []:
        if not isinstance(item, dict):
            continue
        run_id, status = item.get("run_id"), item.get("status")
        if run_id not in wanted or run_id in out or isinstance(status, bool):
            continue
        if not isinstance(status, int) or not 100 <= status <= 599:
            continue
        body = b""
        if isinstance(item.get("accepted"), int):
            body = orjson.dumps({"accepted": item["accepted"]})
        elif "rejected_event_id" in item:
            body = orjson.dumps({"rejected_event_id": item["rejected_event_id"]})
        out[run_id] = Answer(status, body, None, answer.seconds, secrets=answer.secrets)
    for run_id in run_ids:
        if run_id not in out:
            out[run_id] = TransportFailure("the multi-run reply had no result for this run")
    return out
