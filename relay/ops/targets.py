"""Which outbox databases an operator command acts on (issue 51 item 4), and where a run or an
event is when several could hold it. Pure: the databases in, a choice or an error out.

With `RELAY_DATABASE_URL` alone a command acts on that one database and says nothing of names,
as it always did. With the list form (`RELAY_DATABASES` / `RELAY_DATABASES_FILE`) it acts on
every database of the list, or on the one `--database NAME` names. A command about one run or
one event (inspect, retry EVENT_ID or --run, skip) given several databases acts only where it
is: every database is searched first, and the command is refused when one could not be searched
(the run may be there too), when none holds it, or when more than one does (a write must not
guess between two runs that share an id)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from relay.databases import DEFAULT_NAME, Database
from relay.ops.format import NOT_FOUND, UNAVAILABLE, USAGE, OpsError
from relay.settings import ConfigError, redact_url


@dataclass(frozen=True)
class Target:
    """One database a command acts on: its name in the list (None: the one-database form, whose
    output names no database) and its URL."""

    name: str | None
    url: str

    def header(self) -> str:
        """The line above this database's part of a command's plain-text output."""
        return f"== database {self.name}: {redact_url(self.url)}"


def pick(databases: list[Database] | None, wanted: str | None) -> list[Database] | None:
    """The databases of the list a command acts on: all of them, or the one named `wanted`
    (`--database`); None stays None (the one-database form, whose name is `default`). An
    unknown name: ConfigError naming the configured ones."""
    if wanted is None:
        return databases
    names = [DEFAULT_NAME] if databases is None else [d.name for d in databases]
    if wanted not in names:
        raise ConfigError(
            f"--database {wanted!r}: no such database; configured: {', '.join(names)}"
        )
    return None if databases is None else [d for d in databases if d.name == wanted]


def targets(
    databases: list[Database] | None, wanted: str | None, one_url: str | None
) -> list[Target]:
    """What `pick` chose as targets; `one_url`: the one-database form's URL (None with the list)."""
    chosen = pick(databases, wanted)
    if chosen is None:
        if one_url is None:
            raise ConfigError("database_url: required; set --database-url or RELAY_DATABASE_URL")
        return [Target(None, one_url)]
    return [Target(d.name, d.url.reveal()) for d in chosen]


def where(
    what: str, searched: Sequence[Target], found: Sequence[Target], down: Sequence[Target]
) -> Target:
    """The one database that holds `what` ("run 'r1'", "event 'e1'") among those `searched`,
    or OpsError: UNAVAILABLE when one could not be searched (`down`), USAGE when several hold
    it, NOT_FOUND when none does."""
    names = ", ".join(str(t.name) for t in searched)
    at = ", ".join(str(t.name) for t in found)
    if down:
        seen = f"found in {at}" if found else "not found in the others"
        raise OpsError(
            UNAVAILABLE,
            f"{what}: could not search {', '.join(str(t.name) for t in down)} ({seen}); "
            "give --database NAME to act on one database",
        )
    if len(found) > 1:
        raise OpsError(USAGE, f"{what} is in {at}: give --database NAME to say which")
    if not found:
        raise OpsError(NOT_FOUND, f"no {what} in any database ({names})")
    return found[0]
