"""Which build of the relay runs here, for `build_info` and `relay --version` (issue 49 item 10):
the version (`relay.__version__`, bumped with each release and its CHANGELOG.md entry) and the
commit it was built from.

The commit is read, in this order:

1. from git, when the package sits in a git checkout (an editable install, or a run from the
   source tree): the checkout's HEAD now, so a developer's relay names the commit it runs;
2. from the stamp a wheel or sdist carries (`build_commit` beside this module, written at build
   time by hatch_build.py from the git checkout it was built in): a wheel installed anywhere
   knows its commit without git;
3. else "unknown" (a build from a tree without git, or no git binary): never an error.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
STAMP = HERE / "build_commit"  # written into wheels and sdists by hatch_build.py
CHECKOUT = HERE.parents[1]  # the source tree's root, when the package runs from one
UNKNOWN = "unknown"
GIT_TIMEOUT = 5.0  # seconds: git answers in milliseconds; a hung one is not worth a start
_COMMIT = re.compile(r"[0-9a-f]{7,40}")


def commit_of(checkout: Path, stamp: Path) -> str:
    """The commit of a package whose source tree would be `checkout` and whose build stamp would
    be `stamp`: git's HEAD in `checkout` if it is a git checkout, else the stamp, else
    "unknown"."""
    if (checkout / ".git").exists():
        head = git_head(checkout)
        if head is not None:
            return head
    try:
        stamped = stamp.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return UNKNOWN
    return stamped if _COMMIT.fullmatch(stamped) else UNKNOWN


def git_head(checkout: Path) -> str | None:
    """`git rev-parse --short=12 HEAD` in `checkout`, or None when git is missing or fails."""
    try:
        done = subprocess.run(
            ["git", "-C", str(checkout), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    head = done.stdout.strip()
    return head if done.returncode == 0 and _COMMIT.fullmatch(head) else None


@functools.cache
def commit() -> str:
    """This relay's commit (read once per process)."""
    return commit_of(CHECKOUT, STAMP)
