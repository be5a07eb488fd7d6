"""Every command reads its secrets the same way (issue 15 item 1): with nothing but systemd's
`$CREDENTIALS_DIRECTORY` (the shipped units' `LoadCredential=`), each of migrate, status,
inspect, retry, skip, check and run reaches the real database."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import unique

RELAY = [sys.executable, "-m", "relay.cli"]


def base_env(creds: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    return {**env, "CREDENTIALS_DIRECTORY": str(creds), **extra}


@pytest.fixture
def creds(pg_url: str, tmp_path: Path) -> Path:
    (tmp_path / "database_url").write_text(pg_url + "\n")
    (tmp_path / "database_url").chmod(0o400)  # as systemd writes a credential
    return tmp_path


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RELAY, *args], capture_output=True, text=True, env=env, timeout=120)


def test_each_command_reads_the_database_url_from_credentials(pg_url: str, creds: Path) -> None:
    schema = unique("cred")
    env = base_env(creds, RELAY_SCHEMA=schema)
    migrated = run(["migrate"], env)
    assert migrated.returncode == 0, migrated.stderr
    assert f"schema {schema} at version" in migrated.stdout
    for command in (["status"], ["inspect", "no-such-run"]):
        got = run(command, env)
        # Connected and answered (a missing run is its own exit code, not a config error).
        assert got.returncode != 2, (command, got.stderr)
        assert "database_url" not in got.stderr, (command, got.stderr)
    status = run(["status", "--json"], env)
    assert status.returncode == 0, status.stderr
    for command in (["retry", "no-such-event"], ["skip", "no-such-event", "--reason", "x"]):
        got = run(command, env)
        assert got.returncode not in (0, 2), (command, got.stdout, got.stderr)
        assert "no-such-event" in got.stdout + got.stderr, (command, got.stderr)
    checked = run(["check"], {**env, "RELAY_INGRESS_URL": "http://127.0.0.1:9/{run_id}"})
    # The database, schema and LISTEN checks pass from the credential; only the ingress fails.
    verdicts = {
        line.split()[1]: line.split()[0] for line in checked.stdout.splitlines() if line.strip()
    }
    assert verdicts == {
        "configuration": "ok",
        "database": "ok",
        "schema": "ok",
        "listen": "ok",
        "ingress": "FAIL",
    }, checked.stdout
