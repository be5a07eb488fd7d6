"""The small HTTP/1.1 server behind `metrics_addr`: one request per connection, bounded, guarded.

Whatever a client of `metrics_addr` does, the relay's delivery must not notice (issue 32). So:
- **An error boundary around every request.** No exception from parsing, routing, a library
  (prometheus_client once raised TypeError on a malformed Accept) or the socket leaves a
  connection's task: a request that fails gets a 500 and one log line, and the connection closes.
- **An error boundary around `accept()`.** Out of file descriptors (EMFILE/ENFILE) or buffers,
  the accept loop logs once, backs off (`policy.backoff`, up to 1 s) and tries again; the
  pending connections wait in the kernel's backlog. It never ends the server.
- **A bounded number of connections.** At most `MAX_CONNECTIONS` are served at once; one more
  is closed at once (shed) rather than held, so idle clients cannot pile up descriptors. Each
  connection must send its whole request head within `HEAD_DEADLINE`, and the whole exchange
  ends within `REQUEST_DEADLINE`: an idle connection is dropped after a few seconds.
- **Shared fairly between peers.** When every slot is taken, a connection from a peer address
  that holds fewer connections still waiting for their request head than the biggest holder
  takes the place of that holder's oldest such connection (`to_evict`); one from the biggest
  holder itself is shed. So one client holding every slot with unfinished request heads cannot
  starve the kubelet's or Prometheus' `/healthz`, `/readyz` and `/metrics`, which come from
  another address (issue 41: 70 such connections left 1 probe answered in 20 s, and Kubernetes
  restarts a pod whose liveness probe goes unanswered). A connection whose head has arrived is
  never evicted: its answer is bounded by `REQUEST_DEADLINE`.
- The request head is capped at `MAX_REQUEST` bytes (h11's `max_incomplete_event_size`).

The deploy files raise the descriptor limit (`LimitNOFILE`) well above what these bounds, the
pools and the HTTP senders need together; the bounds hold without it.
"""

from __future__ import annotations

import errno
import random
from collections import Counter
from collections.abc import Awaitable, Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import anyio
import h11
from anyio.abc import Listener, SocketAttribute, SocketListener, SocketStream, TaskGroup

from relay import logs
from relay.core.policy import backoff
from relay.serving.ui.web import Request, Response

REQUEST_DEADLINE = 10.0
HEAD_DEADLINE = 5.0
# Room for a run page's URL: a 10 kB run id percent-encoded, plus headers.
MAX_REQUEST = 64 * 1024
# Probes, one scrape and a few status-page viewers need a handful; the rest is headroom.
MAX_CONNECTIONS = 64
ACCEPT_BACKOFF_BASE = 0.01
ACCEPT_BACKOFF_CAP = 1.0

Respond = Callable[[Request], Awaitable[Response]]

_TEXT = "text/plain; charset=utf-8"
# What a failed accept() may say while the listener itself is fine (accept(2), "ERRORS").
_TRANSIENT_ACCEPT = {
    errno.EMFILE,
    errno.ENFILE,
    errno.ENOBUFS,
    errno.ENOMEM,
    errno.ECONNABORTED,
    errno.EPROTO,
    errno.EPERM,
    errno.EINTR,
    errno.EAGAIN,
}


def _headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in raw:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        if key in out:
            text = out[key] + ("; " if key == "cookie" else ", ") + text
        out[key] = text
    return out


async def _read_request(conn: h11.Connection, stream: SocketStream) -> h11.Request | None:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive(65536))
            continue
        if isinstance(event, h11.Request):
            return event
        return None


async def _respond_guarded(respond: Respond, request: Request) -> Response:
    """`respond(request)`, or a 500 and one log line when it raises."""
    try:
        return await respond(request)
    except Exception as exc:
        logs.error(
            "endpoint_failed",
            method=request.method,
            path=request.path[:200],
            error=logs.error_text(exc),
        )
        return Response(500, _TEXT, b"internal error: see the relay's logs\n")


async def _send(conn: h11.Connection, stream: SocketStream, method: str, out: Response) -> None:
    headers = [
        ("content-type", out.content_type),
        ("content-length", str(len(out.body))),
        ("cache-control", "no-store"),
        ("connection", "close"),
        *out.headers,
    ]
    await stream.send(conn.send(h11.Response(status_code=out.status, headers=headers)))
    if method != "HEAD":
        await stream.send(conn.send(h11.Data(data=out.body)))
    await stream.send(conn.send(h11.EndOfMessage()))


async def answer_request(
    stream: SocketStream, respond: Respond, on_head: Callable[[], None] | None = None
) -> None:
    """One request on `stream`, answered by `respond(request)`; `on_head()` once its head has
    arrived. Never raises: a client that breaks the protocol or goes away is dropped, a failing
    `respond` answers 500."""
    async with stream:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST)
        with anyio.move_on_after(REQUEST_DEADLINE):
            try:
                with anyio.fail_after(HEAD_DEADLINE):
                    request = await _read_request(conn, stream)
                if request is None:
                    return
                if on_head is not None:
                    on_head()
                method = request.method.decode("latin-1")
                incoming = Request(
                    method, request.target.decode("latin-1"), _headers(list(request.headers))
                )
                out = await _respond_guarded(respond, incoming)
                await _send(conn, stream, method, out)
            except (TimeoutError, h11.ProtocolError, OSError):
                return
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                return


# -- the slots: fair between peers ------------------------------------------------------------


def to_evict(waiting: Iterable[Hashable], newcomer: Hashable) -> Hashable | None:
    """With every slot taken: the peer that gives a slot to `newcomer`'s peer, or None (shed the
    newcomer). `waiting` holds one peer per connection still waiting for its request head. The
    biggest holder gives way to any peer that holds fewer (max-min fairness), never to itself."""
    held = Counter(waiting)
    if not held:
        return None
    biggest, most = held.most_common(1)[0]
    return biggest if most > held[newcomer] else None


@dataclass(eq=False)
class _Slot:
    peer: Hashable
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    waiting_for_head: bool = True


@dataclass
class Slots:
    """`limit` connections served at once, oldest first in `held`."""

    limit: int
    held: dict[_Slot, None] = field(default_factory=dict)  # an ordered set

    def take(self, peer: Hashable) -> _Slot | None:
        """A slot for a connection from `peer`, evicting another peer's if fairness says so;
        None: shed it."""
        if len(self.held) >= self.limit:
            waiting = [slot for slot in self.held if slot.waiting_for_head]
            loser = to_evict((slot.peer for slot in waiting), peer)
            if loser is None:
                return None
            oldest = next(slot for slot in waiting if slot.peer == loser)
            oldest.scope.cancel()  # its task closes the connection and gives the slot back
            del self.held[oldest]
        slot = _Slot(peer)
        self.held[slot] = None
        return slot

    def give_back(self, slot: _Slot) -> None:
        self.held.pop(slot, None)


def _peer(stream: SocketStream) -> Hashable:
    """The client's address without its port (a client opens many connections from one host)."""
    try:
        address = stream.extra(SocketAttribute.remote_address)
    except (anyio.TypedAttributeLookupError, OSError):
        return None
    return address[0] if isinstance(address, tuple) else address


@dataclass
class _Shedding:
    """Logs the first connection shed of an episode and how many were shed when it ends."""

    shed: int = 0

    def one(self) -> None:
        if self.shed == 0:
            logs.warning("endpoint_connections_shed", limit=MAX_CONNECTIONS)
        self.shed += 1

    def served(self) -> None:
        if self.shed:
            logs.info("endpoint_connections_recovered", shed=self.shed)
            self.shed = 0


async def _accept(listener: SocketListener) -> SocketStream:
    """The next connection; waits out transient accept() failures (EMFILE, ...) with backoff."""
    failures = 0
    while True:
        try:
            return await listener.accept()
        except OSError as exc:
            if exc.errno not in _TRANSIENT_ACCEPT:
                raise
            if failures == 0:
                logs.warning("endpoint_accept_failed", error=logs.error_text(exc))
            delay = backoff(
                failures, base=ACCEPT_BACKOFF_BASE, cap=ACCEPT_BACKOFF_CAP, rand=random.random()
            )
            failures += 1
            await anyio.sleep(max(delay, ACCEPT_BACKOFF_BASE))


async def accept_loop(
    listener: SocketListener,
    respond: Respond,
    tg: TaskGroup,
    slots: Slots,
    shedding: _Shedding | None = None,
) -> None:
    """Accept connections on `listener` until cancelled; each answered in `tg` under a slot."""
    shedding = shedding or _Shedding()

    async def serve_one(stream: SocketStream, slot: _Slot) -> None:
        def head_arrived() -> None:
            slot.waiting_for_head = False

        try:
            with slot.scope:
                await answer_request(stream, respond, head_arrived)
        finally:
            slots.give_back(slot)
            await anyio.aclose_forcefully(stream)  # evicted before answer_request closed it

    while True:
        stream = await _accept(listener)
        slot = slots.take(_peer(stream))
        if slot is None:
            shedding.one()
            await stream.aclose()
            continue
        shedding.served()
        tg.start_soon(serve_one, stream, slot)


async def serve_listeners(listeners: Sequence[Listener[SocketStream]], respond: Respond) -> None:
    """Serve `respond` on every listener of an `anyio.create_tcp_listener` (one per address
    family) until cancelled, sharing MAX_CONNECTIONS slots between them."""
    slots = Slots(MAX_CONNECTIONS)
    shedding = _Shedding()
    async with anyio.create_task_group() as tg:
        for listener in listeners:
            if not isinstance(listener, SocketListener):
                raise TypeError(f"not a TCP listener: {listener!r}")
            tg.start_soon(accept_loop, listener, respond, tg, slots, shedding)
