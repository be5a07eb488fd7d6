"""Secrets given as flags show in `ps`: every production command says so, once (issue 15
item 1), and never repeats the secret."""

from __future__ import annotations

import os
import subprocess
from typing import Any

import psycopg
from psycopg import sql

from tests.faults.proxy import via
from tests.test_cli import RELAY, relay_env
from tests.test_logs import dead_port, parse_lines, with_password


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RELAY, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_migrate_with_the_url_as_a_flag_warns_once(pg_url: str) -> None:
    name = "t_flag_" + os.urandom(4).hex()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    url = with_password(pg_url, "pw-in-argv")
    try:
        got = run("migrate", "--database-url", url, "--schema", name, env=env)
        assert got.returncode == 0, got.stderr
        lines = got.stderr.strip().splitlines()
        assert len(lines) == 1 and "--database-url" in lines[0] and "ps" in lines[0], lines
        assert "pw-in-argv" not in got.stderr
        # The same command reading the environment says nothing.
        quiet = run("migrate", env={**env, "RELAY_DATABASE_URL": url, "RELAY_SCHEMA": name})
        assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    finally:
        with psycopg.connect(pg_url, autocommit=True) as c:
            c.execute(sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(name)))


def test_run_warns_in_its_log_format(pg_url: str, schema: str) -> None:
    env: dict[str, Any] = relay_env(pg_url, schema, "http://127.0.0.1:9",
                                    RELAY_STARTUP_TIMEOUT="0.5s")  # fmt: skip
    del env["RELAY_DATABASE_URL"]
    down = with_password(via(pg_url, dead_port()), "pw-in-argv")
    got = run("run", "--database-url", down, "--ingress-token", "tok-in-argv", env=env)
    assert got.returncode == 2, got.stderr
    records = parse_lines(got.stderr)  # every line JSON, the warning too
    (warning,) = [r for r in records if r.get("event") == "secrets_on_command_line"]
    assert warning["flags"] == ["--database-url", "--ingress-token"]
    assert "pw-in-argv" not in got.stderr and "tok-in-argv" not in got.stderr


def test_run_names_a_misspelled_variable_in_its_log_format(pg_url: str, schema: str) -> None:
    env: dict[str, Any] = relay_env(pg_url, schema, "http://127.0.0.1:9",
                                    RELAY_STARTUP_TIMEOUT="0.5s", RELAY_CONCURENCY="8")  # fmt: skip
    env["RELAY_DATABASE_URL"] = via(pg_url, dead_port())
    got = run("run", env=env)
    assert got.returncode == 2, got.stderr
    (warning,) = [r for r in parse_lines(got.stderr) if r.get("event") == "unknown_variables"]
    assert warning["level"] == "warning" and warning["names"] == ["RELAY_CONCURENCY"]
    assert "did you mean RELAY_CONCURRENCY?" in warning["hint"]


def test_check_and_an_invalid_run_name_it_in_one_plain_line(pg_url: str) -> None:
    env = relay_env(pg_url, "relay", "http://127.0.0.1:9", RELAY_DATABSE_URL="x")
    del env["RELAY_DATABASE_URL"]  # the typo is why it is missing
    for command in (["check", "--timeout", "1"], ["run"]):
        got = run(*command, env=env)
        assert got.returncode == 2, got
        lines = got.stderr.strip().splitlines()
        (line,) = [x for x in lines if "RELAY_DATABSE_URL" in x]
        assert line.startswith("relay: warning: ") and "RELAY_DATABASE_URL?" in line, lines
