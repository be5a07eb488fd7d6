"""The `relay` command line."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio

from relay import logs
from relay.settings import PARSERS, ConfigError, Settings, env_name, flag_name, redact_url

if TYPE_CHECKING:
    from relay.databases import Database
    from relay.fleet import Fleet
    from relay.maintenance.roles import Roles
    from relay.ops.targets import Target
    from relay.runner import Relay

_HELP = {
    "database_url": "PostgreSQL URL (secret; also RELAY_DATABASE_URL_FILE)",
    "ingress_url": "ingress URL template containing {run_id}",
    "schema": "schema of the outbox tables and functions (default relay)",
    "listen_database_url": "direct (never pooled) URL for LISTEN; default database_url (secret)",
    "ingress_batch_url": "optional multi-run batch endpoint",
    "ingress_token": "bearer token for the ingress (secret)",
    "signing_secret": "Standard Webhooks whsec_ secret(s), comma separated (secret)",
    "ingress_ca_file": "PEM CA bundle to verify the ingress's TLS certificate (default: system)",
    "http_transport": "transport under httpx's client: aiohttp (default) or httpx (its own)",
    "event_loop": "auto (default: uvloop where installed, else asyncio), uvloop or asyncio",
    "http2": "HTTP/2 to the ingress: true or false (default); httpx's transport, the http2 extra",
    "ingress_keepalive": "true: a connection to the ingress carries many POSTs; false: one POST a"
    " connection, so no late answer can be read as another POST's; auto (default): true over"
    " aiohttp's transport, false over httpx's own (docs/security.md)",
    "ingress_proxy": "proxy for the ingress, e.g. http://proxy:3128 (default: HTTP_PROXY etc.; "
    "secret)",
    "batch_size": "events per POST (default 100)",
    "lease_ttl": "lease time to live, e.g. 30s",
    "concurrency": "ordinary lane: runs in flight (default 32)",
    "critical_concurrency": "critical lane: runs in flight (default 4)",
    "post_limit": "adaptive (default): POSTs in flight follow the ingress's latency; fixed: each"
    " lane's concurrency",
    "claim_runs": "runs claimed per round trip (default 64)",
    "max_batch_bytes": "payload bytes per POST, e.g. 1MiB (default); a larger event goes alone",
    "max_lane_bytes": "payload bytes a lane holds claimed, e.g. 32MiB (default): the memory bound",
    "poll_interval": "safety-net poll interval (default 1s)",
    "http_timeout": "total deadline of one POST (default 10s)",
    "max_backoff": "cap of retry backoff (default 300s)",
    "shutdown_timeout": "time to finish in-flight work on SIGTERM (default 20s)",
    "startup_timeout": "give up (exit 2) when the database is not reachable at start within this"
    " (default 0: wait forever, logging each attempt)",
    "server_connections": "connections one replica opens to one server, across its databases"
    " with RELAY_DATABASES (default 0: no budget)",
    "retention": "keep delivered events this long (default 24h)",
    "statement_timeout": "bound of every relay statement (default 10s)",
    "metrics_addr": "HOST:PORT for /metrics, /healthz, /readyz and the status page (off)",
    "ui_token": "token the status page requires: Bearer or ?token= cookie (secret)",
    "log_format": "json or text",
    "log_level": "debug, info, warning or error",
    "replica_id": "lease owner name (default host:pid)",
}


def _add_settings(p: argparse.ArgumentParser, only: Sequence[str] | None = None) -> None:
    for option in PARSERS:
        if only is not None and option not in only:
            continue
        p.add_argument(
            flag_name(option),
            dest=option,
            default=None,
            metavar=option.upper(),
            help=f"{_HELP.get(option, '')} [{env_name(option)}]",
        )


def secret_flags(args: argparse.Namespace) -> list[str]:
    """The secret options given as command-line flags (visible to every local user)."""
    from relay.settings import SECRET_OPTIONS

    return [flag_name(o) for o in PARSERS if o in SECRET_OPTIONS and getattr(args, o, None)]


def secret_flags_warning(flags: list[str]) -> str:
    return (
        f"{', '.join(flags)} on the command line can be read by every local user (ps, "
        "/proc/PID/cmdline): use RELAY_<NAME>_FILE or systemd's $CREDENTIALS_DIRECTORY"
    )


StartWarning = tuple[str, dict[str, Any], str]  # a log event, its fields, the hint in one line


def start_warnings(
    args: argparse.Namespace, options: Sequence[str] = tuple(PARSERS)
) -> list[StartWarning]:
    """What a command warns about before it reads its settings, whatever they hold: secrets
    given as flags, RELAY_* variables no option reads (a typo's likely intent named), and the
    secret files of `options` that other users may read or change. One list for every command:
    `relay run` logs each in its log format, the others print each as one plain line."""
    from relay.settings import (
        exposed_secret_file_warning,
        exposed_secret_files,
        unknown_variables,
        unknown_variables_warning,
    )

    out: list[StartWarning] = []
    if flags := secret_flags(args):
        out.append(("secrets_on_command_line", {"flags": flags}, secret_flags_warning(flags)))
    if unknown := unknown_variables(os.environ):
        names = [name for name, _ in unknown]
        out.append(("unknown_variables", {"names": names}, unknown_variables_warning(unknown)))
    for source, path, mode in exposed_secret_files(options, _flags(args), os.environ):
        fields = {"source": source, "file": str(path), "mode": f"{mode:04o}"}
        out.append(("secret_file_exposed", fields, exposed_secret_file_warning(source, path, mode)))
    return out


def _say_warnings(args: argparse.Namespace, options: Sequence[str] = tuple(PARSERS)) -> list[str]:
    """The start warnings as plain lines on stderr (the commands without a log format, and an
    invalid `relay run`); the events said."""
    warnings = start_warnings(args, options)
    for _, _, hint in warnings:
        print(f"relay: warning: {hint}", file=sys.stderr)
    return [event for event, _, _ in warnings]


def _flags(args: argparse.Namespace) -> dict[str, str | None]:
    return {k: getattr(args, k, None) for k in PARSERS}


def _run_settings(args: argparse.Namespace) -> tuple[Settings, list[Database] | None]:
    """The settings `relay run` and `relay check` run on, with the list form of the database
    (RELAY_DATABASES, relay/databases.py) its databases (None: the one-database form): read
    and parsed (relay/settings.py), then what else `relay run` refuses before it connects:
    OpenTelemetry's variables (relay/edges/tracing.py) and an extra the HTTP client would need
    (relay/edges/http_client.py)."""
    from relay.databases import load_all

    settings, databases = load_all(_flags(args), os.environ)
    return _refused_before_connecting(settings), databases


def _refused_before_connecting(settings: Settings) -> Settings:
    from relay.edges.http_client import require_extras
    from relay.edges.tracing import config_from_env

    config_from_env(os.environ)
    require_extras(settings, os.environ)
    return settings


def _targets(args: argparse.Namespace) -> list[Target]:
    """The databases of the commands that need nothing else (migrate, status, inspect, retry,
    skip): the list form's (RELAY_DATABASES, relay/databases.py), all or the one `--database`
    names, else the one URL read like `relay run` reads it (flag, RELAY_DATABASE_URL,
    RELAY_DATABASE_URL_FILE, systemd's $CREDENTIALS_DIRECTORY/database_url) and validated; or
    one line naming what is wrong."""
    from relay.databases import load_databases
    from relay.ops.targets import targets
    from relay.settings import option_value

    _say_warnings(args, ["database_url"])
    databases = load_databases(_flags(args), os.environ)
    url = None
    if databases is None:
        given = {"database_url": getattr(args, "database_url", None)}
        secret = option_value("database_url", given, os.environ)
        url = None if secret is None else secret.reveal()
    return targets(databases, getattr(args, "database", None), url)


def _schema(args: argparse.Namespace) -> str:
    import os

    from relay.maintenance.migrate import validate_schema_name

    name = getattr(args, "schema", None) or os.environ.get("RELAY_SCHEMA") or "relay"
    try:
        return validate_schema_name(name)
    except ValueError as exc:
        raise ConfigError(f"schema (--schema / RELAY_SCHEMA): {exc}") from None


def _reason(exc: Exception, url: str) -> str:
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    from relay.ops import db_error_reason

    try:
        password = conninfo_to_dict(url).get("password")
    except psycopg.ProgrammingError:
        password = None
    return db_error_reason(exc, str(password) if password else None)


def cmd_migrate(args: argparse.Namespace) -> int:
    """Migrate the database, or each of the list's in turn under its header line: one that
    fails is one line naming it and the others are still migrated (exit 1 if any failed)."""
    chosen = _targets(args)
    schema = _schema(args)
    roles = None
    if args.grant_roles:
        from relay.maintenance.roles import Roles

        try:
            roles = Roles.for_schema(schema, args.producer_role, args.relay_role)
        except ValueError as exc:
            raise ConfigError(f"--producer-role / --relay-role: {exc}") from None
    elif args.producer_role or args.relay_role:
        raise ConfigError("--producer-role / --relay-role: only with --grant-roles")
    code = 0
    for i, target in enumerate(chosen):
        if target.name is not None:
            print(("\n" if i else "") + target.header(), flush=True)
        code = _migrate(target, schema, roles) or code
    return code


def _migrate(target: Target, schema: str, roles: Roles | None) -> int:
    import psycopg

    from relay.maintenance.migrate import SchemaError, migrate

    url = target.url
    who = "relay migrate: " + (f"{target.name}: " if target.name is not None else "")
    try:
        result = migrate(url, schema, roles=roles)
    except SchemaError as exc:
        print(f"{who}{exc}", file=sys.stderr)
        return 1
    except psycopg.Error as exc:  # cannot connect, lock timeout, permission denied, ...
        print(f"{who}database at {redact_url(url)}: {_reason(exc, url)}", file=sys.stderr)
        return 1
    applied = ", ".join(map(str, result.applied)) or "none"
    print(
        f"schema {schema} at version {result.version} (applied: {applied}; functions "
        f"{'re-created' if result.functions_reapplied else 'unchanged'})"
    )
    if result.granted is not None:
        print(
            f"roles granted: producer {result.granted.producer} (enqueue only), relay "
            f"{result.granted.relay} (relay run); NOLOGIN, no password: grant them to login roles"
        )
    return 0


class _StopBeforeLoop(Exception):
    """SIGTERM/SIGINT before the event loop owns the signals: start-up is abandoned, exit 0."""


class _EarlySignals:
    """A stop signal at any moment of start-up is a clean exit. Until the event loop's receiver
    takes over, this plain handler abandons the synchronous part (settings, --migrate) by
    raising, or, once the loop is starting, records the signal for the receiver to read first."""

    def __init__(self) -> None:
        self.received = False
        self.in_loop = False
        self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, _signum: int, _frame: object) -> None:
        self.received = True
        if not self.in_loop:
            raise _StopBeforeLoop

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def cmd_run(args: argparse.Namespace) -> int:
    early = _EarlySignals()  # first: settings and imports take a while
    try:
        return _run(args, early)
    except _StopBeforeLoop:
        return 0
    finally:
        early.restore()


def _run(args: argparse.Namespace, early: _EarlySignals) -> int:
    settings, databases = _run_settings(args)
    logs.configure(settings.log_format, settings.log_level, replica=settings.replica_id)
    logs.install_hooks()
    # In the log format: every stderr line of run is a log line.
    for event, fields, hint in start_warnings(args):
        logs.warning(event, **fields, hint=hint)
    if args.migrate:
        from relay.maintenance.migrate import migrate

        for url in [d.url for d in databases] if databases else [settings.database_url]:
            migrate(url.reveal(), settings.schema)

    from relay.core import loop
    from relay.maintenance.migrate import SchemaError
    from relay.runner import tune_gc

    chosen = _event_loop(settings)
    relay = _relay_or_fleet(settings, databases)
    tune_gc()

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            ready = anyio.Event()

            async def on_signals() -> None:
                with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    ready.set()
                    if early.received:
                        relay.stop()
                        return
                    async for _ in signals:
                        relay.stop()
                        return

            tg.start_soon(on_signals)
            await ready.wait()
            await relay.run()
            tg.cancel_scope.cancel()

    code = 0
    early.in_loop = True
    try:
        anyio.run(main, backend="asyncio", backend_options=loop.backend_options(chosen))
    except* SchemaError as group:
        code = _refused(group, 3)
    except* ConnectionError as group:
        code = _refused(group, 2)
    return code


def _event_loop(settings: Settings) -> str:
    """The event loop `relay run` runs on (relay/core/loop.py): `uvloop` or `asyncio`."""
    from relay.core import loop

    try:  # refused by name before anything starts, as a bad setting is (exit 2)
        return loop.choose(settings.event_loop, loop.uvloop_installed())
    except loop.LoopUnavailable as exc:
        raise ConfigError(str(exc)) from None


def _relay_or_fleet(settings: Settings, databases: list[Database] | None) -> Relay | Fleet:
    """What `relay run` runs: the list form of the database runs a fleet, one relay per database
    (relay/fleet.py), even for a list of one; RELAY_DATABASE_URL alone runs one relay, as it
    always did."""
    from relay.fleet import Fleet
    from relay.integrations import start_tracing
    from relay.runner import Relay

    # OpenTelemetry's own variables (OTEL_*), read like any instrumented service's; a bad value
    # is a ConfigError here, before anything starts.
    tracer = start_tracing(os.environ)
    if databases is None:
        return Relay(settings, tracer=tracer)
    return Fleet(settings, databases, tracer=tracer)


def _refused(group: BaseExceptionGroup[BaseException], code: int) -> int:
    exc = group.exceptions[0]
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    # One line, in the configured log format (every stderr line of `relay run` is a log line).
    logs.error("refused_to_start", reason=str(exc), exit_code=code)
    return code


# The tools wing (relay/tools/) is reached by module name only, when one of its commands is
# asked for: the production wing never imports it, and its dependencies are extras.
TOOLS: dict[str, tuple[str, str]] = {
    "sink": ("relay.tools.sink", "sink"),
    "demo": ("relay.tools.demo", "demo"),
    "bench": ("relay.tools.bench", "bench"),
}


def run_tool(command: str, argv: list[str]) -> int:
    """Run a tools-wing command; a missing extra is one line naming the install, exit 2."""
    import importlib

    module_name, extra = TOOLS[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name == "relay" or exc.name.startswith("relay."):
            raise
        print(
            f"relay {command}: needs the {exc.name!r} package of the {extra!r} extra: "
            f"pip install 'ledger-relay[{extra}]'",
            file=sys.stderr,
        )
        return 2
    code: int = module.main(argv)
    return code


class _Version(argparse.Action):
    """`relay --version`: the version and the commit, as `build_info` reports them. The commit
    is read only when asked (git may be run for it: relay/serving/build.py)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from relay import __version__
        from relay.serving import build

        print(f"ledger-relay {__version__} (commit {build.commit()})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="relay", description="ledger-relay: outbox → HTTP ingress")
    p.add_argument("--version", action=_Version, help="print the version and commit, and exit")
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("migrate", help="create or upgrade the schema")
    _add_settings(m, ["database_url", "schema"])
    from relay.ops.commands import DATABASE_HELP

    m.add_argument("--database", metavar="NAME", help=DATABASE_HELP)
    m.add_argument(
        "--grant-roles",
        action="store_true",
        help="create (NOLOGIN, no password) the producer and relay roles when missing and grant"
        " each exactly its privileges (docs/security.md)",
    )
    m.add_argument("--producer-role", help="producer role name (default <schema>_producer)")
    m.add_argument("--relay-role", help="relay role name (default <schema>_relay)")
    m.set_defaults(func=cmd_migrate)

    r = sub.add_parser(
        "run",
        help="run the relay",
        epilog="Several outbox databases: RELAY_DATABASES='NAME=URL NAME=URL ...' or "
        "RELAY_DATABASES_FILE (one NAME=URL a line), instead of RELAY_DATABASE_URL: one relay "
        "per database in this process; NAME.listen=URL entries give a database a direct URL "
        "for LISTEN (docs/sharding.md).",
    )
    _add_settings(r)
    r.add_argument("--migrate", action="store_true", help="migrate first (development)")
    r.set_defaults(func=cmd_run)

    # -- operator tools: status, inspect, retry, skip (relay/ops/) -----------------------------
    from relay.ops import add_commands as add_ops_commands

    add_ops_commands(sub, _add_settings, _targets, _schema)
    # -- end operator tools ---------------------------------------------------------------------

    # -- relay check (relay/ops/checks.py)
    # ----------------------------------------------------------
    from relay.ops.checks import add_command as add_check_command

    add_check_command(sub, _add_settings, _run_settings, _say_warnings)
    # -- end relay check ------------------------------------------------------------------------

    sub.add_parser("sink", help="run the reference ingress [extra: sink]", add_help=False)
    sub.add_parser("demo", help="run the demo [extra: demo]", add_help=False)
    sub.add_parser(
        "bench", help="run the benchmarks (relay bench --help) [extra: bench]", add_help=False
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] in TOOLS:
        return run_tool(args_list[0], args_list[1:])
    parser = build_parser()
    args = parser.parse_args(args_list)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        if args.command == "run":  # (the others said them before reading the configuration)
            _say_warnings(args)  # a typo may be the cause: RELAY_DATABSE_URL
        print(f"relay: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["main", "redact_url"]
