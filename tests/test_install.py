"""The core install as a user gets it: the wheel, built once, installed without extras into a
fresh venv of the default Python and of Python 3.13 (pyenv's, or `python3.13` on PATH, when this
user can run one; skipped with the reason otherwise). The venv holds the core dependencies and
theirs, nothing of the tools wing; `relay --help` works; `relay sink|demo|bench` name the extra
to install; and `relay run` from that venv delivers an enqueued event to the reference sink and
exits 0 on SIGTERM. On 3.13 the `sink` extra installs and serves, and the `demo` extra leaves
pgserver out by its marker (the embedded PostgreSQL then uses the system's binaries).

Cheap enough for every CI run (not `slow`): one wheel build and one venv per Python and install
per session, cached under the session's tmp dir (about a minute for the module with a warm pip
cache); every subprocess has a deadline, and pip calls stop being tried once one ran over."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tomllib
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from relay.tools.sink import Sink, serve_sink
from tests.support import count, wait_for

ROOT = Path(__file__).resolve().parent.parent
# The tools wing's packages: none may come with the core install.
TOOLS_PACKAGES = {"uvicorn", "rich", "pgserver", "absurdctl", "matplotlib", "pgqueuer"}
TOOLS_EXTRAS = {"sink": "sink", "demo": "demo", "bench": "bench"}  # command -> extra it names
PIP_DEADLINE = 180.0  # one pip install or wheel build (cold cache: downloads)
COMMAND_DEADLINE = 60.0
# Once a pip call ran out of time (the registry unreachable, say), the others fail at once
# instead of waiting out their own deadlines: the module's time stays bounded.
PIP_STUCK: list[str] = []

PYTHONS = ["default", "3.13"]


def find_python_313() -> tuple[Path | None, str]:
    """A Python 3.13 this user may run: pyenv's newest 3.13.x, else `python3.13` on PATH; or
    the reason to skip, naming each place looked at and what it lacked. A place this user
    cannot read counts as not found: an ordinary user's environment may still point at root's
    pyenv (`su` keeps PYENV_ROOT and PATH), behind a 0700 /root."""
    missing: list[str] = []
    for root in pyenv_roots():
        python, why = pyenv_313(root)
        if python is not None:
            return python, ""
        missing.append(why)
    python, why = path_313()
    if python is not None:
        return python, ""
    missing.append(why)
    return None, f"Python 3.13 check skipped: no Python 3.13 found ({'; '.join(missing)})"


def pyenv_roots() -> list[Path]:
    """Where pyenv may keep its Pythons: `pyenv root`, $PYENV_ROOT, ~/.pyenv (each once)."""
    roots: list[Path] = []
    pyenv = shutil.which("pyenv")
    if pyenv:
        try:
            got = subprocess.run(
                [pyenv, "root"], capture_output=True, text=True, timeout=30, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            got = None
        if got is not None and got.returncode == 0 and got.stdout.strip():
            roots.append(Path(got.stdout.strip()))
    if os.environ.get("PYENV_ROOT"):
        roots.append(Path(os.environ["PYENV_ROOT"]))
    roots.append(Path.home() / ".pyenv")
    return list(dict.fromkeys(roots))


def pyenv_313(root: Path) -> tuple[Path | None, str]:
    """The newest 3.13.x under the pyenv root `root`, or what that root lacks."""
    versions = root / "versions"
    try:
        names = sorted(p.name for p in versions.iterdir())
    except FileNotFoundError:
        return None, f"no {versions}"
    except OSError as exc:  # PermissionError: another user's pyenv
        return None, f"{versions} not readable ({exc.strerror})"
    found = sorted(
        (tuple(int(part) for part in name.split(".")), versions / name / "bin" / "python")
        for name in names
        if re.fullmatch(r"3\.13\.\d+", name)
    )
    runnable = [python for _, python in found if os.access(python, os.X_OK)]
    if not runnable:
        return None, f"{versions} has no 3.13.x (has: {', '.join(names) or 'none'})"
    return runnable[-1], ""


def path_313() -> tuple[Path | None, str]:
    """`python3.13` on PATH, as the interpreter it runs (a pyenv shim resolves to its
    version's), or why there is none."""
    found = shutil.which("python3.13")
    if found is None:
        return None, "no python3.13 on PATH"
    try:
        got = subprocess.run(
            [found, "-c", "import sys; print(*sys.version_info[:2]); print(sys.executable)"],
            capture_output=True,
            text=True,
            timeout=30,
            env=clean_env(),
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{found} does not run ({exc})"
    lines = got.stdout.splitlines()
    if got.returncode != 0 or len(lines) != 2 or lines[0] != "3 13":
        said = (got.stderr or got.stdout).strip().splitlines()
        return None, f"{found} is not a Python 3.13 ({said[-1] if said else 'no output'})"
    return Path(lines[1]), ""


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without what would leak it into a venv's commands."""
    drop = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "PYTHONSAFEPATH"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("RELAY_")}
    env.update(PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


def run_pip(command: list[str], *, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    if PIP_STUCK:
        pytest.fail(f"not tried: {PIP_STUCK[0]}")
    try:
        return subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=PIP_DEADLINE,
            cwd=cwd,
            env=clean_env(),
            check=False,
        )
    except subprocess.TimeoutExpired:
        PIP_STUCK.append(f"{' '.join(command[2:5])} ran over {PIP_DEADLINE:g}s (no registry?)")
        pytest.fail(PIP_STUCK[0])


@dataclass
class Venv:
    path: Path
    workdir: Path  # outside the checkout: `relay` must come from the venv, not the source tree
    baseline: set[str]  # distributions of the empty venv (pip, setuptools on 3.11)

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def relay(self) -> Path:
        return self.path / "bin" / "relay"

    def run(
        self, *args: str | Path, timeout: float = COMMAND_DEADLINE, **env: str
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(a) for a in args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.workdir,
            env=clean_env(**env),
            check=False,
        )

    def pip(self, *args: str) -> str:
        got = run_pip([str(self.python), "-m", "pip", *args], cwd=self.workdir)
        assert got.returncode == 0, f"pip {' '.join(map(str, args))}:\n{got.stderr[-3000:]}"
        return got.stdout

    def inspect(self) -> dict[str, Any]:
        report: dict[str, Any] = json.loads(self.pip("inspect", "--local"))
        return report

    def distributions(self) -> set[str]:
        return {canonicalize_name(d["metadata"]["name"]) for d in self.inspect()["installed"]}


class Venvs:
    """Venvs cached for the session, one per (Python, what was installed)."""

    def __init__(self, base: Path, wheel: Path) -> None:
        self.base, self.wheel = base, wheel
        self.made: dict[tuple[str, str], Venv] = {}
        self.failed: dict[tuple[str, str], str] = {}
        self.python_313, self.reason_313 = find_python_313()

    def interpreter(self, python: str) -> Path:
        if python == "default" or sys.version_info[:2] == (3, 13):
            return Path(sys.executable)
        if self.python_313 is None:
            pytest.skip(self.reason_313)
        return self.python_313

    def get(self, python: str, extra: str = "") -> Venv:
        """The venv of `python` with the wheel (and `extra`) installed; made once a session, and
        a failure to make it is not retried."""
        key = (python, extra)
        if key in self.failed:
            pytest.fail(f"not retried: {self.failed[key]}")
        if key not in self.made:
            interpreter = self.interpreter(python)
            try:
                self.made[key] = self._make(interpreter, python, extra)
            except BaseException as exc:
                self.failed[key] = f"making the {key} venv failed: {exc}"[:3000]
                raise
        return self.made[key]

    def _make(self, interpreter: Path, python: str, extra: str) -> Venv:
        name = f"{python}-{extra}" if extra else python
        path, workdir = self.base / name, self.base / f"work-{name}"
        workdir.mkdir()
        got = subprocess.run(
            [str(interpreter), "-m", "venv", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
            env=clean_env(),
            check=False,
        )
        assert got.returncode == 0, got.stderr
        venv = Venv(path, workdir, set())
        venv.baseline = venv.distributions()
        venv.pip("install", "--quiet", self.requirement(extra))
        return venv

    def requirement(self, extra: str = "") -> str:
        return f"ledger-relay{f'[{extra}]' if extra else ''} @ {self.wheel.as_uri()}"


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    got = run_pip(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(ROOT)]
    )
    assert got.returncode == 0, got.stderr[-3000:]
    (built,) = out.glob("ledger_relay-*.whl")
    return built


@pytest.fixture(scope="session")
def venvs(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Venvs:
    return Venvs(tmp_path_factory.mktemp("venvs"), wheel)


@pytest.fixture(params=PYTHONS)
def core(request: pytest.FixtureRequest, venvs: Venvs) -> Venv:
    """The core install (no extras) on the default Python and on 3.13."""
    if request.param == "3.13" and sys.version_info[:2] == (3, 13):
        pytest.skip("the default Python is 3.13: its run covers 3.13")
    return venvs.get(request.param)


# -- what the core install holds --------------------------------------------------------------


def wheel_requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(z.read(name).decode())
    return [Requirement(r) for r in metadata.get_all("Requires-Dist") or []]


def applies(requirement: Requirement, environment: dict[str, str], extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({**environment, "extra": e}) for e in {"", *extras})


def closure(report: dict[str, Any], roots: list[Requirement]) -> set[str]:
    """The distributions `roots` need in the environment `report` (pip inspect) describes,
    following extras (psycopg[binary] -> psycopg-binary) and markers."""
    environment = report["environment"]
    metadata = {
        canonicalize_name(d["metadata"]["name"]): d["metadata"] for d in report["installed"]
    }
    extras_seen: dict[str, set[str]] = {}
    todo = list(roots)
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        done = extras_seen.get(name)
        if done is not None and set(req.extras) <= done:
            continue
        extras_seen[name] = (done or set()) | set(req.extras)
        assert name in metadata, f"{req} is required but not installed"
        for spec in metadata[name].get("requires_dist") or []:
            dependency = Requirement(spec)
            if applies(dependency, environment, extras_seen[name]):
                todo.append(dependency)
    return set(extras_seen)


def core_names() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}


def test_core_install_is_the_core_dependencies_and_theirs(core: Venv, wheel: Path) -> None:
    report = core.inspect()
    installed = {canonicalize_name(d["metadata"]["name"]) for d in report["installed"]}
    roots = [r for r in wheel_requirements(wheel) if applies(r, report["environment"], set())]
    assert {canonicalize_name(r.name) for r in roots} == core_names(), "the wheel's core"
    needed = closure(report, roots)
    assert installed - core.baseline == needed | {"ledger-relay"}, "more or less than the core"
    assert not installed & TOOLS_PACKAGES
    assert core.pip("check").strip() == "No broken requirements found."
    where = core.run(core.python, "-c", "import relay; print(relay.__file__)")
    assert Path(where.stdout.strip()).is_relative_to(core.path), where


def test_relay_help_works_from_the_core_install(core: Venv) -> None:
    got = core.run(core.relay, "--help")
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith("usage: relay")
    for command in ("migrate", "run", "status", "check", "sink", "demo", "bench"):
        assert command in got.stdout
    assert core.run(core.relay, "run", "--help").returncode == 0


@pytest.mark.parametrize("command", sorted(TOOLS_EXTRAS))
def test_tools_command_without_its_extra_names_the_install(core: Venv, command: str) -> None:
    got = core.run(core.relay, command)
    assert got.returncode == 2, (got.stdout, got.stderr)
    assert got.stdout == ""
    assert "Traceback" not in got.stderr
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1, got.stderr
    assert f"pip install 'ledger-relay[{TOOLS_EXTRAS[command]}]'" in lines[0]
    assert lines[0].startswith(f"relay {command}: ")


def test_a_socks_proxy_without_its_extra_is_refused_at_start(core: Venv) -> None:
    """Issue 40: `ALL_PROXY=socks5://…` failed every POST once a second with `No module named
    'socksio'`. From the core install (no `socks` extra) `relay run` refuses at start, one line
    naming the install, before any connection is tried."""
    assert "socksio" not in core.distributions()
    got = core.run(
        core.relay,
        "run",
        RELAY_DATABASE_URL="postgresql://nobody@127.0.0.1:1/none",
        RELAY_INGRESS_URL="http://127.0.0.1:1/runs/{run_id}",
        ALL_PROXY="socks5://127.0.0.1:1",
    )
    assert got.returncode == 2, (got.stdout, got.stderr)
    lines = got.stderr.strip().splitlines()
    assert "Traceback" not in got.stderr, got.stderr
    assert any("pip install 'ledger-relay[socks]'" in line for line in lines), got.stderr


# -- relay run from the core install ----------------------------------------------------------

ENQUEUE = """
import sys, psycopg, relay
url, schema, run_id = sys.argv[1:]
with psycopg.connect(url) as conn:
    relay.enqueue(conn, run_id=run_id, event_id=run_id + "-1", event_type="run_created",
                  payload={"from": "core venv"}, terminal=True, schema=schema)
"""


@pytest.mark.anyio
async def test_relay_run_from_the_core_install_delivers_and_stops_on_sigterm(
    core: Venv, pg_url: str, schema: str, conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    run_id = f"core-{uuid.uuid4().hex[:8]}"
    sink = Sink()
    async with serve_sink(sink) as url:
        # The producer side from the same install (the Python helper over relay.enqueue).
        enqueued = core.run(core.python, "-c", ENQUEUE, pg_url, schema, run_id)
        assert enqueued.returncode == 0, enqueued.stderr
        log_path = tmp_path / "relay.log"
        with log_path.open("wb") as log:
            proc = await anyio.open_process(
                [str(core.relay), "run"],
                cwd=core.workdir,
                env=clean_env(
                    RELAY_DATABASE_URL=pg_url,
                    RELAY_SCHEMA=schema,
                    RELAY_INGRESS_URL=url + "/runs/{run_id}/events",
                    RELAY_POLL_INTERVAL="0.2",
                    RELAY_SHUTDOWN_TIMEOUT="5s",
                    RELAY_LOG_LEVEL="info",
                ),
                stdout=log,
                stderr=subprocess.STDOUT,
            )

            def delivered_or_exited() -> bool:
                return proc.returncode is not None or (
                    count(conn, schema, "state = 'delivered'") == 1
                )

            try:
                try:
                    await wait_for(delivered_or_exited, timeout=COMMAND_DEADLINE, what="the ack")
                except AssertionError as exc:
                    raise AssertionError(
                        f"{exc}; its log: {log_path.read_text()[-3000:]}"
                    ) from None
                assert proc.returncode is None, (
                    f"relay run exited {proc.returncode}: {log_path.read_text()[-3000:]}"
                )
                proc.send_signal(signal.SIGTERM)
                with anyio.fail_after(COMMAND_DEADLINE):
                    code = await proc.wait()
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
    text = log_path.read_text()
    assert code == 0, text[-3000:]
    assert sink.state.first_order == {run_id: [1]}
    assert sink.state.deliveries == {f"{run_id}-1": 1}
    assert '"event":"delivered"' in text and "Traceback" not in text


# -- the extras on 3.13 -----------------------------------------------------------------------


def test_sink_extra_installs_and_serves_on_313(venvs: Venvs) -> None:
    venv = venvs.get("3.13", "sink")
    installed = venv.distributions()
    assert {"uvicorn", "httptools"} <= installed
    assert not installed & (TOOLS_PACKAGES - {"uvicorn"})
    assert venv.run(venv.relay, "sink", "--help").returncode == 0
    proc = subprocess.Popen(
        [str(venv.relay), "sink", "--port", "0"],
        cwd=venv.workdir,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # "relay sink listening on http://127.0.0.1:PORT"
        m = re.search(r"listening on (http://\S+)", first)
        assert m, first
        probe = venv.run(
            venv.python,
            "-c",
            "import sys, urllib.request as u; print(u.urlopen(sys.argv[1], timeout=5).status)",
            m.group(1) + "/healthz",
        )
        assert probe.stdout.strip() == "200", probe.stderr
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=COMMAND_DEADLINE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert json.loads(out)["requests"] == 0  # its report, printed on the way out


def would_install(venv: Venv, requirement: str) -> set[str]:
    """What `pip install requirement` would add to `venv` (resolved, nothing installed)."""
    report = json.loads(venv.pip("install", "--dry-run", "--quiet", "--report", "-", requirement))
    return {canonicalize_name(item["metadata"]["name"]) for item in report["install"]}


def extra_brings(wheel: Path, extra: str, environment: dict[str, str]) -> set[str]:
    """The distributions the wheel's metadata asks for with `extra`, in `environment`: the
    marker resolution alone (cheap, no network)."""
    return {
        canonicalize_name(r.name)
        for r in wheel_requirements(wheel)
        if r.marker is not None and r.marker.evaluate({**environment, "extra": extra})
    }


def test_demo_extra_leaves_pgserver_out_on_313(venvs: Venvs, wheel: Path) -> None:
    """By the markers (pgserver has wheels up to 3.12 only) and by pip's resolution (a dry run:
    nothing installed, no matplotlib anywhere near the 3.13 venv)."""
    venv = venvs.get("3.13")
    environment = venv.inspect()["environment"]
    below = {**environment, "python_version": "3.12", "python_full_version": "3.12.1"}
    for extra in ("demo", "bench", "dev"):
        assert "pgserver" not in extra_brings(wheel, extra, environment), extra
        assert "pgserver" in extra_brings(wheel, extra, below), extra
    demo = would_install(venv, venvs.requirement("demo"))
    assert {"rich", "absurdctl", "uvicorn"} <= demo
    assert not demo & {"pgserver", "matplotlib", "pgqueuer"}


def test_demo_extra_brings_pgserver_below_313(venvs: Venvs) -> None:
    """The other side of the marker: the default Python, when it is below 3.13."""
    if sys.version_info >= (3, 13):
        pytest.skip(f"the default Python is {sys.version.split()[0]}: pgserver has no wheel")
    demo = would_install(venvs.get("default"), venvs.requirement("demo"))
    assert {"pgserver", "rich", "absurdctl"} <= demo


# -- the embedded PostgreSQL without pgserver -------------------------------------------------

EMBEDDED = """
import importlib.util, sys
from pathlib import Path
assert importlib.util.find_spec("pgserver") is None, "pgserver is installed"
import psycopg
from relay.tools.embedded import EmbeddedPostgres
pg = EmbeddedPostgres(Path(sys.argv[1]) / "data", durable=False)
print(pg.bin)
url = pg.start()
try:
    with psycopg.connect(url, connect_timeout=10) as conn:
        print(conn.execute("show server_version").fetchone()[0])
finally:
    pg.stop("immediate")
"""


def system_postgres() -> bool:
    return shutil.which("pg_ctl") is not None or any(
        Path("/usr/lib/postgresql").glob("*/bin/pg_ctl")
    )


@pytest.fixture
def datadir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    postmaster = tmp_path / "data" / "postmaster.pid"
    if postmaster.exists():  # the snippet failed between start and stop: do not leak a server
        subprocess.run(
            ["kill", "-QUIT", postmaster.read_text().split()[0]], check=False, timeout=10
        )


@pytest.mark.skipif(not system_postgres(), reason="no system PostgreSQL binaries to fall back to")
def test_embedded_postgres_falls_back_to_system_binaries_without_pgserver(
    venvs: Venvs, datadir: Path
) -> None:
    """On 3.13 pgserver cannot be installed: relay/tools/embedded.py (stdlib only) runs the
    system's PostgreSQL from the core install, as the demo and benchmarks would."""
    python = "3.13" if venvs.python_313 is not None else "default"
    venv = venvs.get(python)
    got = venv.run(venv.python, "-c", EMBEDDED, datadir, timeout=180)
    assert got.returncode == 0, got.stderr[-3000:]
    bin_dir, version = got.stdout.splitlines()
    assert (Path(bin_dir) / "pg_ctl").exists() and "pgserver" not in bin_dir
    assert re.match(r"\d+", version)


def test_the_wheel_knows_its_commit_without_git(wheel: Path, core: Venv) -> None:
    """Issue 49 item 10: the wheel carries the commit it was built from (hatch_build.py), and a
    relay installed from it reports it (`build_info{commit}`, `relay --version`) with no git
    checkout around it."""
    if not (ROOT / ".git").exists():
        pytest.skip("built from a tree without git: nothing to stamp")
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"],
        capture_output=True, text=True, timeout=COMMAND_DEADLINE, check=True,
    ).stdout.strip()  # fmt: skip
    with zipfile.ZipFile(wheel) as z:
        assert z.read("relay/serving/build_commit").decode().strip() == head
    got = core.run(core.relay, "--version")
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == f"ledger-relay {relay_version()} (commit {head})"


def relay_version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])
