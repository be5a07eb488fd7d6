"""Which outbox databases one process serves (issue 51 item 1): the list form of the database.

`RELAY_DATABASES` holds whitespace-separated `NAME=URL` entries; `RELAY_DATABASES_FILE` names a
file with one entry a line (a line starting with `#` is a comment; the rest of a line after
`NAME=` is the URL, so a key=value conninfo fits there too). A `NAME.listen=URL` entry, in
either, gives that database's LISTEN connection a URL of its own, as `listen_database_url` does
for the one-database form (a direct connection where the pools go through a transaction-mode
pooler). `RELAY_DATABASE_URL` alone stays the one-database form, named `default`, and runs as
it always did. The list form and `database_url` (or `listen_database_url`) together are
refused, as are both list variables together: a configuration names its databases once.

Parsing is pure, like relay/settings.py's: `load_databases(flags, environ)` returns the list (or
None when the list form is not used) or raises ConfigError with one line naming the variable and
the entry, never a password. Two entries naming the same server and database are refused: they
would be drained twice.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from relay.settings import (
    PARSERS,
    ConfigError,
    Secret,
    Settings,
    env_name,
    flag_name,
    load,
    redact_url,
    secret_file,
)

LIST = "RELAY_DATABASES"
LIST_FILE = "RELAY_DATABASES_FILE"  # both in relay/settings.py's LIST_VARIABLES: no typo
DEFAULT_NAME = "default"  # the one-database form's name (RELAY_DATABASE_URL alone)
NAME_RE = re.compile(r"[a-z0-9_-]{1,32}")
# `NAME.listen=URL`: the database's LISTEN connection through another URL than its pools' (a
# direct one, where the pools go through a transaction-mode pooler). '.' is in no name.
ATTRIBUTE_RE = re.compile(r"([a-z0-9_-]{1,32})\.([a-z_]{1,32})")
LISTEN = "listen"
Server = tuple[str, str, str]  # (host, port, dbname), as libpq reads a URL (`server_key`)


@dataclass(frozen=True)
class Database:
    """One outbox database of the list: its name (in logs, the `relay-database` header and the
    ingress URL's `{database}`), its URL and, when its `NAME.listen` entry gives one, the URL of
    its LISTEN connection (else the URL)."""

    name: str
    url: Secret
    listen_url: Secret | None = None

    def __repr__(self) -> str:
        listen = "" if self.listen_url is None else f", {redact_url(self.listen_url.reveal())!r}"
        return f"Database({self.name!r}, {redact_url(self.url.reveal())!r}{listen})"


def parse_entries(
    entries: list[tuple[str, str]], source: str, environ: Mapping[str, str]
) -> list[Database]:
    """`(where, text)` entries (`where`: "entry 2", "line 7") as databases, in order; ConfigError
    naming `source` and the entry for the first that is no `NAME=URL` (or `NAME.listen=URL`)
    with a valid name and URL, a name given twice, or a server and database given twice."""
    out: list[Database] = []
    seen: dict[str, str] = {}  # name -> where
    servers: dict[tuple[str, str, str], str] = {}  # (host, port, dbname) -> name
    listens: list[tuple[str, str, str]] = []  # (where, name, url) of the NAME.listen entries
    for where, text in entries:
        name, eq, url = text.partition("=")
        if not eq or not url.strip():
            # Not echoed: a URL given without its name would show its password.
            raise ConfigError(
                f"{source}: {where} is not NAME=URL (the value is not shown: it may hold a "
                "password), e.g. shard1=postgresql://relay@db1/app"
            )
        name = name.strip()
        attribute = ATTRIBUTE_RE.fullmatch(name)
        if attribute is not None:
            if attribute[2] != LISTEN:
                raise ConfigError(
                    f"{source}: {where}: {name!r} is neither NAME=URL nor NAME.listen=URL"
                )
            listens.append((where, attribute[1], url))
            continue
        if not NAME_RE.fullmatch(name):
            raise ConfigError(
                f"{source}: {where}: the name {redact_url(name)[:40]!r} must be 1 to 32 of "
                "a-z, 0-9, '_' and '-'"
            )
        if name in seen:
            raise ConfigError(f"{source}: {where}: the name {name!r} is given twice")
        secret, server = _parsed(source, f"{where} ({name})", url, servers, environ)
        seen[name] = where
        servers[server] = name
        out.append(Database(name, secret))
    if not out:
        raise ConfigError(f"{source}: names no database")
    return with_listen_urls(out, listens, source, servers, environ)


def with_listen_urls(
    databases: list[Database],
    listens: list[tuple[str, str, str]],
    source: str,
    servers: Mapping[tuple[str, str, str], str],
    environ: Mapping[str, str],
) -> list[Database]:
    """`databases` with the URLs of their `NAME.listen` entries (`(where, name, url)`, in any
    order beside them); ConfigError naming the entry for one that names no database of the list,
    is given twice, has a URL libpq refuses, or names the server and database of another
    database of the list (its LISTEN would hear that database's notifications, not its own)."""
    names = {d.name for d in databases}
    given: dict[str, Secret] = {}
    heard: dict[tuple[str, str, str], str] = {}  # (host, port, dbname) -> the name that LISTENs
    for where, name, url in listens:
        entry = f"{where} ({name}.{LISTEN})"
        if name not in names:
            raise ConfigError(f"{source}: {entry} names no database of the list")
        if name in given:
            raise ConfigError(f"{source}: {entry}: {name}'s listen URL is given twice")
        # Its own database's server and database it may name, no other database's, nor one
        # that a listen entry before it named.
        taken = {**servers, **heard}
        secret, server = _parsed(source, entry, url, taken, environ, listens_for=name)
        given[name] = secret
        heard[server] = name
    return [replace(d, listen_url=given.get(d.name)) for d in databases]


def _parsed(
    source: str,
    entry: str,
    url: str,
    taken: Mapping[Server, str],
    environ: Mapping[str, str],
    *,
    listens_for: str | None = None,
) -> tuple[Secret, Server]:
    """The URL of `entry` (where it stands and whose it is) as libpq takes it, and the server and
    database it names. ConfigError naming the entry for a URL refused, or for a server and
    database `taken` (-> the name of the entry that has it) already, unless it is the one of
    `listens_for`, the database a `NAME.listen` entry gives its LISTEN connection."""
    option = "database_url" if listens_for is None else "listen_database_url"
    try:
        secret = PARSERS[option](url.strip())
    except ValueError as exc:
        raise ConfigError(f"{source}: {entry}: the URL {exc}") from None
    server = server_key(secret.reveal(), environ)
    other = taken.get(server, listens_for)
    if other != listens_for:
        why = (
            "it would be drained twice"
            if listens_for is None
            else f"{listens_for} would LISTEN on {other}'s database"
        )
        raise ConfigError(
            f"{source}: {entry} names the same server and database as {other!r} "
            f"({describe_server(server)}): {why}"
        )
    return secret, server


def server_key(url: str, environ: Mapping[str, str] | None = None) -> Server:
    """The server and database a URL connects to, as libpq reads it with its defaults applied
    (host: PGHOST, else the local socket; port: PGPORT, else 5432; dbname: PGDATABASE, else the
    user's name): two URLs spelled differently for one database compare equal. Host names are
    compared as written (lower-cased): `localhost` and `127.0.0.1` are two servers here."""
    from psycopg.conninfo import conninfo_to_dict

    env = {} if environ is None else environ
    parts = conninfo_to_dict(url)
    host = str(parts.get("host") or env.get("PGHOST") or "").lower()
    port = str(parts.get("port") or env.get("PGPORT") or "5432")
    user = str(parts.get("user") or env.get("PGUSER") or env.get("USER") or "")
    dbname = str(parts.get("dbname") or env.get("PGDATABASE") or user)
    return host, port, dbname


def describe_server(server: tuple[str, str, str]) -> str:
    host, port, dbname = server
    return f"host {host or '(local socket)'}, port {port}, database {dbname}"


def list_entries(environ: Mapping[str, str]) -> tuple[list[tuple[str, str]], str] | None:
    """The list form's raw entries and the variable they came from; None when neither list
    variable is set. Both set: ConfigError naming both."""
    text, path = environ.get(LIST), environ.get(LIST_FILE)
    if text is not None and path is not None:
        raise ConfigError(f"{LIST} and {LIST_FILE} are both set: give the list once")
    if text is not None:
        return [(f"entry {i}", e) for i, e in enumerate(text.split(), 1)], LIST
    if path is None:
        return None
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"{LIST_FILE}: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{LIST_FILE}: cannot read {path}: not UTF-8 text") from None
    entries = []
    for number, line in enumerate(lines, 1):
        # A comment is a whole line: '#' may stand in a conninfo's quoted password.
        body = line.strip()
        if body and not body.startswith("#"):
            entries.append((f"line {number}", body))
    return entries, f"{LIST_FILE} ({path})"


def load_databases(
    flags: Mapping[str, str | None], environ: Mapping[str, str]
) -> list[Database] | None:
    """The databases of the list form, or None when it is not used (RELAY_DATABASE_URL alone).
    Given with `database_url` or `listen_database_url` (a flag, a variable, a secret file or a
    credential): ConfigError naming both."""
    found = list_entries(environ)
    if found is None:
        return None
    entries, source = found
    for option in ("database_url", "listen_database_url"):
        if (
            flags.get(option) is not None
            or environ.get(env_name(option)) is not None
            or secret_file(option, flags, environ) is not None
        ):
            listen = ", its listen URL a NAME.listen=URL entry" if "listen" in option else ""
            raise ConfigError(
                f"{source.split()[0]} and {option} ({flag_name(option)} / {env_name(option)}) "
                f"are both given: with the list form every database is an entry of the list{listen}"
                " (docs/sharding.md)"
            )
    return parse_entries(entries, source, environ)


def load_all(
    flags: Mapping[str, str | None], environ: Mapping[str, str]
) -> tuple[Settings, list[Database] | None]:
    """The settings and, with the list form, its databases. The settings are read as
    relay/settings.py reads them, with the first database's URL standing for `database_url`, so
    that every check of `load` applies; each database then runs on a copy with its own URL
    (`for_database`)."""
    databases = load_databases(flags, environ)
    if databases is None:
        alone = load(flags, environ)
        own_share(alone)  # a budget too small is refused at start
        return alone, None
    first = {**flags, "database_url": databases[0].url.reveal()}
    settings = load(first, environ)
    connection_shares(settings, databases, environ)  # a budget too small is refused at start
    return settings, databases


def for_database(settings: Settings, database: Database) -> Settings:
    """The settings one database of a fleet runs on: its URL, and its listen URL (its
    `NAME.listen` entry's, or none: LISTEN on its URL); no `metrics_addr` of its own (the fleet
    answers it, relay/fleet.py)."""
    return replace(
        settings,
        database_url=database.url,
        listen_database_url=database.listen_url,
        metrics_addr=None,
    )


# What one database of a fleet needs at least under `server_connections`: its LISTEN connection
# and two connections for each lane's pool (its claim loop, its acks and renewals wait in turn).
MIN_CONNECTIONS = 5


def own_share(settings: Settings) -> int | None:
    """The one-database form's share of `server_connections`: the whole budget, less the status
    page's one connection when `metrics_addr` serves it (relay/serving/ui/pool.py); its LISTEN
    connection counts within it wherever `listen_database_url` leads. None without a budget;
    ConfigError when it is below MIN_CONNECTIONS. relay/pools.py sizes the pools within it."""
    budget = settings.server_connections
    if budget <= 0:
        return None
    page = 1 if settings.metrics_addr is not None else 0
    if budget - page < MIN_CONNECTIONS:
        why = ", and the status page's on metrics_addr" if page else ""
        raise ConfigError(
            f"server_connections ({budget}) is too few for the database: it needs at least "
            f"{MIN_CONNECTIONS + page} (its LISTEN connection, two for each lane's pool{why})"
        )
    return budget - page


def connection_shares(
    settings: Settings, databases: Sequence[Database], environ: Mapping[str, str]
) -> dict[str, int]:
    """Each database's share of `server_connections` (issue 51): the budget of a server split
    evenly among the databases of the list on it (the same host and port, as libpq reads them).
    Empty without a budget. ConfigError when a share is below MIN_CONNECTIONS, naming the
    server; relay/fleet.py sizes each database's pools within its share."""
    budget = settings.server_connections
    if budget <= 0:
        return {}
    on: dict[tuple[str, str], list[Database]] = {}
    for d in databases:
        host, port, _ = server_key(d.url.reveal(), environ)
        on.setdefault((host, port), []).append(d)
    shares = {}
    for (host, port), together in on.items():
        share = budget // len(together)
        if share < MIN_CONNECTIONS:
            raise ConfigError(
                f"server_connections ({budget}) is too few for the {len(together)} databases on "
                f"host {host or '(local socket)'}, port {port}: each needs at least "
                f"{MIN_CONNECTIONS} (its LISTEN connection and two for each lane's pool)"
            )
        shares.update(dict.fromkeys((d.name for d in together), share))
    return shares
