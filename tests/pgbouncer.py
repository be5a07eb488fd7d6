"""A real PgBouncer (Debian's `pgbouncer`) in front of a test PostgreSQL, for the suite.

`PgBouncer.start(upstream_url, ...)` writes a config into a private directory, runs the
`pgbouncer` binary on a free 127.0.0.1 port and waits until it answers. Every database name is
forwarded to the upstream server (a `*` fallback entry) as its user, with `auth_type = trust`:
the embedded PostgreSQL trusts local connections, so nothing secret is involved. As root it
runs as an unprivileged user (PgBouncer refuses to run as root): the Debian package's
`postgres`, else `nobody`.

`pgbouncer_binary()` is None when it is not installed: scripts/test.sh installs it best effort,
and the tests that need it skip with `MISSING`.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from tests.support import wait_until

MISSING = (
    "pgbouncer is not installed (Debian package `pgbouncer`; scripts/test.sh installs it best"
    " effort as root with apt): install it to run the PgBouncer tests"
)


def pgbouncer_binary() -> str | None:
    return shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.access(p, os.X_OK)), None
    )


def version(binary: str) -> tuple[int, int]:
    """(major, minor) of `pgbouncer --version` ("PgBouncer 1.18.0")."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True)
    numbers = out.stdout.split()[1].split(".")
    return int(numbers[0]), int(numbers[1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_as() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise RuntimeError("running as root and neither `postgres` nor `nobody` exists")


class PgBouncer:
    """One PgBouncer process. `url(dbname)` is a client URL through it; `admin_url` reaches its
    admin console (`SHOW POOLS`, `SHOW VERSION`)."""

    def __init__(
        self,
        upstream_url: str,
        *,
        pool_mode: str = "transaction",
        pool_size: int = 20,
        extra: dict[str, str] | None = None,
    ) -> None:
        binary = pgbouncer_binary()
        if binary is None:
            raise RuntimeError(MISSING)
        self.binary = binary
        self.upstream = urlsplit(upstream_url)
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.extra = extra or {}
        self.port = _free_port()
        self.user = self.upstream.username or "postgres"
        self.dir = Path(tempfile.mkdtemp(prefix="relay-pgbouncer-"))
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, dbname: str | None = None) -> str:
        db = dbname or self.upstream.path.lstrip("/") or "postgres"
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{db}"

    @property
    def admin_url(self) -> str:
        return self.url("pgbouncer")

    @property
    def log(self) -> Path:
        return self.dir / "pgbouncer.log"

    def _config(self) -> str:
        host, port = self.upstream.hostname or "127.0.0.1", self.upstream.port or 5432
        settings = {
            "listen_addr": "127.0.0.1",
            "listen_port": str(self.port),
            "unix_socket_dir": "",
            "auth_type": "trust",
            "auth_file": str(self.dir / "users.txt"),
            "admin_users": self.user,
            "pool_mode": self.pool_mode,
            "default_pool_size": str(self.pool_size),
            "max_client_conn": "1000",
            "logfile": str(self.log),
            "pidfile": str(self.dir / "pgbouncer.pid"),
            **self.extra,
        }
        lines = ["[databases]", f"* = host={host} port={port} user={self.user}", "[pgbouncer]"]
        lines += [f"{k} = {v}" for k, v in settings.items()]
        return "\n".join(lines) + "\n"

    def start(self) -> PgBouncer:
        (self.dir / "users.txt").write_text(f'"{self.user}" ""\n')
        ini = self.dir / "pgbouncer.ini"
        ini.write_text(self._config())
        owner = _run_as()
        if owner is not None:
            for path in (self.dir, *self.dir.iterdir()):
                os.chown(path, owner.pw_uid, owner.pw_gid)
        self.proc = subprocess.Popen(
            [self.binary, str(ini)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            user=owner.pw_uid if owner else None,
            group=owner.pw_gid if owner else None,
            extra_groups=[] if owner else None,
            start_new_session=True,
        )
        self._wait_listening()
        return self

    def _wait_listening(self, deadline: float = 30.0) -> None:
        """Until the port accepts connections (a start-up deadline, not a measurement)."""
        assert self.proc is not None
        proc = self.proc

        def listening() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited at start: {self.log_tail()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                return True
            return False

        wait_until(listening, timeout=deadline, what=f"pgbouncer to listen ({self.log})")

    def log_tail(self, chars: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-chars:]
        return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # PgBouncer: immediate shutdown
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
