"""Unit tests for relay.edges.listener's notification handling (DESIGN §4.1), without a connection:
`dispatch` turns every payload into exactly one wake, and a malformed one never crashes it."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import orjson
import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from relay.edges.listener import MAX_PAYLOAD, Listener
from tests.support import relay_logs

CHANNEL = "x_terminal"


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None]] = []

    def terminal(self, run_id: str) -> None:
        self.calls.append(("terminal", run_id))

    def delivered(self, run_id: str) -> None:
        self.calls.append(("delivered", run_id))

    def wake(self) -> None:
        self.calls.append(("wake", None))

    def connected(self) -> None:
        self.calls.append(("connected", None))


def make() -> tuple[Listener, Recorder]:
    rec = Recorder()
    listener = Listener(
        "postgresql://unused",
        CHANNEL,
        on_terminal=rec.terminal,
        on_delivered=rec.delivered,
        on_wake=rec.wake,
        on_connected=rec.connected,
    )
    return listener, rec


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def logged() -> Iterator[list[logging.LogRecord]]:
    """Records of the `relay` logger, whatever another test configured it to do."""
    with relay_logs(_Capture()) as handler:
        yield handler.records


def payload(**fields: object) -> str:
    return orjson.dumps(fields).decode()


def test_constructing_does_not_connect() -> None:
    listener, rec = make()
    assert listener.terminal_channel == CHANNEL
    assert (listener.up, listener.state.received, listener.state.malformed) == (False, 0, 0)
    assert rec.calls == []


def test_an_observer_reads_a_copy_of_the_state_as_it_was_when_it_asked() -> None:
    listener, _ = make()
    seen = listener.view()
    listener.dispatch("absurd_wake", "")
    assert (seen.received, listener.view().received) == (0, 1)
    seen.up = True  # an observer's copy is its own
    assert not listener.up


def test_terminal_committed_drains_that_run() -> None:
    listener, rec = make()
    listener.dispatch(CHANNEL, payload(kind="terminal_committed", run_id="run-7"))
    assert rec.calls == [("terminal", "run-7")]
    assert (listener.state.received, listener.state.malformed) == (1, 0)


def test_outbox_delivered_goes_to_on_delivered() -> None:
    listener, rec = make()
    listener.dispatch(
        CHANNEL,
        payload(kind="outbox_delivered", run_id="run-7", last_seq=9, event_ids=["a", "b"]),
    )
    assert rec.calls == [("delivered", "run-7")]
    assert listener.state.malformed == 0


def test_extra_fields_and_odd_run_ids_are_fine() -> None:
    listener, rec = make()
    for run_id in ("a/b", "é🚀", " ", "x" * 1000):
        listener.dispatch(CHANNEL, payload(kind="terminal_committed", run_id=run_id, extra=[1]))
    assert [c[1] for c in rec.calls] == ["a/b", "é🚀", " ", "x" * 1000]
    assert listener.state.malformed == 0


@pytest.mark.parametrize("text", ["default", "", "not json at all", '{"kind": 1}'])
def test_absurd_wake_is_a_discovery_pass(text: str) -> None:
    listener, rec = make()
    listener.dispatch("absurd_wake", text)
    assert rec.calls == [("wake", None)]
    assert (listener.state.received, listener.state.malformed) == (1, 0)


@pytest.mark.parametrize("channel", ["other", "relay_terminal", "X_TERMINAL", ""])
def test_any_other_channel_is_a_discovery_pass(channel: str) -> None:
    listener, rec = make()
    listener.dispatch(channel, payload(kind="terminal_committed", run_id="run-7"))
    assert rec.calls == [("wake", None)]


def test_unknown_kind_on_the_terminal_channel_is_a_discovery_pass() -> None:
    listener, rec = make()
    listener.dispatch(CHANNEL, payload(kind="something_new", run_id="run-7"))
    assert rec.calls == [("wake", None)]
    assert listener.state.malformed == 0


MALFORMED = [
    "",
    "   ",
    "not json",
    "{",
    '{"kind": "terminal_committed", "run_id": "r"',  # truncated
    "null",
    "true",
    "42",
    '"terminal_committed"',
    '["terminal_committed", "r"]',
    "{}",
    '{"kind": "terminal_committed"}',  # no run_id
    '{"run_id": "r"}',  # no kind
    '{"kind": "terminal_committed", "run_id": ""}',
    '{"kind": "terminal_committed", "run_id": null}',
    '{"kind": "terminal_committed", "run_id": 7}',
    '{"kind": "terminal_committed", "run_id": ["r"]}',
    '{"kind": "terminal_committed", "run_id": {"id": "r"}}',
    '{"kind": "terminal_committed", "run_id": true}',
    '{"kind": null, "run_id": "r"}',
    '{"kind": 1, "run_id": "r"}',
    '{"kind": ["terminal_committed"], "run_id": "r"}',
    '{"kind": "outbox_delivered", "run_id": 3}',
    "\x00",
    "\ud800",  # a lone surrogate: not valid UTF-8
]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_payload_is_counted_logged_and_wakes(
    text: str, logged: list[logging.LogRecord]
) -> None:
    listener, rec = make()
    listener.dispatch(CHANNEL, text)
    assert rec.calls == [("wake", None)]
    assert (listener.state.received, listener.state.malformed) == (1, 1)
    (record,) = logged
    assert record.levelno == logging.WARNING
    assert record.getMessage() == "notification_ignored"
    assert record.fields["channel"] == CHANNEL  # type: ignore[attr-defined]


@pytest.mark.parametrize("text", MALFORMED)
def test_parse_rejects_malformed(text: str) -> None:
    assert Listener._parse(text) is None


def test_parse_accepts_a_well_formed_payload() -> None:
    assert Listener._parse(payload(kind="terminal_committed", run_id="r")) == (
        "terminal_committed",
        "r",
    )


def test_oversized_payload_is_malformed_and_only_an_excerpt_is_logged(
    logged: list[logging.LogRecord],
) -> None:
    listener, rec = make()
    filler = "x" * (MAX_PAYLOAD + 1)
    text = payload(kind="terminal_committed", run_id="run-7", pad=filler)
    listener.dispatch(CHANNEL, text)
    assert rec.calls == [("wake", None)]
    assert listener.state.malformed == 1
    (record,) = logged
    assert len(record.fields["payload"]) <= 200  # type: ignore[attr-defined]


def test_payload_limit_is_in_bytes_not_characters() -> None:
    # PostgreSQL limits NOTIFY payloads to 8000 *bytes*; 3000 '€' are 9000 bytes.
    base = payload(kind="terminal_committed", run_id="r", pad="")
    pad_chars = 3000
    text = payload(kind="terminal_committed", run_id="r", pad="€" * pad_chars)
    assert len(text) < MAX_PAYLOAD < len(text.encode())
    assert Listener._parse(text) is None
    # At the limit exactly it is still accepted.
    exact = payload(kind="terminal_committed", run_id="r", pad="x" * (MAX_PAYLOAD - len(base)))
    assert len(exact.encode()) == MAX_PAYLOAD
    assert Listener._parse(exact) == ("terminal_committed", "r")


@hsettings(deadline=None)  # no wall-clock threshold: the machine may be busy
@given(st.text(max_size=300))
def test_dispatch_never_raises_and_always_wakes_exactly_once(text: str) -> None:
    listener, rec = make()
    listener.dispatch(CHANNEL, text)
    assert len(rec.calls) == 1
    kind, _ = rec.calls[0]
    assert (kind == "wake") or listener.state.malformed == 0


@hsettings(deadline=None)  # no wall-clock threshold: the machine may be busy
@given(
    st.dictionaries(
        st.sampled_from(["kind", "run_id", "other"]),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(min_value=-(2**63), max_value=2**63 - 1),
            st.floats(allow_nan=False),
            st.text(max_size=10),
            st.sampled_from(["terminal_committed", "outbox_delivered"]),
            st.lists(st.text(max_size=3), max_size=2),
        ),
    )
)
def test_dispatch_routes_by_kind_or_wakes(msg: dict[str, object]) -> None:
    listener, rec = make()
    listener.dispatch(CHANNEL, orjson.dumps(msg).decode())
    kind, run_id = msg.get("kind"), msg.get("run_id")
    valid = isinstance(kind, str) and isinstance(run_id, str) and run_id != ""
    if valid and kind == "terminal_committed":
        assert rec.calls == [("terminal", run_id)]
    elif valid and kind == "outbox_delivered":
        assert rec.calls == [("delivered", run_id)]
    else:
        assert rec.calls == [("wake", None)]
    assert listener.state.malformed == (0 if valid else 1)


def test_counters_accumulate() -> None:
    listener, rec = make()
    listener.dispatch(CHANNEL, payload(kind="terminal_committed", run_id="a"))
    listener.dispatch(CHANNEL, "junk")
    listener.dispatch("absurd_wake", "q")
    listener.dispatch(CHANNEL, "{}")
    assert (listener.state.received, listener.state.malformed) == (4, 2)
    assert [c[0] for c in rec.calls] == ["terminal", "wake", "wake", "wake"]
