"""The package's shape (issue 12): a production wing that never imports the tools wing, no import
circles, each module's one job named in its docstring, and a core install that is exactly what
the production wing imports. How long a function may grow is ruff's to say (pyproject.toml,
`[tool.ruff.lint]`: mccabe and pylint's branch and statement counts, issue 27 item 7), not a
line count per module here."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "relay"
TOOLS = "relay.tools"
# The first sentence of a module's docstring names its job: at most this many words.
MAX_JOB_WORDS = 75
# Optional integrations: each needs an extra, loaded only when configured (relay/edges/tracing.py).
INTEGRATIONS = {"relay.integrations": "otel"}
# In the core install although nothing imports it (every other core dependency is one the
# production wing imports, since issue 40). uvloop: anyio imports it (use_uvloop,
# relay/core/loop.py); the relay names it, never imports it.
INSTALLED_NOT_IMPORTED: set[str] = {"uvloop"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _in_wing(name: str, wing: str) -> bool:
    return name == wing or name.startswith(wing + ".")


def production() -> dict[str, Path]:
    return {
        name: path
        for name, path in modules().items()
        if not any(_in_wing(name, wing) for wing in (TOOLS, *INTEGRATIONS))
    }


def _type_checking_only(tree: ast.Module) -> set[ast.AST]:
    return {
        inner
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for statement in node.body
        for inner in ast.walk(statement)
    }


def imports(path: Path, *, runtime: bool = False) -> set[str]:
    """Every module an import statement in `path` names, at any depth: lazy imports inside
    functions count (they are dependencies all the same), and so do TYPE_CHECKING blocks
    unless `runtime` (what must be installed to run it)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path.parent)
    skip = _type_checking_only(tree) if runtime else set()
    known = set(modules())
    found: set[str] = set()
    for node in ast.walk(tree):
        if node in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join([*base, node.module] if node.module else base)
            else:
                prefix = node.module or ""
            submodules = {f"{prefix}.{alias.name}" for alias in node.names} & known
            # `from relay import logs` imports the module relay.logs (its package is only on
            # the way there, like any parent package)
            found.update(submodules)
            if len(submodules) < len(node.names):
                found.add(prefix)
    return found


def internal_edges(names: dict[str, Path]) -> dict[str, set[str]]:
    known = set(modules())
    edges: dict[str, set[str]] = {}
    for name, path in names.items():
        edges[name] = {m for m in imports(path) if m in known and m != name and m != "relay"}
    return edges


def test_production_wing_never_imports_the_tools_wing() -> None:
    offenders = {
        name: sorted(m for m in imports(path) if m == TOOLS or m.startswith(TOOLS + "."))
        for name, path in production().items()
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"production modules importing the tools wing: {offenders}"
    assert len(production()) >= 15 and any(n.startswith(TOOLS) for n in modules())


def test_importing_every_production_module_loads_nothing_of_the_tools_wing() -> None:
    """At run time too: `relay.cli` reaches the tools wing by module name only when a tools
    command is asked for."""
    names = sorted(n for n in production() if n != "relay")
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "from relay.cli import build_parser\n"
        "build_parser()\n"
        "print(sorted(m for m in sys.modules if m.startswith('relay.tools')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.strip()
    assert out == "[]", f"loaded by the production wing: {out}"


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_planted_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_in_the_package() -> None:
    assert cycles(internal_edges(modules())) == []


def first_sentence(docstring: str) -> str:
    """The docstring's first sentence: its first paragraph up to the first full stop."""
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    return re.split(r"(?<=[.?])\s", paragraph, maxsplit=1)[0]


def test_first_sentence_stops_at_the_first_full_stop() -> None:
    assert first_sentence("Does one thing (§5).\nMore: here.") == "Does one thing (§5)."
    assert first_sentence("Names a job:\nthis one.\n\nDetails.") == "Names a job: this one."
    assert first_sentence("No full stop\n\nat all") == "No full stop"


def test_every_module_names_its_one_job_in_its_docstring() -> None:
    """A module has one job, named in the first sentence of its docstring (docs/style.md): a
    sentence (it ends with a full stop) of a few words up to a long line's worth, not a
    paragraph that lists several."""
    unnamed = {}
    for name, path in modules().items():
        doc = ast.get_docstring(ast.parse(path.read_text()))
        sentence = first_sentence(doc or "")
        if not (sentence.endswith((".", "?")) and 3 <= len(sentence.split()) <= MAX_JOB_WORDS):
            unnamed[name] = sentence
    assert unnamed == {}, "modules whose docstring does not open with their one job"


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def core_dependencies() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = set()
    for requirement in project["dependencies"]:
        match = re.match(r"[A-Za-z0-9._-]+", requirement)
        assert match, requirement
        names.add(_normalise(match.group(0)))
    return names


def imported_distributions() -> set[str]:
    stdlib = sys.stdlib_module_names
    by_module = packages_distributions()
    found: set[str] = set()
    for path in production().values():
        for name in imports(path, runtime=True):
            top = name.split(".")[0]
            if not top or top in stdlib or top == "relay":
                continue
            distributions = by_module.get(top)
            assert distributions, f"{path.name} imports {top}, which no installed package gives"
            found.update(_normalise(d) for d in distributions)
    return found


def test_core_dependencies_are_exactly_what_the_production_wing_imports() -> None:
    declared = core_dependencies()
    imported = imported_distributions()
    # psycopg[binary] pulls psycopg-binary, which nothing imports by that name
    assert imported - declared == set(), "imported by the production wing but not declared"
    assert declared - imported == INSTALLED_NOT_IMPORTED, "declared but not imported"


@pytest.mark.parametrize(("wing", "extra"), INTEGRATIONS.items())
def test_every_integration_dependency_sits_in_its_extra(wing: str, extra: str) -> None:
    """An integration imports only the core install and its own extra (otel: OpenTelemetry)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    allowed = core_dependencies() | {
        _normalise(re.match(r"[A-Za-z0-9._-]+", r).group(0))  # type: ignore[union-attr]
        for r in project["optional-dependencies"][extra]
    }
    by_module = packages_distributions()
    for name, path in modules().items():
        if not _in_wing(name, wing):
            continue
        for imported in imports(path, runtime=True):
            top = imported.split(".")[0]
            if top in sys.stdlib_module_names or top == "relay":
                continue
            dists = {_normalise(d) for d in by_module.get(top, [top])}
            assert dists & allowed, f"{path.name} imports {top}, not in the {extra!r} extra"


def test_the_production_wing_loads_an_integration_only_inside_a_function() -> None:
    """`import relay.runner` (what `relay run` loads) pulls in no integration: they are
    imported lazily where their configuration asks for them."""
    code = (
        "import sys, relay.runner, relay.cli, relay.edges.tracing, relay.edges.ingress; "
        "print([m for m in sys.modules if m.startswith(("
        "'relay.integrations', 'opentelemetry'))])"
    )
    got = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert got.stdout.strip() == "[]", got.stdout


def test_no_asyncio_deadline_inside_the_relays_anyio_scopes() -> None:
    """The relay runs under anyio (its asyncio backend only, README): a deadline is anyio's
    (`fail_after`, `move_on_after`, a CancelScope). asyncio.timeout / wait_for inside an anyio
    cancel scope mix two cancellation schemes on one task (issue 27, item 8)."""
    found = {
        name: sorted(
            f"asyncio.{node.attr}"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute)
            and node.attr in ("timeout", "wait_for", "timeout_at")
            and isinstance(node.value, ast.Name)
            and node.value.id == "asyncio"
        )
        for name, path in production().items()
    }
    assert {k: v for k, v in found.items() if v} == {}


@pytest.mark.parametrize("extra", ["sink", "demo", "bench", "dev"])
def test_every_tools_dependency_sits_in_an_extra(extra: str) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert extra in project["optional-dependencies"]
    assert not {"uvicorn", "rich", "pgserver", "absurdctl", "matplotlib", "pgqueuer"} & (
        core_dependencies()
    )


# --- no private name of a dependency (issue 40 item 3) -------------------------------------------

ACCESSORS = {"getattr", "setattr", "hasattr", "delattr"}
# Underscore names that are documented API: namedtuple's methods (the underscore keeps them
# apart from field names).
DOCUMENTED = {"_make", "_asdict", "_replace", "_fields", "_field_defaults"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _names_defined(tree: ast.AST) -> set[str]:
    """Every name the relay's own code binds: functions, classes, arguments, assignment targets
    (names and attributes), `__slots__` entries."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            out |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
    return out


def _bindings(tree: ast.AST, *, stdlib: bool) -> set[str]:
    """Names bound by `import x` / `from x import y` of a third-party module (or, with
    `stdlib`, of the standard library's)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods = [(a.name, a.asname or a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods = [(node.module, a.asname or a.name) for a in node.names]
        else:
            continue
        for module, bound in mods:
            top = module.split(".")[0]
            if top != "relay" and (top in sys.stdlib_module_names) == stdlib:
                out.add(bound)
    return out


def private_names_of_dependencies(sources: dict[str, str]) -> list[str]:
    """`x._name` (or getattr(x, "_name")) where `_name` is nothing the relay defines, or where
    `x` is a third-party module or name: a dependency's private name."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    defined = set().union(*(_names_defined(t) for t in trees.values()))
    found = []
    for name, tree in trees.items():
        foreign, stdlib = _bindings(tree, stdlib=False), _bindings(tree, stdlib=True)
        for node in ast.walk(tree):
            attr, owner = None, None
            if isinstance(node, ast.Attribute) and _private(node.attr):
                attr, owner = node.attr, node.value
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ACCESSORS
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and _private(node.args[1].value)
            ):
                attr, owner = node.args[1].value, node.args[0]
            if attr is None or attr in DOCUMENTED:
                continue
            named = owner.id if isinstance(owner, ast.Name) else None
            if named in foreign or named in stdlib or attr not in defined:
                found.append(f"{name}:{node.lineno} {attr}")
    return found


def production_sources() -> dict[str, str]:
    return {name: path.read_text() for name, path in modules().items() if not _in_wing(name, TOOLS)}


def test_the_production_wing_uses_no_private_name_of_a_dependency() -> None:
    """A library's underscore names are not its API (docs/style.md): none in relay/ outside
    relay/tools/ (it read absurd_sdk's `_queue_name`, the OTLP exporter's `_client` and h11's
    limits before issue 40)."""
    assert private_names_of_dependencies(production_sources()) == []


@pytest.mark.parametrize(
    "planted",
    [
        "import absurd_sdk\nq = absurd_sdk._queue_name\n",
        "def f(client):\n    return getattr(client, '_queue_name', None)\n",
        "def f(exporter):\n    return exporter._client\n",
        "from h11 import _util\nx = _util.thing\ny = _util._private\n",
        "import argparse\ndef f(sub: argparse._SubParsersAction) -> None: ...\n",
    ],
)
def test_a_private_name_of_a_dependency_is_found(planted: str) -> None:
    """The walk itself: each planted access is reported, beside the real production wing."""
    sources = production_sources() | {"relay.planted": planted}
    found = private_names_of_dependencies(sources)
    assert [f for f in found if f.startswith("relay.planted:")], found


# --- the tree shows the architecture (issue 47) ---------------------------------------------------

# relay/'s top level is its public face and the runner's parts; everything else sits in the
# subpackage of its component (docs/architecture.md).
MAX_TOP_LEVEL = 12


def lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    """import-linter's contracts (pyproject.toml, `[tool.importlinter]`) over the `relay` package
    found first on the path from `cwd`."""
    command = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(command), "--no-cache"],
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(cwd)},
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_top_level_holds_the_public_face_and_few_modules() -> None:
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(top) <= MAX_TOP_LEVEL, f"relay/ has {len(top)} top-level modules: {top}"
    assert {"cli", "producer", "runner", "settings", "logs"} <= set(top)


def test_every_subpackage_says_what_it_holds_and_what_it_may_import() -> None:
    """Each subpackage's `__init__` docstring names its modules and the layers it may import."""
    silent = {}
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        held = sorted(
            p.stem if p.suffix else p.name
            for p in init.parent.iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()
        )
        missing = [m for m in held if m not in doc]
        if init.parent.name != "tools" and ("import" not in doc or missing):
            silent[init.parent.name] = missing or ["what it may import"]
    assert silent == {}, f"subpackages whose docstring does not say: {silent}"


def test_the_import_layers_are_kept() -> None:
    got = lint_imports(ROOT)
    assert got.returncode == 0, got.stdout + got.stderr
    assert "broken" not in got.stdout.split("Contracts:")[-1].replace("0 broken", "")


@pytest.mark.parametrize(
    ("where", "planted", "says"),
    [
        # an edge reaching up into the delivery pipeline
        ("edges/store.py", "from relay.delivery import lane", "relay.edges is not allowed"),
        # the pure core reaching an edge
        ("core/policy.py", "from relay.edges import store", "relay.core is not allowed"),
        # the production wing reaching the tools wing
        ("runner.py", "from relay.tools import embedded", "relay.runner is not allowed"),
        # the pipeline's complete reaching back up to fetch
        ("delivery/execute.py", "from relay.delivery import lane", "execute is not allowed"),
        # the lane's discovery calling back into the lane, or reaching across to its deliveries
        ("delivery/discovery.py", "from relay.delivery import lane", "discovery is not allowed"),
        ("delivery/discovery.py", "from relay.delivery import deliveries", "discovery is not"),
        # the critical lane's targeted drains likewise
        ("delivery/targets.py", "from relay.delivery import lane", "targets is not allowed"),
        ("delivery/targets.py", "from relay.delivery import deliveries", "targets is not"),
    ],
)
def test_a_planted_upward_import_breaks_the_layers(
    tmp_path: Path, where: str, planted: str, says: str
) -> None:
    shutil.copytree(PACKAGE, tmp_path / "relay", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with (tmp_path / "relay" / where).open("a") as f:
        f.write(f"\n{planted}  # planted\n")
    got = lint_imports(tmp_path)
    assert got.returncode != 0, got.stdout
    assert says in got.stdout, got.stdout
