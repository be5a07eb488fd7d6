"""The list form of the database (issue 51 item 1): RELAY_DATABASES / RELAY_DATABASES_FILE parsed
purely from an explicit environment, and every refusal one line naming the variable and the
entry, never a password."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.databases import (
    LIST,
    LIST_FILE,
    connection_shares,
    for_database,
    load_all,
    load_databases,
    server_key,
)
from relay.edges.ingress import render_group_url
from relay.fleet import split_share
from relay.settings import LIST_VARIABLES, ConfigError, Settings, load, unknown_variables

INGRESS = "http://127.0.0.1:9/runs/{run_id}/events"
PASSWORD = "CANARY-pw"


def env(**extra: str) -> dict[str, str]:
    return {"RELAY_INGRESS_URL": INGRESS, **extra}


def refusal(environ: dict[str, str], flags: dict[str, str | None] | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        load_databases(flags or {}, environ)
    text = str(caught.value)
    assert PASSWORD not in text, text
    return text


def test_the_list_names_each_database_in_order() -> None:
    databases = load_databases(
        {},
        env(
            RELAY_DATABASES=f" a=postgresql://u:{PASSWORD}@h1/app\n\tb-2=postgresql://u@h2:6432/app"
            " c_3=postgresql://u@h1/other "
        ),
    )
    assert databases is not None
    assert [d.name for d in databases] == ["a", "b-2", "c_3"]
    assert databases[0].url.reveal() == f"postgresql://u:{PASSWORD}@h1/app"
    assert PASSWORD not in repr(databases)


def test_without_the_list_the_one_database_form_runs_as_before() -> None:
    assert load_databases({}, env(RELAY_DATABASE_URL="postgresql://u@h/app")) is None
    settings, databases = load_all({}, env(RELAY_DATABASE_URL="postgresql://u@h/app"))
    assert databases is None
    assert settings.database_url.reveal() == "postgresql://u@h/app"


def test_the_file_holds_one_entry_a_line_with_comments(tmp_path: Path) -> None:
    listed = tmp_path / "databases"
    listed.write_text(
        "# shards of the ledger\n"
        "\n"
        f"  one=postgresql://u:{PASSWORD}@h1/app\n"
        "two=host=h2 dbname=app user=u password='a # b'\n"
        "   # the third is retired\n"
    )
    databases = load_databases({}, env(RELAY_DATABASES_FILE=str(listed)))
    assert databases is not None
    assert [d.name for d in databases] == ["one", "two"]
    assert databases[1].url.reveal() == "host=h2 dbname=app user=u password='a # b'"


def test_each_database_runs_on_the_settings_with_its_own_url() -> None:
    settings, databases = load_all(
        {},
        env(
            RELAY_DATABASES="a=postgresql://u@h1/app b=postgresql://u@h2/app",
            RELAY_METRICS_ADDR="127.0.0.1:0",
        ),
    )
    assert databases is not None
    assert settings.database_url == databases[0].url
    b = for_database(settings, databases[1])
    assert b.database_url.reveal() == "postgresql://u@h2/app"
    assert b.metrics_addr is None  # the fleet answers metrics_addr, not each database
    assert b.ingress_url == settings.ingress_url


@pytest.mark.parametrize(
    ("entries", "says"),
    [
        (f"postgresql://u:{PASSWORD}@h/app", "entry 1 is not NAME=URL"),
        (f"a=postgresql://u@h/app postgresql://u:{PASSWORD}@h/b", "entry 2 is not NAME=URL"),
        ("a=", "entry 1 is not NAME=URL"),
        (f"Shard=postgresql://u:{PASSWORD}@h/app", "the name 'Shard' must be 1 to 32"),
        (f"{'x' * 33}=postgresql://u@h/app", "must be 1 to 32 of a-z"),
        (f"a.b=postgresql://u:{PASSWORD}@h/app", "'a.b' is neither NAME=URL nor NAME.listen"),
        (
            f"a=postgresql://u@h/app a=postgresql://u:{PASSWORD}@h/other",
            "entry 2: the name 'a' is given twice",
        ),
        (
            f"a=postgresql://u:{PASSWORD}@h:5432/app b=postgresql://v@H/app",
            "entry 2 (b) names the same server and database as 'a' (host h, port 5432, "
            "database app): it would be drained twice",
        ),
        (f"a=postgresql://u:{PASSWORD}@h:port/app", "entry 1 (a): the URL its port is not"),
        ("a=mysql://u@h/app", "entry 1 (a): the URL"),
        ("", "names no database"),
    ],
)
def test_a_bad_list_is_refused_naming_the_variable_and_the_entry(entries: str, says: str) -> None:
    text = refusal(env(RELAY_DATABASES=entries))
    assert text.startswith(f"{LIST}: "), text
    assert says in text, text


def test_the_same_database_spelled_through_the_environment_defaults_is_refused() -> None:
    text = refusal(
        env(
            RELAY_DATABASES="a=postgresql://u@h/app b=postgresql://u@h:6432",
            PGPORT="6432",
            PGDATABASE="app",
        )
    )
    assert "names the same server and database as 'a'" in text
    assert server_key("host=h user=u", {"PGDATABASE": "x"}) == ("h", "5432", "x")
    assert server_key("host=h user=u", {}) == ("h", "5432", "u")


def test_a_bad_line_of_the_file_is_named(tmp_path: Path) -> None:
    listed = tmp_path / "databases"
    listed.write_text(f"# shards\na=postgresql://u@h/app\nB=postgresql://u:{PASSWORD}@h/b\n")
    text = refusal(env(RELAY_DATABASES_FILE=str(listed)))
    assert text.startswith(f"{LIST_FILE} ({listed}): line 3: the name 'B'"), text
    text = refusal(env(RELAY_DATABASES_FILE=str(tmp_path / "missing")))
    assert text == f"{LIST_FILE}: cannot read {tmp_path / 'missing'}: No such file or directory"


def test_the_list_and_the_one_database_form_together_are_refused(tmp_path: Path) -> None:
    listed = "a=postgresql://u@h/app"
    for given in (
        env(RELAY_DATABASES=listed, RELAY_DATABASE_URL="postgresql://u@h/app"),
        env(RELAY_DATABASES=listed, RELAY_DATABASE_URL_FILE=str(tmp_path / "url")),
    ):
        text = refusal(given)
        assert text.startswith(
            f"{LIST} and database_url (--database-url / RELAY_DATABASE_URL) are both given"
        ), text
    text = refusal(env(RELAY_DATABASES=listed), {"database_url": "postgresql://u@h/app"})
    assert "RELAY_DATABASES and database_url" in text
    text = refusal(env(RELAY_DATABASES=listed, RELAY_LISTEN_DATABASE_URL="postgresql://u@h/app"))
    assert "RELAY_DATABASES and listen_database_url" in text
    (tmp_path / "list").write_text(listed)
    text = refusal(env(RELAY_DATABASES=listed, RELAY_DATABASES_FILE=str(tmp_path / "list")))
    assert text == f"{LIST} and {LIST_FILE} are both set: give the list once"


def test_the_list_variables_are_no_unknown_variables() -> None:
    assert {LIST, LIST_FILE} == LIST_VARIABLES
    assert unknown_variables({LIST: "a=x", LIST_FILE: "/f", "RELAY_DATABASE": "y"}) == [
        ("RELAY_DATABASE", "RELAY_DATABASES")
    ]


def test_relay_check_refuses_the_list_beside_database_url() -> None:
    """`relay check` reads the list as `relay run` does (tests/test_fleet_cli.py checks each
    database of it): given with RELAY_DATABASE_URL too, its one configuration line names both,
    exit 2."""
    from tests.test_settings_refusals import cli_env, refusal

    env = cli_env(RELAY_DATABASES="a=postgresql://u@127.0.0.1:1/app")
    assert "RELAY_DATABASES and database_url" in refusal("check", env)


def batch_url(value: str) -> Settings:
    return load({}, env(RELAY_DATABASE_URL="postgresql://u@h/app", RELAY_INGRESS_BATCH_URL=value))


def test_the_batch_url_may_name_the_database_in_its_path_or_query() -> None:
    """Issue 51: `ingress_batch_url` names `{database}` as `ingress_url` does."""
    for url in ("http://in/batch", "http://in/{database}/batch", "http://in/batch?db={database}"):
        assert batch_url(url).ingress_batch_url == url
    assert render_group_url("http://in/{database}/batch?d={database}", "s1") == (
        "http://in/s1/batch?d=s1"
    )
    assert render_group_url("http://in/batch") == "http://in/batch"
    assert render_group_url("http://in/{database}/batch") == "http://in/default/batch"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://{database}.in/batch", "only in the path or query"),
        ("http://in/runs/{run_id}/batch", "no {run_id}"),
        ("http://in/{db}/batch", "no placeholder other than {database}"),
        ("http://in/{{database}}/batch", "no placeholder other than {database}"),
    ],
)
def test_the_batch_url_names_no_other_placeholder(url: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        batch_url(url)
    assert "ingress_batch_url" in str(caught.value) and says in str(caught.value)


def test_server_connections_is_split_among_the_databases_of_each_server() -> None:
    """Issue 51: the budget is per server (host and port), each database's share split into its
    LISTEN connection and its two pools, neither pool above what it uses unbudgeted."""
    listed = "a=postgresql://u@h1/a b=postgresql://u@h1/b c=postgresql://u@h1:6432/c"
    settings, databases = load_all({}, env(RELAY_DATABASES=listed, RELAY_SERVER_CONNECTIONS="20"))
    assert databases is not None
    assert connection_shares(settings, databases, {}) == {"a": 10, "b": 10, "c": 20}
    assert split_share(settings, 10) == (6, 3)  # + 1 LISTEN = 10
    assert split_share(settings, 5) == (2, 2)
    assert split_share(settings, 20) == (10, 6)  # the unbudgeted pools: 17 in all, under 20
    assert split_share(settings, 17) == (10, 6)
    assert split_share(settings, 16) == (10, 5)
    unbudgeted, _ = load_all({}, env(RELAY_DATABASES=listed))
    assert connection_shares(unbudgeted, databases, {}) == {}


def test_a_server_connections_too_few_for_a_servers_databases_is_refused_at_start() -> None:
    listed = "a=postgresql://u@h1/a b=postgresql://u@h1/b"
    with pytest.raises(ConfigError) as caught:
        load_all({}, env(RELAY_DATABASES=listed, RELAY_SERVER_CONNECTIONS="9"))
    assert "server_connections (9) is too few for the 2 databases on host h1, port 5432" in str(
        caught.value
    )
    load_all({}, env(RELAY_DATABASES=listed, RELAY_SERVER_CONNECTIONS="10"))
