"""Which event loop the relay runs on (`event_loop`, issue 52): uvloop where it is installed,
through anyio's public `use_uvloop` option of its asyncio backend, else asyncio's own loop."""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any


class LoopUnavailable(ValueError):
    """`event_loop=uvloop` asked for where uvloop is not installed."""


def uvloop_installed() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def choose(setting: str, installed: bool) -> str:
    """The loop to run on: `uvloop` or `asyncio`. Pure: `installed` says whether uvloop is."""
    if setting == "asyncio":
        return "asyncio"
    if setting == "uvloop" and not installed:
        raise LoopUnavailable("event_loop=uvloop: uvloop is not installed (pip install uvloop)")
    return "uvloop" if installed else "asyncio"


def backend_options(loop: str) -> dict[str, Any]:
    """anyio.run's backend_options for the chosen loop."""
    return {"use_uvloop": loop == "uvloop"}


def running() -> str:
    """The loop this task runs on, by name: `uvloop` or `asyncio` (for the start line)."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.split(".")[0] == "uvloop" else "asyncio"
