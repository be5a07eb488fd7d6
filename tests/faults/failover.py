"""A primary with a synchronous standby, built with the embedded PostgreSQL's own tools, and the
failover lever: the primary SIGKILLed (the postmaster and every process of it, as a machine
dies: `EmbeddedPostgres.kill`, relay/tools/embedded.py), the standby promoted (issue 29).

The standby is a `pg_basebackup -R` of the primary (`standby.signal` and `primary_conninfo`
written by the tool), started on its own port. `synchronous_standby_names = '*'` is set on the
primary only after the copy (the standby's configuration must not wait for a standby of its
own once promoted), so every commit the primary confirms is on the standby's disk first.

Clients use one multi-host URL (`127.0.0.1:P1,127.0.0.1:P2`, `target_session_attrs=read-write`):
libpq tries both and keeps the one that accepts writes, the primary before the failover and the
promoted standby after it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import psycopg

from relay.tools.embedded import EmbeddedPostgres
from tests.support import wait_until


class Pair:
    """The primary, its synchronous standby, and the URL that follows the writable one. Passed
    to `Lab.open` in place of one server (it needs `url`)."""

    def __init__(self, root: Path) -> None:
        self.primary = EmbeddedPostgres(root / "primary", durable=True)
        self.standby = EmbeddedPostgres(root / "standby", durable=True)
        self.ports = (self.primary.port, self.standby.port)  # the URL's, whichever is primary

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.ports)
        return f"postgresql://postgres@{hosts}/postgres?target_session_attrs=read-write"

    def start(self) -> None:
        self.primary.start()
        self._base_backup()
        self.standby.start()
        self._synchronous()

    def rebuild_standby(self) -> None:
        """After a promotion: the dead primary's directory made anew as a standby of the promoted
        one (a fresh `pg_basebackup -R`, on its old port), and synchronous again, so the pair
        can fail over once more, back the other way."""
        dead = self.primary
        self.primary = self.standby
        self.standby = EmbeddedPostgres(dead.datadir, port=dead.port, durable=True)
        self._base_backup()
        self.standby.start()
        self._synchronous()

    def _synchronous(self) -> None:
        with psycopg.connect(self.primary.url, autocommit=True) as conn:
            conn.execute("alter system set synchronous_standby_names = '*'")
            conn.execute("select pg_reload_conf()")
            wait_until(
                lambda: (
                    conn.execute(
                        "select 1 from pg_stat_replication where sync_state = 'sync'"
                    ).fetchone()
                    is not None
                ),
                timeout=30,
                what="the standby to become synchronous",
            )

    def _base_backup(self) -> None:
        target = self.standby.datadir
        command = [
            str(self.standby.bin / "pg_basebackup"),
            *("-D", str(target), "-h", "127.0.0.1", "-p", str(self.primary.port)),
            *("-U", "postgres", "-X", "stream", "-R", "--no-sync"),
        ]
        for attempt in range(3):  # once seen to fail on a loaded machine, and not again
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            ids = self.standby._ids  # the server user when root (EmbeddedPostgres runs it so)
            if ids is not None:
                os.chown(target, *ids)
            target.chmod(0o700)
            try:
                self.standby._run(command)
                return
            except subprocess.CalledProcessError as exc:
                error = f"{exc.stdout.decode()}{exc.stderr.decode()}".strip()
                if attempt == 2:
                    raise AssertionError(f"pg_basebackup failed 3 times: {error}") from exc
                time.sleep(1)  # between attempts of a command, not a wait for an effect

    def kill_primary(self) -> None:
        self.primary.kill()

    def standby_caught_up(self) -> None:
        """Until the standby replayed all it received (the primary is dead: nothing more comes)."""
        with psycopg.connect(self.standby.url, autocommit=True) as conn:
            wait_until(
                lambda: (
                    conn.execute(
                        "select pg_last_wal_receive_lsn() <= pg_last_wal_replay_lsn()"
                    ).fetchone()
                    == (True,)
                ),
                timeout=30,
                what="the standby to replay what it received",
            )

    def promote(self) -> None:
        self.standby._run(
            [str(self.standby.bin / "pg_ctl"), "-D", str(self.standby.datadir), "-w", "promote"]
        )

    def stop(self, mode: str = "immediate") -> None:
        self.standby.stop(mode)
        self.primary.stop(mode)
