"""A lane's POST slots: a bounded number of them, waiters served critical first and in the order
they queued within a class, and a freed slot handed straight to the next waiter (DESIGN §4.3).

The lane (relay/delivery/lane.py) takes one for each single claim or multi-run group before its POST
and frees it once: early when only the acks are left, else when the delivery ends. The queue knows
nothing of claims: a waiter is its class and the keys (the lane's run ids) by which it may be
woken without a slot, when its class may have changed (a promotion) or the lane stops; it then
queues again, or not.

A freed slot is handed over, not contended for again: `release()` gives it to the next waiter
at once, so a caller of `take_nowait()` who comes before that waiter runs finds none free and
the waiter keeps its place. A waiter cancelled after a slot was handed to it passes the slot on,
so cancellation never leaks one.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

import anyio


@dataclass(eq=False, slots=True)
class Waiter:
    """One place in the queue. `critical` as it was when queued: a waiter whose class changes
    is woken (`Slots.wake`) and queues again."""

    critical: bool
    keys: tuple[Hashable, ...]
    granted: bool = False  # a slot was handed to it: the waiter's to release now
    woken: anyio.Event = field(default_factory=anyio.Event)


class Slots:
    """`total` slots: `take_nowait()` or `take()` one, `release()` it once (`release_once()`
    makes a release that may be called again harmlessly)."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError(f"at least one slot, not {total}")
        self.total = total
        self._free = total
        self._waiters: dict[Waiter, None] = {}  # queued, in FIFO order
        self._by_key: dict[Hashable, Waiter] = {}

    @property
    def value(self) -> int:
        """Free slots (anyio.Semaphore's name for it). Never above 0 while anyone waits."""
        return self._free

    @property
    def queued(self) -> tuple[Waiter, ...]:
        """The waiters, in the order they queued (a copy)."""
        return tuple(self._waiters)

    def take_nowait(self) -> bool:
        """Take a free slot, if there is one."""
        if self._free == 0:
            return False
        self._free -= 1
        return True

    async def take(self, critical: bool, keys: Iterable[Hashable] = ()) -> bool:
        """Take a slot, queued for one if none is free: True once the caller has one (to
        release once), False when woken without one (`wake`, `wake_all`). However the wait
        ends, cancelled (a deadline of the caller's) included, the waiter leaves the queue."""
        if self.take_nowait():
            return True
        waiter = Waiter(critical, tuple(keys))
        self._queue(waiter)
        try:
            await waiter.woken.wait()
        except BaseException:
            if waiter.granted:  # handed a slot, then cancelled before it ran: pass it on
                self.release()
            raise
        finally:
            self._leave(waiter)
        return waiter.granted

    def wake(self, key: Hashable) -> None:
        """Wake the waiter queued under `key` without a slot (it may queue again)."""
        waiter = self._by_key.get(key)
        if waiter is not None:
            self._wake(waiter)

    def wake_all(self) -> None:
        """Wake every waiter without a slot (the lane stops)."""
        for waiter in list(self._waiters):
            self._wake(waiter)

    def release(self) -> None:
        """Free a slot: handed to the waiter queued longest, critical ones first, or kept free
        when none waits."""
        if self._waiters:
            waiter = next((w for w in self._waiters if w.critical), next(iter(self._waiters)))
            waiter.granted = True
            self._wake(waiter)
        elif self._free < self.total:
            self._free += 1
        else:
            raise RuntimeError("a POST slot released more often than taken")

    def release_once(self) -> Callable[[], None]:
        """The release of a slot just taken, as a callable that frees it the first time only:
        its holder may free it early (only the acks are left) and again at the end."""
        held = True

        def free() -> None:
            nonlocal held
            if held:
                held = False
                self.release()

        return free

    def _queue(self, waiter: Waiter) -> None:
        self._waiters[waiter] = None
        for key in waiter.keys:
            self._by_key[key] = waiter

    def _leave(self, waiter: Waiter) -> None:
        if waiter in self._waiters:
            del self._waiters[waiter]
            for key in waiter.keys:
                if self._by_key.get(key) is waiter:
                    del self._by_key[key]

    def _wake(self, waiter: Waiter) -> None:
        self._leave(waiter)
        waiter.woken.set()
