"""The reference ingress over real sockets: bookkeeping, faults, both request forms, controls."""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import anyio
import httpx
import pytest

from relay.tools.sink import (
    BadRequest,
    Faults,
    Sink,
    SinkState,
    SinkThread,
    parse_batch,
    serve_sink,
)
from tests.support import wait_for

pytestmark = pytest.mark.anyio


def body(run_id: str, seqs: list[int], epoch: int = 1) -> dict[str, Any]:
    events = [
        {
            "event_id": f"{run_id}-{seq}",
            "seq": seq,
            "type": "step",
            "terminal": False,
            "payload": {"n": seq},
            "created_at": "2025-01-01T00:00:00Z",
        }
        for seq in seqs
    ]
    return {"run_id": run_id, "epoch": epoch, "events": events}


class Ingress:
    """A client for the sink under test."""

    def __init__(self, client: httpx.AsyncClient, sink: Sink) -> None:
        self.client, self.sink = client, sink

    async def post(self, run_id: str, seqs: list[int], epoch: int = 1) -> httpx.Response:
        return await self.client.post(
            f"/runs/{quote(run_id, safe='')}/events",
            json=body(run_id, seqs, epoch),
            headers={"relay-lease-epoch": str(epoch)},
        )


@pytest.fixture
async def ingress() -> AsyncIterator[Ingress]:
    sink = Sink()
    async with serve_sink(sink) as url, httpx.AsyncClient(base_url=url) as client:
        yield Ingress(client, sink)


async def test_accepts_a_batch(ingress: Ingress) -> None:
    r = await ingress.post("r1", [1, 2, 3])
    assert r.status_code == 200
    assert r.json() == {"accepted": 3}
    state = ingress.sink.state
    assert state.first_order == {"r1": [1, 2, 3]}
    assert state.deliveries == {"r1-1": 1, "r1-2": 1, "r1-3": 1}
    assert set(state.first_seen_at) == {"r1-1", "r1-2", "r1-3"}
    assert state.received[0]["headers"]["relay-lease-epoch"] == "1"
    assert state.received[0]["seqs"] == [1, 2, 3]


async def test_counts_duplicates(ingress: Ingress) -> None:
    await ingress.post("r1", [1, 2])
    r = await ingress.post("r1", [2, 3])
    assert r.json() == {"accepted": 2}
    state = ingress.sink.state
    assert state.duplicates == 1
    assert state.deliveries["r1-2"] == 2
    assert state.first_order["r1"] == [1, 2, 3]
    stats = (await ingress.client.get("/_sink/stats")).json()
    assert stats == {
        "requests": 2,
        "events_received": 4,
        "unique_events": 3,
        "duplicates": 1,
        "max_duplicates_of_one_event": 1,
        "order_violations": 0,
        "stale_epochs": 0,
        "runs": 1,
        "unauthorized": 0,
        "unauthorized_by_reason": {},
    }


async def test_detects_order_violations(ingress: Ingress) -> None:
    await ingress.post("r1", [5])
    await ingress.post("r1", [3, 4])
    await ingress.post("r2", [1])  # other runs have their own order
    assert ingress.sink.state.order_violations == 2
    assert ingress.sink.state.first_order == {"r1": [5, 3, 4], "r2": [1]}


async def test_rejects_stale_epochs(ingress: Ingress) -> None:
    assert (await ingress.post("r1", [1], epoch=2)).status_code == 200
    r = await ingress.post("r1", [2], epoch=1)
    assert r.status_code == 409
    assert r.json() == {"stale_epoch": True}
    state = ingress.sink.state
    assert state.stale_epochs == 1
    assert "r1-2" not in state.deliveries
    assert state.max_epoch == {"r1": 2}
    assert (await ingress.post("r1", [2], epoch=3)).status_code == 200


def test_stale_epochs_can_be_accepted() -> None:
    state = SinkState()
    state.reject_stale_epochs = False
    assert state.record("r", 2, body("r", [1])["events"])[0] == 200
    assert state.record("r", 1, body("r", [2])["events"]) == (200, {"accepted": 1})
    assert state.stale_epochs == 1
    assert state.max_epoch == {"r": 2}


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"epoch": True}, "epoch must be a non-negative integer"),  # a bool is no integer
        ({"epoch": -1}, "epoch must be a non-negative integer"),
        ({"run_id": ""}, "run_id must be a non-empty string"),
        ({"events": [body("r", [1])["events"][0]] * 2}, "seqs must be strictly increasing"),
        ({"events": [{**body("r", [1])["events"][0], "seq": True}]}, "seq must be an integer"),
    ],
)
def test_parse_batch_names_what_is_wrong(change: dict[str, Any], problem: str) -> None:
    """The DESIGN §5 body check on its own, without a socket."""
    ok = body("r", [1, 5])
    assert parse_batch(ok) == ("r", 1, ok["events"])
    with pytest.raises(BadRequest, match=problem):
        parse_batch({**ok, **change})


def test_faults_are_taken_first_in_first_out_for_the_request_or_its_run() -> None:
    faults = Faults()
    faults.fail(500, run_id="r1")
    faults.fail(503, times=2)
    assert faults.pending() == 3
    other = faults.take("r2")  # r1's fault is not for r2: the whole-request one is
    assert other is not None and other.status == 503
    first = faults.take("r1")  # first in, first out
    assert first is not None and first.status == 500
    assert faults.take("r1", exact=True) is None  # only a whole-request fault is left
    last = faults.take(None)
    assert last is not None and last.status == 503
    assert faults.pending() == 0 and faults.take(None) is None


async def test_fail_fault_with_retry_after(ingress: Ingress) -> None:
    ingress.sink.faults.fail(503, 2, retry_after="7")
    for _ in range(2):
        r = await ingress.post("r1", [1])
        assert r.status_code == 503
        assert r.headers["retry-after"] == "7"
    assert ingress.sink.state.deliveries == {}
    assert [x["status"] for x in ingress.sink.state.received] == [503, 503]
    assert (await ingress.post("r1", [1])).status_code == 200


async def test_fail_fault_with_raw_body_for_one_run(ingress: Ingress) -> None:
    ingress.sink.faults.fail(422, body=b"<html>nope</html>", run_id="bad")
    assert (await ingress.post("good", [1])).status_code == 200
    r = await ingress.post("bad", [1])
    assert (r.status_code, r.content) == (422, b"<html>nope</html>")
    assert "retry-after" not in r.headers
    assert ingress.sink.faults.pending() == 0


async def test_delay_fault_holds_the_request(ingress: Ingress) -> None:
    ingress.sink.faults.delay(3600)
    with pytest.raises(httpx.ReadTimeout):
        await ingress.client.post(
            "/runs/r1/events",
            json=body("r1", [1]),
            headers={"relay-lease-epoch": "1"},
            timeout=0.2,
        )
    assert ingress.sink.state.requests == 0
    # The next request is not delayed; shutting down (fixture exit) cuts the delay short.
    assert (await ingress.post("r1", [2])).status_code == 200


async def test_delay_fault_then_processes() -> None:
    sink = Sink()
    sink.faults.delay(0.01)
    async with serve_sink(sink) as url, httpx.AsyncClient(base_url=url) as client:
        r = await Ingress(client, sink).post("r1", [1])
    assert r.json() == {"accepted": 1}
    assert sink.state.received[0]["fault"] == "delay"


@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_drop_reply_records_then_cuts_the_connection(http: str) -> None:
    sink = Sink()
    sink.faults.drop_reply()
    async with serve_sink(sink, http=http) as url, httpx.AsyncClient(base_url=url) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await Ingress(client, sink).post("r1", [1, 2])
        assert sink.state.deliveries == {"r1-1": 1, "r1-2": 1}
        r = await Ingress(client, sink).post("r1", [1, 2])
        assert r.json() == {"accepted": 2}
        assert sink.state.duplicates == 2


async def test_accept_only(ingress: Ingress) -> None:
    ingress.sink.faults.accept_only(1)
    r = await ingress.post("r1", [1, 2, 3])
    assert r.json() == {"accepted": 1}
    assert ingress.sink.state.first_order == {"r1": [1]}


async def test_default_status_until_cleared(ingress: Ingress) -> None:
    ingress.sink.faults.set_default(503)
    assert (await ingress.post("r1", [1])).status_code == 503
    assert (await ingress.post("r2", [1])).status_code == 503
    assert (await ingress.client.get("/healthz")).status_code == 200
    ingress.sink.faults.set_default(None)
    assert (await ingress.post("r1", [1])).status_code == 200


@pytest.mark.parametrize(
    ("payload", "headers", "problem"),
    [
        (b"not json", {"relay-lease-epoch": "1"}, "not JSON"),
        (b"[]", {"relay-lease-epoch": "1"}, "not a JSON object"),
        ({**body("r1", [1]), "events": []}, {"relay-lease-epoch": "1"}, "non-empty list"),
        (body("r1", [2, 1]), {"relay-lease-epoch": "1"}, "strictly increasing"),
        (body("other", [1]), {"relay-lease-epoch": "1"}, "does not match the run id"),
        (body("r1", [1]), {"relay-lease-epoch": "2"}, "relay-lease-epoch"),
        (body("r1", [1]), {}, "relay-lease-epoch"),
    ],
)
async def test_malformed_bodies_get_400(
    ingress: Ingress, payload: Any, headers: dict[str, str], problem: str
) -> None:
    content = payload if isinstance(payload, bytes) else None
    r = await ingress.client.post(
        "/runs/r1/events",
        content=content,
        json=None if content is not None else payload,
        headers=headers,
    )
    assert r.status_code == 400
    assert problem in r.json()["error"]
    assert ingress.sink.state.requests == 0


async def test_missing_event_key_names_the_event(ingress: Ingress) -> None:
    payload = body("r1", [1])
    del payload["events"][0]["terminal"]
    r = await ingress.client.post(
        "/runs/r1/events", json=payload, headers={"relay-lease-epoch": "1"}
    )
    assert r.status_code == 400
    assert r.json() == {"error": "event lacks terminal", "event_id": "r1-1"}


@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_url_encoded_run_id_round_trips(http: str) -> None:
    run_id = "tenant/a%2Fb c?ü#"
    sink = Sink()
    async with serve_sink(sink, http=http) as url, httpx.AsyncClient(base_url=url) as client:
        r = await Ingress(client, sink).post(run_id, [1])
    assert r.json() == {"accepted": 1}
    assert sink.state.first_order == {run_id: [1]}


async def test_batch_form(ingress: Ingress) -> None:
    faults = ingress.sink.faults
    faults.fail(503, run_id="r2")
    faults.accept_only(1, run_id="r3")
    await ingress.post("r4", [1], epoch=5)
    r = await ingress.client.post(
        "/batch",
        json={
            "batches": [
                body("r1", [1, 2]),
                body("r2", [1]),
                body("r3", [1, 2]),
                body("r4", [2], epoch=4),
                {"run_id": "r5", "epoch": 1, "events": []},
            ]
        },
    )
    assert r.status_code == 200
    assert r.json() == {
        "results": [
            {"run_id": "r1", "status": 200, "accepted": 2},
            {"run_id": "r2", "status": 503},
            {"run_id": "r3", "status": 200, "accepted": 1},
            {"run_id": "r4", "status": 409, "stale_epoch": True},
            {"run_id": "r5", "status": 400, "error": "events must be a non-empty list"},
        ]
    }
    assert ingress.sink.state.first_order == {"r1": [1, 2], "r3": [1], "r4": [1]}


async def test_batch_form_request_level_faults(ingress: Ingress) -> None:
    ingress.sink.faults.fail(429, retry_after="1")
    ingress.sink.faults.drop_reply()
    batches = {"batches": [body("r1", [1]), body("r2", [1])]}
    r = await ingress.client.post("/batch", json=batches)
    assert (r.status_code, r.headers["retry-after"]) == (429, "1")
    with pytest.raises(httpx.RemoteProtocolError):
        await ingress.client.post("/batch", json=batches)
    assert ingress.sink.state.first_order == {"r1": [1], "r2": [1]}
    assert (await ingress.client.post("/batch", json={"batches": []})).status_code == 400


async def test_control_endpoints() -> None:
    sink = Sink(fault_control=True)
    async with serve_sink(sink) as url, httpx.AsyncClient(base_url=url) as client:
        await _control_endpoints(Ingress(client, sink))


async def _control_endpoints(ingress: Ingress) -> None:
    client = ingress.client
    assert (await client.get("/healthz")).status_code == 200
    r = await client.post(
        "/_sink/faults", json={"action": "fail", "status": 500, "times": 2, "body": "boom"}
    )
    assert r.json() == {"pending": 2, "default": None}
    assert (await ingress.post("r1", [1])).content == b"boom"
    await client.post("/_sink/faults", json={"action": "clear"})
    await client.post("/_sink/faults", json={"action": "accept_only", "k": 0})
    assert (await ingress.post("r1", [1])).json() == {"accepted": 0}
    await client.post("/_sink/faults", json={"action": "default", "status": 502})
    assert (await ingress.post("r1", [1])).status_code == 502
    await client.post("/_sink/faults", json={"action": "default", "status": None})
    assert (await ingress.post("r1", [1])).status_code == 200
    for bad in ({"action": "explode"}, {"action": "fail"}, {"action": "fail", "status": 5}):
        assert (await client.post("/_sink/faults", json=bad)).status_code == 400
    assert (await client.get("/_sink/stats")).json()["unique_events"] == 1
    assert (await client.post("/_sink/reset")).status_code == 200
    assert (await client.get("/_sink/stats")).json()["requests"] == 0
    assert ingress.sink.state.received == []
    assert (await client.get("/nowhere")).status_code == 404
    assert (await client.get("/runs/r1/events")).status_code == 405


def test_sink_thread_start_stop() -> None:
    sink = Sink()
    thread = SinkThread(sink)
    url = thread.start()
    try:
        sink.faults.fail(503)
        with httpx.Client(base_url=url) as client:
            for status in (503, 200):
                r = client.post(
                    "/runs/r1/events", json=body("r1", [1]), headers={"relay-lease-epoch": "1"}
                )
                assert r.status_code == status
        assert thread.stats()["unique_events"] == 1
    finally:
        thread.stop()
    with pytest.raises(httpx.ConnectError), httpx.Client(base_url=url) as client:
        client.get("/healthz")


async def test_shutdown_cuts_injected_delays_short() -> None:
    sink = Sink()
    sink.faults.delay(3600)
    with anyio.fail_after(30):
        async with serve_sink(sink) as url, httpx.AsyncClient(base_url=url) as client:
            async with anyio.create_task_group() as tg:
                tg.start_soon(Ingress(client, sink).post, "r1", [1])
                await wait_for(lambda: sink.faults.pending() == 0, what="the request to arrive")
                tg.cancel_scope.cancel()
    assert sink.state.requests == 0


async def test_main_serves_until_sigterm_and_prints_stats() -> None:
    command = [sys.executable, "-m", "relay.tools.sink", "--port", "0"]
    with anyio.fail_after(30):
        async with await anyio.open_process(command) as process:
            assert process.stderr is not None and process.stdout is not None
            line = b""
            while not line.endswith(b"\n"):
                line += await process.stderr.receive(1)
            url = line.decode().split()[-1]
            async with httpx.AsyncClient(base_url=url) as client:
                r = await client.post(
                    "/runs/r1/events", json=body("r1", [1, 2]), headers={"relay-lease-epoch": "1"}
                )
                assert r.json() == {"accepted": 2}
            process.send_signal(signal.SIGTERM)
            output = b"".join([chunk async for chunk in process.stdout])
            assert await process.wait() == 0
    stats = json.loads(output)
    assert (stats["requests"], stats["unique_events"], stats["runs"]) == (1, 2, 1)
