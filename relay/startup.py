"""Waiting for the database at start (issue 15 item 3).

A relay started while its database is down (a host booting, a failover, a migration window)
waits for it with capped backoff and logs each attempt, instead of exiting and leaning on the
supervisor's restart limits (systemd gives up after StartLimitBurst; Kubernetes backs off to
five minutes). `startup_timeout` (default 0: wait forever) bounds the wait for deployments that
prefer a crash-loop: past it, `ConnectionError` (exit 2). A stop request ends the wait at once.
A refusal (authentication failed, no such role or database) is not waited out: exit 2 at once.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import psycopg

from relay import logs
from relay.core.policy import backoff
from relay.serving import sdnotify
from relay.settings import passwords_in, redact_url, scrub

FIRST_DELAY = 0.5
MAX_DELAY = 10.0
ATTEMPT_DEADLINE = 5.0


def startup_delay(attempt: int, rand: float, cap: float = MAX_DELAY) -> float:
    """Seconds to wait after failed attempt `attempt` (1, 2, ...): doubling from FIRST_DELAY up
    to `cap`, with `rand` in [0, 1) spreading it over its upper half so that replicas started
    together do not knock in step."""
    return backoff(max(0, attempt - 1), base=FIRST_DELAY, cap=cap, rand=rand, jitter=0.5)


# Refusals that waiting will not cure: the server answered and said no. They fail the start
# at once (exit 2), like a malformed URL, instead of hiding a configuration error in a wait.
_PERMANENT = (
    "authentication failed",
    "does not exist",
    "no pg_hba.conf entry",
    "permission denied",
    "role is not permitted to log in",
)


def permanent(error: str) -> bool:
    """Whether a failed connection attempt's message is a refusal rather than an outage."""
    text = error.lower()
    return any(marker in text for marker in _PERMANENT)


def remaining(timeout: float, started: float, now: float) -> float | None:
    """Time left of a `startup_timeout` (None: no bound)."""
    if timeout <= 0:
        return None
    return max(0.0, timeout - (now - started))


async def _connect_once(url: str, deadline: float) -> None:
    with anyio.fail_after(deadline):
        conn = await psycopg.AsyncConnection.connect(url, connect_timeout=max(1, int(deadline)))
        await conn.close()


async def wait_for_database(
    url: str,
    *,
    timeout: float,  # noqa: ASYNC109 - startup_timeout: a bound the operator set, not an I/O timeout
    stop: anyio.Event,
    replica: str,
    connect: Callable[[str, float], Awaitable[Any]] = _connect_once,
) -> bool:
    """Return True once a connection to `url` succeeds, False when `stop` is set first; raise
    ConnectionError (its message without the password) when `timeout` > 0 runs out.

    While it waits, `metrics_addr` (when set, relay/serving/health.py's MetricsPort) answers
    /healthz 200 and /readyz 503, so that a liveness or startup probe does not restart a relay that
    is only waiting; under systemd, each attempt extends the start timeout (EXTEND_TIMEOUT_USEC)
    and pings the watchdog."""
    notifier = sdnotify.from_environ()
    try:
        return await _wait(url, timeout, stop, replica, connect, notifier)
    finally:
        if notifier is not None:
            notifier.close()


async def _attempt(
    url: str,
    deadline: float,
    stop: anyio.Event,
    connect: Callable[[str, float], Awaitable[Any]],
) -> str | None:
    """One connection attempt, abandoned when `stop` is set; its error's text, or None."""
    error: str | None = None
    async with anyio.create_task_group() as tg:

        async def on_stop() -> None:
            await stop.wait()
            tg.cancel_scope.cancel()

        tg.start_soon(on_stop)
        try:
            await connect(url, deadline)
        except (psycopg.Error, OSError, TimeoutError) as exc:
            error = logs.error_text(exc)
        tg.cancel_scope.cancel()
    return error


async def _wait(
    url: str,
    timeout: float,  # noqa: ASYNC109 - see wait_for_database
    stop: anyio.Event,
    replica: str,
    connect: Callable[[str, float], Awaitable[Any]],
    notifier: sdnotify.Notifier | None,
) -> bool:
    started = anyio.current_time()
    attempt = 0
    while not stop.is_set():
        attempt += 1
        left = remaining(timeout, started, anyio.current_time())
        deadline = ATTEMPT_DEADLINE if left is None else max(0.1, min(ATTEMPT_DEADLINE, left))
        error = await _attempt(url, deadline, stop, connect)
        if stop.is_set():
            return False
        if error is None:
            if attempt > 1:
                logs.info("database_reachable", replica=replica, attempts=attempt)
            return True
        # Redacted once for every use below; libpq may quote a password alone (decoded).
        error = scrub(logs.redact_text(error), passwords_in(url))
        if permanent(error):
            raise ConnectionError(f"cannot connect to the database at {redact_url(url)}: {error}")
        left = remaining(timeout, started, anyio.current_time())
        if left is not None and left <= 0:
            raise ConnectionError(
                f"cannot connect to the database at {redact_url(url)} within startup_timeout "
                f"({timeout:g}s): {error}"
            )
        delay = startup_delay(attempt, random.random())
        if left is not None:
            delay = min(delay, left)
        if notifier is not None:
            notifier.notify(
                f"STATUS=waiting for the database (attempt {attempt})",
                f"EXTEND_TIMEOUT_USEC={int((delay + ATTEMPT_DEADLINE + 30) * 1_000_000)}",
                "WATCHDOG=1",
            )
        logs.warning(
            "database_wait",
            replica=replica,
            attempt=attempt,
            error=error,
            retry_in=round(delay, 2),
        )
        with anyio.move_on_after(delay):
            await stop.wait()
    return False
