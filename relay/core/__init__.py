"""The pure core: the relay's decisions as values, with no I/O and no event loop.

policy.py (the DESIGN §5 answer table as `decide`, backoff with full jitter, `Retry-After`, the
lease trust window, batch planning), classes.py (which class of discovered work the ordinary
lane claims next: finished runs and any due run in their shares), recent.py (run ids kept for a
lease's time: what a terminal notification left to do) and clock.py (the hot paths' monotonic
clock, read directly). Every layer may use them; they import nothing of the relay
(pyproject.toml, `[tool.importlinter]`), so they are unit-tested without a database.
"""
