"""The reference sink's ASGI app: the ingress routes of DESIGN §5 and `/_sink/*` controls.

With signing secrets configured, both ingress routes verify Standard Webhooks signatures first
(`verify_signature`) and answer 401 to anything that does not verify, before any fault or
bookkeeping: an unsigned request never reaches the outbox's state.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote_to_bytes

import anyio
import orjson

from relay.settings import Secret
from relay.tools.sink.state import JSON, JSON_TYPE, Fault, Faults, Header, SinkState
from relay.tools.sink.verify import SIGNATURE_TOLERANCE, signing_keys, verify_signature

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

EVENT_KEYS = ("event_id", "seq", "type", "terminal", "payload", "created_at")
MAX_BODY = 64 * 1024 * 1024


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


FAULT_CONTROL_OFF = "fault control is off: start the sink with --fault-control to use /_sink/faults"


class Sink:
    """The ASGI app: routes of DESIGN §5 plus `/_sink/*` controls for a sink in another process.

    `POST /batch` does not check `relay-lease-epoch` (one request carries several runs' epochs).
    `POST /_sink/faults` and `/_sink/reset` change what the sink answers and forget what it
    received, unauthenticated even when signatures are checked: they answer 403 unless the sink
    was made with `fault_control=True` (`relay sink --fault-control`).
    """

    def __init__(
        self,
        state: SinkState | None = None,
        faults: Faults | None = None,
        *,
        signing_secrets: Iterable[str | Secret] = (),
        tolerance: float = SIGNATURE_TOLERANCE,
        clock: Callable[[], float] = time.time,
        fault_control: bool = False,
    ) -> None:
        self.state = state if state is not None else SinkState()
        self.fault_control = fault_control
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
            case "POST", b"/_sink/faults" | b"/_sink/reset" if not self.fault_control:
                return json_reply(403, {"error": FAULT_CONTROL_OFF})
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
