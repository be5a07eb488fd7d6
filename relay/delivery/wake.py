"""A coalescing wake-up for loops that wait for "something changed" (relay/delivery/lane.py)."""

from __future__ import annotations

import anyio


class Wake:
    """A level-triggered, coalescing wake-up: many set() calls, one wait() return."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self, within: float) -> bool:
        with anyio.move_on_after(within):
            await self._event.wait()
        fired = self._event.is_set()
        if fired:
            self._event = anyio.Event()
        return fired
