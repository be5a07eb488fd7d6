"""The relay's clock on its hot paths: `time.monotonic`, read directly, on either event loop.

On asyncio's own loop `anyio.current_time()` is the loop's `time()`, which is
`time.monotonic()`. Read through anyio's backend lookup it costs about 0.4 us; a POST reads the
clock about ten times (its turn and permit, its lease's trust window, its round trip, its batch's
database time, its claim and renewal statements), and a profile of the relay at a fast ingress
put `anyio.current_time` at 4-5% of the relay's CPU (issue 42's bench, docs/performance.md). So
the hot paths read `now()`.

On uvloop (relay/core/loop.py) the loop's clock is libuv's: the same monotonic clock of the
system, kept in whole milliseconds (`loop.time()` is it rounded down, never ahead of `now()`),
and a timer is armed in whole milliseconds, rounded, from the time libuv read at its iteration's
start. Two consequences, and the rules the relay follows for them (issue 52 item 2):

- `now()` is not bound to the running loop's `time()`: on uvloop that would read a 0.6 ms
  round trip as 0 or 1 ms, and the adaptive limit judges round trips against their recent
  minimum (relay/admission/limit.py). Durations, windows and stamps are read on `now()`, and
  compared only with other readings of `now()` (a lease's trust window, the retry budget's
  view, the ack's resolve loop: none reads the loop's clock against a stamp of this one).
- A wait for a deadline of `now()` may end before the deadline on uvloop (measured here, 300
  sleeps each: to 2.5 ms ahead, 276 ended before it, by up to 0.44 ms; with 0.7 ms of work in
  the loop's iteration first, 231, by up to 1.3 ms; never on asyncio). Whatever wakes for a
  deadline reads `now()` again and waits for what is left: a POST's timer cuts only the
  requests whose deadline `now()` has reached and is armed again for the rest
  (relay/edges/ingress.py, `Deadlines`), and the lease renewer renews only the claims due by
  `now()` (relay/delivery/renewal.py). tests/test_clock_loops.py holds both, on both loops.

Code that runs a few times a second and keeps its own stamps may read `anyio.current_time()`
(the loop's clock: the lanes' turns, the loop lag probe, the pause gate), as long as it does not
mix them with `now()`'s.

Per call, timeit's best of 7 x 500,000 on this machine (CPython 3.11, 2 cores at load 5):
`now()` 111 ns on asyncio and 102 ns on uvloop; the loop's own `time()` 127 ns and 125 ns;
`anyio.current_time()` 2,805 ns and 1,498 ns.
"""

from __future__ import annotations

import time

now = time.monotonic  # seconds, monotonic: asyncio's loop's clock; uvloop's, finer (see above)
