"""systemd `Type=notify` (DESIGN §8.2), written against the protocol itself: newline-separated
`KEY=VALUE` assignments in one datagram to the AF_UNIX socket named by `$NOTIFY_SOCKET` (a path,
or `@name` for the abstract namespace). No libsystemd.

- READY=1 once the relay is really serving: the pools are open and the schema version verified
  (both happen before the relay serves at all), the LISTEN connection is up, and every lane
  went once round its loop (its first discovery pass ran).
- WATCHDOG=1 every half `$WATCHDOG_USEC`, only while every lane's loop is turning
  (`progress.loops_alive`, the rule /healthz uses): a stuck loop stops the pings and systemd
  restarts the process.
- STOPPING=1 when a graceful stop is requested (SIGTERM), before the drain.

Sending never blocks and never fails the relay: a lost datagram is a missed ping, which the
watchdog's factor of two absorbs.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import anyio

from relay import logs
from relay.serving.progress import RelayView, loops_alive, stall_limit
from relay.settings import Settings

STARTUP_CHECK = 0.05


def socket_address(value: str) -> str | None:
    """The address to send to: a filesystem path, or `@name` -> '\\0name' (abstract namespace).
    Anything else is not a notify socket (systemd only sets these two forms)."""
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None


def watchdog_interval(environ: Mapping[str, str], pid: int) -> float | None:
    """Half of WATCHDOG_USEC in seconds, or None when the watchdog is off or meant for another
    process (WATCHDOG_PID names the process that must ping)."""
    usec = environ.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    owner = environ.get("WATCHDOG_PID", "")
    if owner and (not owner.isdigit() or int(owner) != pid):
        return None
    return int(usec) / 2 / 1_000_000


class Notifier:
    def __init__(self, address: str) -> None:
        self.address = address
        self.sent: list[str] = []
        self._failed = False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.setblocking(False)

    def notify(self, *assignments: str) -> bool:
        message = "\n".join(assignments)
        try:
            self._sock.sendto(message.encode(), self.address)
        except OSError as exc:
            if not self._failed:  # once: a dead socket must not flood the log
                logs.warning("sd_notify_failed", message=message, error=exc.strerror or str(exc))
            self._failed = True
            return False
        self._failed = False
        self.sent.append(message)
        del self.sent[:-16]
        return True

    def close(self) -> None:
        self._sock.close()


def from_environ(environ: Mapping[str, str] | None = None) -> Notifier | None:
    env = os.environ if environ is None else environ
    address = socket_address(env.get("NOTIFY_SOCKET", ""))
    return Notifier(address) if address is not None else None


def ready_to_serve(view: RelayView) -> bool:
    if not view.started():
        return False
    listener = view.listener()
    lanes = view.lanes()
    return (
        listener is not None
        and listener.up
        and bool(lanes)
        and all(lane.turns >= 2 for lane in lanes)
    )


async def supervise(
    settings: Settings,
    view: RelayView,
    notifier: Notifier,
    environ: Mapping[str, str] | None = None,
) -> None:
    """READY, WATCHDOG and STOPPING for one relay run; runs until cancelled."""
    env = os.environ if environ is None else environ
    interval = watchdog_interval(env, os.getpid())
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_stopping, view, notifier)
            # No event to wait on for "LISTEN up and first pass ran": look every 50 ms.
            while not ready_to_serve(view) and not view.stop_requested():  # noqa: ASYNC110
                await anyio.sleep(STARTUP_CHECK)
            if not view.stop_requested():
                notifier.notify("READY=1", "STATUS=delivering")
                logs.info("sd_notify_ready", watchdog_s=interval)
            if interval is not None:
                await _watchdog(view, notifier, interval, stall_limit(settings))
    finally:
        notifier.close()


async def _stopping(view: RelayView, notifier: Notifier) -> None:
    await view.wait_stop_requested()
    notifier.notify("STOPPING=1", "STATUS=draining in-flight batches")


async def _watchdog(view: RelayView, notifier: Notifier, interval: float, limit: float) -> None:
    """Ping while every loop turns within `limit`: the same bound as /healthz, since a lane
    slowed by a database outage is not stuck, and withholding pings then would restart every
    replica at once."""
    since = anyio.current_time()
    withheld = False
    while True:
        turned = [lane.turned_at for lane in view.lanes()]
        if view.stop_requested() or loops_alive(turned, since, anyio.current_time(), limit):
            notifier.notify("WATCHDOG=1")
            withheld = False
        elif not withheld:
            logs.error("watchdog_withheld", stalled_for_s=round(limit, 3))
            withheld = True
        await anyio.sleep(interval)
