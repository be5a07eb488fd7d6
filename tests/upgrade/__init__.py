"""The previous release, built from git history for the rolling-upgrade test (issue 29, item 3).

`PREVIOUS_RELEASE` names the commit; another file here may name another (`BEFORE_CURSOR`: a
release from before schema version 7, for tests/test_migrate_cursor.py), passed as `name`.
`previous_release(root)` builds it once into its own venv,
`.venv-previous/<commit>/` at the checkout's root (git-ignored; kept across sessions, keyed by
the commit, built under a file lock so concurrent sessions build it once): `git archive` of the
commit, `python -m venv`, `pip install` of that tree (a regular, non-editable install with its
own dependencies). A build that cannot complete (a shallow clone without the commit, no package
index) raises `Unavailable` with the reason, for the test to skip with.

`Previous.command` runs the previous release's `relay`; `Previous.prefix` is the same as a
command prefix for the fault harness (tests/faults/harness.py starts
`[*prefix, python, "-m", "relay.cli", "run"]`): a wrapper that drops the harness' interpreter and
module and runs the previous `relay` with the rest, from `/` so nothing of this checkout is on
its path.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
BUILD_TIMEOUT = 900.0  # pip install of the release and its dependencies, once per commit


class Unavailable(Exception):
    """The previous release cannot be built here (the reason is the message)."""


@dataclass(frozen=True)
class Previous:
    commit: str
    venv: Path

    @property
    def relay(self) -> Path:
        return self.venv / "bin" / "relay"

    @property
    def package(self) -> Path:
        """Its installed `relay` package directory."""
        found = sorted(self.venv.glob("lib/python*/site-packages/relay"))
        assert found, f"no relay package in {self.venv}"
        return found[0]

    @property
    def command(self) -> list[str]:
        return [str(self.relay)]

    @property
    def prefix(self) -> list[str]:
        return [str(self.venv / "run-as-harness")]


def previous_commit(name: str = "PREVIOUS_RELEASE") -> str:
    """The one full commit hash the file `name` (here, beside this module) holds."""
    lines = (HERE / name).read_text().splitlines()
    commits = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert len(commits) == 1 and len(commits[0]) == 40, f"{name}: {commits}"
    return commits[0]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(cmd: list[str], what: str, **kwargs: object) -> None:
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=BUILD_TIMEOUT, **kwargs)  # type: ignore[call-overload]
    except subprocess.CalledProcessError as exc:
        tail = (exc.stderr or b"").decode(errors="replace").strip()[-1500:]
        raise Unavailable(f"{what} failed: {tail}") from exc
    except subprocess.TimeoutExpired as exc:
        raise Unavailable(f"{what} took over {BUILD_TIMEOUT:g}s") from exc


WRAPPER = """#!/bin/sh
# Started by the fault harness as: run-as-harness <python> -m relay.cli <command> [args]
# Runs the previous release's relay with <command> [args] instead, from outside the checkout.
shift 3
unset PYTHONPATH
cd /
exec "{relay}" "$@"
"""


def previous_release(root: Path, name: str = "PREVIOUS_RELEASE") -> Previous:
    commit = previous_commit(name)
    base = root / ".venv-previous"
    venv = base / commit
    done = venv / ".built"
    if done.exists():
        return Previous(commit, venv)
    base.mkdir(exist_ok=True)
    with _locked(base / f"{commit}.lock"):
        if done.exists():
            return Previous(commit, venv)
        shutil.rmtree(venv, ignore_errors=True)  # a build that was interrupted
        try:
            _build(root, commit, venv)
        except BaseException:
            shutil.rmtree(venv, ignore_errors=True)
            raise
        done.write_text(commit + "\n")
    return Previous(commit, venv)


def _build(root: Path, commit: str, venv: Path) -> None:
    src = venv / "src"
    src.mkdir(parents=True)
    tar = venv / "src.tar"
    _run(["git", "-C", str(root), "archive", "--format=tar", "-o", str(tar), commit],
         f"git archive {commit[:12]} (a shallow clone lacks it?)")  # fmt: skip
    _run(["tar", "-xf", str(tar), "-C", str(src)], "tar")
    _run([sys.executable, "-m", "venv", str(venv)], "python -m venv")
    env = {k: v for k, v in os.environ.items() if k != "PIP_REQUIRE_VIRTUALENV"}
    _run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-input", str(src)],
        f"pip install of {commit[:12]} (no package index?)",
        env=env,
    )
    shutil.rmtree(src)
    tar.unlink()
    wrapper = venv / "run-as-harness"
    wrapper.write_text(WRAPPER.format(relay=venv / "bin" / "relay"))
    wrapper.chmod(0o755)


def previous_or_skip(root: Path, name: str = "PREVIOUS_RELEASE") -> Previous:
    """`previous_release(root, name)`, or the calling test skipped with the reason it cannot be
    built (for the fixtures of the tests that need it)."""
    import pytest

    try:
        return previous_release(root, name)
    except Unavailable as exc:
        pytest.skip(f"the previous release could not be built here: {exc}")
