"""What the reference sink has seen and what it is told to get wrong.

`SinkState` is the pure bookkeeping (dedupe by event_id, per-run order of first deliveries,
stale lease epochs); `Faults` queues injected misbehaviour, taken in FIFO order, one per request.
A fault without `run_id` applies to a whole HTTP request; on `POST /batch` a fault with `run_id`
applies to that run's part of the request.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

JSON = dict[str, Any]
Header = tuple[bytes, bytes]

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
