"""`relay check` (DESIGN §8.1): is this configuration able to run, here, now?

One line per check, in order: configuration, database, schema, listen, ingress. A check whose
precondition failed is skipped (no schema check without a database). The exit code says which
failed, as a sum of bits, so a script can tell "database down" from "ingress unreachable":

    0   every check passed
    2   configuration invalid (nothing else was checked; the same code as `relay run`)
    4   database: cannot connect or authenticate
    8   schema: not installed, older or newer than this relay (run `relay migrate` / upgrade)
    16  listen: the LISTEN session is handed to another client between its transactions, or
        cannot receive notifications (e.g. it goes through a transaction-mode pooler: set
        listen_database_url to a direct connection)
    32  ingress: no HTTP answer (DNS, connection, TLS, timeout), or an answer `relay run` would
        pause its lane for as `ingress_misconfigured` (401/403: fix ingress_token; 404, 405,
        410 or a redirect: fix ingress_url), from ingress_url or ingress_batch_url

e.g. 36 = database and ingress failed. With several databases (RELAY_DATABASES, issue 51) the
database, schema and listen lines come once per database, each naming it (`[shard1]`), and the
bits of all of them add up: 4 when any database is down, the others' lines `ok` beside it;
`--database NAME` checks one. The ingress is probed once per database too, as that database's
relay posts (the URL's `{database}` filled in, its `relay-database` header). Nothing a check
prints carries a password or token: database URLs are redacted and every error text is scrubbed
of the configured secrets.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import anyio
import httpx
import orjson
import psycopg
from psycopg import sql

from relay.core import loop
from relay.core.policy import Outcome, classify
from relay.databases import DEFAULT_NAME, Database, for_database
from relay.edges.http_client import (
    Reply,
    TransportFailure,
    keepalive_for,
    open_sender,
    sent_secrets,
    transport_for,
)
from relay.edges.ingress import USER_AGENT, render_group_url, render_url, sign
from relay.edges.store import CONNECT_KWARGS
from relay.maintenance.migrate import code_version, read_version, version_problem
from relay.ops.targets import pick
from relay.settings import ConfigError, Settings, Subcommands, redact_url, scrub

OK = 0
CONFIGURATION = 2
DATABASE = 4
SCHEMA = 8
LISTEN = 16
INGRESS = 32

BITS = {
    "database": DATABASE,
    "schema": SCHEMA,
    "listen": LISTEN,
    "ingress": INGRESS,
    "ingress_batch": INGRESS,
}
PROBE_RUN_ID = "relay-check"
# A batch of the probe run with no event in it: nothing is delivered.
PROBE_BODY = orjson.dumps({"run_id": PROBE_RUN_ID, "epoch": 0, "events": []})
PROBE_GROUP_BODY = orjson.dumps({"batches": []})


@dataclass(frozen=True)
class Result:
    name: str
    ok: bool | None  # None: skipped
    detail: str
    database: str | None = None  # the list form's database it is about (issue 51)

    def line(self) -> str:
        mark = "skip" if self.ok is None else ("ok" if self.ok else "FAIL")
        about = f"[{self.database}] " if self.database is not None else ""
        return f"{mark:<5}{self.name:<15}{about}{self.detail}"


def exit_code(results: Sequence[Result]) -> int:
    code = OK
    for r in results:
        if r.ok is False:
            code |= CONFIGURATION if r.name == "configuration" else BITS[r.name]
    return code


def _error(exc: BaseException, s: Settings) -> str:
    return _quoted(exc, sent_secrets(s))


def _quoted(exc: BaseException, secrets: Sequence[str]) -> str:
    """The error's type and first line, cut at 300 characters, with `secrets` scrubbed out."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return scrub(f"{type(exc).__name__}: {first}"[:300], secrets)


async def check_database(s: Settings, within: float) -> tuple[Result, Result]:
    url = s.database_url.reveal()
    where = redact_url(url)
    try:
        with anyio.fail_after(within):
            conn = await psycopg.AsyncConnection.connect(
                url, **{**CONNECT_KWARGS, "connect_timeout": max(1, int(within))}
            )
            async with conn:
                version = conn.info.server_version
                db_version = await read_version(conn, s.schema)
    except (psycopg.Error, OSError, TimeoutError) as exc:
        return (
            Result("database", False, f"{where}: {_error(exc, s)}"),
            Result("schema", None, "needs the database"),
        )
    database = Result(
        "database", True, f"{where} (PostgreSQL {version // 10000}.{version % 10000})"
    )
    problem = version_problem(db_version, s.schema)
    if problem:
        return database, Result("schema", False, problem)
    return database, Result("schema", True, f"{s.schema} at version {code_version()}")


async def check_listen(s: Settings, within: float) -> Result:
    """The LISTEN session must stay this relay's between its transactions: a transaction-mode
    pooler hands it to other clients, and the notifications go nowhere. One session LISTENs and
    notes its server pid in one transaction; a second client then opens a transaction on the same
    URL while the first is idle (as other clients do in production) and notifies from it.

    - the second client got the first one's server session (the same `pg_backend_pid()`): a
      pooler hands sessions around between transactions. PgBouncer does, in transaction mode.
    - otherwise the notification must come back to the first session within the timeout.

    A LISTEN and NOTIFY on one connection, as this check did before, passes through a
    transaction pool that has nothing else to do: both land on the one idle server session."""
    source = s.listen_database_url or s.database_url
    url = source.reveal()
    where = redact_url(url)
    channel = f"relay_check_{uuid.uuid4().hex[:12]}"
    kwargs = {**CONNECT_KWARGS, "connect_timeout": max(1, int(within))}
    try:
        with anyio.fail_after(within):
            listener = await psycopg.AsyncConnection.connect(url, **kwargs)
            async with listener:
                async with listener.transaction():
                    await listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                    listening = await _backend_pid(listener)
                other = await psycopg.AsyncConnection.connect(url, **kwargs)
                async with other, other.transaction():
                    if await _backend_pid(other) == listening:
                        return Result("listen", False, f"{where}: {_SHARED_SESSION}")
                    await other.execute("select pg_notify(%s, 'check')", (channel,))
                async for note in listener.notifies(timeout=within, stop_after=1):
                    if note.channel == channel:
                        return Result("listen", True, f"{where} receives notifications")
    except TimeoutError:
        pass
    except (psycopg.Error, OSError) as exc:
        return Result("listen", False, f"{where}: {_error(exc, s)}")
    return Result(
        "listen",
        False,
        f"{where}: no notification came back within {within:g}s; LISTEN needs a direct "
        "connection, not a transaction-mode pooler (set listen_database_url)",
    )


_SHARED_SESSION = (
    "the session that LISTENs was handed to another client between its transactions (a "
    "transaction-mode pooler such as PgBouncer): notifications would go nowhere; set "
    "listen_database_url to a direct connection"
)


async def _backend_pid(conn: psycopg.AsyncConnection[Any]) -> int:
    cur = await conn.execute("select pg_backend_pid()")
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


@dataclass(frozen=True)
class Probe:
    """One ingress probe, as `relay run` would post it, and what its line names."""

    name: str  # its line: ingress, or ingress_batch
    setting: str  # the setting an answer that would pause a lane tells to fix
    url: str
    body: bytes
    headers: dict[str, str]
    # What of the secrets this probe sends an answer or an error may quote back (issue 48 item
    # 4). Read here, not when judging, as they read the environment's proxies.
    secrets: tuple[str, ...]
    database: str | None = None  # the fleet's database it posts as (issue 51)


def ingress_probe(s: Settings, *, batch: bool = False, database: str | None = None) -> Probe:
    """A POST like `relay run`'s (its headers, token and signature) that carries no event: an
    empty batch for the probe run `relay-check` (`batch`: an empty `{"batches": []}` to
    `ingress_batch_url`), so nothing is delivered. `database`: as one database of a fleet
    posts (issue 51), its name in the URL's `{database}` and in `relay-database`.

    A POST rather than a HEAD: an endpoint that takes only POSTs answers a HEAD with 405 (or,
    under some frameworks, 404), so a HEAD cannot tell a right URL from a wrong one."""
    named = database or DEFAULT_NAME
    if batch:
        assert s.ingress_batch_url is not None
        url, body = render_group_url(s.ingress_batch_url, named), PROBE_GROUP_BODY
    else:
        url, body = render_url(s.ingress_url, PROBE_RUN_ID, named), PROBE_BODY
    headers = probe_headers(s, body, epoch=not batch)
    if database is not None:
        headers["relay-database"] = database
    return Probe(
        name="ingress_batch" if batch else "ingress",
        setting="ingress_batch_url" if batch else "ingress_url",
        url=url,
        body=body,
        headers=headers,
        secrets=tuple(sent_secrets(s)),
        database=database,
    )


def judge_ingress(
    s: Settings, probe: Probe, answer: Reply | TransportFailure | ConfigError | TimeoutError
) -> Result:
    """The probe's line from what it got: a reply, or the error that stood for one. A reply is
    judged by the table `relay run` uses (relay.core.policy.classify): what would pause a lane
    as `ingress_misconfigured` (401, 403, 404, 405, 410, a redirect) fails, naming the setting
    to fix; any other answer (an empty batch may well be refused as such: 400, 422) proves the
    endpoint takes POSTs. Reads nothing but its arguments."""
    where = redact_url(probe.url)
    if not isinstance(answer, Reply):
        return Result(
            probe.name, False, f"{where}: {_quoted(answer, probe.secrets)}", probe.database
        )
    status = answer.status
    outcome = classify(status)
    if outcome is Outcome.MISCONFIGURED:
        why = _misconfigured(status, answer.location, probe.setting, s)
        return Result(probe.name, False, f"{where} answered {status}: {why}", probe.database)
    if outcome is Outcome.ACCEPTED and answer.unframed and not answer.body.strip():
        # relay/core/policy.py: such an answer cannot be told from a reset, so relay run would
        # retry every batch and deliver none.
        return Result(
            probe.name,
            False,
            f"{where} answered {status} with an empty body and no Content-Length or chunked "
            "framing, which relay run cannot tell from a connection reset: frame the answers",
            probe.database,
        )
    note = {
        Outcome.ACCEPTED: "",
        Outcome.POISON: " (to an empty batch: the endpoint takes POSTs)",
        Outcome.TRANSIENT: " (relay run would retry: the ingress is failing now)",
    }[outcome]
    return Result(probe.name, True, f"{where} answered {status}{note}", probe.database)


async def check_ingress(
    s: Settings,
    within: float,
    transport: httpx.AsyncBaseTransport | None = None,
    *,
    batch: bool = False,
    database: str | None = None,
) -> Result:
    """Post the probe (`ingress_probe`) once, and judge what came back (`judge_ingress`)."""
    probe = ingress_probe(s, batch=batch, database=database)
    try:
        # The relay's own client (relay/edges/http_client.py): its TLS trust, proxies, transport and
        # the URL's userinfo handled as `relay run` handles them. Its transport and keep-alive
        # are the configuration line's to say (`transport_line`), not a log line on stderr.
        with anyio.fail_after(within):
            async with open_sender(s, 1, transport, announce=False) as sender:
                reply = await sender.send(probe.url, probe.body, probe.headers)
    except (TransportFailure, ConfigError, TimeoutError) as exc:
        return judge_ingress(s, probe, exc)
    return judge_ingress(s, probe, reply)


# At most this many of a fleet's ingress probes at once (one per database, issue 51).
PROBES_AT_ONCE = 8


async def check_ingresses(
    s: Settings,
    within: float,
    databases: Sequence[Database] | None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list[Result]:
    """The ingress probe(s) as `relay run` would post: once in the one-database form; with the
    list form, once per database (its name in the URL's `{database}` and in `relay-database`,
    as its POSTs carry them), a few at once, the lines in the list's order."""
    names: list[str | None] = [None] if databases is None else [d.name for d in databases]
    kinds = [False] if s.ingress_batch_url is None else [False, True]
    probes = [(name, batch) for name in names for batch in kinds]
    results: list[Result | None] = [None] * len(probes)
    limiter = anyio.CapacityLimiter(PROBES_AT_ONCE)

    async def probe(i: int, name: str | None, batch: bool) -> None:
        async with limiter:
            results[i] = await check_ingress(s, within, transport, batch=batch, database=name)

    async with anyio.create_task_group() as tg:
        for i, (name, batch) in enumerate(probes):
            tg.start_soon(probe, i, name, batch)
    return [r for r in results if r is not None]


def probe_headers(s: Settings, body: bytes, *, epoch: bool) -> dict[str, str]:
    """The headers `relay run` sends (DESIGN §5), signed with the local clock."""
    headers = {"content-type": "application/json", "user-agent": USER_AGENT}
    if epoch:
        headers["relay-lease-epoch"] = "0"
    if s.ingress_token is not None:
        headers["authorization"] = f"Bearer {s.ingress_token.reveal()}"
    if s.signing_secret:
        msg_id, ts = f"msg_{uuid.uuid4().hex}", int(time.time())
        headers["webhook-id"] = msg_id
        headers["webhook-timestamp"] = str(ts)
        headers["webhook-signature"] = sign(s.signing_secret, msg_id, ts, body)
    return headers


def _misconfigured(status: int, location: str | None, setting: str, s: Settings) -> str:
    """Why an answer would pause the lane, and the setting to fix."""
    if status in (401, 403):
        fix = "ingress_token" + (" or signing_secret" if s.signing_secret else "")
        return f"credentials rejected; fix {fix}"
    if 300 <= status < 400:
        to = f" to {redact_url(location)!r}" if location else ""
        return f"a redirect{to}, which relay run never follows; set {setting} to where it points"
    if status == 405:
        return f"this URL does not take POSTs; fix {setting}"
    if status == 407:
        return "the proxy wants credentials; fix ingress_proxy's (or HTTP_PROXY's) user:password"
    return f"no such endpoint; fix {setting} (its path)"


async def run_checks(
    s: Settings,
    within: float = 5.0,
    warned: Sequence[str] = (),
    databases: Sequence[Database] | None = None,
) -> list[Result]:
    """Every check in order; `warned`: the start warnings said on stderr (their log events),
    which the configuration line names so that an `ok` does not read as "nothing to fix".
    `databases`: the list form's (issue 51): the database, schema and listen checks of each in
    turn, each line naming it, then the ingress as each database posts to it."""
    config = check_configuration(s, warned)
    if databases is None:
        stores = await check_store(s, within)
    else:
        stores = []
        for d in databases:
            results = await check_store(for_database(s, d), within)
            stores += [replace(r, database=d.name) for r in results]
    return [config, *stores, *await check_ingresses(s, within, databases)]


def check_configuration(s: Settings, warned: Sequence[str] = ()) -> Result:
    """The configuration line, once the settings loaded: what `relay run` would run with (the
    schema, the ingress, the replica, the transport and keep-alive, the event loop it is on)
    and the start warnings said on stderr (`warned`, their log events)."""
    note = f" (warned on stderr: {', '.join(warned)})" if warned else ""
    return Result(
        "configuration",
        True,
        f"schema={s.schema} ingress={redact_url(s.ingress_url)} replica={s.replica_id}"
        f" {transport_line(s)} event_loop={loop.running()}{note}",
    )


def transport_line(s: Settings) -> str:
    """The transport that will carry the POSTs and the keep-alive in force, and why (issue 48
    item 1: over httpx's own transport keep-alive is off unless set), as `relay run` decides
    them (relay/edges/http_client.py)."""
    name, _ = transport_for(s, os.environ)
    keepalive, why = keepalive_for(s, name)
    return f"transport={name} keepalive={'on' if keepalive else 'off'} ({why})"


async def check_store(s: Settings, within: float) -> list[Result]:
    """The database, schema and listen checks of one database."""
    database, schema = await check_database(s, within)
    if database.ok or s.listen_database_url is not None:
        listen = await check_listen(s, within)
    else:
        listen = Result("listen", None, "needs the database")
    return [database, schema, listen]


# -- the `relay check` subcommand -------------------------------------------------------------


def add_command(
    sub: Subcommands,
    add_settings: Callable[[argparse.ArgumentParser], None],
    load_settings: Callable[[argparse.Namespace], tuple[Settings, list[Database] | None]],
    say_warnings: Callable[[argparse.Namespace], list[str]],
) -> None:
    """`relay check`, its settings read, refused and warned about as `relay run`'s are: by
    relay/cli.py's `load_settings` and `say_warnings`, the ones `relay run` uses."""
    p = sub.add_parser(
        "check",
        help="check configuration, database, schema, LISTEN and ingress; exit code says which",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_settings(p)
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per check (default 5)")
    p.add_argument(
        "--database",
        metavar="NAME",
        help="with RELAY_DATABASES / RELAY_DATABASES_FILE: check this database of the list only"
        " (default: every one)",
    )

    def cmd_check(args: argparse.Namespace) -> int:
        warned = say_warnings(args)
        try:
            s, databases = load_settings(args)
            databases = pick(databases, args.database)
            chosen = loop.choose(s.event_loop, loop.uvloop_installed())
        except (ConfigError, loop.LoopUnavailable) as exc:
            print(Result("configuration", False, str(exc)).line())
            return CONFIGURATION
        # On the loop `relay run` would choose, which the configuration line names.
        results = anyio.run(
            run_checks,
            s,
            args.timeout,
            warned,
            databases,
            backend_options=loop.backend_options(chosen),
        )
        for r in results:
            print(r.line())
        return exit_code(results)

    p.set_defaults(func=cmd_check)
