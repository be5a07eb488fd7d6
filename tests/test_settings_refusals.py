"""Settings refused at start (issue 49 items 1, 2 and 7; issue 48 item 7): an ingress URL parsed
as httpx will send to it, the database URL's libpq parameters read as libpq will read them,
`relay check` validating what `relay run` validates. Each through the real CLI (`relay run`,
`relay check` in subprocesses: exit code and the one line) and as a unit of the parsing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relay.settings import ConfigError, load

INGRESS = "http://127.0.0.1:9/runs/{run_id}/events"
DB = "postgresql://app@127.0.0.1:1/appdb"


def settings_error(**flags: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load({"database_url": DB, "ingress_url": INGRESS, **flags}, environ={})
    return str(caught.value)


def cli_env(**extra: str) -> dict[str, str]:
    """No database and no ingress: every case here must be refused before either is tried."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update(RELAY_DATABASE_URL=DB, RELAY_INGRESS_URL=INGRESS, RELAY_STARTUP_TIMEOUT="0.5s")
    env.update(extra)
    return env


def relay(command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    args = ["check", "--timeout", "1"] if command == "check" else [command]
    return subprocess.run(
        [sys.executable, "-m", "relay.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def refusal(command: str, env: dict[str, str]) -> str:
    """The one line `relay run` or `relay check` refuses the configuration with, exit 2."""
    got = relay(command, env)
    assert got.returncode == 2, (got.returncode, got.stdout, got.stderr)
    assert "Traceback" not in got.stderr, got.stderr
    if command == "run":
        lines = got.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("relay: invalid configuration: "), lines
    else:
        lines = got.stdout.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("FAIL configuration"), lines
    return lines[0]


# --- item 1: the ingress URLs as httpx will use them ---------------------------------------------


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://ingress.internal:80a80/runs/{run_id}/events", "Invalid port: '80a80'"),
        ("http://ingress.internal:99999/runs/{run_id}/events", "from 1 to 65535, got 99999"),
        ("https://ingress.internal:0/runs/{run_id}/events", "from 1 to 65535, got 0"),
        ("http://10.0.0.300/runs/{run_id}/events", "Invalid IPv4 address: '10.0.0.300'"),
    ],
)
def test_an_ingress_url_httpx_cannot_send_to_is_refused(url: str, why: str) -> None:
    message = settings_error(ingress_url=url)
    assert message.startswith("ingress_url (--ingress-url / RELAY_INGRESS_URL): "), message
    assert why in message, message


def test_the_batch_url_is_parsed_as_httpx_will_too() -> None:
    message = settings_error(ingress_batch_url="http://ingress.internal:80a80/batch")
    assert message.startswith("ingress_batch_url") and "Invalid port: '80a80'" in message


def test_a_port_that_may_be_a_passwords_start_is_not_quoted() -> None:
    """An unencoded '/' in the userinfo ends the authority: 'Kq7v' would be the port."""
    message = settings_error(ingress_url="http://bot:Kq7v/x9@ingress.internal/r/{run_id}")
    assert message.startswith("ingress_url") and "Kq7v" not in message, message


@pytest.mark.parametrize(
    "url",
    [
        "http://ingress.internal:8080/runs/{run_id}/events",
        "https://[::1]:8443/runs/{run_id}/events",
        "https://ingress.internal/e?run={run_id}",
        "http://bot:pw@ingress.internal:65535/runs/{run_id}",
    ],
)
def test_ingress_urls_httpx_takes_still_start(url: str) -> None:
    assert load({"database_url": DB, "ingress_url": url}, environ={}).ingress_url == url


@pytest.mark.parametrize("command", ["run", "check"])
@pytest.mark.parametrize(
    ("option", "url", "needle"),
    [
        ("INGRESS_URL", "http://127.0.0.1:80a80/runs/{run_id}/events", "Invalid port: '80a80'"),
        ("INGRESS_URL", "http://127.0.0.1:99999/runs/{run_id}/events", "from 1 to 65535"),
        ("INGRESS_BATCH_URL", "http://127.0.0.1:80a80/batch", "Invalid port: '80a80'"),
    ],
)
def test_relay_refuses_an_ingress_url_with_a_bad_port(
    command: str, option: str, url: str, needle: str
) -> None:
    """`relay check` died with httpx.InvalidURL's traceback (exit 1), `relay run` looped on
    delivery_error: now both exit 2 with one line naming the setting."""
    line = refusal(command, cli_env(**{f"RELAY_{option}": url}))
    assert option.lower() in line and needle in line, line


# --- item 2: libpq's parameters as libpq will read them ------------------------------------------


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("postgresql://app@db/ledger?sslmode=disabled", "sslmode='disabled' is not one of"),
        ("host=db sslmode=verify_full", "sslmode='verify_full' is not one of"),
        ("postgresql://app@db/ledger?target_session_attrs=writable", "target_session_attrs="),
        ("postgresql://app@db/ledger?gssencmode=off", "gssencmode='off'"),
        ("postgresql://app@db/ledger?connect_timeout=10s", "connect_timeout='10s' is not an"),
        ("postgresql://app@db:99999/ledger", "port 99999 is not from 1 to 65535"),
        ("postgresql://app@db1:5432,db2:0/ledger", "port 0 is not from 1 to 65535"),
    ],
)
def test_a_value_libpq_would_refuse_at_connect_is_refused_at_start(url: str, needle: str) -> None:
    message = settings_error(database_url=url)
    assert message.startswith("database_url (--database-url / RELAY_DATABASE_URL): "), message
    assert needle in message, message


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        (
            "postgresql://app@db/ledger?sslmod=require",
            "no parameter 'sslmod' (did you mean sslmode",
        ),
        ("postgresql://app@db/ledger?pasword=x", "no parameter 'pasword' (did you mean password"),
        ("host=db dbname=ledger sslmod=require", "no parameter 'sslmod' (did you mean sslmode?)"),
        ("host=db pasword=secret", "no parameter 'pasword' (did you mean password?)"),
        ("postgresql://app@db/ledger?colour=blue", "no parameter 'colour'"),
    ],
)
def test_an_unknown_parameter_is_named(url: str, needle: str) -> None:
    message = settings_error(database_url=url)
    assert message.startswith("database_url") and needle in message, message
    assert "secret" not in message.replace("--", "")


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app@db/ledger?password=Kq7v&Zx9w=1",  # an unencoded '&' in a password
        "postgresql://app:Kq7v/Zx9w?Zx9w=1@db/ledger",  # unencoded "/" and "?": a path, a query
        "host=db password='Kq7v Zx9w=1' x",  # a password's blank, its quote unclosed later
        "Zx9w=Kq7v",  # a password (base64's '=') given as the URL
    ],
)
def test_a_name_that_may_be_a_passwords_part_is_not_shown(url: str) -> None:
    message = settings_error(database_url=url)
    assert message.startswith("database_url") and "not a PostgreSQL URL" in message, message
    assert "Kq7v" not in message and "Zx9w" not in message, message


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app:pw@db.internal:5432/ledger?sslmode=verify-full&sslrootcert=/ca.pem",
        "postgresql://app@db1:5432,db2:5433/ledger?target_session_attrs=Read-Write",
        "postgresql://app@db/ledger?ssl=true&load_balance_hosts=random&connect_timeout=5",
        "postgresql:///ledger?host=/run/postgresql",
        "host=db port=5432 dbname=ledger sslmode=prefer gssencmode=disable channel_binding=require",
        "postgresql://app@db/ledger?ssl_min_protocol_version=tlsv1.2&keepalives_idle=30",
        "postgresql://app@db/ledger?sslmode=&connect_timeout=",  # empty: left to libpq
    ],
)
def test_urls_libpq_takes_still_start(url: str) -> None:
    assert load({"database_url": url, "ingress_url": INGRESS}, environ={}).database_url


@pytest.mark.parametrize("command", ["run", "check"])
@pytest.mark.parametrize(
    ("option", "url", "needle"),
    [
        ("DATABASE_URL", "postgresql://app:pw@127.0.0.1:1/appdb?sslmode=disabled", "sslmode"),
        ("DATABASE_URL", "postgresql://app:pw@127.0.0.1:1/appdb?sslmod=require", "'sslmod'"),
        ("LISTEN_DATABASE_URL", "host=127.0.0.1 port=1 pasword=pw", "'pasword'"),
    ],
)
def test_relay_refuses_a_libpq_parameter_at_once(
    command: str, option: str, url: str, needle: str
) -> None:
    """sslmode=disabled was waited on as an outage (`database_wait ... invalid sslmode value`,
    forever by default); the key typos read only "is not a PostgreSQL URL"."""
    env = cli_env(**{f"RELAY_{option}": url}, RELAY_STARTUP_TIMEOUT="0")  # 0: wait forever
    line = refusal(command, env)
    assert option.lower() in line and needle in line, line


# --- item 7 of issue 49: relay check validates what relay run validates --------------------------


@pytest.mark.parametrize("command", ["run", "check"])
@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (  # OpenTelemetry's variables: relay run refused them, relay check did not read them
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_TRACES_SAMPLER": "x"},
            "OTEL_TRACES_SAMPLER",
        ),
        (  # an extra the HTTP client needs: relay check called it an ingress failure (32)
            {"RELAY_INGRESS_PROXY": "socks5://127.0.0.1:1080"},
            "pip install 'ledger-relay[socks]'",
        ),
    ],
)
def test_check_refuses_what_run_refuses(command: str, extra: dict[str, str], needle: str) -> None:
    line = refusal(command, cli_env(**extra))
    assert needle in line, line


def test_check_names_an_unknown_variable_and_says_so_in_its_report() -> None:
    """The warning `relay run` logs (`unknown_variables`), from the same code; the report's
    configuration line points to it, so that its `ok` does not read as nothing to fix."""
    got = relay("check", cli_env(RELAY_CONCURENCY="8"))
    assert got.returncode & 2 == 0, got  # a warning, as in relay run: not a refusal
    (warning,) = got.stderr.strip().splitlines()
    assert warning.startswith("relay: warning: ") and "RELAY_CONCURENCY" in warning
    assert "did you mean RELAY_CONCURRENCY?" in warning
    (config,) = [line for line in got.stdout.splitlines() if "configuration" in line]
    assert config.startswith("ok") and "warned on stderr: unknown_variables" in config, config


# --- item 7 of issue 48: secret files other users may read or change -----------------------------

ROOT, RELAY_USER = 0, 1000


@pytest.mark.parametrize(
    ("mode", "owner", "open_"),
    [
        (0o600, RELAY_USER, False),
        (0o400, RELAY_USER, False),
        (0o640, RELAY_USER, True),  # libpq: u=rw (0600) or less when the user owns it
        (0o440, RELAY_USER, True),
        (0o644, RELAY_USER, True),
        (0o666, RELAY_USER, True),
        (0o440, ROOT, False),  # Kubernetes' defaultMode 0440 with fsGroup, as deploy/k8s has
        (0o640, ROOT, False),  # libpq: u=rw,g=r (0640) or less when root owns it
        (0o660, ROOT, True),  # the group may change it
        (0o644, ROOT, True),  # Kubernetes' default defaultMode: world-readable
        (0o604, ROOT, True),
    ],
)
def test_which_modes_are_open_to_others(mode: int, owner: int, open_: bool) -> None:
    from relay.settings import open_to_others

    assert open_to_others(0o100000 | mode, owner, RELAY_USER) is open_


def secret_file(tmp_path: Path, name: str, content: str, mode: int) -> Path:
    path = tmp_path / name
    path.write_text(content)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("command", ["run", "check"])
@pytest.mark.parametrize("mode", [0o644, 0o666, 0o640])
def test_a_secret_file_open_to_others_is_named_with_its_mode(
    command: str, mode: int, tmp_path: Path
) -> None:
    token = secret_file(tmp_path, "ingress_token", "tok-0123456789", mode)
    creds = tmp_path / "creds"
    creds.mkdir()
    secret_file(creds, "database_url", DB, 0o600)  # private: not named
    env = cli_env(RELAY_INGRESS_TOKEN_FILE=str(token), CREDENTIALS_DIRECTORY=str(creds))
    del env["RELAY_DATABASE_URL"]  # read from the credential
    got = relay(command, env)
    assert got.returncode not in (0, 1), got  # the database and ingress are down: 2 or 36
    assert "Traceback" not in got.stderr and "tok-0123456789" not in got.stdout + got.stderr
    if command == "run":
        records = [json.loads(line) for line in got.stderr.splitlines()]
        warnings = [r for r in records if r.get("event") == "secret_file_exposed"]
        assert [(w["source"], w["file"], w["mode"]) for w in warnings] == [
            ("RELAY_INGRESS_TOKEN_FILE", str(token), f"{mode:04o}")
        ], records
        assert warnings[0]["level"] == "warning"
    else:
        (line,) = [x for x in got.stderr.splitlines() if "mode" in x]
        assert line.startswith("relay: warning: RELAY_INGRESS_TOKEN_FILE: ")
        assert str(token) in line and f"mode {mode:04o}" in line, line
        assert "warned on stderr: secret_file_exposed" in got.stdout


@pytest.mark.parametrize("command", ["run", "check"])
def test_a_private_secret_file_or_credential_says_nothing(command: str, tmp_path: Path) -> None:
    token = secret_file(tmp_path, "ingress_token", "tok-0123456789", 0o400)
    creds = tmp_path / "creds"
    creds.mkdir()
    secret_file(creds, "database_url", DB, 0o600)
    env = cli_env(RELAY_INGRESS_TOKEN_FILE=str(token), CREDENTIALS_DIRECTORY=str(creds))
    del env["RELAY_DATABASE_URL"]
    got = relay(command, env)
    assert "mode" not in got.stderr and "warned" not in got.stdout, got


def test_a_credential_open_to_others_is_named_and_one_not_read_is_not(tmp_path: Path) -> None:
    """systemd writes credentials 0400 for the unit's user; a directory made by hand may not."""
    creds = tmp_path / "creds"
    creds.mkdir()
    secret_file(creds, "database_url", DB, 0o644)
    secret_file(creds, "ingress_token", "tok-0123456789", 0o644)  # RELAY_INGRESS_TOKEN wins
    env = cli_env(CREDENTIALS_DIRECTORY=str(creds), RELAY_INGRESS_TOKEN="tok-from-env-01")
    del env["RELAY_DATABASE_URL"]
    got = relay("check", env)
    lines = [x for x in got.stderr.splitlines() if "mode" in x]
    assert len(lines) == 1 and "database_url (CREDENTIALS_DIRECTORY)" in lines[0], lines


def test_the_shipped_kubernetes_secrets_get_no_warning_a_default_mount_does() -> None:
    """The files as the kubelet makes them (tests/test_deploy.py): deploy/k8s's projected volume
    with `defaultMode: 0440` and fsGroup passes; without `defaultMode` (0644) the warning is due."""
    from relay.settings import open_to_others
    from tests.test_deploy import k8s_objects, secret_files

    pod = k8s_objects()["Deployment"]["spec"]["template"]["spec"]
    uid, fs_group = pod["securityContext"]["runAsUser"], pod["securityContext"]["fsGroup"]
    volume = next(v for v in pod["volumes"] if "projected" in v or "secret" in v)
    owner, _, mode = secret_files(volume, {"database_url"}, fs_group)["database_url"]
    assert not open_to_others(0o100000 | mode, owner, uid)
    del (volume.get("projected") or volume["secret"])["defaultMode"]
    owner, _, mode = secret_files(volume, {"database_url"}, fs_group)["database_url"]
    assert open_to_others(0o100000 | mode, owner, uid)


@pytest.mark.parametrize("mode", [0o644, 0o600])
def test_the_database_list_file_open_to_others_is_named_with_its_mode(
    mode: int, tmp_path: Path
) -> None:
    """RELAY_DATABASES_FILE holds every database's URL, passwords included (issue 51): open to
    others it is named as a secret file is; private, nothing is said."""
    listed = secret_file(tmp_path, "databases", f"a={DB}\n", mode)
    env = cli_env(RELAY_DATABASES_FILE=str(listed))
    del env["RELAY_DATABASE_URL"]
    got = relay("check", env)
    assert "Traceback" not in got.stderr, got
    lines = [x for x in got.stderr.splitlines() if "mode" in x]
    if mode == 0o600:
        assert lines == [], lines
    else:
        (line,) = lines
        assert line.startswith("relay: warning: RELAY_DATABASES_FILE: ")
        assert str(listed) in line and "mode 0644" in line, line
