"""One query for many viewers: an answer is kept for `ttl` seconds, and requests that arrive
while it is being fetched wait for that same fetch (single flight) instead of sending their own.

N browsers refreshing the status page at once cost one `ui_status()` per `ttl` per page of
blocked runs, whatever N is (issue 32, item 3). An error is shared like an answer by those
who waited for it, but not kept: the next request after it tries again. A fetch whose own
request is cancelled (its client went away, its deadline passed) leaves no answer: one of the
waiters fetches instead.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import anyio

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass
class _Flight(Generic[V]):
    done: anyio.Event = field(default_factory=anyio.Event)
    value: V | None = None
    error: Exception | None = None
    answered: bool = False


class Coalesced(Generic[K, V]):
    def __init__(
        self,
        fetch: Callable[[K], Awaitable[V]],
        ttl: float,
        clock: Callable[[], float] = anyio.current_time,
    ) -> None:
        self._fetch = fetch
        self.ttl = ttl
        self._clock = clock
        self._kept: dict[K, tuple[float, V]] = {}
        self._flights: dict[K, _Flight[V]] = {}
        self.fetches = 0  # fetches started (tests: one per ttl, whatever the number of viewers)

    def waiting(self, key: K) -> int:
        """Requests waiting for the fetch of `key` in flight."""
        flight = self._flights.get(key)
        return 0 if flight is None else flight.done.statistics().tasks_waiting

    async def get(self, key: K) -> V:
        while True:
            kept = self._kept.get(key)
            if kept is not None and self._clock() - kept[0] < self.ttl:
                return kept[1]
            flight = self._flights.get(key)
            if flight is None:
                return await self._lead(key)
            await flight.done.wait()
            if flight.error is not None:
                raise flight.error
            if flight.answered:
                return flight.value  # type: ignore[return-value]  # V itself may be None

    async def _lead(self, key: K) -> V:
        flight: _Flight[V] = _Flight()
        self._flights[key] = flight
        self.fetches += 1
        try:
            value = await self._fetch(key)
        except Exception as exc:
            flight.error = exc
            raise
        else:
            self._forget_old()
            self._kept[key] = (self._clock(), value)
            flight.value, flight.answered = value, True
            return value
        finally:
            del self._flights[key]
            flight.done.set()

    def _forget_old(self) -> None:
        now = self._clock()
        for key in [k for k, (t, _) in self._kept.items() if now - t >= self.ttl]:
            del self._kept[key]
