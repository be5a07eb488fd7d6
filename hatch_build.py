"""Stamps each wheel and sdist with the commit it is built from (relay/serving/build.py reads
it: `build_info{commit}` and `relay --version` of an installed relay, without git at run time):
`RELAY_BUILD_COMMIT` when set (deploy/Dockerfile's build argument: no .git in the image's
build), else git's HEAD of this tree. Built from a tree without either (an unpacked sdist, `git
archive`), nothing is stamped here: an sdist's stamp is already in its tree; otherwise the relay
says "unknown". An editable install is not stamped: it reads git's HEAD as it runs."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

STAMP = "relay/serving/build_commit"
COMMIT = re.compile(r"[0-9a-f]{7,40}")


class CustomBuildHook(BuildHookInterface):
    _dir: tempfile.TemporaryDirectory[str] | None = None

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if version == "editable":
            return
        commit = os.environ.get("RELAY_BUILD_COMMIT", "").strip().lower() or self._git_head()
        if commit is None or not COMMIT.fullmatch(commit):
            return
        self._dir = tempfile.TemporaryDirectory()
        stamp = Path(self._dir.name) / "build_commit"
        stamp.write_text(commit + "\n", encoding="utf-8")
        build_data["force_include"][str(stamp)] = STAMP

    def _git_head(self) -> str | None:
        # Only this tree's own git: built from an unpacked sdist inside another repository,
        # git would name that repository's HEAD.
        if not (Path(self.root) / ".git").exists():
            return None
        try:
            done = subprocess.run(
                ["git", "-C", self.root, "rev-parse", "--short=12", "HEAD"],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        if self._dir is not None:
            self._dir.cleanup()
