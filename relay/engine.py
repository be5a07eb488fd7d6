"""Wakes for Absurd workers: resume a task the moment the relay acknowledges its event.

Absurd is pull-only: its workers poll `claim_task` every `poll_interval` (0.25 s) and nothing
in it LISTENs. The relay's ack (DESIGN §6) emits `absurd.emit_event` and, in the same
transaction, `pg_notify('absurd_wake', <queue>)`. This module is the worker's side of that
notification: a `WakeWorker` runs the SDK's stock worker unchanged (its polling, concurrency
and batching are the fallback) and, next to it, a wake path that LISTENs on `absurd_wake` and
calls `work_batch()` at once when the payload is its own queue.

    worker = WakeWorker(url, "billing")
    await worker.run(AsyncAbsurd(url, queue_name="billing"))   # or worker.run_sync(Absurd(...))

Both return when `client.stop_worker()` is called, like `client.start_worker()`.

- Other payloads (another queue, the producers' `outbox:<schema>` wake) are ignored.
- Wakes coalesce: notifications that arrive while a wake batch runs cause one more batch.
- One notification is sent per ack transaction and queue, so one wake batch (up to
  `batch_size`, default `concurrency`, run one after the other like `work_batch` does) runs at
  once; tasks beyond it readied by the same ack are picked up by the stock poll. At most
  `concurrency` + that batch run at the same time.
- Claims made on a wake carry the worker id `<worker_id>/wake` (Absurd's `claimed_by`), so an
  operator can see which path resumed a task.
- The LISTEN connection is the relay listener's own loop (relay/edges/listening.py): TCP keepalives,
  a `select 1` with a deadline after `check_interval` of quiet, reconnection with capped,
  jittered backoff, and one wake batch after every (re)connect because NOTIFY is not durable.
  While it is down, the stock poll goes on. It needs a direct connection: a transaction-mode
  pooler does not carry LISTEN.
- `absurd.spawn_task` sends no notification: a new task starts at the next poll unless its
  producer also runs `select pg_notify('absurd_wake', <queue>)` in the spawning transaction.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any, NoReturn

import anyio
import psycopg
from anyio.from_thread import start_blocking_portal

from relay import logs
from relay.edges.listening import Listening, ping
from relay.edges.store import CONNECT_KWARGS

if TYPE_CHECKING:
    from absurd_sdk import Absurd, AsyncAbsurd

CHANNEL = "absurd_wake"
_LISTEN_KWARGS: dict[str, Any] = {**CONNECT_KWARGS, "application_name": "absurd-wake-listener"}


class WakeListener:
    """The LISTEN connection: turns `absurd_wake` notifications naming `queue` into one
    coalesced, level-triggered wake that `wait()` consumes. `run()` never returns."""

    def __init__(
        self,
        conninfo: str,
        queue: str,
        *,
        check_interval: float = 5.0,
        check_timeout: float = 5.0,
        max_backoff: float = 10.0,
    ) -> None:
        self.listening = Listening(
            conninfo,
            (CHANNEL,),
            _LISTEN_KWARGS,
            check_interval=check_interval,
            check_timeout=check_timeout,
            max_backoff=max_backoff,
        )
        self.queue = queue
        self.up = False
        self.connects = 0
        self.wakes = 0  # notifications for this queue
        self.ignored = 0  # notifications for anything else
        self.backend_pid: int | None = None
        self._event: anyio.Event | None = None  # created on the event loop that uses it

    def dispatch(self, payload: str) -> bool:
        """One notification: wake iff it names our queue."""
        if payload != self.queue:
            self.ignored += 1
            return False
        self.wakes += 1
        self._flag().set()
        return True

    async def wait(self, timeout: float | None = None) -> bool:  # noqa: ASYNC109 - a wait, not I/O
        """Wait for a wake (or `timeout`); consume every wake received so far. True if woken."""
        with anyio.move_on_after(float("inf") if timeout is None else timeout):
            await self._flag().wait()
        fired = self._flag().is_set()
        if fired:
            self._event = anyio.Event()
        return fired

    async def run(self) -> NoReturn:
        await self.listening.run(self)

    # -- the hooks of relay/edges/listening.py
    # -------------------------------------------------------

    async def prepare(self, conn: psycopg.AsyncConnection[Any]) -> None:
        pass

    def connected(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.backend_pid = conn.info.backend_pid
        if self.connects:
            logs.info("wake_listen_reconnected", queue=self.queue, pid=self.backend_pid)
        self.connects += 1
        self.up = True
        self._flag().set()  # whatever was notified while we were away: claim once

    def notified(self, channel: str, payload: str) -> None:
        if channel == CHANNEL:
            self.dispatch(payload)

    async def quiet(self, conn: psycopg.AsyncConnection[Any]) -> None:
        await ping(conn)

    def lost(self, was_up: bool, exc: BaseException, retry_in: float) -> None:
        self.up, self.backend_pid = False, None
        logs.warning(
            "wake_listen_lost" if was_up else "wake_listen_connect_failed",
            queue=self.queue,
            error=f"{type(exc).__name__}: {str(exc).strip()[:200]}",
            retry_in=round(retry_in, 3),
        )

    def _flag(self) -> anyio.Event:
        if self._event is None:
            self._event = anyio.Event()
        return self._event


class WakeWorker:
    """An Absurd worker for `queue` that resumes tasks on `absurd_wake` (see module doc)."""

    def __init__(
        self,
        conninfo: str,
        queue: str,
        *,
        poll_interval: float = 0.25,
        worker_id: str | None = None,
        claim_timeout: int = 120,
        concurrency: int = 1,
        batch_size: int | None = None,
        check_interval: float = 5.0,
        check_timeout: float = 5.0,
        max_backoff: float = 10.0,
    ) -> None:
        self.queue = queue
        self.poll_interval = poll_interval
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}"
        self.claim_timeout = claim_timeout
        self.concurrency = concurrency
        self.batch_size = batch_size or concurrency
        self.listener = WakeListener(
            conninfo,
            queue,
            check_interval=check_interval,
            check_timeout=check_timeout,
            max_backoff=max_backoff,
        )
        self.wake_batches = 0  # work_batch() calls made on a wake (completed)

    @property
    def wake_worker_id(self) -> str:
        return f"{self.worker_id}/wake"

    async def run(self, client: AsyncAbsurd) -> None:
        """Run with an async client until `client.stop_worker()` (or cancellation)."""
        self._check(await client.list_queues())  # also connects the lazy client once

        async def batch() -> None:
            await client.work_batch(self.wake_worker_id, self.claim_timeout, self.batch_size)

        async with anyio.create_task_group() as tg:
            tg.start_soon(self._serve_wakes, batch)
            await client.start_worker(**self._stock_kwargs())
            tg.cancel_scope.cancel()

    def run_sync(self, client: Absurd) -> None:
        """Run with a sync client in this thread until `client.stop_worker()`. The listener
        runs on an event loop in a helper thread and calls `work_batch()` in a worker thread;
        psycopg connections are thread-safe (the SDK's own thread pool shares one too)."""
        self._check(client.list_queues())
        batch = partial(client.work_batch, self.wake_worker_id, self.claim_timeout, self.batch_size)

        async def run_batch() -> None:
            await anyio.to_thread.run_sync(batch)

        with start_blocking_portal() as portal:
            wakes = portal.start_task_soon(self._serve_wakes, run_batch)

            def stop_if_failed(fut: Future[None]) -> None:
                if not fut.cancelled() and fut.exception() is not None:
                    client.stop_worker()  # the wake path failed: stop, and raise it below

            wakes.add_done_callback(stop_if_failed)
            try:
                client.start_worker(**self._stock_kwargs())
            finally:
                wakes.cancel()
            if not wakes.cancelled() and wakes.exception() is not None:
                wakes.result()

    # -- internals ---------------------------------------------------------------------------

    def _check(self, queues: list[str]) -> None:
        # The SDK claims from the client's own queue, so a client made for another queue than
        # this worker's would never be helped by its wakes. absurd-sdk 0.5 does not say which
        # queue a client works (only a private attribute holds it): that is the caller's to get
        # right, and docs/operations.md says so (issue 40: no private name of a dependency).
        if self.queue not in queues:
            raise ValueError(f"Absurd has no queue {self.queue!r}")

    def _stock_kwargs(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "claim_timeout": self.claim_timeout,
            "concurrency": self.concurrency,
            "batch_size": self.batch_size,
            "poll_interval": self.poll_interval,
        }

    async def _serve_wakes(self, batch: Callable[[], Awaitable[None]]) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.listener.run)
            while True:
                await self.listener.wait()
                await batch()  # wakes during it set the flag again: one more batch, not many
                self.wake_batches += 1


async def run_worker(client: AsyncAbsurd, conninfo: str, queue: str, **options: Any) -> None:
    """`await client.start_worker()` that also resumes tasks on wakes. `options`: WakeWorker's."""
    await WakeWorker(conninfo, queue, **options).run(client)


def run_worker_sync(client: Absurd, conninfo: str, queue: str, **options: Any) -> None:
    """`client.start_worker()` that also resumes tasks on wakes. `options`: WakeWorker's."""
    WakeWorker(conninfo, queue, **options).run_sync(client)
