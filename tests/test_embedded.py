"""The embedded PostgreSQL starts wherever the project is cloned, root's 0700 home included.

As root the cluster runs as the unprivileged `pgserver` user, which cannot traverse a 0700
directory: binaries installed in a clone under `/root` are out of its reach unless the relay
puts a copy where it can go (relay/tools/embedded.py)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from relay.tools import embedded
from relay.tools.embedded import EmbeddedPostgres

pgserver = pytest.importorskip("pgserver._commands", reason="the pgserver wheel is not installed")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="only root runs the cluster as another user (pgserver)"
)


def wheel_install() -> Path:
    """The wheel's install root (`…/site-packages/pgserver/pginstall`)."""
    return Path(pgserver.POSTGRES_BIN_PATH).resolve().parent


@pytest.fixture
def home_0700(tmp_path: Path) -> Iterator[Path]:
    """A copy of the wheel's files where a clone in /root keeps them: behind a 0700 directory."""
    home = tmp_path / "root-home"
    site = home / "clone" / ".venv" / "lib" / "site-packages"
    install = wheel_install()
    for part in ("bin", "lib", "share"):
        shutil.copytree(install / part, site / "pgserver" / "pginstall" / part)
    libs = install.parent.parent / "pgserver.libs"
    if libs.is_dir():
        shutil.copytree(libs, site / "pgserver.libs")
    home.chmod(0o700)
    yield site / "pgserver" / "pginstall" / "bin"


@pytest.fixture
def shared_cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh copy cache, so the test sees the copy being made rather than an old one."""
    base = Path(tempfile.mkdtemp(prefix="relay-test-cache-", dir="/var/tmp"))
    base.chmod(0o755)
    monkeypatch.setattr(embedded, "_SHARED_CACHE", base / "ledger-relay")
    yield base / "ledger-relay"
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def server_dir() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="relay-test-pg-"))
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_embedded_postgres_starts_from_binaries_behind_a_0700_home(
    home_0700: Path, shared_cache: Path, server_dir: Path
) -> None:
    home = home_0700.parents[6]
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    server = EmbeddedPostgres(server_dir / "data", durable=False, bin_dir=home_0700)
    try:
        url = server.start()
        with psycopg.connect(url, connect_timeout=10) as conn:
            assert conn.execute("select 1").fetchone() == (1,)
    finally:
        server.stop("immediate")
    assert server.bin.is_relative_to(shared_cache), server.bin
    # The user's directory was left as it was: the copy, not a chmod, made the binaries reachable.
    assert stat.S_IMODE(home.stat().st_mode) == 0o700


def test_a_reachable_install_is_used_where_it_is(tmp_path: Path, shared_cache: Path) -> None:
    """No copy when the server user can already run the binaries (e.g. the system's)."""
    install = tmp_path / "open"
    shutil.copytree(wheel_install() / "bin", install / "bin")
    for path in (install, *install.parents):
        if path == Path("/"):
            break
        path.chmod(path.stat().st_mode | 0o011)
    assert embedded._reachable_bin_dir(install / "bin") == install / "bin"
    assert not shared_cache.exists()


def test_the_copy_is_made_once_and_shared(home_0700: Path, shared_cache: Path) -> None:
    first = embedded._reachable_bin_dir(home_0700)
    again = embedded._reachable_bin_dir(home_0700)
    assert first == again
    assert [p.name for p in shared_cache.iterdir()] == [first.parents[2].name]
