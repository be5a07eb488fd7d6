"""`relay inspect` shows each event's last answer (issue 49 item 6): a run whose head was answered
500 backs off with that status on the run (runs.last_status, which `relay retry --backing-off`
showed), and inspect showed `-` for it, reading only the failures kept per event. Through the
real `relay inspect` (text and --json) against a real database, after a real 500 from the
reference ingress on a real socket to a relay in this process."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

import relay
from relay.runner import Relay
from tests.support import Rig, wait_for
from tests.test_ops import cli, cli_env, cli_json

pytestmark = pytest.mark.anyio


def run_row(rig: Rig, run_id: str) -> dict[str, Any]:
    row = rig.conn.execute(
        rig.q("select attempts, last_status from {s}.runs where run_id = %s"), (run_id,)
    ).fetchone()
    return {"attempts": row[0], "last_status": row[1]} if row else {}


async def test_inspect_shows_the_500_its_head_backs_off_after(rig: Rig) -> None:
    with rig.conn.transaction():
        for i in (1, 2):
            relay.enqueue(rig.conn, "r500", f"r500-{i}", "step", {"i": i}, schema=rig.schema)
    rig.sink.faults.set_default(500)  # the ingress answers every POST 500
    async with Relay(rig.settings()).running():
        await wait_for(lambda: run_row(rig, "r500").get("attempts", 0) >= 1, what="a failure")
    assert run_row(rig, "r500")["last_status"] == 500  # what retry --backing-off reads

    env = cli_env(rig.pg_url, rig.schema)
    data = await anyio.to_thread.run_sync(lambda: cli_json(env, "inspect", "r500"))
    head, rest = data["events"]
    assert (head["state"], head["last_status"]) == ("pending", 500), head
    assert head["attempts"] == data["run"]["attempts"] >= 1
    assert head["last_error"] and "500" in head["last_error"], head
    assert (rest["last_status"], rest["last_error"]) == (None, None)  # never answered yet

    text = await anyio.to_thread.run_sync(lambda: cli(env, "inspect", "r500"))
    assert text.returncode == 0, text.stderr
    [row] = [line for line in text.stdout.splitlines() if "r500-1" in line and "step" in line]
    assert " 500 " in row, text.stdout
    [other] = [line for line in text.stdout.splitlines() if "r500-2" in line and "step" in line]
    assert " 500 " not in other, text.stdout
