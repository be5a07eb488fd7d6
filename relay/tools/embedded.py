"""An embedded PostgreSQL for the demo, the benchmarks and the tests.

Uses the binaries of the `pgserver` wheel (PostgreSQL 16) or, failing that, the system's
PostgreSQL. As root, PostgreSQL refuses to run, so the cluster runs as an unprivileged
system user (`pgserver`, created when missing, as the pgserver package does itself).
The server listens on 127.0.0.1 on a free port (real TCP, like production) and on a unix
socket in its data directory.

That user must reach the binaries. The wheel's live inside the project's `.venv`, and a clone
in root's home (`/root` is 0700) puts them where no other user may go. Rather than open the
user's directories, the install is copied once, as root, to a root-owned place every user can
read (`/var/cache/ledger-relay/`, keyed by its `postgres` binary) and run from
there. The data directory is the caller's: its own temporary directories are opened for
traversal (o+x), as before.

The fault levers of the tests and of `relay bench --only fleet_outage` are here too, so both
kill a server the same way: `kill()` SIGKILLs the postmaster and every process of it at once,
as when its machine dies, and `start_again()` starts it once more on the same data directory
and port (PostgreSQL's crash recovery runs then).
"""

from __future__ import annotations

import hashlib
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

_RUN_AS = "pgserver"
# Where root keeps a copy of binaries the server user could not reach where they are installed.
_SHARED_CACHE = Path("/var/cache/ledger-relay")
KILL_DEADLINE = 30.0  # seconds for a killed postmaster to die, and to be reaped


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


def _others_can_reach(path: Path) -> bool:
    """Whether a user with no special rights can traverse to `path` and run it."""
    if not path.exists() or not path.stat().st_mode & stat.S_IXOTH:
        return False
    return all(parent.stat().st_mode & stat.S_IXOTH for parent in path.resolve().parents)


def _install_copy_key(bin_dir: Path) -> str:
    """Names one build: the same wheel installed in two clones shares one copy."""
    postgres = (bin_dir / "postgres").stat()
    ident = f"{postgres.st_size}|{postgres.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _open_for_reading(root: Path) -> None:
    """Let every user read the tree under `root`, and traverse or run what its owner can."""
    for path in (root, *root.rglob("*")):
        if path.is_symlink():
            continue
        mode = path.stat().st_mode
        mode |= stat.S_IRGRP | stat.S_IROTH
        if path.is_dir() or mode & stat.S_IXUSR:
            mode |= stat.S_IXGRP | stat.S_IXOTH
        path.chmod(mode)


def _reachable_bin_dir(bin_dir: Path, cache: Path | None = None) -> Path:
    """`bin_dir`, or a copy of its install that the unprivileged server user can reach.

    The install root (`bin_dir`'s parent: bin, lib, share) is copied with the two levels above
    it and the package's `*.libs` folder beside them, because the wheel's binaries find their
    bundled libraries at `$ORIGIN/../../../pgserver.libs`. The copy is made under a temporary name
    and renamed into place, so concurrent starts (test workers) never see half of one.
    """
    if _others_can_reach(bin_dir / "postgres") and _others_can_reach(bin_dir / "initdb"):
        return bin_dir
    cache = cache or _SHARED_CACHE
    install = bin_dir.resolve().parent
    package, site = install.parent, install.parent.parent
    dest = cache / f"postgresql-{_install_copy_key(bin_dir)}"
    copied_bin = dest / package.name / install.name / "bin"
    if (copied_bin / "postgres").exists():
        return copied_bin
    cache.mkdir(parents=True, exist_ok=True)
    cache.chmod(0o755)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=cache))
    try:
        for part in ("bin", "lib", "share"):
            if (install / part).is_dir():
                shutil.copytree(install / part, staging / package.name / install.name / part)
        libs = site / f"{package.name}.libs"
        if libs.is_dir():
            shutil.copytree(libs, staging / libs.name)
        _open_for_reading(staging)
        try:
            staging.rename(dest)
        except OSError:  # another process put its copy in place first: use that one
            if not (copied_bin / "postgres").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return copied_bin


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
        bin_dir: Path | None = None,
    ) -> None:
        self.datadir = Path(datadir)
        self.port = port or _free_port()
        self.durable = durable
        self.max_connections = max_connections
        self._ids = _ensure_user()
        self._killed: int | None = None  # the postmaster `kill` killed, until restarted
        self.bin = bin_dir or _bin_dir()
        if self._ids is not None:
            self.bin = _reachable_bin_dir(self.bin)

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

    def kill(self) -> None:
        """SIGKILL the postmaster and all its processes at once: nothing is flushed, no client
        gets a goodbye, as when its machine dies. All are stopped first: killed one by one, a
        backend that outlived the postmaster for a moment saw it die and exited cleanly,
        releasing its session locks while other backends still ran claims (a liveness lock seen
        free on the dying server: not a machine's death). Returns once the postmaster is dead
        (a zombie counts: its parent reaps it later, see `start_again`)."""
        pid = int((self.datadir / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGSTOP)  # it forks nothing more
        procs = [pid, *_children(pid)]
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for p in procs:
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
        self._killed = pid
        _until(lambda: _state(pid) in ("Z", "X"), f"postmaster {pid} to die of SIGKILL")

    def start_again(self) -> str:
        """After `kill`: the server started once more on its data directory and port, once the
        dead postmaster is reaped (until then its pid, still taken, makes a new postmaster
        refuse the directory as another server's). Returns its URL."""
        pid = self._killed
        if pid is not None:
            _until(lambda: _state(pid) == "X", f"the dead postmaster {pid} to be reaped")
            self._killed = None
        return self.start()


def _until(done: Callable[[], bool], what: str) -> None:
    """Poll `done` until it holds, for at most KILL_DEADLINE seconds."""
    deadline = time.monotonic() + KILL_DEADLINE
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {KILL_DEADLINE:g} s waiting for {what}")
        time.sleep(0.05)


def _children(pid: int) -> list[int]:
    found = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat_file.parent.name))
    return found


def _state(pid: int) -> str:
    """The process's state letter from /proc (`Z` a zombie), `X` once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"
