"""A secret canary (DESIGN §7, issue 5): the database password, the ingress token, the signing
secret and an ingress URL's userinfo never appear in any log line, error or CLI output, in
process and in subprocesses, including a failing database login and failing deliveries."""

from __future__ import annotations

import base64
import io
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import httpx
import psycopg
import pytest

from relay import logs
from relay.runner import Relay
from relay.settings import describe
from tests.support import Rig, count, settings, wait_for
from tests.test_cli import RELAY, relay_env, relay_run
from tests.test_relay import enqueue_runs

CANARY = "CANARY" + uuid.uuid4().hex[:12]
DB_PASSWORD = f"pw-{CANARY}-db"
TOKEN = f"tok-{CANARY}-ingress"
URL_PASSWORD = f"up-{CANARY}-url"
UI_TOKEN = f"ui-{CANARY}-page"
# A whsec secret cannot be made to contain the canary once decoded; its text is searched for
# instead, with its key (base64) too.
SIGNING_KEY = base64.b64encode(os.urandom(24)).decode()
SIGNING_SECRET = "whsec_" + SIGNING_KEY
NEEDLES = (CANARY, SIGNING_SECRET, SIGNING_KEY)


def assert_clean(text: str, where: str) -> None:
    for needle in NEEDLES:
        assert needle not in text, f"a secret leaked into {where}: ...{_around(text, needle)}..."


def _around(text: str, needle: str) -> str:
    i = text.index(needle)
    return text[max(0, i - 120) : i + len(needle) + 40]


@pytest.fixture
def role_url(pg_url: str, conn: psycopg.Connection[Any]) -> Iterator[str]:
    """A login role with the canary in its password (superuser: this test is about output, not
    privileges)."""
    role = f"canary_{uuid.uuid4().hex[:8]}"
    conn.execute(
        psycopg.sql.SQL("create role {} login superuser password {}").format(
            psycopg.sql.Identifier(role), psycopg.sql.Literal(DB_PASSWORD)
        )
    )
    parts = urlsplit(pg_url)
    host = f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)
    yield urlunsplit(parts._replace(netloc=f"{role}:{DB_PASSWORD}@{host}"))
    conn.execute(psycopg.sql.SQL("drop role {}").format(psycopg.sql.Identifier(role)))


def failing_login_url(pg_url: str) -> str:
    """A role that does not exist, with the canary as its password: the login fails whatever
    the server's authentication method."""
    parts = urlsplit(pg_url)
    host = f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)
    role = f"nobody_{uuid.uuid4().hex[:8]}"
    return urlunsplit(parts._replace(netloc=f"{role}:{DB_PASSWORD}@{host}"))


def with_userinfo(sink_url: str) -> str:
    parts = urlsplit(sink_url)
    return urlunsplit(parts._replace(netloc=f"user:{URL_PASSWORD}@{parts.netloc}"))


@pytest.mark.anyio
async def test_canary_in_process(rig: Rig, role_url: str, caplog: pytest.LogCaptureFixture) -> None:
    s, conn, schema, url = rig.sink, rig.conn, rig.schema, rig.url
    caplog.set_level("DEBUG", logger="psycopg")  # the pool's own warnings, e.g. failed logins
    stream = io.StringIO()
    logs.configure("json", "debug", stream)
    try:
        # Every kind of decision: a transient failure, a misconfigured answer, a poison event,
        # deliveries.
        s.faults.fail(503, times=1, retry_after="0")  # rescheduled, not retried in the attempt
        s.faults.fail(401, times=1)
        s.faults.fail(422, times=2, run_id="c1")
        enqueue_runs(conn, schema, 3, 2, prefix="c", terminal=False)
        cfg = settings(
            role_url,
            schema,
            with_userinfo(url),
            ingress_token=TOKEN,
            signing_secret=SIGNING_SECRET,
            ui_token=UI_TOKEN,
            metrics_addr="127.0.0.1:0",
            max_backoff="0.5s",
            log_level="debug",
        )
        # describe() is what `relay check`/status print; repr() is what a traceback shows.
        assert_clean(str(describe(cfg)), "describe(settings)")
        assert_clean(repr(cfg) + str(cfg), "repr(settings)")
        assert "ingress_url=" in repr(cfg) and "***" in repr(cfg)
        async with Relay(cfg).running() as r:
            await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 4, what="4")
            await wait_for(lambda: count(conn, schema, "state = 'failed'") == 1, what="poison")
            assert r.endpoints is not None
            async with httpx.AsyncClient() as client:
                for path in ("/metrics", "/readyz", "/healthz"):
                    got = await client.get(f"http://127.0.0.1:{r.endpoints.port}{path}")
                    assert_clean(got.text, path)
                # The status page, as the relay role serves it (its grants suffice).
                bearer = {"authorization": f"Bearer {UI_TOKEN}"}
                for path in ("/", "/api/status", "/runs/c1", "/api/runs/c1", "/x"):
                    got = await client.get(
                        f"http://127.0.0.1:{r.endpoints.port}{path}", headers=bearer
                    )
                    assert got.status_code == (404 if path == "/x" else 200), path
                    assert_clean(got.text, path)
                    assert_clean(str(got.headers), path)
        # The request really carried the secrets (so the test would see a leak of them).
        headers = s.state.received[-1]["headers"]
        assert "authorization" in headers and "webhook-signature" in headers
        # A failing login in process.
        bad = settings(failing_login_url(role_url), schema, url, ingress_token=TOKEN)
        with pytest.raises(BaseException) as info:
            async with Relay(bad).running():
                pass
        assert_clean(repr(info.value) + str(info.value) + _chain(info.value), "the error")
    finally:
        logs.configure("json", "warning")
    text = stream.getvalue()
    for event in ("delivered", "run_blocked", "ingress_misconfigured", "retry_scheduled"):
        assert f'"event":"{event}"' in text, event
    assert_clean(text, "the logs")
    assert "does not exist" in caplog.text  # the failing login was logged by psycopg's pool
    assert_clean(caplog.text, "psycopg's log records")


def _chain(exc: BaseException) -> str:
    out = []
    stack = [exc]
    while stack:
        e = stack.pop()
        out.append(f"{type(e).__name__}: {e}")
        if isinstance(e, BaseExceptionGroup):
            stack.extend(e.exceptions)
        if e.__cause__ is not None:
            stack.append(e.__cause__)
    return "\n".join(out)


def secret_env(db_url: str, schema: str, ingress_url: str) -> dict[str, str]:
    env = relay_env(db_url, schema)
    env.update(
        RELAY_INGRESS_URL=ingress_url + "/runs/{run_id}/events",
        RELAY_INGRESS_TOKEN=TOKEN,
        RELAY_SIGNING_SECRET=SIGNING_SECRET,
        RELAY_LOG_LEVEL="debug",
    )
    return env


@pytest.mark.anyio
async def test_canary_in_subprocesses(rig: Rig, role_url: str, tmp_path: Path) -> None:
    s, conn, schema = rig.sink, rig.conn, rig.schema
    good = secret_env(role_url, schema, with_userinfo(rig.url))
    bad = secret_env(failing_login_url(rig.pg_url), schema, with_userinfo(rig.url))
    outputs: dict[str, str] = {}

    async def cli(name: str, env: dict[str, str], *args: str) -> int:
        got = await anyio.run_process([*RELAY, *args], env=env, check=False)
        outputs[name] = got.stdout.decode() + got.stderr.decode()
        return got.returncode

    # relay run: deliveries, a transient failure, SIGTERM.
    s.faults.fail(503, times=1)
    enqueue_runs(conn, schema, 2, 2, prefix="sub", terminal=False)
    log_path = tmp_path / "run.log"
    with log_path.open("wb") as log:
        async with relay_run(good, stdout=log, stderr=subprocess.STDOUT) as proc:
            await wait_for(lambda: count(conn, schema, "state = 'delivered'") == 4, what="4")
            proc.send_signal(signal.SIGTERM)
            with anyio.fail_after(60):
                assert await proc.wait() == 0
    outputs["run"] = log_path.read_text()
    assert '"event":"delivered"' in outputs["run"]

    assert await cli("check ok", good, "check", "--timeout", "3") == 0
    assert await cli("status", good, "status") == 0
    assert await cli("status json", good, "status", "--json") == 0
    assert await cli("status failing login", bad, "status") != 0
    assert await cli("check failing login", bad, "check", "--timeout", "3") != 0
    assert await cli("run failing login", bad, "run") == 2
    assert await cli("migrate failing login", bad, "migrate") != 0
    invalid = {**good, "RELAY_BATCH_SIZE": "lots"}
    assert await cli("invalid configuration", invalid, "run") == 2
    # The failing login did reach the server and fail, and said so.
    assert "FAIL database" in outputs["check failing login"]
    for name in ("migrate failing login", "status failing login"):
        assert "Traceback" not in outputs[name], outputs[name]
        assert "does not exist" in outputs[name] or "authentication" in outputs[name], name
    for name, text in outputs.items():
        assert text.strip(), name
        assert_clean(text, f"`relay {name}` output")


@pytest.mark.anyio
async def test_configured_token_wins_over_url_userinfo(rig: Rig) -> None:
    s = rig.sink
    enqueue_runs(rig.conn, rig.schema, 1, 1, prefix="u", terminal=False)
    cfg = settings(rig.pg_url, rig.schema, with_userinfo(rig.url), ingress_token=TOKEN)
    async with Relay(cfg).running():
        await wait_for(lambda: bool(s.state.received), what="a POST")
    assert s.state.received[0]["headers"]["authorization"] == f"Bearer {TOKEN}"
