"""A real asyncio server on 127.0.0.1 for the tests' hostile ingresses and proxies: each one says
what it does with a connection (`connection`); this says how it is served and stopped, with
every connection still open ended (cancelled and awaited) before `serving()` returns."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any


class TaskServer:
    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self.ssl_context = ssl_context
        self._tasks: set[asyncio.Task[Any]] = set()

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One client connection, from its first byte until it is done with (closed)."""
        raise NotImplementedError

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self.connection(reader, writer)
        finally:
            self._tasks.discard(task)

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        """Serve for the block, which gets the server's base URL."""
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.ssl_context)
        port = server.sockets[0].getsockname()[1]
        scheme = "https" if self.ssl_context else "http"
        try:
            yield f"{scheme}://127.0.0.1:{port}"
        finally:
            server.close()
            for task in list(self._tasks):
                task.cancel()
            for task in list(self._tasks):
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await server.wait_closed()
