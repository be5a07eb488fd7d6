"""The contracts, held by code that is not ours: a producer written only against DESIGN §3 (plain
SQL, no helper) and an ingress written only against §5 (the standard library's http.server,
not `relay sink`) work with `relay run` unchanged — with two replicas, one of them SIGKILLed
mid-run. Every test here runs once per HTTP transport (`http_transport`): the contract is the
relay's, whichever client sends the POST."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import unquote

import psycopg
import pytest
from psycopg import sql

from tests.support import HTTP_TRANSPORTS, assert_acked_only_if_received, wait_for
from tests.test_cli import relay_env, replicas, stop_all

pytestmark = pytest.mark.anyio

# A Standard Webhooks secret (§5): the ingress below verifies every POST's signature with it.
SECRET = "whsec_" + base64.b64encode(b"contract-suite-secret-0123456789").decode()


@pytest.fixture(params=HTTP_TRANSPORTS)
def http_transport(request: pytest.FixtureRequest) -> str:
    """Each contract test runs over every HTTP client."""
    return str(request.param)


def signature_problems(headers: Any, raw: bytes) -> list[str]:
    """What is wrong with a POST's Standard Webhooks headers, checked as §5 words them."""
    msg_id, ts = headers.get("webhook-id"), headers.get("webhook-timestamp")
    sent = headers.get("webhook-signature") or ""
    if not msg_id or not ts or not ts.isdigit():
        return [f"webhook-id {msg_id!r} / webhook-timestamp {ts!r} missing or malformed"]
    key = base64.b64decode(SECRET.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{ts}.".encode() + raw, hashlib.sha256).digest()
    if "v1," + base64.b64encode(mac).decode() not in sent.split(" "):
        return [f"webhook-signature {sent!r} does not sign the body"]
    return []


def _rfc3339_with_offset(value: object) -> bool:
    """`2026-12-02T12:56:42.450426+00:00`: a date, a time and an offset (or Z), nothing else."""
    pattern = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?([+-]\d\d:\d\d|Z)"
    return isinstance(value, str) and re.fullmatch(pattern, value) is not None


class PlainIngress(BaseHTTPRequestHandler):
    """An ingress per §5: idempotent on event_id, answers 2xx; records first deliveries."""

    lock = threading.Lock()
    seen: ClassVar[dict[str, int]] = {}
    order: ClassVar[dict[str, list[int]]] = {}
    epochs: ClassVar[dict[str, int]] = {}

    violations: ClassVar[list[str]] = []  # checked on the test's own thread, with messages

    def do_POST(self) -> None:
        problems = []
        parts = self.path.split("/")
        if len(parts) != 4 or parts[1] != "runs" or parts[3] != "events":
            problems.append(f"path {self.path!r} is not /runs/<run_id>/events")
        run_id = unquote(parts[2]) if len(parts) > 2 else ""
        raw = self.rfile.read(int(self.headers["content-length"]))
        body = json.loads(raw)
        if self.headers.get("content-type") != "application/json":
            problems.append(f"content-type {self.headers.get('content-type')!r}")
        if not (self.headers.get("user-agent") or "").startswith("ledger-relay/"):
            problems.append(f"user-agent {self.headers.get('user-agent')!r}")
        problems += signature_problems(self.headers, raw)
        if body.get("run_id") != run_id:
            problems.append(f"body run_id {body.get('run_id')!r} is not the URL's {run_id!r}")
        if self.headers.get("relay-lease-epoch") != str(body.get("epoch")):
            problems.append(
                f"relay-lease-epoch {self.headers.get('relay-lease-epoch')!r} is not the body's"
                f" epoch {body.get('epoch')!r}"
            )
        fields = {"event_id", "seq", "type", "terminal", "payload", "created_at"}
        for event in body.get("events", []):
            if set(event) != fields:
                problems.append(f"event fields {sorted(event)} are not {sorted(fields)}")
            elif not _rfc3339_with_offset(event["created_at"]):
                problems.append(f"created_at {event['created_at']!r} is not RFC 3339 with offset")
        if problems:
            with self.lock:
                self.violations.extend(problems)
            self.send_response(400)  # poison: visible, never silently accepted
            self.send_header("content-length", "0")
            self.end_headers()
            return
        with self.lock:
            self.epochs[run_id] = max(self.epochs.get(run_id, 0), body["epoch"])
            for event in body["events"]:
                n = self.seen.get(event["event_id"], 0)
                self.seen[event["event_id"]] = n + 1
                if n == 0:
                    self.order.setdefault(run_id, []).append(event["seq"])
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def plain_ingress() -> Iterator[str]:
    PlainIngress.seen, PlainIngress.order, PlainIngress.epochs = {}, {}, {}
    PlainIngress.violations = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), PlainIngress)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def plain_producer(conn: psycopg.Connection[Any], schema: str, runs: range, steps: int) -> int:
    """Only SQL: `<schema>.enqueue(run_id, event_id, event_type, payload, terminal)` per §3."""
    enqueue = sql.SQL("select {}.enqueue(%s, %s, %s, %s::jsonb, %s)").format(sql.Identifier(schema))
    n = 0
    for r in runs:
        with conn.transaction():
            for i in range(steps):
                conn.execute(
                    enqueue, (f"run {r}/x", f"ev-{r}-{i}", "step", json.dumps({"i": i}), False)
                )
                n += 1
        with conn.transaction():  # the terminal event in a later transaction, as a scheduler would
            conn.execute(enqueue, (f"run {r}/x", f"ev-{r}-end", "run_finished", "{}", True))
            n += 1
    return n


async def test_foreign_producer_and_ingress_with_a_replica_killed(
    pg_url: str,
    schema: str,
    conn: psycopg.Connection[Any],
    plain_ingress: str,
    tmp_path: Path,
    http_transport: str,
) -> None:
    sent = plain_producer(conn, schema, range(0, 80), 4)
    env = relay_env(
        pg_url,
        schema,
        plain_ingress,
        RELAY_LEASE_TTL="3s",
        RELAY_HTTP_TIMEOUT="1s",
        RELAY_HTTP_TRANSPORT=http_transport,
        RELAY_SIGNING_SECRET=SECRET,
    )
    async with replicas(2, env, tmp_path) as procs:
        sent += plain_producer(conn, schema, range(80, 120), 4)  # while they run
        await wait_for(
            lambda: len(PlainIngress.seen) >= 150 or bool(PlainIngress.violations),
            timeout=60,
            what="some delivery",
        )
        assert PlainIngress.violations == [], "the relay broke the §5 contract"
        procs[0].kill()  # SIGKILL mid-run: its leases expire and the survivor takes over
        sent += plain_producer(conn, schema, range(120, 160), 4)
        await wait_for(
            lambda: len(PlainIngress.seen) == sent or bool(PlainIngress.violations),
            timeout=120,
            what="every event",
        )
        assert PlainIngress.violations == [], "the relay broke the §5 contract"
        codes = await stop_all(procs[1:])
    assert codes == [0]
    assert sent == 160 * 5
    for r in range(160):
        assert PlainIngress.order[f"run {r}/x"] == [1, 2, 3, 4, 5]  # first deliveries in order
    pending = conn.execute(
        sql.SQL("select count(*) from {}.events where state <> 'delivered'").format(
            sql.Identifier(schema)
        )
    ).fetchone()
    assert pending == (0,)
    assert_acked_only_if_received(conn, schema, PlainIngress.seen)
