"""`relay sink` as a command (issue 15 item 6): a busy port is one line and exit 2; --host and
--port say what they are; in json mode every stderr line, uvicorn's too, is one JSON object."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
import pytest
from anyio.abc import Process

from tests.support import wait_for
from tests.test_cli import RELAY
from tests.test_sink import body as sink_body

ENV = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}


def test_a_busy_port_is_one_line_and_exit_2() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        got = subprocess.run(
            [*RELAY, "sink", "--port", str(port)],
            env=ENV, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    assert got.returncode == 2, got.stderr
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0], got.stderr
    assert "in use" in lines[0].lower(), lines[0]


def test_host_and_port_have_help_text() -> None:
    got = subprocess.run(
        [*RELAY, "sink", "--help"], env=ENV, capture_output=True, text=True, timeout=60, check=True
    )
    text = " ".join(got.stdout.split())
    assert "--host HOST address to listen on" in text, got.stdout
    assert "--port PORT TCP port to listen on" in text, got.stdout


def listening_url(err: Path) -> str:
    url: str = orjson.loads(err.read_text().splitlines()[0])["url"]
    return url


@asynccontextmanager
async def json_sink(err: Path, *flags: str) -> AsyncIterator[tuple[Process, str]]:
    """`relay sink --log-format json` in a subprocess, stderr to `err`: (it, its URL). Leaving
    the block kills it if the test did not stop it."""
    with err.open("wb") as f:
        proc = await anyio.open_process(
            [*RELAY, "sink", "--port", "0", "--log-format", "json", *flags],
            env=ENV, stdout=subprocess.DEVNULL, stderr=f,
        )  # fmt: skip
    try:
        await wait_for(lambda: "sink_listening" in err.read_text(), what="listening")
        yield proc, listening_url(err)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def stop(proc: Process) -> None:
    proc.send_signal(signal.SIGTERM)
    with anyio.fail_after(30):
        assert await proc.wait() == 0


@pytest.mark.anyio
async def test_json_mode_makes_uvicorn_lines_json_too(tmp_path: Path) -> None:
    err = tmp_path / "stderr.log"
    async with json_sink(err) as (proc, url):
        host, _, port = url.removeprefix("http://").rpartition(":")
        # Garbage instead of HTTP: uvicorn logs "Invalid HTTP request received." (a warning).
        async with await anyio.connect_tcp(host, int(port)) as conn:
            await conn.send(b"\x16\x03\x01 not http\r\n\r\n")
            with anyio.move_on_after(10):
                await conn.receive()
        await wait_for(lambda: '"logger":"uvicorn' in err.read_text(), what="uvicorn's warning")
        await stop(proc)
    for line in err.read_text().splitlines():
        record: dict[str, Any] = orjson.loads(line)
        assert {"ts", "level", "logger"} <= record.keys() and ("event" in record or "msg" in record)


@pytest.mark.anyio
@pytest.mark.parametrize("enabled", [False, True], ids=["default", "fault-control"])
async def test_fault_and_reset_controls_answer_403_unless_enabled(
    tmp_path: Path, enabled: bool
) -> None:
    """/_sink/faults and /_sink/reset take no authentication, even with a signing secret: a sink
    refuses them unless started with --fault-control, and a refused call changes nothing."""
    flags = ["--fault-control"] if enabled else []
    async with json_sink(tmp_path / "stderr.log", *flags) as (proc, url):
        async with httpx.AsyncClient(base_url=url) as client:
            body = sink_body("r1", [1])
            headers = {"relay-lease-epoch": "1"}
            assert (await client.post("/runs/r1/events", json=body, headers=headers)).is_success
            fail = {"action": "default", "status": 503}
            faults = await client.post("/_sink/faults", json=fail)
            reset = await client.post("/_sink/reset")
            if enabled:
                assert (faults.status_code, reset.status_code) == (200, 200)
            else:
                assert (faults.status_code, reset.status_code) == (403, 403)
                assert "--fault-control" in faults.json()["error"]
            stats = (await client.get("/_sink/stats")).json()
            again = await client.post("/runs/r1/events", json=body, headers=headers)
        if enabled:  # reset forgot r1, and the default fault now answers 503
            assert again.status_code == 503 and stats["unique_events"] == 0, stats
        else:  # nothing changed: r1's event is still counted, and the sink answers 200
            assert again.status_code == 200 and stats["unique_events"] == 1, stats
        await stop(proc)
