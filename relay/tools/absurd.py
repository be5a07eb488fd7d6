"""Installs the real Absurd engine schema (bundled in the `absurdctl` wheel) into a database.

One installer at a time: the demo, the benchmarks and the test fixtures may race on one server,
and the bundled SQL is not idempotent, so the check and the install run under one session
advisory lock.
"""

from __future__ import annotations

import psycopg

INSTALL_LOCK = 4242  # advisory lock key shared by every installer


def install_absurd(url: str, queues: tuple[str, ...] = ()) -> bool:
    """Install the Absurd schema unless present, then create `queues`. Returns True when it
    installed the schema."""
    import absurdctl

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("select pg_advisory_lock(%s)", (INSTALL_LOCK,))
        try:
            row = conn.execute("select to_regclass('absurd.queues') is null").fetchone()
            installed = bool(row and row[0])
            if installed:
                conn.execute(absurdctl.BUNDLED_SCHEMA_SQL)
            for queue in queues:
                conn.execute("select absurd.create_queue(%s)", (queue,))
        finally:
            conn.execute("select pg_advisory_unlock(%s)", (INSTALL_LOCK,))
    return installed
