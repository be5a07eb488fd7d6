"""Run ids remembered only as long as they can still matter (relay/core/recent.py): each for
`ttl` after it was last added, no more than `limit` of them. Pure: the clock is the caller's."""

from __future__ import annotations

from relay.core.recent import Recent


def test_a_name_is_kept_for_its_ttl_and_taken_once() -> None:
    r = Recent(ttl=30.0)
    r.add("a", now=0.0)
    assert r.names(29.9) == {"a"} and r.names(30.0) == set()
    assert r.take("a", now=10.0)
    assert not r.take("a", now=10.0)  # taken: no longer kept
    r.add("b", now=0.0)
    assert not r.take("b", now=30.0)  # its time was up
    assert not r.take("never", now=0.0)


def test_names_whose_time_is_up_are_forgotten_as_others_come() -> None:
    """The leak it exists to stop: names nothing comes back for (a run another replica delivered
    to its end) do not pile up."""
    r = Recent(ttl=30.0)
    for i in range(1000):
        r.add(f"r{i}", now=float(i))  # one a second, none taken
    assert len(r) == 30  # the last 30 s of them
    assert r.names(999.0) == {f"r{i}" for i in range(970, 1000)}


def test_added_again_is_kept_from_then_and_the_oldest_go_first_past_the_limit() -> None:
    r = Recent(ttl=30.0, limit=3)
    for name in ("a", "b", "c"):
        r.add(name, now=0.0)
    r.add("a", now=1.0)  # again: last in the order, kept until 31
    r.add("d", now=2.0)  # past the limit: the oldest, b, goes
    assert r.names(2.0) == {"a", "c", "d"}
    assert r.names(30.5) == {"a", "d"}
    r.discard("a")
    assert r.names(2.0) == {"c", "d"}
