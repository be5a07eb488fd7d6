"""A broken or hostile ingress (issue 13 item 6): a 2xx whose body is not JSON, or is cut at
the read limit, is not "all accepted" (DESIGN §5) — the batch is rescheduled, and acked only
once an answer says it was taken."""

from __future__ import annotations

import pytest

import relay
from relay.edges.ingress import MAX_BODY
from tests.support import HTTP_TRANSPORTS, Rig, q, wait_for

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"{not json", "not JSON"),
        # Parses once cut (JSON allows trailing blanks), but was cut: what was taken is unknown.
        (b'{"accepted": 1}' + b" " * (MAX_BODY + 4096), "cut at the read limit"),
    ],
    ids=["garbled", "cut"],
)
@pytest.mark.parametrize("http_transport", HTTP_TRANSPORTS)
async def test_a_2xx_that_cannot_be_read_is_retried_not_acked(
    rig: Rig, body: bytes, error: str, http_transport: str
) -> None:
    s, conn, schema = rig.sink, rig.conn, rig.schema
    s.faults.fail(200, body=body)  # the first answer only; the retry gets a real one
    with conn.transaction():
        relay.enqueue(conn, "r1", "r1-1", "step", {}, schema=schema)
        relay.enqueue(conn, "r1", "r1-2", "step", {}, schema=schema)
    async with rig.relay(http_transport=http_transport, max_backoff="0.5s").running():
        await wait_for(lambda: rig.count("state = 'delivered'") == 2, what="the retry")
    assert [x["fault"] for x in s.state.received] == ["fail", None], "acked on the bad answer"
    # one rescheduled attempt (the run's, schema version 7: cleared by the ack), then delivered
    row = conn.execute(q(schema, "select state, attempts from {s}.events where seq = 1")).fetchone()
    assert row == ("delivered", 0), row
    assert s.state.first_order["r1"] == [1, 2]
    runs = conn.execute(q(schema, "select last_error from {s}.runs")).fetchone()
    assert runs == (None,)
