"""The reference ingress (`relay sink`): the receiving side of DESIGN §5, for tests, the demo and
benchmarks.

`SinkState` is the pure bookkeeping (dedupe by event_id, per-run order of first deliveries,
stale lease epochs); `Faults` queues injected misbehaviour; `Sink` is the ASGI app joining them,
served by uvicorn through `serve_sink` (inside the caller's event loop), `SinkThread` (a loop in
a background thread, for blocking code) or `main` (the `relay sink` command).

Faults are taken in FIFO order, one per request. A fault without `run_id` applies to a whole
HTTP request; on `POST /batch` a fault with `run_id` applies to that run's part of the request.

With signing secrets configured, both ingress routes verify Standard Webhooks signatures first
(`verify_signature`, the rules the relay signs by) and answer 401 to anything that does not
verify, before any fault or bookkeeping: an unsigned request never reaches the outbox's state.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import hmac
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    MutableMapping,
    Sequence,
)
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import unquote_to_bytes

import anyio
import orjson
import uvicorn
from anyio.from_thread import BlockingPortal, start_blocking_portal

from relay.ingress import signature as webhook_signature
from relay.settings import ConfigError, Secret, option_value

JSON = dict[str, Any]
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Header = tuple[bytes, bytes]

EVENT_KEYS = ("event_id", "seq", "type", "terminal", "payload", "created_at")
MAX_BODY = 64 * 1024 * 1024
JSON_TYPE: Header = (b"content-type", b"application/json")


class SinkState:
    """Everything the sink has seen. Pure Python: one event loop owns it, so no locks."""

    reject_stale_epochs: bool = True
    keep_received: bool = True  # `received` grows with every request; off for long benchmarks

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.deliveries: dict[str, int] = {}
        self.first_order: dict[str, list[int]] = {}
        self.first_seen_at: dict[str, float] = {}
        self.max_epoch: dict[str, int] = {}
        self.received: list[JSON] = []
        self.requests = 0
        self.events_received = 0
        self.duplicates = 0
        self.max_receipts = 0
        self.order_violations = 0
        self.stale_epochs = 0
        self.unauthorized: dict[str, int] = {}  # reason -> requests answered 401
        self._top_seq: dict[str, int] = {}

    def record(self, run_id: str, epoch: int, events: list[JSON]) -> tuple[int, JSON]:
        """Apply one batch; returns the (status, JSON body) the ingress answers."""
        self.requests += 1
        top_epoch = self.max_epoch.get(run_id)
        if top_epoch is not None and epoch < top_epoch:
            # Counted even when accepted: a stale writer is worth knowing about either way.
            self.stale_epochs += 1
            if self.reject_stale_epochs:
                return 409, {"stale_epoch": True}
        else:
            self.max_epoch[run_id] = epoch
        order = self.first_order.setdefault(run_id, [])
        now = time.time()
        for event in events:
            event_id: str = event["event_id"]
            receipts = self.deliveries.get(event_id, 0) + 1
            self.deliveries[event_id] = receipts
            self.events_received += 1
            self.max_receipts = max(self.max_receipts, receipts)
            if receipts > 1:
                self.duplicates += 1
                continue
            seq: int = event["seq"]
            self.first_seen_at[event_id] = now
            top_seq = self._top_seq.get(run_id)
            if top_seq is not None and seq < top_seq:
                self.order_violations += 1
            self._top_seq[run_id] = seq if top_seq is None else max(seq, top_seq)
            order.append(seq)
        return 200, {"accepted": len(events)}

    def note(
        self,
        run_id: str | None,
        epoch: int | None,
        events: list[JSON],
        headers: dict[str, str],
        status: int,
        fault: str | None = None,
    ) -> None:
        """Keep one received batch (faulted and rejected ones too) for tests to inspect."""
        if self.keep_received:
            self.received.append(
                {
                    "run_id": run_id,
                    "epoch": epoch,
                    "seqs": [e["seq"] for e in events],
                    "event_ids": [e["event_id"] for e in events],
                    "headers": headers,
                    "status": status,
                    "fault": fault,
                }
            )

    def stats(self) -> JSON:
        return {
            "requests": self.requests,
            "events_received": self.events_received,
            "unique_events": len(self.deliveries),
            "duplicates": self.duplicates,
            "max_duplicates_of_one_event": max(self.max_receipts - 1, 0),
            "order_violations": self.order_violations,
            "stale_epochs": self.stale_epochs,
            "runs": len(self.first_order),
            "unauthorized": sum(self.unauthorized.values()),
            "unauthorized_by_reason": dict(self.unauthorized),
        }


FaultKind = Literal["fail", "delay", "drop_reply", "accept_only"]


@dataclass
class Fault:
    kind: FaultKind
    times: int
    run_id: str | None
    status: int = 0
    headers: list[Header] = field(default_factory=list)
    body: bytes = b""
    seconds: float = 0.0
    k: int = 0


class Faults:
    """Injected faults. A lock makes them safe to add from another thread (`SinkThread`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: deque[Fault] = deque()
        self.default_status: int | None = None
        self.poisoned: dict[str, tuple[int, bool]] = {}  # event_id -> (status, name it?)

    def fail(
        self,
        status: int,
        times: int = 1,
        *,
        retry_after: str | None = None,
        body: bytes | dict[str, Any] | None = None,
        run_id: str | None = None,
    ) -> None:
        if not 100 <= status <= 599:
            raise ValueError(f"status {status} is not an HTTP status")
        if body is None:
            body = {"error": f"injected {status}"}
        headers = [] if isinstance(body, bytes) else [JSON_TYPE]
        raw = body if isinstance(body, bytes) else orjson.dumps(body)
        if retry_after is not None:
            headers.append((b"retry-after", retry_after.encode()))
        self._push(Fault("fail", times, run_id, status=status, headers=headers, body=raw))

    def delay(self, seconds: float, times: int = 1, run_id: str | None = None) -> None:
        self._push(Fault("delay", times, run_id, seconds=float(seconds)))

    def drop_reply(self, times: int = 1, run_id: str | None = None) -> None:
        self._push(Fault("drop_reply", times, run_id))

    def accept_only(self, k: int, times: int = 1, run_id: str | None = None) -> None:
        if k < 0:
            raise ValueError("accept_only needs k >= 0")
        self._push(Fault("accept_only", times, run_id, k=k))

    def poison(self, event_id: str, status: int = 422, *, name: bool = False) -> None:
        """Reject every batch that contains `event_id` with `status` (a poison event) until
        cleared; with `name`, the body says which event: `{"rejected_event_id": ...}`."""
        with self._lock:
            self.poisoned[event_id] = (status, name)

    def poison_in(self, events: list[JSON]) -> tuple[int, JSON] | None:
        with self._lock:
            for event in events:
                hit = self.poisoned.get(event["event_id"])
                if hit is not None:
                    status, name = hit
                    body: JSON = {"error": f"event rejected ({status})"}
                    if name:
                        body["rejected_event_id"] = event["event_id"]
                    return status, body
        return None

    def set_default(self, status: int | None) -> None:
        """Answer every ingress request with `status` (e.g. 503: ingress down) until None."""
        self.default_status = status

    def clear(self) -> None:
        with self._lock:
            self._queue.clear()
            self.poisoned.clear()
            self.default_status = None

    def pending(self) -> int:
        with self._lock:
            return sum(f.times for f in self._queue)

    def take(self, run_id: str | None, *, exact: bool = False) -> Fault | None:
        """Consume the first fault for this request: one without run_id or (exact) for run_id."""
        with self._lock:
            for fault in self._queue:
                if (fault.run_id is None and not exact) or (
                    fault.run_id is not None and fault.run_id == run_id
                ):
                    fault.times -= 1
                    if fault.times == 0:
                        self._queue.remove(fault)
                    return fault
        return None

    def _push(self, fault: Fault) -> None:
        if fault.times < 1:
            raise ValueError("times must be >= 1")
        with self._lock:
            self._queue.append(fault)


class BadRequest(Exception):
    def __init__(self, error: str, event_id: Any = None) -> None:
        super().__init__(error)
        self.body: JSON = (
            {"error": error} if event_id is None else {"error": error, "event_id": event_id}
        )


def parse_batch(obj: Any) -> tuple[str, int, list[JSON]]:
    """Validate one run batch of DESIGN §5; raises BadRequest naming the problem."""
    if not isinstance(obj, dict):
        raise BadRequest("body is not a JSON object")
    run_id, epoch, events = obj.get("run_id"), obj.get("epoch"), obj.get("events")
    if not isinstance(run_id, str) or not run_id:
        raise BadRequest("run_id must be a non-empty string")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise BadRequest("epoch must be a non-negative integer")
    if not isinstance(events, list) or not events:
        raise BadRequest("events must be a non-empty list")
    last_seq: int | None = None
    for event in events:
        if not isinstance(event, dict):
            raise BadRequest("each event must be a JSON object")
        event_id = event.get("event_id")
        missing = [key for key in EVENT_KEYS if key not in event]
        if missing:
            raise BadRequest(f"event lacks {', '.join(missing)}", event_id)
        if not isinstance(event_id, str) or not event_id:
            raise BadRequest("event_id must be a non-empty string", event_id)
        seq = event["seq"]
        if not isinstance(seq, int) or isinstance(seq, bool):
            raise BadRequest("seq must be an integer", event_id)
        if last_seq is not None and seq <= last_seq:
            raise BadRequest("seqs must be strictly increasing", event_id)
        last_seq = seq
    return run_id, epoch, events


@dataclass
class Reply:
    status: int
    body: bytes = b""
    headers: list[Header] = field(default_factory=list)
    drop: bool = False  # process, then close the connection without answering


def json_reply(status: int, obj: Any, *, drop: bool = False) -> Reply:
    return Reply(status, orjson.dumps(obj), [JSON_TYPE], drop=drop)


SIGNATURE_TOLERANCE = 300.0  # seconds either side of now, as in the Standard Webhooks libraries


def signing_keys(secrets: Iterable[str | Secret]) -> tuple[bytes, ...]:
    """The HMAC keys of `whsec_...` secrets (the prefix is optional, as in the reference
    libraries); raises ValueError on a secret that is not base64."""
    keys = []
    for secret in secrets:
        text = secret.reveal() if isinstance(secret, Secret) else secret
        try:
            key = base64.b64decode(text.strip().removeprefix("whsec_"), validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("a signing secret must be whsec_ followed by base64") from None
        if not key:
            raise ValueError("a signing secret must not be empty")
        keys.append(key)
    return tuple(keys)


def verify_signature(
    keys: Sequence[bytes], headers: dict[str, str], body: bytes, now: float, tolerance: float
) -> str | None:
    """Standard Webhooks verification, the rules `relay.ingress.sign` signs by: the three
    `webhook-*` headers present, the timestamp within `tolerance` seconds of `now`, and any
    `v1,` signature of the space-separated list equal (constant-time) to the HMAC-SHA256 of
    `{id}.{timestamp}.{body}` under any key. Returns None when it verifies, else the reason."""
    msg_id = headers.get("webhook-id")
    stamp = headers.get("webhook-timestamp")
    given = headers.get("webhook-signature")
    if not msg_id or not stamp or not given:
        return "missing_headers"
    try:
        timestamp = int(stamp.strip())
    except ValueError:
        return "bad_timestamp"
    if abs(now - timestamp) > tolerance:
        return "timestamp_out_of_tolerance"
    expected = [webhook_signature(key, msg_id, timestamp, body) for key in keys]
    ok = False
    for item in given.split():
        version, _, signature = item.partition(",")
        if version != "v1":
            continue
        candidate = signature.encode("utf-8", "surrogatepass")
        for want in expected:
            # No early exit: every comparison runs, so timing says nothing about which matched.
            ok |= hmac.compare_digest(candidate, want)
    return None if ok else "bad_signature"


class Sink:
    """The ASGI app: routes of DESIGN §5 plus `/_sink/*` controls for a sink in another process.

    `POST /batch` does not check `relay-lease-epoch` (one request carries several runs' epochs).
    """

    def __init__(
        self,
        state: SinkState | None = None,
        faults: Faults | None = None,
        *,
        signing_secrets: Iterable[str | Secret] = (),
        tolerance: float = SIGNATURE_TOLERANCE,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.state = state if state is not None else SinkState()
        self.faults = faults if faults is not None else Faults()
        self.signing_keys = signing_keys(signing_secrets)  # none: signatures are not checked
        self.tolerance = tolerance
        self.clock = clock
        self._closing: anyio.Event | None = None  # set by serve_sink; ends injected delays

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # serve_sink turns lifespan and websockets off
        body = await _read_body(receive)
        if body is None:
            return  # the client went away
        if len(body) > MAX_BODY:
            reply = json_reply(413, {"error": "body too large"})
        else:
            headers: dict[str, str] = {}
            for key, value in scope["headers"]:
                name, text = key.decode("latin-1").lower(), value.decode("latin-1")
                headers[name] = f"{headers[name]}, {text}" if name in headers else text
            path: bytes = scope.get("raw_path") or scope["path"].encode()
            reply = await self._route(scope["method"], path.partition(b"?")[0], body, headers)
        if reply.drop:
            await _drop_connection(receive, send)
            return
        length = (b"content-length", str(len(reply.body)).encode())
        await send(
            {
                "type": "http.response.start",
                "status": reply.status,
                "headers": [length, *reply.headers],
            }
        )
        await send({"type": "http.response.body", "body": reply.body})

    async def _route(self, method: str, path: bytes, body: bytes, headers: dict[str, str]) -> Reply:
        if path.startswith(b"/runs/") and path.endswith(b"/events") and len(path) > 12:
            if method != "POST":
                return json_reply(405, {"error": "method not allowed"})
            try:
                run_id = unquote_to_bytes(path[6:-7]).decode()
            except UnicodeDecodeError:
                return json_reply(400, {"error": "run id in the URL is not UTF-8"})
            if (denied := self._unauthorized(body, headers)) is not None:
                self.state.note(run_id, None, [], headers, 401, "unauthorized")
                return denied
            return await self._run_events(run_id, body, headers)
        match method, path:
            case "POST", b"/batch":
                if (denied := self._unauthorized(body, headers)) is not None:
                    return denied
                return await self._batch(body, headers)
            case "GET", b"/_sink/stats":
                return json_reply(200, self.state.stats())
            case "POST", b"/_sink/faults":
                return self._control_faults(body)
            case "POST", b"/_sink/reset":
                self.state.reset()
                return json_reply(200, {"ok": True})
            case "GET", b"/healthz":
                return json_reply(200, {"ok": True})
        return json_reply(404, {"error": "no such route"})

    def _unauthorized(self, body: bytes, headers: dict[str, str]) -> Reply | None:
        """A 401 reply when signatures are checked and this request's does not verify."""
        if not self.signing_keys:
            return None
        reason = verify_signature(self.signing_keys, headers, body, self.clock(), self.tolerance)
        if reason is None:
            return None
        self.state.unauthorized[reason] = self.state.unauthorized.get(reason, 0) + 1
        return json_reply(401, {"error": f"signature verification failed: {reason}"})

    async def _run_events(self, url_run_id: str, body: bytes, headers: dict[str, str]) -> Reply:
        try:
            run_id, epoch, events = parse_batch(_loads(body))
            if run_id != url_run_id:
                raise BadRequest("body run_id does not match the run id in the URL")
            if headers.get("relay-lease-epoch", "").strip() != str(epoch):
                raise BadRequest("relay-lease-epoch header does not match the body epoch")
        except BadRequest as exc:
            self.state.note(url_run_id, None, [], headers, 400)
            return json_reply(400, exc.body)
        if (down := self.faults.default_status) is not None:
            self.state.note(run_id, epoch, events, headers, down, "default")
            return json_reply(down, {"error": f"injected {down}"})
        fault = self.faults.take(run_id)
        if fault is not None and fault.kind == "fail":
            self.state.note(run_id, epoch, events, headers, fault.status, "fail")
            return Reply(fault.status, fault.body, fault.headers)
        if (poisoned := self.faults.poison_in(events)) is not None:
            self.state.note(run_id, epoch, events, headers, poisoned[0], "poison")
            return json_reply(*poisoned)
        status, result = await self._process(fault, run_id, epoch, events)
        self.state.note(run_id, epoch, events, headers, status, fault.kind if fault else None)
        return json_reply(status, result, drop=fault is not None and fault.kind == "drop_reply")

    async def _batch(self, body: bytes, headers: dict[str, str]) -> Reply:
        try:
            obj = _loads(body)
            if not isinstance(obj, dict) or not isinstance(obj.get("batches"), list):
                raise BadRequest('body must be {"batches": [...]}')
            if not obj["batches"]:
                raise BadRequest("batches must be a non-empty list")
        except BadRequest as exc:
            return json_reply(400, exc.body)
        if (down := self.faults.default_status) is not None:
            return json_reply(down, {"error": f"injected {down}"})
        whole = self.faults.take(None)
        if whole is not None and whole.kind == "fail":
            return Reply(whole.status, whole.body, whole.headers)
        if whole is not None and whole.kind == "delay" and not await self._delay(whole.seconds):
            return json_reply(503, {"error": "sink shutting down"})
        drop = whole is not None and whole.kind == "drop_reply"
        results: list[JSON] = []
        for item in obj["batches"]:
            try:
                run_id, epoch, events = parse_batch(item)
            except BadRequest as exc:
                guess = item.get("run_id") if isinstance(item, dict) else None
                results.append({"run_id": guess, "status": 400, **exc.body})
                continue
            fault = self.faults.take(run_id, exact=True)
            if fault is None and whole is not None and whole.kind == "accept_only":
                fault = whole
            kind = fault.kind if fault else None
            if fault is not None and fault.kind == "fail":
                self.state.note(run_id, epoch, events, headers, fault.status, kind)
                results.append({"run_id": run_id, "status": fault.status})
                continue
            if (poisoned := self.faults.poison_in(events)) is not None:
                self.state.note(run_id, epoch, events, headers, poisoned[0], "poison")
                results.append({"run_id": run_id, "status": poisoned[0], **poisoned[1]})
                continue
            status, result = await self._process(fault, run_id, epoch, events)
            self.state.note(run_id, epoch, events, headers, status, kind)
            results.append({"run_id": run_id, "status": status, **result})
            drop = drop or kind == "drop_reply"
        return json_reply(200, {"results": results}, drop=drop)

    async def _process(
        self, fault: Fault | None, run_id: str, epoch: int, events: list[JSON]
    ) -> tuple[int, JSON]:
        if fault is not None and fault.kind == "delay" and not await self._delay(fault.seconds):
            return 503, {"error": "sink shutting down"}
        if fault is not None and fault.kind == "accept_only":
            status, result = self.state.record(run_id, epoch, events[: fault.k])
            return status, {"accepted": min(fault.k, len(events))} if status == 200 else result
        return self.state.record(run_id, epoch, events)

    async def _delay(self, seconds: float) -> bool:
        """Sleep, cut short when the server shuts down; False if it did."""
        closing = self._closing
        with anyio.move_on_after(seconds):
            await (closing.wait() if closing is not None else anyio.sleep(seconds))
        return closing is None or not closing.is_set()

    def _control_faults(self, body: bytes) -> Reply:
        """`{"action": <Faults method, "default" for set_default>, **its arguments}`."""
        actions = {"fail", "delay", "drop_reply", "accept_only", "default", "clear"}
        try:
            kwargs = _loads(body)
            if not isinstance(kwargs, dict) or kwargs.get("action") not in actions:
                raise BadRequest(f"action must be one of {', '.join(sorted(actions))}")
            action = kwargs.pop("action")
            if isinstance(kwargs.get("body"), str):
                kwargs["body"] = kwargs["body"].encode()
            getattr(self.faults, "set_default" if action == "default" else action)(**kwargs)
        except BadRequest as exc:
            return json_reply(400, exc.body)
        except (TypeError, ValueError) as exc:
            return json_reply(400, {"error": str(exc)})
        return json_reply(
            200, {"pending": self.faults.pending(), "default": self.faults.default_status}
        )


async def _read_body(receive: Receive) -> bytes | None:
    body = bytearray()
    while len(body) <= MAX_BODY:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    return bytes(body)


def _loads(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"body is not JSON: {exc}") from None


async def _drop_connection(receive: Receive, send: Send) -> None:
    """Close the connection without a response: the client sees the reply lost in transit.

    Returning without a response makes uvicorn answer 500, so close its transport (reached via
    the bound `send`) and wait until uvicorn notices the disconnect.
    """
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if isinstance(transport, asyncio.BaseTransport):
        transport.close()
        with anyio.move_on_after(5):
            while (await receive())["type"] != "http.disconnect":
                pass
        return
    # Another server: promise a body and never send it; the server then closes the connection.
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"1")]}
    )


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers (the host owns signals), reporting readiness."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = anyio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets=sockets)
        finally:
            self.ready.set()


@contextlib.asynccontextmanager
async def serve_sink(
    sink: Sink, host: str = "127.0.0.1", port: int = 0, *, http: str = "auto"
) -> AsyncIterator[str]:
    """Serve `sink` with uvicorn in the current event loop; yields its base URL."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted sockets only when their
    # proto says TCP; with proto 0, Nagle meets delayed ACKs and every reply waits ~40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
        bound_port = sock.getsockname()[1]
        config = uvicorn.Config(
            sink,
            http=http,
            ws="none",
            lifespan="off",
            log_config=None,  # leave the host's logging alone
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=10,
        )
        server = _EmbeddedServer(config)
        sink._closing = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve, [sock])
            await server.ready.wait()
            if not server.started:
                raise RuntimeError("the sink failed to start")
            try:
                yield f"http://{f'[{host}]' if family == socket.AF_INET6 else host}:{bound_port}"
            finally:
                sink._closing.set()
                server.should_exit = True
    finally:
        sock.close()


class SinkThread:
    """`serve_sink` on an event loop in a background thread, for code that blocks."""

    def __init__(self, sink: Sink, host: str = "127.0.0.1", port: int = 0) -> None:
        self.sink, self.host, self.port = sink, host, port
        self._stack: contextlib.ExitStack | None = None
        self._portal: BlockingPortal | None = None
        self.url: str | None = None

    def start(self) -> str:
        if self.url is not None:
            return self.url
        with contextlib.ExitStack() as stack:
            self._portal = stack.enter_context(start_blocking_portal("asyncio"))
            served = self._portal.wrap_async_context_manager(
                serve_sink(self.sink, self.host, self.port)
            )
            self.url = stack.enter_context(served)
            self._stack = stack.pop_all()
        return self.url

    def stats(self) -> JSON:
        """`state.stats()` read on the sink's own loop."""
        assert self._portal is not None, "start() first"
        return self._portal.call(self.sink.state.stats)

    def stop(self) -> None:
        if self._stack is not None:
            self._stack.close()
        self._stack = self._portal = self.url = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """`relay sink`: serve the reference ingress until SIGTERM/SIGINT, then print stats JSON."""
    parser = argparse.ArgumentParser(prog="relay sink", description=main.__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--http", choices=["auto", "httptools", "h11"], default="auto")
    parser.add_argument(
        "--accept-stale-epochs", action="store_true", help="count stale epochs, answer 200"
    )
    parser.add_argument(
        "--signing-secret",
        metavar="SIGNING_SECRET",
        help="verify Standard Webhooks signatures with these whsec_ secret(s), comma separated;"
        " also RELAY_SIGNING_SECRET, RELAY_SIGNING_SECRET_FILE, $CREDENTIALS_DIRECTORY",
    )
    parser.add_argument(
        "--signature-tolerance",
        type=float,
        default=SIGNATURE_TOLERANCE,
        metavar="SECONDS",
        help=f"accepted clock skew of webhook-timestamp (default {SIGNATURE_TOLERANCE:g})",
    )
    args = parser.parse_args(argv)
    try:
        secrets: tuple[Secret, ...] = (
            option_value("signing_secret", {"signing_secret": args.signing_secret}, os.environ)
            or ()
        )
    except ConfigError as exc:
        parser.exit(2, f"relay sink: invalid configuration: {exc}\n")
    sink = Sink(signing_secrets=secrets, tolerance=args.signature_tolerance)
    sink.state.reject_stale_epochs = not args.accept_stale_epochs
    sink.state.keep_received = False  # nothing outside the process can read it

    async def run() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with serve_sink(sink, args.host, args.port, http=args.http) as url:
                print(f"relay sink listening on {url}", file=sys.stderr, flush=True)
                async for _ in signals:
                    break

    anyio.run(run)
    print(orjson.dumps(sink.state.stats()).decode(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
