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
    32  ingress: no HTTP answer (DNS, connection, TLS, timeout) or credentials rejected (401/403)

e.g. 36 = database and ingress failed. Nothing a check prints carries a password or token:
database URLs are redacted and every error text is scrubbed of the configured secrets.
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import psycopg
from psycopg import sql

from relay.ingress import USER_AGENT, render_url
from relay.migrate import code_version, read_version, version_problem
from relay.settings import ConfigError, Settings, passwords_in, redact_url, scrub
from relay.store import CONNECT_KWARGS

OK = 0
CONFIGURATION = 2
DATABASE = 4
SCHEMA = 8
LISTEN = 16
INGRESS = 32

BITS = {"database": DATABASE, "schema": SCHEMA, "listen": LISTEN, "ingress": INGRESS}
PROBE_RUN_ID = "relay-check"


@dataclass(frozen=True)
class Result:
    name: str
    ok: bool | None  # None: skipped
    detail: str

    def line(self) -> str:
        mark = "skip" if self.ok is None else ("ok" if self.ok else "FAIL")
        return f"{mark:<5}{self.name:<15}{self.detail}"


def exit_code(results: Sequence[Result]) -> int:
    code = OK
    for r in results:
        if r.ok is False:
            code |= CONFIGURATION if r.name == "configuration" else BITS[r.name]
    return code


def secrets_of(s: Settings) -> list[str]:
    """Every secret of the settings, and the passwords inside the database URLs as libpq
    reads them: an error may quote a password alone (e.g. percent-decoded)."""
    out = []
    for url in (s.database_url, s.listen_database_url):
        if url is not None:
            out.append(url.reveal())
            out.extend(passwords_in(url.reveal()))
    if s.ingress_token is not None:
        out.append(s.ingress_token.reveal())
    out.extend(secret.reveal() for secret in s.signing_secret)
    return [x for x in out if x]


def _error(exc: BaseException, s: Settings) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return scrub(f"{type(exc).__name__}: {first}"[:300], secrets_of(s))


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


async def check_ingress(
    s: Settings, within: float, transport: httpx.AsyncBaseTransport | None = None
) -> Result:
    """A HEAD request to the ingress URL of a probe run (no body: nothing is delivered). Any
    HTTP answer proves reachability; 401/403 mean the configured credentials are rejected."""
    url = render_url(s.ingress_url, PROBE_RUN_ID)
    where = redact_url(url)
    headers = {"user-agent": USER_AGENT}
    if s.ingress_token is not None:
        headers["authorization"] = f"Bearer {s.ingress_token.reveal()}"
    try:
        with anyio.fail_after(within):
            async with httpx.AsyncClient(
                timeout=within, follow_redirects=False, transport=transport
            ) as client:
                resp = await client.head(url, headers=headers)
    except (httpx.HTTPError, OSError, TimeoutError) as exc:
        return Result("ingress", False, f"{where}: {_error(exc, s)}")
    if resp.status_code in (401, 403):
        return Result(
            "ingress", False, f"{where} answered {resp.status_code}: credentials rejected"
        )
    return Result("ingress", True, f"{where} answered {resp.status_code}")


async def run_checks(s: Settings, within: float = 5.0) -> list[Result]:
    config = Result(
        "configuration",
        True,
        f"schema={s.schema} ingress={redact_url(s.ingress_url)} replica={s.replica_id}",
    )
    database, schema = await check_database(s, within)
    if database.ok or s.listen_database_url is not None:
        listen = await check_listen(s, within)
    else:
        listen = Result("listen", None, "needs the database")
    ingress = await check_ingress(s, within)
    return [config, database, schema, listen, ingress]


# -- the `relay check` subcommand -------------------------------------------------------------


def add_command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    add_settings: Callable[[argparse.ArgumentParser], None],
    load_settings: Callable[[argparse.Namespace], Settings],
) -> None:
    p = sub.add_parser(
        "check",
        help="check configuration, database, schema, LISTEN and ingress; exit code says which",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_settings(p)
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per check (default 5)")

    def cmd_check(args: argparse.Namespace) -> int:
        try:
            s = load_settings(args)
        except ConfigError as exc:
            print(Result("configuration", False, str(exc)).line())
            return CONFIGURATION
        results = anyio.run(run_checks, s, args.timeout)
        for r in results:
            print(r.line())
        return exit_code(results)

    p.set_defaults(func=cmd_check)
