"""The demo's relay replicas: `relay run` subprocesses, each logging to its own file."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import orjson

REPLICA_STOP_TIMEOUT = 40.0  # the replica's shutdown_timeout (20 s) plus room


class Replica:
    def __init__(self, index: int, env: dict[str, str], log_path: Path) -> None:
        self.index = index
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "relay.cli", "run"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # our Ctrl-C must not reach it: we stop it with SIGTERM
        )
        self.exit_code: int | None = None

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None when it had to be killed."""
        try:
            self.exit_code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self.exit_code = None
        self._log.close()
        return self.exit_code

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


def count_log_events(paths: Sequence[Path]) -> dict[str, int]:
    """Warning and error decisions logged by the replicas, by event name."""
    counts: Counter[str] = Counter()
    for path in paths:
        with contextlib.suppress(OSError), path.open("rb") as f:
            for line in f:
                try:
                    obj = orjson.loads(line)
                    name = obj.get("event") or obj.get("msg") or "unknown"
                except (orjson.JSONDecodeError, AttributeError):
                    name = "non-json output"
                counts[str(name)] += 1
    return dict(counts)
