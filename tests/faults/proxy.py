"""A TCP fault proxy (after psycopg's `tests/fix_proxy.py`), run in the test's own event loop.

Sits between a relay and PostgreSQL, or between a relay and the ingress. Modes, switched at any
time and applied to every open connection at its next chunk:

- `heal()`: forward bytes as they come.
- `latency(s)`: hold each chunk `s` seconds before forwarding it.
- `blackhole()`: a silent partition. Nothing is forwarded and nothing is closed; new
  connections are accepted and stay silent. Held bytes are flushed on `heal()`, like TCP
  retransmissions that finally get through a partition shorter than the kernel's timeout.
- `cut_after(n)`: every connection (open or new) is closed after `n` more bytes each way.
- `reset()`: every open connection is aborted with a TCP RST (SO_LINGER 0); new ones pass.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import anyio
from anyio.abc import SocketAttribute, SocketStream, TaskGroup


@dataclass(eq=False)
class _Conn:
    client: SocketStream
    upstream: SocketStream | None = None
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    budget: int | None = None  # bytes left before a cut (cut_after)


class FaultProxy:
    def __init__(self, host: str, port: int, name: str = "proxy") -> None:
        self.target = (host, port)
        self.name = name
        self.port = 0
        self.mode = "pass"
        self.delay = 0.0
        self.cut_bytes = 0
        self.connections = 0
        self.resets = 0
        self.cuts = 0
        self._conns: set[_Conn] = set()
        self._healed = anyio.Event()
        self._healed.set()

    async def start(self, tg: TaskGroup) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self.port = listener.extra(SocketAttribute.local_port)

        async def serve() -> None:
            async with listener:
                await listener.serve(self._handle)

        tg.start_soon(serve)

    # -- the nemesis' switches -----------------------------------------------------------------

    def heal(self) -> None:
        self.mode = "pass"
        self.delay = 0.0
        for conn in self._conns:
            conn.budget = None
        self._healed.set()

    def latency(self, seconds: float) -> None:
        self.heal()
        self.mode, self.delay = "latency", seconds

    def blackhole(self) -> None:
        self.mode = "blackhole"
        self._healed = anyio.Event()

    def cut_after(self, n: int) -> None:
        self.heal()
        self.mode, self.cut_bytes = "cut", n
        for conn in self._conns:
            conn.budget = n

    def reset(self) -> None:
        for conn in list(self._conns):
            self.resets += 1
            _abort(conn.client)
            if conn.upstream is not None:
                _abort(conn.upstream)
            conn.scope.cancel()

    # -- plumbing --------------------------------------------------------------------------

    async def _handle(self, client: SocketStream) -> None:
        conn = _Conn(client, budget=self.cut_bytes if self.mode == "cut" else None)
        self.connections += 1
        self._conns.add(conn)
        try:
            async with client:
                with conn.scope:
                    try:
                        conn.upstream = await anyio.connect_tcp(*self.target)
                    except OSError:
                        return  # the target is down: the client sees the connection closed
                    async with conn.upstream, anyio.create_task_group() as tg:
                        tg.start_soon(self._pipe, conn, client, conn.upstream, tg)
                        tg.start_soon(self._pipe, conn, conn.upstream, client, tg)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        finally:
            self._conns.discard(conn)

    async def _pipe(self, conn: _Conn, src: SocketStream, dst: SocketStream, tg: TaskGroup) -> None:
        try:
            async for chunk in src:
                if self.mode == "blackhole":
                    await self._healed.wait()
                if self.mode == "latency" and self.delay > 0:
                    await anyio.sleep(self.delay)
                if conn.budget is not None:
                    if len(chunk) >= conn.budget:
                        if conn.budget:
                            await dst.send(chunk[: conn.budget])
                        self.cuts += 1
                        _abort(conn.client)
                        break
                    conn.budget -= len(chunk)
                await dst.send(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        tg.cancel_scope.cancel()


def _abort(stream: SocketStream) -> None:
    """Make the coming close a RST rather than a FIN (SO_LINGER 0): the peer sees `connection
    reset by peer`. The caller then cancels the connection's scope, which closes it."""
    try:
        sock: socket.socket = stream.extra(SocketAttribute.raw_socket)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass


def via(url: str, port: int) -> str:
    """`url` with its host and port replaced by the proxy's."""
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0] + "@" if len(netloc) == 2 else ""
    return urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{port}"))
