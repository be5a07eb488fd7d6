"""TLS trust as documented (issue 30 item 2, issue 32 item 8): without `ingress_ca_file`, every
sender verifies the ingress against the operating system's trust store, not certifi's bundle.

The test makes a CA that exists only in a system-like store: `relay run` runs in a mount
namespace of its own (`unshare --mount`, as root) where /etc/ssl/certs, the directory of
OpenSSL's default paths on Debian, holds that CA and nothing else, with SSL_CERT_FILE and
SSL_CERT_DIR unset. certifi's bundle does not know the CA, so a relay trusting certifi refuses
the ingress; one trusting the system's store delivers."""

from __future__ import annotations

import asyncio
import os
import shutil
import ssl
import subprocess
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest
import trustme

from tests.support import HTTP_TRANSPORTS, count, wait_for
from tests.test_cli import RELAY, relay_env
from tests.test_security import RawIngress, enqueue_some

pytestmark = pytest.mark.anyio

DEBIAN_STORE = Path("/etc/ssl/certs")


def can_unshare() -> str | None:
    """Why a private mount namespace cannot be had here, or None."""
    if os.geteuid() != 0:
        return "needs root (a private mount namespace over /etc/ssl/certs)"
    if shutil.which("unshare") is None:
        return "needs util-linux's unshare"
    if ssl.get_default_verify_paths().capath != str(DEBIAN_STORE):
        return f"OpenSSL's default CA directory is not {DEBIAN_STORE} here"
    got = subprocess.run(
        ["unshare", "--mount", "true"], capture_output=True, text=True, check=False
    )
    return None if got.returncode == 0 else f"unshare --mount fails: {got.stderr.strip()}"


@pytest.mark.parametrize("http_transport", HTTP_TRANSPORTS)
async def test_without_a_ca_file_the_system_trust_store_is_used(
    pg_url: str,
    schema: str,
    conn: psycopg.Connection[Any],
    tmp_path: Path,
    http_transport: str,
) -> None:
    if why := can_unshare():
        pytest.skip(why)
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    store = tmp_path / "system-certs"
    store.mkdir()
    ca.cert_pem.write_to_path(str(store / "ca-certificates.crt"))
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server_ctx)

    async def ok(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()

    raw = RawIngress(ok, server_ctx)
    log = tmp_path / "relay.log"
    async with raw.serving() as url:
        enqueue_some(conn, schema, 1, 1, prefix="sys")
        env = relay_env(pg_url, schema, url, RELAY_HTTP_TRANSPORT=http_transport)
        for name in ("SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):
            env.pop(name, None)
        script = f'mount --bind "{store}" {DEBIAN_STORE} && exec "$@"'
        unshare = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]
        with log.open("wb") as out:
            proc = await anyio.open_process(
                [*unshare, *RELAY, "run"], env=env, stdout=out, stderr=subprocess.STDOUT
            )
            try:
                await wait_for(
                    lambda: (
                        count(conn, schema, "state = 'delivered'") == 1
                        or count(conn, schema, "attempts >= 1") == 1
                    ),
                    what="a delivery or a refused attempt",
                )
            finally:
                proc.terminate()
                with anyio.fail_after(30):
                    await proc.wait()
    row = conn.execute(f'select state, last_error from "{schema}".events').fetchone()
    assert row is not None and row[0] == "delivered", (row, log.read_text()[-2000:])
    assert raw.requests == [("POST", "/runs/sys0/events")]
