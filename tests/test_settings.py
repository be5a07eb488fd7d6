"""Unit tests for relay.settings (DESIGN §7): pure parsing from an explicit environ, secrets that
never print, one clear error line naming the option."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from relay.settings import (
    PARSERS,
    REQUIRED,
    SECRET_OPTIONS,
    ConfigError,
    Secret,
    Settings,
    describe,
    env_name,
    flag_name,
    load,
    parse_duration,
    redact_url,
)

INGRESS = "https://ingress.internal/runs/{run_id}/events"
DB = "postgresql://app:pw@db.internal:5432/ledger"
WHSEC = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
CANARY = "CANARY-s3cr3t"
# The canary in a form a whsec_ secret accepts (base64 alphabet, length a multiple of 4).
CANARY_B64 = "CANARYs3cr3t" * 3  # 27 bytes decoded: a key long enough to be accepted


def base_env(**extra: str) -> dict[str, str]:
    env = {"RELAY_DATABASE_URL": DB, "RELAY_INGRESS_URL": INGRESS}
    env.update(extra)
    return env


def load_env(**extra: str) -> Settings:
    return load({}, base_env(**extra))


def config_error(flags: dict[str, str | None], env: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as info:
        load(flags, env)
    message = str(info.value)
    assert "\n" not in message, "one clear line"
    return message


# --- defaults and required options --------------------------------------------------------------


def test_minimal_configuration_and_defaults() -> None:
    s = load_env()
    assert s.database_url.reveal() == DB
    assert s.ingress_url == INGRESS
    assert s.schema == "relay"
    assert s.terminal_channel == "relay_terminal"
    assert s.ingress_token is None
    assert s.signing_secret == ()
    assert s.batch_size == 100
    assert s.lease_ttl == 30.0
    assert s.poll_interval == 1.0
    assert s.retention == 86400.0
    assert s.metrics_addr is None
    assert s.log_format == "json"
    assert s.http_transport == "aiohttp"
    assert s.http2 is False and s.ingress_proxy is None
    assert s.replica_id  # host:pid
    assert s.replica_id.endswith(f":{os.getpid()}")


def test_load_does_not_read_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_BATCH_SIZE", "7")
    assert load_env().batch_size == 100


@pytest.mark.parametrize("option", REQUIRED)
def test_missing_required_option_names_the_option_and_env_var(option: str) -> None:
    env = base_env()
    del env[env_name(option)]
    message = config_error({}, env)
    assert option in message
    assert env_name(option) in message
    assert flag_name(option) in message


def test_every_option_has_a_flag_and_env_name() -> None:
    for option in PARSERS:
        assert env_name(option) == "RELAY_" + option.upper()
        assert flag_name(option) == "--" + option.replace("_", "-")
    assert {"database_url", "ingress_token", "signing_secret"} <= SECRET_OPTIONS
    for option in SECRET_OPTIONS:
        assert option in PARSERS


# --- every numeric and duration option rejects garbage and out-of-range values ----------------

INT_OPTIONS = {
    "batch_size": ("0", "10001"),
    "concurrency": ("0", "1025"),
    "critical_concurrency": ("0", "257"),
    "claim_runs": ("0", "1001"),
}
DURATION_OPTIONS = {
    "lease_ttl": ("0.5s", "2h"),
    "poll_interval": ("5ms", "2h"),
    "http_timeout": ("10ms", "11m"),
    "max_backoff": ("50ms", "2d"),
    "shutdown_timeout": (None, "2h"),
    "retention": (None, "366d"),
    "statement_timeout": ("50ms", "11m"),
}


def assert_refused(option: str, value: str, says: str) -> None:
    """`value` for `option` is a configuration error that names the option and says `says`."""
    message = config_error({}, base_env(**{env_name(option): value}))
    assert message.startswith(option)
    assert says in message


@pytest.mark.parametrize("option", sorted(INT_OPTIONS))
@pytest.mark.parametrize("garbage", ["", "ten", "1.5", "1e3", "0x10", "12abc", "--1", "∞"])
def test_int_options_reject_garbage(option: str, garbage: str) -> None:
    assert_refused(option, garbage, "integer")


@pytest.mark.parametrize("option", sorted(INT_OPTIONS))
def test_int_options_reject_out_of_range(option: str) -> None:
    for value in (*INT_OPTIONS[option], "-1"):
        assert_refused(option, value, "between")


@pytest.mark.parametrize("option", sorted(DURATION_OPTIONS))
@pytest.mark.parametrize("garbage", ["", "soon", "-1s", "1w", "s", "1.2.3s", "nan", "inf", "1 0s"])
def test_duration_options_reject_garbage(option: str, garbage: str) -> None:
    assert_refused(option, garbage, "duration")


@pytest.mark.parametrize("option", sorted(DURATION_OPTIONS))
def test_duration_options_reject_out_of_range(option: str) -> None:
    for value in DURATION_OPTIONS[option]:
        if value is not None:
            assert_refused(option, value, "between")


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("batch_size", "250", 250),
        ("batch_size", "1", 1),
        ("batch_size", "10000", 10000),
        ("concurrency", "32", 32),
        ("critical_concurrency", "2", 2),
        ("claim_runs", "200", 200),
        ("lease_ttl", "1m", 60.0),
        ("poll_interval", "250ms", 0.25),
        ("http_timeout", "5", 5.0),
        ("max_backoff", "10m", 600.0),
        ("shutdown_timeout", "0", 0.0),
        ("retention", "7d", 7 * 86400.0),
        ("statement_timeout", "1.5s", 1.5),
        ("log_format", "TEXT", "text"),
        ("log_level", "Debug", "debug"),
        ("http_transport", "aiohttp", "aiohttp"),
        ("http_transport", " HTTPTools", "httptools"),
        ("http_transport", "HTTPX", "httpx"),
        # Retired names are kept as given: relay/edges/http_client.py says what replaces them.
        ("http_transport", "httpcore", "httpcore"),
        ("http2", "true", True),
        ("http2", "Off", False),
        ("metrics_addr", "127.0.0.1:9464", "127.0.0.1:9464"),
        ("metrics_addr", "[::1]:9464", "[::1]:9464"),
        ("replica_id", "relay-a", "relay-a"),
        ("schema", "ledger_relay2", "ledger_relay2"),
        ("ingress_batch_url", "http://ingress:8080/batch", "http://ingress:8080/batch"),
    ],
)
def test_valid_values(option: str, value: str, expected: object) -> None:
    assert getattr(load_env(**{env_name(option): value}), option) == expected


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("log_format", "xml"),
        ("log_level", "trace"),
        ("http_transport", "requests"),
        ("http2", "maybe"),
        ("ingress_proxy", "ftp://proxy:21"),
        ("metrics_addr", "9464"),
        ("metrics_addr", "host:http"),
        ("metrics_addr", "host:70000"),
        ("ingress_batch_url", "ftp://ingress/batch"),
        ("ingress_batch_url", "not a url"),
        ("database_url", "   "),
    ],
)
def test_other_invalid_values_name_the_option(option: str, value: str) -> None:
    assert_refused(option, value, env_name(option))


def test_schema_name_is_validated_and_sets_the_channel() -> None:
    assert load_env(RELAY_SCHEMA="outbox").terminal_channel == "outbox_terminal"
    for bad in ("", "Relay", "1relay", "re-lay", 'x"; drop schema public; --', "a" * 55, "ré"):
        message = config_error({}, base_env(RELAY_SCHEMA=bad))
        assert message.startswith("schema")


# --- ingress_url --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "https://ingress.internal/runs/events",  # no {run_id}
        "https://ingress.internal/runs/{runid}/events",
        "ftp://ingress.internal/runs/{run_id}/events",
        "ingress.internal/runs/{run_id}/events",
        "https:///runs/{run_id}",  # no host
        "https://ingress.internal/runs/{run_id}/{other}",
        "https://ingress.internal/runs/{run_id}/{}",
        "https://ingress.internal/runs/{run_id}/{0}",
        "https://ingress.internal/runs/{run_id}/{run_id.upper}",
        "https://ingress.internal/runs/{run_id}/{run_id[0]}",
        "https://ingress.internal/runs/{run_id}/{run_id!r}",
        "https://ingress.internal/runs/{run_id}/{{run_id}}",
        "https://ingress.internal/runs/{run_id}/{",
    ],
)
def test_ingress_url_must_be_an_http_template_with_run_id(url: str) -> None:
    message = config_error({}, base_env(RELAY_INGRESS_URL=url))
    assert message.startswith("ingress_url")


@pytest.mark.parametrize(
    "url",
    [
        "http://localhost:8080/runs/{run_id}/events",
        "https://ingress.internal/v1/{run_id}",
        "https://ingress.internal/runs/{run_id}/events?source={run_id}",
    ],
)
def test_ingress_url_accepts_templates(url: str) -> None:
    assert load_env(RELAY_INGRESS_URL=url).ingress_url == url


# --- flags, env, files, systemd credentials -----------------------------------------------------


def test_flags_override_env() -> None:
    s = load(
        {"batch_size": "5", "ingress_token": "from-flag", "log_level": None},
        base_env(RELAY_BATCH_SIZE="7", RELAY_INGRESS_TOKEN="from-env", RELAY_LOG_LEVEL="error"),
    )
    assert s.batch_size == 5
    assert s.ingress_token == Secret("from-flag")
    assert s.log_level == "error"  # a None flag means "not given"


def test_required_option_from_flag_only() -> None:
    s = load({"database_url": DB, "ingress_url": INGRESS}, {})
    assert s.database_url.reveal() == DB


def test_a_flag_overrides_a_secret_file(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("from-file\n")
    s = load({"ingress_token": "from-flag"}, base_env(RELAY_INGRESS_TOKEN_FILE=str(f)))
    assert s.ingress_token == Secret("from-flag")


@pytest.mark.parametrize("option", sorted(SECRET_OPTIONS))
def test_secret_file(option: str, tmp_path: Path) -> None:
    value = {
        "ingress_token": "tok-123",
        "signing_secret": WHSEC,
        "ingress_proxy": "http://user:pw@proxy:3128",
    }.get(option, DB)
    f = tmp_path / option
    f.write_text(value + "\n")  # the trailing newline of `echo … > file` is stripped
    env = base_env(**{env_name(option) + "_FILE": str(f)})
    env.pop(env_name(option), None)
    s = load({}, env)
    got = getattr(s, option)
    if option == "signing_secret":
        assert got == (Secret(WHSEC),)
    else:
        assert got == Secret(value)


def test_env_value_wins_over_file(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("from-file")
    s = load_env(RELAY_INGRESS_TOKEN="from-env", RELAY_INGRESS_TOKEN_FILE=str(f))
    assert s.ingress_token == Secret("from-env")


def test_file_is_only_for_secrets(tmp_path: Path) -> None:
    f = tmp_path / "batch"
    f.write_text("7")
    assert load_env(RELAY_BATCH_SIZE_FILE=str(f)).batch_size == 100


def test_signing_secret_file_may_hold_several_lines(tmp_path: Path) -> None:
    other = "whsec_" + base64.b64encode(b"another key of 24 bytes!").decode()
    f = tmp_path / "secrets"
    f.write_text(f"{WHSEC}\n{other}\n")
    s = load_env(RELAY_SIGNING_SECRET_FILE=str(f))
    assert s.signing_secret == (Secret(WHSEC), Secret(other))


def test_unreadable_file_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    message = config_error({}, base_env(RELAY_INGRESS_TOKEN_FILE=str(missing)))
    assert "RELAY_INGRESS_TOKEN_FILE" in message
    assert str(missing) in message
    assert "No such file" in message


def test_directory_as_secret_file_is_a_clear_error(tmp_path: Path) -> None:
    message = config_error({}, base_env(RELAY_INGRESS_TOKEN_FILE=str(tmp_path)))
    assert "RELAY_INGRESS_TOKEN_FILE" in message
    assert str(tmp_path) in message


def test_binary_secret_file_is_a_clear_error_and_leaks_nothing(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_bytes(b"CANARY\xff\xfe")
    message = config_error({}, base_env(RELAY_INGRESS_TOKEN_FILE=str(f)))
    assert "RELAY_INGRESS_TOKEN_FILE" in message
    assert "CANARY" not in message


def test_systemd_credentials_directory(tmp_path: Path) -> None:
    (tmp_path / "ingress_token").write_text("cred-token\n")
    (tmp_path / "signing_secret").write_text(WHSEC)
    (tmp_path / "database_url").write_text(DB)
    env = {"RELAY_INGRESS_URL": INGRESS, "CREDENTIALS_DIRECTORY": str(tmp_path)}
    s = load({}, env)
    assert s.ingress_token == Secret("cred-token")
    assert s.signing_secret == (Secret(WHSEC),)
    assert s.database_url == Secret(DB)


def test_systemd_credentials_come_after_env_and_file(tmp_path: Path) -> None:
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "ingress_token").write_text("cred-token")
    f = tmp_path / "token"
    f.write_text("file-token")
    env = base_env(CREDENTIALS_DIRECTORY=str(creds))
    assert load({}, {**env, "RELAY_INGRESS_TOKEN": "env-token"}).ingress_token == Secret(
        "env-token"
    )
    assert load({}, {**env, "RELAY_INGRESS_TOKEN_FILE": str(f)}).ingress_token == Secret(
        "file-token"
    )
    assert load({}, env).ingress_token == Secret("cred-token")


def test_missing_systemd_credential_is_just_absent(tmp_path: Path) -> None:
    assert load_env(CREDENTIALS_DIRECTORY=str(tmp_path)).ingress_token is None


def test_unreadable_systemd_credential_is_a_clear_error(tmp_path: Path) -> None:
    cred = tmp_path / "ingress_token"
    cred.write_bytes(b"\xff\xfe")
    message = config_error({}, base_env(CREDENTIALS_DIRECTORY=str(tmp_path)))
    assert "ingress_token" in message
    assert "CREDENTIALS_DIRECTORY" in message


# --- signing secrets ----------------------------------------------------------------------------


def test_several_signing_secrets_for_rotation() -> None:
    other = "whsec_" + base64.b64encode(b"k" * 32).decode()
    s = load_env(RELAY_SIGNING_SECRET=f"{WHSEC}, {other}")
    assert s.signing_secret == (Secret(WHSEC), Secret(other))
    s = load_env(RELAY_SIGNING_SECRET=f"{WHSEC} {other}")
    assert len(s.signing_secret) == 2


@pytest.mark.parametrize(
    "value",
    [
        "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",  # no prefix
        "whsec_not base64!",
        "whsec_***",
        "whsec_abc",  # bad padding
        f"{WHSEC},nope",
        "sk_live_abc",
    ],
)
def test_signing_secret_must_be_whsec_base64(value: str) -> None:
    message = config_error({}, base_env(RELAY_SIGNING_SECRET=value))
    assert message.startswith("signing_secret")
    assert "whsec_" in message


# --- relations ----------------------------------------------------------------------------------


def test_lease_ttl_must_exceed_http_timeout_plus_margin() -> None:
    # margin = max(0.2, ttl / 5): ttl 12.5 -> 2.5, so 10 + 2.5 is not enough.
    message = config_error({}, base_env(RELAY_LEASE_TTL="12.5s", RELAY_HTTP_TIMEOUT="10s"))
    assert "lease_ttl" in message
    assert "http_timeout" in message
    config_error({}, base_env(RELAY_LEASE_TTL="10s", RELAY_HTTP_TIMEOUT="10s"))
    config_error({}, base_env(RELAY_LEASE_TTL="5s", RELAY_HTTP_TIMEOUT="10s"))
    s = load_env(RELAY_LEASE_TTL="13s", RELAY_HTTP_TIMEOUT="10s")
    assert s.lease_ttl == 13.0


# --- parse_duration -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("0", 0.0),
        ("1.5", 1.5),
        ("500ms", 0.5),
        ("30s", 30.0),
        ("5m", 300.0),
        ("24h", 86400.0),
        ("1d", 86400.0),
        (" 2 s ", 2.0),
        ("0.25s", 0.25),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text", ["", "s", "-1s", "1w", "1sec", "1.s", ".5s", "1e3", "nan", "1 h 2"]
)
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


# --- Secret -------------------------------------------------------------------------------------


def test_secret_never_shows_its_value() -> None:
    s = Secret(CANARY)
    shown = [repr(s), str(s), f"{s}", f"{s!r}", f"{s!s}", format(s)]
    # %-formatting is what logging does with its arguments.
    shown += ["%s" % s, "%r" % (s,)]  # noqa: UP031
    shown.append(repr([s, {"k": s}, (s,)]))
    for text in shown:
        assert CANARY not in text
        assert "***" in text
    assert s.reveal() == CANARY


def test_secret_equality_and_hash() -> None:
    assert Secret("a") == Secret("a")
    assert Secret("a") != Secret("b")
    assert Secret("a") != "a"
    assert len({Secret("a"), Secret("a")}) == 1


# --- describe and redact_url --------------------------------------------------------------------


def test_describe_masks_database_password_and_tokens() -> None:
    s = load_env(RELAY_INGRESS_TOKEN="tok-123", RELAY_SIGNING_SECRET=WHSEC)
    d = describe(s)
    assert d["database_url"] == "postgresql://app:***@db.internal:5432/ledger"
    assert d["ingress_token"] == "***"
    assert d["signing_secret"] == "***"
    assert d["batch_size"] == 100
    assert set(d) == set(PARSERS)
    text = repr(d)
    assert "pw@" not in text
    assert "tok-123" not in text
    assert WHSEC not in text


def test_ui_token_is_a_secret(tmp_path: Path) -> None:
    assert load_env().ui_token is None  # the status page is open unless a token is set
    f = tmp_path / "ui"
    f.write_text("  page-token-1234567\n")
    s = load_env(RELAY_UI_TOKEN_FILE=str(f))
    assert s.ui_token == Secret("page-token-1234567")
    assert describe(s)["ui_token"] == "***"
    assert "page-token-1234567" not in repr(s) + str(describe(s))
    # A guessable token is refused, naming the option, not quoting the value.
    with pytest.raises(ConfigError, match=r"ui_token.*at least 16 characters") as got:
        load_env(RELAY_UI_TOKEN="short-tok")
    assert "short-tok" not in str(got.value)


def test_describe_without_optional_secrets() -> None:
    d = describe(load_env())
    assert d["listen_database_url"] is None
    assert d["ingress_batch_url"] is None
    assert d["ingress_token"] is None
    assert d["signing_secret"] is None


def test_describe_masks_userinfo_in_ingress_urls() -> None:
    s = load_env(
        RELAY_INGRESS_URL="https://bot:hunter2@ingress.internal/runs/{run_id}/events",
        RELAY_INGRESS_BATCH_URL="https://bot:hunter2@ingress.internal/batch",
    )
    d = describe(s)
    assert "hunter2" not in repr(d)
    assert d["ingress_url"] == "https://***@ingress.internal/runs/{run_id}/events"
    assert d["ingress_batch_url"] == "https://***@ingress.internal/batch"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "postgresql://app:s3cret@db:5432/ledger",
            "postgresql://app:***@db:5432/ledger",
        ),
        (
            "postgres://app:s3cret@db/ledger?sslmode=require",
            "postgres://app:***@db/ledger?sslmode=require",
        ),
        ("postgresql://app:@db/ledger", "postgresql://app:***@db/ledger"),
        # libpq takes everything up to the '@' as userinfo, including unencoded '?', '#', ':'
        ("postgresql://app:se?cr#et@db/ledger", "postgresql://app:***@db/ledger"),
        ("postgresql://app:a:b@db/ledger", "postgresql://app:***@db/ledger"),
        # ... and an unencoded '@/' ends its authority early: the tail is no database's name
        ("postgresql://app:se@/cr@db/ledger", "postgresql://app:***@db/ledger"),
        ("postgresql://app:se@/?cr@db:5432/ledger", "postgresql://app:***@db:5432/ledger"),
        # multi-host URLs (libpq failover) keep their host list
        (
            "postgresql://app:s3cret@db1:5432,db2:5433/ledger",
            "postgresql://app:***@db1:5432,db2:5433/ledger",
        ),
        ("postgresql://app:s3cret@[::1]:5432/ledger", "postgresql://app:***@[::1]:5432/ledger"),
        (
            "postgresql://db/ledger?user=app&password=s3cret&sslmode=require",
            "postgresql://db/ledger?user=app&password=***&sslmode=require",
        ),
        ("postgresql://app@db?password=s3cret", "postgresql://app@db?password=***"),
        ("https://user:s3cret@ingress/runs/{run_id}", "https://***@ingress/runs/{run_id}"),
        ("https://s3cret@ingress:8443/x", "https://***@ingress:8443/x"),
        ("http://user:s3cret@ingress/x?y=1#f", "http://***@ingress/x?y=1#f"),
    ],
)
def test_redact_url_masks_passwords(url: str, expected: str) -> None:
    assert redact_url(url) == expected
    assert "s3cret" not in redact_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://db.internal:5432/ledger",
        "postgresql://app@db.internal/ledger",
        "postgresql:///ledger?host=/run/postgresql",
        "https://ingress.internal/runs/{run_id}/events",
        "http://localhost:8080/batch?x=1",
        "host=db dbname=ledger user=app",
        "",
    ],
)
def test_redact_url_leaves_urls_without_credentials_unchanged(url: str) -> None:
    assert redact_url(url) == url


@pytest.mark.parametrize(
    ("dsn", "expected"),
    [
        ("host=db password=s3cret dbname=x", "host=db password=*** dbname=x"),
        ("password=s3cret", "password=***"),
        ("host=db password = s3cret", "host=db password = ***"),
        ("host=db password='s3 cr\\'et' user=app", "host=db password=*** user=app"),
        ("host=db password=s3\\ cret user=app", "host=db password=*** user=app"),
        ("host=db passfile=/x/.pgpass", "host=db passfile=/x/.pgpass"),
    ],
)
def test_redact_url_masks_key_value_dsn_passwords(dsn: str, expected: str) -> None:
    assert redact_url(dsn) == expected


@hsettings(deadline=None)  # no wall-clock threshold: the machine may be busy
@given(st.text(alphabet=st.characters(blacklist_characters="/@"), min_size=1, max_size=40))
def test_redact_url_hides_any_password_in_a_database_url(password: str) -> None:
    url = f"postgresql://app:{password}@db.internal:5432/ledger"
    assert redact_url(url) == "postgresql://app:***@db.internal:5432/ledger"


@hsettings(deadline=None)  # no wall-clock threshold: the machine may be busy
@given(st.text(min_size=1, max_size=40))
def test_redact_url_hides_any_quoted_password_in_a_dsn(password: str) -> None:
    quoted = "'" + password.replace("\\", "\\\\").replace("'", "\\'") + "'"
    dsn = f"host=db password={quoted} dbname=ledger"
    assert redact_url(dsn) == "host=db password=*** dbname=ledger"


# --- the canary: secrets never leak into repr, str, describe or errors --------------------------


def canary_env(**extra: str) -> dict[str, str]:
    env = {
        "RELAY_DATABASE_URL": f"postgresql://app:{CANARY}@db.internal:5432/ledger",
        "RELAY_INGRESS_URL": INGRESS,
        "RELAY_LISTEN_DATABASE_URL": f"host=db.internal port=5432 password={CANARY} user=app",
        "RELAY_INGRESS_TOKEN": CANARY,
        "RELAY_SIGNING_SECRET": f"{WHSEC} whsec_{CANARY_B64}",
    }
    env.update(extra)
    return env


def assert_no_canary(text: str) -> None:
    assert CANARY not in text
    assert CANARY_B64 not in text
    assert "CANARY" not in text


@pytest.mark.parametrize(
    "database_url",
    [
        f"postgresql://app:{CANARY}@db.internal:5432/ledger",
        f"host=db.internal user=app password={CANARY} dbname=ledger",
        f"host=db.internal user=app password='{CANARY}' dbname=ledger",
        f"postgresql://db.internal/ledger?user=app&password={CANARY}",
    ],
)
def test_canary_never_printed(database_url: str) -> None:
    s = load({}, canary_env(RELAY_DATABASE_URL=database_url))
    assert s.ingress_token is not None
    assert s.ingress_token.reveal() == CANARY
    assert s.signing_secret[1].reveal() == f"whsec_{CANARY_B64}"
    for text in (repr(s), str(s), f"{s}", repr(describe(s)), str(describe(s))):
        assert_no_canary(text)
    assert_no_canary(redact_url(database_url))


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("batch_size", "lots"),
        ("lease_ttl", "forever"),
        ("http_timeout", "0"),
        ("ingress_url", "https://ingress.internal/runs/events"),
        ("ingress_url", "ftp://ingress.internal/{run_id}"),
        ("ingress_batch_url", "gopher://x"),
        ("schema", "Bad-Schema"),
        ("metrics_addr", "nope"),
        ("log_format", "yaml"),
        ("lease_ttl", "2s"),  # a relation error: mentions several options
    ],
)
def test_canary_absent_from_errors_of_other_options(option: str, value: str) -> None:
    message = config_error({}, canary_env(**{env_name(option): value}))
    assert option in message
    assert_no_canary(message)


@pytest.mark.parametrize(
    "secret",
    [f"whsec_{CANARY}", CANARY, f"{WHSEC},whsec_{CANARY}!", f"whsec_{CANARY_B64}x"],
)
def test_canary_absent_from_invalid_signing_secret_errors(secret: str) -> None:
    message = config_error({}, canary_env(RELAY_SIGNING_SECRET=secret))
    assert message.startswith("signing_secret")
    assert_no_canary(message)


def test_canary_absent_from_invalid_ingress_url_with_credentials() -> None:
    message = config_error(
        {}, canary_env(RELAY_INGRESS_URL=f"ftp://bot:{CANARY}@ingress.internal/{{run_id}}")
    )
    assert_no_canary(message)


def test_canary_absent_from_unreadable_file_errors(tmp_path: Path) -> None:
    f = tmp_path / "db"
    f.write_bytes(CANARY.encode() + b"\xff")
    env = canary_env(RELAY_DATABASE_URL_FILE=str(f))
    del env["RELAY_DATABASE_URL"]
    assert_no_canary(config_error({}, env))


def test_a_proxys_password_never_prints() -> None:
    """`ingress_proxy` is a secret: its userinfo is a credential, in errors and in describe."""
    message = config_error({}, base_env(RELAY_INGRESS_PROXY="ftp://user:s3cretPW@proxy:21"))
    assert message.startswith("ingress_proxy") and "s3cretPW" not in message, message
    s = load_env(RELAY_INGRESS_PROXY="http://user:s3cretPW@proxy:3128")
    assert s.ingress_proxy is not None
    assert s.ingress_proxy.reveal() == "http://user:s3cretPW@proxy:3128"
    assert "s3cretPW" not in repr(s) and "s3cretPW" not in str(describe(s))


# --- issue 41 item 2: unknown RELAY_* variables are named --------------------------------------


def test_unknown_variables_are_named_with_the_option_they_resemble() -> None:
    from relay.settings import unknown_variables, unknown_variables_warning

    environ = {
        "RELAY_CONCURENCY": "8",  # the reported typo
        "RELAY_CONCURRENCY": "8",
        "RELAY_DATABASE_URL_FILE": "/run/secrets/db",  # a secret's file form
        "RELAY_BATCH_SIZE_FILE": "/x",  # not a secret: no file form
        "RELAY_TEST_DATABASE_URL": "postgresql:///t",  # the project's own tests read it
        "RELAY_SHINY_NEW_OPTION": "1",  # a newer relay's option during a rolling upgrade
        "PATH": "/usr/bin",
    }
    unknown = unknown_variables(environ)
    assert unknown == [
        ("RELAY_BATCH_SIZE_FILE", "RELAY_BATCH_SIZE"),
        ("RELAY_CONCURENCY", "RELAY_CONCURRENCY"),
        ("RELAY_SHINY_NEW_OPTION", None),
    ]
    line = unknown_variables_warning(unknown)
    assert "RELAY_CONCURENCY (did you mean RELAY_CONCURRENCY?)" in line
    assert "\n" not in line and "8" not in line  # names only, never values
    assert unknown_variables({"RELAY_" + o.upper(): "x" for o in PARSERS}) == []
