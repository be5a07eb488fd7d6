"""`relay sink`: the reference ingress as a command."""

from __future__ import annotations

import argparse
import os
import signal
import sys

import anyio
import orjson

from relay import logs
from relay.settings import ConfigError, Secret, option_value
from relay.tools.sink.app import Sink
from relay.tools.sink.server import serve_sink
from relay.tools.sink.verify import SIGNATURE_TOLERANCE


def main(argv: list[str] | None = None) -> int:
    """`relay sink`: serve the reference ingress until SIGTERM/SIGINT, then print stats JSON."""
    parser = argparse.ArgumentParser(prog="relay sink", description=main.__doc__)
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; 0.0.0.0 or :: for every interface)",
    )
    parser.add_argument(
        "--port", type=int, default=8080, help="TCP port to listen on (default 8080; 0: any free)"
    )
    parser.add_argument(
        "--http",
        choices=["auto", "httptools", "h11"],
        default="auto",
        help="uvicorn's HTTP parser (default auto)",
    )
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="stderr lines, uvicorn's included: text (default) or one JSON object per line",
    )
    parser.add_argument(
        "--accept-stale-epochs", action="store_true", help="count stale epochs, answer 200"
    )
    parser.add_argument(
        "--fault-control",
        action="store_true",
        help="allow POST /_sink/faults and /_sink/reset (unauthenticated: test networks only)",
    )
    parser.add_argument(
        "--signing-secret",
        metavar="SIGNING_SECRET",
        help="verify Standard Webhooks signatures with these whsec_ secret(s), comma separated;"
        " also RELAY_SIGNING_SECRET, RELAY_SIGNING_SECRET_FILE, $CREDENTIALS_DIRECTORY",
    )
    parser.add_argument(
        "--signature-tolerance",
        type=float,
        default=SIGNATURE_TOLERANCE,
        metavar="SECONDS",
        help=f"accepted clock skew of webhook-timestamp (default {SIGNATURE_TOLERANCE:g})",
    )
    args = parser.parse_args(argv)
    try:
        secrets: tuple[Secret, ...] = (
            option_value("signing_secret", {"signing_secret": args.signing_secret}, os.environ)
            or ()
        )
    except ConfigError as exc:
        parser.exit(2, f"relay sink: invalid configuration: {exc}\n")
    sink = Sink(
        signing_secrets=secrets,
        tolerance=args.signature_tolerance,
        fault_control=args.fault_control,
    )
    sink.state.reject_stale_epochs = not args.accept_stale_epochs
    sink.state.keep_received = False  # nothing outside the process can read it

    logs.configure(args.log_format, "info")
    logs.install_hooks()

    async def run() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with serve_sink(sink, args.host, args.port, http=args.http) as url:
                if args.log_format == "json":
                    logs.info("sink_listening", url=url)
                else:
                    print(f"relay sink listening on {url}", file=sys.stderr, flush=True)
                async for _ in signals:
                    break

    try:
        anyio.run(run)
    except OSError as exc:  # the address is taken, not local, or not an address at all
        reason = exc.strerror or str(exc)
        print(f"relay sink: cannot listen on {args.host}:{args.port}: {reason}", file=sys.stderr)
        return 2
    print(orjson.dumps(sink.state.stats()).decode(), flush=True)
    return 0
