"""Serving the reference sink with uvicorn: `serve_sink` inside the caller's event loop,
`SinkThread` on a loop in a background thread, for blocking code."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Iterator

import anyio
import uvicorn
from anyio.from_thread import BlockingPortal, start_blocking_portal

from relay.tools.sink.app import Sink
from relay.tools.sink.state import JSON


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
