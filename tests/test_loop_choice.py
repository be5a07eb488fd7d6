import pytest

from relay.core import loop
from relay.settings import _choice


def test_auto_takes_uvloop_where_installed() -> None:
    assert loop.choose("auto", installed=True) == "uvloop"
    assert loop.choose("auto", installed=False) == "asyncio"


def test_asyncio_is_pinned_and_uvloop_missing_is_refused_by_name() -> None:
    assert loop.choose("asyncio", installed=True) == "asyncio"
    assert loop.choose("uvloop", installed=True) == "uvloop"
    with pytest.raises(loop.LoopUnavailable, match="event_loop=uvloop"):
        loop.choose("uvloop", installed=False)
    assert loop.backend_options("uvloop") == {"use_uvloop": True}


def test_a_bad_value_is_refused() -> None:
    with pytest.raises(ValueError, match="auto, uvloop, asyncio"):
        _choice("auto", "uvloop", "asyncio")("trio")
