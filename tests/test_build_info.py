"""Each release has its own version, and a running relay says which build it is (issue 49 item
10: every commit was 0.1.0, so the dashboard's "replicas and versions" panel could not show a
rollout): the version written in pyproject.toml and relay/__init__.py, with CHANGELOG.md's
newest entry; `build_info{version,commit}` in a scrape and `relay --version`; the commit read from
git in a checkout, from the build's stamp elsewhere, "unknown" otherwise, never an error
(relay/serving/build.py). The wheel's stamp: tests/test_install.py."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import relay
from relay.serving import build
from relay.serving.metrics import Metrics

ROOT = Path(__file__).resolve().parent.parent
HEX = re.compile(r"[0-9a-f]{12}")


def git(*args: str, cwd: Path) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True)
    return done.stdout.strip()


needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="no git on PATH")


def test_the_version_is_the_same_in_each_place_with_a_changelog_entry() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    headings = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    # What is merged since the last release waits under "Unreleased", above it.
    headings = headings[1:] if headings[0] == "Unreleased" else headings
    assert project["version"] == relay.__version__
    # What is merged since the last release gathers under "Unreleased", on top, until a release
    # bumps the version and renames the heading.
    if headings[0] == "Unreleased":
        headings = headings[1:]
    assert headings[0] == relay.__version__, "the newest CHANGELOG.md entry is this version's"
    assert len(headings) == len(set(headings)), f"a version released twice: {headings}"


@needs_git
def test_in_a_checkout_the_commit_is_gits_head(tmp_path: Path) -> None:
    git("init", "-q", cwd=tmp_path)
    (tmp_path / "f").write_text("x")
    git("add", "f", cwd=tmp_path)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one", cwd=tmp_path)
    stale = tmp_path / "build_commit"
    stale.write_text("0123456789ab\n")  # a stamp left over: git's HEAD is what runs
    assert build.commit_of(tmp_path, stale) == git("rev-parse", "--short=12", "HEAD", cwd=tmp_path)
    # this package runs from this checkout (PYTHONPATH or an editable install)
    if (ROOT / ".git").exists():
        assert build.commit() == git("rev-parse", "--short=12", "HEAD", cwd=ROOT)


def test_out_of_a_checkout_the_commit_is_the_builds_stamp(tmp_path: Path) -> None:
    stamp = tmp_path / "build_commit"
    stamp.write_text("0123456789ab\n")
    assert build.commit_of(tmp_path, stamp) == "0123456789ab"


def test_without_git_or_stamp_the_commit_is_unknown_never_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "build_commit"
    assert build.commit_of(tmp_path, missing) == "unknown"  # no checkout, no stamp
    (tmp_path / ".git").mkdir()  # a checkout git cannot read
    assert build.commit_of(tmp_path, missing) == "unknown"
    missing.write_bytes(b"\xff\xfe not a commit")
    assert build.commit_of(tmp_path, missing) == "unknown"
    missing.write_text("not a commit\n")  # a label takes what it is given: only a commit here
    assert build.commit_of(tmp_path, missing) == "unknown"
    missing.write_text("0123456789ab")
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))  # no git binary at run time
    assert build.commit_of(ROOT, missing) == "0123456789ab"


def test_a_scrape_carries_the_version_and_the_commit() -> None:
    scraped = generate_latest(Metrics().registry).decode()
    [info] = [
        f for f in text_string_to_metric_families(scraped) if f.name == "ledger_relay_build_info"
    ]
    [sample] = info.samples
    assert sample.labels["version"] == relay.__version__
    assert sample.labels["commit"] == build.commit()
    assert sample.labels["commit"] == "unknown" or HEX.fullmatch(sample.labels["commit"])
    assert sample.value == 1.0


def test_relay_version_prints_the_version_and_the_commit() -> None:
    got = subprocess.run(
        [sys.executable, "-m", "relay.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    want = f"ledger-relay {relay.__version__} (commit {build.commit()})"
    assert got.returncode == 0 and got.stdout.strip() == want, got
