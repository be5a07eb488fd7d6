"""Hostile and careless configuration (issue 13): short signing keys, a producer-chosen host,
malformed database URLs that would leak their password, unreadable secret files, and log lines
forged through the text format."""

from __future__ import annotations

import base64
import io
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from relay import logs
from relay.settings import ConfigError, load

INGRESS = "https://ingress.internal/runs/{run_id}/events"
DB = "postgresql://app:pw@db.internal:5432/ledger"


def settings_error(**flags: str) -> str:
    base = {"database_url": DB, "ingress_url": INGRESS}
    with pytest.raises(ConfigError) as caught:
        load({**base, **flags}, environ={})
    return str(caught.value)


@pytest.mark.parametrize("key", [b"", b"a", b"x" * 23])
def test_a_short_signing_key_is_refused(key: bytes) -> None:
    message = settings_error(signing_secret="whsec_" + base64.b64encode(key).decode())
    assert message.startswith("signing_secret")
    assert "at least 24 bytes" in message


def test_a_24_byte_signing_key_is_accepted() -> None:
    secret = "whsec_" + base64.b64encode(b"k" * 24).decode()
    s = load({"database_url": DB, "ingress_url": INGRESS, "signing_secret": secret}, environ={})
    assert [k.reveal() for k in s.signing_secret] == [secret]


@pytest.mark.parametrize(
    "url",
    [
        "http://{run_id}:18099/x",
        "http://{run_id}.ingress.internal/x",
        "http://ingress.internal:{run_id}/x",
        "http://u:{run_id}@ingress.internal/x",
    ],
)
def test_run_id_may_not_choose_the_host_or_port(url: str) -> None:
    message = settings_error(ingress_url=url)
    assert message.startswith("ingress_url")
    assert "only in the path or query" in message


def test_run_id_in_the_query_is_allowed() -> None:
    s = load({"database_url": DB, "ingress_url": "https://i.internal/e?run={run_id}"}, environ={})
    assert s.ingress_url.endswith("?run={run_id}")


SECRET = "Tail-s3cret"


@pytest.mark.parametrize(
    "url",
    [f"postgresql://u:Ab@cd?{SECRET}@host/db", f"postgresql://u:Ab@{SECRET}@host:5432/db"],
)
def test_a_malformed_database_url_fails_without_its_password(url: str) -> None:
    message = settings_error(database_url=url)
    assert message.startswith("database_url")
    assert SECRET not in message and "Ab" not in message, message
    assert "percent-encode" in message or "not a PostgreSQL URL" in message


def relay_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "import sys; from relay.cli import main; sys.exit(main())", *args],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", **env},
        timeout=60,
    )


@pytest.mark.parametrize("command", [["migrate"], ["status"], ["skip", "e1", "--reason", "x"]])
@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_an_unreadable_secret_file_is_one_line_and_exit_2(
    command: list[str], kind: str, tmp_path: Path
) -> None:
    path = tmp_path / "nonexistent" if kind == "missing" else tmp_path
    got = relay_cli(*command, env={"RELAY_DATABASE_URL_FILE": str(path)})
    assert got.returncode == 2, got.stderr
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in got.stderr, got.stderr
    assert "RELAY_DATABASE_URL_FILE" in lines[0] and str(path) in lines[0]


def test_migrate_reads_the_database_url_from_systemd_credentials(tmp_path: Path) -> None:
    """`relay migrate` (the shipped migrate unit) finds $CREDENTIALS_DIRECTORY/database_url like
    `relay run` does; here it names the malformed URL it read from there."""
    (tmp_path / "database_url").write_text(f"postgresql://u:Ab@cd?{SECRET}@host/db\n")
    got = relay_cli("migrate", env={"CREDENTIALS_DIRECTORY": str(tmp_path)})
    assert got.returncode == 2, got.stderr
    # Read from there (not "required"), judged, and reported without its password.
    assert "required" not in got.stderr and "database_url" in got.stderr, got.stderr
    assert SECRET not in got.stderr and "Ab" not in got.stderr, got.stderr


def test_text_log_lines_cannot_be_forged_or_colour_the_terminal() -> None:
    stream = io.StringIO()
    logger = logging.getLogger("relay")
    handlers, level, propagate = logger.handlers[:], logger.level, logger.propagate
    try:
        logs.configure("text", "info", stream)
        logs.error(
            "run_blocked",
            run_id="r\x1b[31mred\r\n12:00:00 info    delivered run_id=forged",
            body="a\u202eb",
        )
    finally:
        logger.handlers[:], logger.level, logger.propagate = handlers, level, propagate
    out = stream.getvalue()
    assert out.count("\n") == 1, out  # one record, one line
    assert "\x1b" not in out and "\r" not in out and "\u202e" not in out
    assert '"r\\u001b[31mred\\r\\n12:00:00 info    delivered run_id=forged"' in out


def test_the_sink_refuses_an_empty_signing_key_in_one_line() -> None:
    got = relay_cli("sink", "--signing-secret", "whsec_", "--port", "0", env={})
    assert got.returncode == 2, got.stderr
    assert "Traceback" not in got.stderr
    assert "at least 24 bytes" in got.stderr.strip().splitlines()[-1]
