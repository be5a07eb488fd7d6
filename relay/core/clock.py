"""The relay's clock on its hot paths: the event loop's, read directly.

On asyncio, the relay's only backend (docs/style.md), `anyio.current_time()` is the loop's
`time()`, which is `time.monotonic()`. Read through anyio's backend lookup it costs about
0.4 us; a POST reads the clock about ten times (its turn and permit, its lease's trust window,
its round trip, its batch's database time, its claim and renewal statements), and a profile of the
relay at a fast ingress put `anyio.current_time` at 4-5% of the relay's CPU (issue 42's bench,
docs/performance.md). So the hot paths read `now()`; code that runs a few times a second may read
either, since they are one clock (tests/test_clock.py holds them together).
"""

from __future__ import annotations

import time

now = time.monotonic  # seconds, monotonic: the event loop's clock on asyncio
