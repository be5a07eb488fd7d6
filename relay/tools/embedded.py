"""An embedded PostgreSQL for the demo, the benchmarks and the tests.

Uses the binaries of the `pgserver` wheel (PostgreSQL 16) or, failing that, the system's
PostgreSQL. As root, PostgreSQL refuses to run, so the cluster runs as an unprivileged
system user (`pgserver`, created when missing, as the pgserver package does itself).
The server listens on 127.0.0.1 on a free port (real TCP, like production) and on a unix
socket in its data directory.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
from pathlib import Path

_RUN_AS = "pgserver"


def _bin_dir() -> Path:
    try:
        from pgserver._commands import POSTGRES_BIN_PATH

        path = Path(POSTGRES_BIN_PATH)
        if (path / "postgres").exists():
            return path
    except ImportError:
        pass
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    for candidate in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (candidate / "pg_ctl").exists():
            return candidate
    raise RuntimeError(
        "no PostgreSQL binaries: install the `pgserver` wheel or PostgreSQL, "
        "or set RELAY_DATABASE_URL to an existing server"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ensure_user() -> tuple[int, int] | None:
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam(_RUN_AS)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", _RUN_AS],
            check=True,
            capture_output=True,
        )
        entry = pwd.getpwnam(_RUN_AS)
    return entry.pw_uid, entry.pw_gid


class EmbeddedPostgres:
    """A throwaway cluster in `datadir`. `start()` returns its URL; `stop()` stops it."""

    def __init__(
        self,
        datadir: Path,
        *,
        port: int | None = None,
        durable: bool = True,
        max_connections: int = 300,
    ) -> None:
        self.datadir = Path(datadir)
        self.port = port or _free_port()
        self.durable = durable
        self.max_connections = max_connections
        self.bin = _bin_dir()
        self._ids = _ensure_user()

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, args: list[str], timeout: float = 120) -> None:
        kwargs: dict[str, object] = {}
        if self._ids is not None:
            kwargs["user"] = self._ids[0]
            kwargs["group"] = self._ids[1]
            kwargs["extra_groups"] = []
        subprocess.run(
            args,
            check=True,
            capture_output=True,
            timeout=timeout,
            cwd="/",
            **kwargs,  # type: ignore[call-overload]
        )

    def start(self) -> str:
        self.datadir.mkdir(parents=True, exist_ok=True)
        if self._ids is not None:
            for path in (self.datadir, *self.datadir.parents):
                if path == Path("/"):
                    break
                path.chmod(path.stat().st_mode | 0o011)  # let the server user traverse
            os.chown(self.datadir, *self._ids)
        self.datadir.chmod(0o700)
        if not (self.datadir / "PG_VERSION").exists():
            self._run(
                [
                    str(self.bin / "initdb"),
                    "-D",
                    str(self.datadir),
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "--encoding=UTF8",
                    "--no-sync",
                ]
            )
        opts = [
            "-c listen_addresses=127.0.0.1",
            f"-c port={self.port}",
            f"-c unix_socket_directories={self.datadir}",
            f"-c max_connections={self.max_connections}",
            "-c shared_buffers=256MB",
            "-c log_min_messages=warning",
        ]
        if not self.durable:
            opts += ["-c fsync=off", "-c synchronous_commit=off", "-c full_page_writes=off"]
        self._run(
            [
                str(self.bin / "pg_ctl"),
                "-D",
                str(self.datadir),
                "-l",
                str(self.datadir / "server.log"),
                "-w",
                "-t",
                "60",
                "-o",
                " ".join(opts),
                "start",
            ]
        )
        return self.url

    def stop(self, mode: str = "fast") -> None:
        if not (self.datadir / "postmaster.pid").exists():
            return
        try:
            self._run(
                [str(self.bin / "pg_ctl"), "-D", str(self.datadir), "-m", mode, "-w", "stop"],
                timeout=60,
            )
        except subprocess.CalledProcessError:
            pass
