"""The documentation holds: every ```sql block of README.md runs as written against a migrated
database, every `DESIGN §N(.M)` citation in the tree names a section of docs/design.md, no file
points at design documents outside the repository, relative links in README.md and docs/
resolve, and docs/operations.md's log table names every event the production wing logs."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from relay.maintenance.migrate import migrate
from relay.tools.absurd import install_absurd

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DESIGN = ROOT / "docs" / "design.md"
# Where citations of the design may live (deploy/ and pyproject.toml carry comments too).
CITING = ("relay", "schema", "tests", "docs", "scripts", "deploy", "README.md", "pyproject.toml")
SKIP_DIRS = {"__pycache__", ".venv", ".git", ".mypy_cache", ".ruff_cache", ".pytest_cache"}

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)
HEADING = re.compile(r"^#{1,6} ", re.M)
SECTION = re.compile(r"^#{2,4} §(\d+(?:\.\d+)?)[.\s]", re.M)
# "DESIGN §4.2", "DESIGN §3, §6", "DESIGN §4.2/§9.1", "DESIGN.md §5 and §9.3"
CITATION = re.compile(
    r"DESIGN(?:\.md)?\s*§\s*\d+(?:\.\d+)?(?:\s*(?:,|/|\+|and|or)\s*§\s*\d+(?:\.\d+)?)*"
)
NUMBER = re.compile(r"§\s*(\d+(?:\.\d+)?)")
# scripts/mutants.py names what each planted bug guards by bare DESIGN sections ("§4.2 …").
BARE = re.compile(r"(?<!\.md )§\s*(\d+(?:\.\d+)?)")
# Design documents that live outside the repository (built from parts so this file does not
# match itself).
OUTSIDE = re.compile(r"(?:\.\./)*" + "sha" + r"red/" + r"|\.\./" + "sha" + "red")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def sql_blocks(markdown: str) -> list[str]:
    return [m.group(2) for m in FENCE.finditer(markdown) if m.group(1) == "sql"]


def blocks_under(markdown: str, heading: str, lang: str) -> list[str]:
    """The ```lang blocks of the section whose heading line starts with `heading`."""
    start = markdown.index("\n" + heading) + 1
    nxt = HEADING.search(markdown, start + len(heading))
    section = markdown[start : nxt.start() if nxt else len(markdown)]
    return [m.group(2) for m in FENCE.finditer(section) if m.group(1) == lang]


def design_sections(text: str) -> set[str]:
    """Section numbers of the design page: "§4.2" headings give "4.2" and "4"."""
    found = set(SECTION.findall(text))
    return found | {s.split(".")[0] for s in found}


def citations(text: str, *, bare: bool = False) -> set[str]:
    """Section numbers cited as DESIGN §N(.M) (and, with `bare`, as §N(.M) alone)."""
    cited = {n for m in CITATION.finditer(text) for n in NUMBER.findall(m.group(0))}
    if bare:
        cited |= set(BARE.findall(text))
    return cited


def tree_files() -> Iterator[Path]:
    for name in CITING:
        top = ROOT / name
        paths = [top] if top.is_file() else sorted(top.rglob("*"))
        for p in paths:
            if p.is_file() and not SKIP_DIRS.intersection(p.relative_to(ROOT).parts):
                yield p


def read_text(p: Path) -> str | None:
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None  # images, the bench's PNG


# -- the design page and its citations --------------------------------------------------------


def dangling(files: dict[str, str], sections: set[str]) -> list[str]:
    """`path: §N` for every citation that names no section."""
    out = []
    for rel, text in files.items():
        bare = rel == "scripts/mutants.py"
        out += [f"{rel}: §{n}" for n in sorted(citations(text, bare=bare)) if n not in sections]
    return out


def test_the_citation_collector_reads_every_form_and_finds_a_missing_section() -> None:
    text = "x (DESIGN §4.2, §6, §9). y DESIGN §5/§9.1 z DESIGN.md §3 and §8.2; DESIGN § 7."
    assert citations(text) == {"4.2", "6", "9", "5", "9.1", "3", "8.2", "7"}
    assert citations('"§4.2 liveness", docs/operations.md §8a', bare=True) == {"4.2"}
    sections = design_sections("## §4. Loop\n### §4.2 Lease\n## §9. Invariants\n### §9.1 x\n")
    assert sections == {"4", "4.2", "9", "9.1"}
    # §4.7 and §9.3 stand apart in this file, so the tree's own check does not read them.
    files = {"relay/a.py": "# DESIGN §4.2, " + "§4.7", "scripts/mutants.py": '"§9.3 fencing"'}
    assert dangling(files, sections) == ["relay/a.py: §4.7", "scripts/mutants.py: §9.3"]


def test_every_design_citation_names_a_section_of_docs_design_md() -> None:
    sections = design_sections(DESIGN.read_text())
    assert {"1", "2", "3", "4.1", "4.5", "5", "6", "7", "8.1", "8.2", "9.1", "9.6"} <= sections
    files = {}
    for p in tree_files():
        text = read_text(p)
        if text is not None:
            files[str(p.relative_to(ROOT))] = text
    cited = {n for rel, t in files.items() for n in citations(t, bare=rel == "scripts/mutants.py")}
    assert len(cited) >= 10, f"the collector found too few citations: {sorted(cited)}"
    assert dangling(files, sections) == []


def test_the_design_page_says_how_it_is_cited() -> None:
    top = DESIGN.read_text().split("\n## ", 1)[0]
    assert '"DESIGN §N"' in top


def test_nothing_points_at_design_documents_outside_the_repository() -> None:
    hits = []
    for p in tree_files():
        text = read_text(p)
        if text is None:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert hits == []


def test_relative_links_of_the_readme_and_docs_resolve() -> None:
    broken = []
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


# A path of this repository named in a file of the tree: relay/edges/store.py, schema/0001_init.sql.
# Not a part of a longer path or address (psycopg's `tests/fix_proxy.py` is one: listed below).
NAMED_PATH = re.compile(
    r"(?<![/\w.-])(?:relay|tests|scripts|schema|deploy|docs)/[\w./-]+"
    r"\.(?:py|sql|md|sh|yml|yaml|json|toml|html|js|css|png)(?!\w)"
)
# Paths named on purpose that are not in the tree: other projects' files, and the files whose
# removal docs/performance.md, docs/security.md and docs/operations.md tell (the history of the
# HTTP senders before issue 40 and of the hand-written OTLP encoder).
NOT_OURS = {"tests/fix_proxy.py"}
GONE = {
    "relay/http_aiohttp.py",
    "relay/http_httptools.py",
    "relay/http_httpx.py",
    "relay/integrations/otlp.py",
    "relay/proxies.py",
    "tests/test_http_httptools.py",
    "tests/test_http_httpx.py",
    "tests/test_tracing_otlp.py",
}


def missing_paths(files: dict[str, str], exists: Callable[[str], bool]) -> list[str]:
    """`file:line path` for every path a file names that `exists` does not find."""
    out = []
    for rel, text in files.items():
        for i, line in enumerate(text.splitlines(), 1):
            for path in NAMED_PATH.findall(line):
                if path not in NOT_OURS | GONE and not exists(path):
                    out.append(f"{rel}:{i} {path}")
    return out


def test_the_path_collector_finds_a_moved_file_and_passes_over_addresses() -> None:
    files = {
        "schema/x.sql": "-- refreshed by relay/health.py (now relay/serving/health.py)",
        "docs/y.md": "https://example.org/docs/relay/a.py, `tests/fix_proxy.py`, relay/b.pyc",
    }
    here = {"relay/serving/health.py"}
    assert missing_paths(files, here.__contains__) == ["schema/x.sql:1 relay/health.py"]


def test_every_path_the_tree_names_is_in_the_tree() -> None:
    """A file moved (the restructure by component) or removed leaves no comment, docstring,
    SQL comment or page pointing at its old place, except the history listed in GONE."""
    files = {}
    for p in tree_files():
        text = read_text(p)
        if text is not None and p != Path(__file__):
            files[str(p.relative_to(ROOT))] = text
    files.update({"CHANGELOG.md": (ROOT / "CHANGELOG.md").read_text()})
    assert missing_paths(files, lambda path: (ROOT / path).exists()) == []


# -- the log table names every event the relay logs ----------------------------------------------

OPERATIONS = ROOT / "docs" / "operations.md"
# What relay/logs.py writes a line with: `logs.info("event", ...)`, ...; its own `_logger` for
# uncaught exceptions (`_logger.log`, the one forwarding point, is not a line of its own).
LOG_LEVELS = {"debug", "info", "warning", "error", "critical", "log"}


def production_sources() -> dict[str, str]:
    """The production wing's modules (relay/ outside relay/tools/), by path."""
    return {
        str(p.relative_to(ROOT)): p.read_text()
        for p in sorted((ROOT / "relay").rglob("*.py"))
        if "tools" not in p.relative_to(ROOT / "relay").parts
    }


def _log_calls(tree: ast.AST) -> Iterator[tuple[ast.expr, list[ast.AST]]]:
    """Each log line's event argument, with the functions it is written in (innermost last)."""

    def walk(node: ast.AST, scope: list[ast.AST]) -> Iterator[tuple[ast.expr, list[ast.AST]]]:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            scope = [*scope, node]
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.attr in LOG_LEVELS
            and node.args
            and (node.func.value.id == "logs" or node.func.value.id == "_logger")
            and not (node.func.value.id == "_logger" and node.func.attr == "log")
        ):
            yield node.args[0], scope
        for child in ast.iter_child_nodes(node):
            yield from walk(child, scope)

    yield from walk(tree, [])


def _literals(node: ast.expr) -> list[str] | None:
    """The event names an argument may be: a literal, or each literal of a conditional."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        body, orelse = _literals(node.body), _literals(node.orelse)
        return body + orelse if body is not None and orelse is not None else None
    return None


def _called(name: str, trees: list[ast.AST]) -> Iterator[ast.Call]:
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                if (isinstance(f, ast.Name) and f.id == name) or (
                    isinstance(f, ast.Attribute) and f.attr == name
                ):
                    yield node


def _forwarded(name: str, scope: list[ast.AST], trees: list[ast.AST]) -> list[str] | None:
    """The names a variable event carries: a parameter of the function that logs it (the
    literal first arguments of its calls, as `_say_once("event", ...)`), or the first element
    of the tuples a loop reads from a function's result (`for event, ... in start_warnings()`,
    that function's `("event", ...)` literals)."""
    func = scope[-1] if scope else None
    if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    if name in {a.arg for a in func.args.args}:
        return [v for c in _called(func.name, trees) if c.args for v in _literals(c.args[0]) or []]
    for loop in ast.walk(func):
        if not (isinstance(loop, ast.For) and isinstance(loop.target, ast.Tuple)):
            continue
        first = loop.target.elts[0]
        if not (isinstance(first, ast.Name) and first.id == name):
            continue
        if isinstance(loop.iter, ast.Call) and isinstance(loop.iter.func, ast.Name):
            source = loop.iter.func.id
            return [
                v
                for tree in trees
                for d in ast.walk(tree)
                if isinstance(d, ast.FunctionDef) and d.name == source
                for t in ast.walk(d)
                if isinstance(t, ast.Tuple) and t.elts
                for v in _literals(t.elts[0]) or []
            ]
    return None


def logged_events(sources: dict[str, str]) -> dict[str, str]:
    """Every event name these modules log, and where (the first place); raises naming a log
    call whose event this reader cannot tell, so that none escapes the check unseen."""
    trees = {path: ast.parse(text) for path, text in sources.items()}
    found: dict[str, str] = {}
    for path, tree in trees.items():
        for arg, scope in _log_calls(tree):
            names = _literals(arg)
            if names is None and isinstance(arg, ast.Name):
                names = _forwarded(arg.id, scope, list(trees.values()))
            if not names:
                raise AssertionError(f"{path}:{arg.lineno}: an event name this check cannot read")
            for name in names:
                found.setdefault(name, f"{path}:{arg.lineno}")
    return found


def log_table(markdown: str) -> set[str]:
    """The event names of the log table (docs/operations.md §8): each row's first cell."""
    start = markdown.index("\n## 8. Logs")
    end = HEADING.search(markdown, start + 1 + len("## 8. Logs"))
    section = markdown[start : end.start() if end else len(markdown)]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([a-z_]+)`", row.split("|")[1])}


def test_the_event_reader_reads_every_form_and_refuses_what_it_cannot() -> None:
    sources = {
        "relay/a.py": (
            "def f(up):\n"
            "    logs.info('plain', x=1)\n"
            "    logs.log('leveled', logging.WARNING)\n"
            "    logs.warning('lost' if up else 'connect_failed')\n"
            "    _logger.critical('uncaught', exc_info=None)\n"
            "    _logger.log(level, event)\n"
            "    logs.error_text(exc)\n"
            "def _say_once(event, **fields):\n"
            "    logs.warning(event, **fields)\n"
            "def g():\n"
            "    _say_once('said_once', why='x')\n"
            "def warnings():\n"
            "    out.append(('start_warning', {}, 'hint'))\n"
            "def run():\n"
            "    for event, fields, hint in warnings():\n"
            "        logs.warning(event, **fields)\n"
        )
    }
    assert set(logged_events(sources)) == {
        "plain", "leveled", "lost", "connect_failed", "uncaught", "said_once", "start_warning",
    }  # fmt: skip
    with pytest.raises(AssertionError, match=r"relay/b\.py:2: an event name"):
        logged_events({"relay/b.py": "def f(names):\n    logs.info(names[0])\n"})
    table = "## 8. Logs\n| event |\n|---|\n| `a` / `b` | x |\n| `c`, `d` | `not_me` |\n## 9. x\n"
    assert log_table("# t\n" + table + "| `e` | after |\n") == {"a", "b", "c", "d"}


def test_the_log_table_of_operations_md_names_every_event_the_relay_logs() -> None:
    """docs/operations.md §8 is where an operator looks up a line: every event the production
    wing logs has its row (issue 49 named five without one; 29 were), and no row names one it
    no longer logs."""
    logged = logged_events(production_sources())
    assert {"delivered", "retry_deferred", "secret_file_exposed", "http_transport_chosen"} <= set(
        logged
    ), "the reader found too few events"
    table = log_table(OPERATIONS.read_text())
    missing = {name: where for name, where in logged.items() if name not in table}
    assert missing == {}, f"events without a row in docs/operations.md's log table: {missing}"
    assert table - set(logged) == set(), "rows of the log table for events nothing logs"


# -- the README's SQL runs as written ---------------------------------------------------------


@pytest.fixture
def readme_db(pg_url: str) -> Iterator[str]:
    """A fresh database with the relay migrated under its default schema name `relay`, and
    Absurd with the queue `default` (the README's wake examples name it)."""
    name = f"docs_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
    url = make_conninfo(pg_url, dbname=name)
    try:
        migrate(url, "relay")
        install_absurd(url, ("default",))
        yield url
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name))
            )


def test_the_readme_has_sql_blocks_with_named_arguments() -> None:
    blocks = sql_blocks(README.read_text())
    assert len(blocks) >= 2
    assert any("p_terminal => true" in b for b in blocks)


def test_every_sql_block_of_the_readme_runs_against_a_migrated_database(readme_db: str) -> None:
    blocks = sql_blocks(README.read_text())
    with psycopg.connect(readme_db, autocommit=True) as conn:
        for i, block in enumerate(blocks, 1):
            try:
                conn.execute(block.encode())  # no parameters: one simple-protocol message
            except psycopg.Error as e:
                pytest.fail(f"README.md's sql block {i} fails: {e}\n{block}")
        named = {n for b in blocks for n in re.findall(r"p_event_id\s*=>\s*'([^']+)'", b)}
        cur = conn.execute(
            "select event_id from relay.outbox where event_id = any(%s)", [list(named)]
        )
        assert named and {r[0] for r in cur} == named


def test_the_quick_starts_python_runs_as_written(readme_db: str) -> None:
    (block,) = blocks_under(README.read_text(), "## Quick start", "python")
    env = {**os.environ, "RELAY_DATABASE_URL": readme_db}
    subprocess.run([sys.executable, "-c", block], env=env, check=True, timeout=60, cwd=ROOT)
    ids = set(re.findall(r'"(run-\d+:\w+)"', block))
    with psycopg.connect(readme_db) as conn:
        cur = conn.execute(
            "select event_id, terminal from relay.outbox where event_id = any(%s)", [list(ids)]
        )
        rows = dict(cur.fetchall())
    assert ids and set(rows) == ids and any(rows.values())
