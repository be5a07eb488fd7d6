"""The HTTP client's floor: what POSTing alone costs this process, with no relay code and no
database (issue 52: the relay's own share of a POST, docs/performance.md).

    python scripts/client_floor.py [--posts 6000] [--inflight 32] [--loop uvloop] [--rounds 3]
                                   [--events 10]

Starts `relay sink` on a free port, then in this process POSTs `--posts` prebuilt bodies the size
of the e2e bench's run of `--events` events (10; 1 as in `tiny_runs`), `--inflight` at a time,
three ways in turn each round:

- `client`: the relay's own client (relay.edges.http_client.build_client: httpx's AsyncClient,
  cookieless, over httpx-aiohttp's transport and the relay's connector), each POST sent as
  HttpxSender sends it (`build_request`, `send(stream=True)`, read, `aclose`);
- `plain`: an `httpx.AsyncClient` over `AiohttpTransport()` as its README builds it, `post`;
- `transport`: `AiohttpTransport.handle_async_request` alone (httpx's public transport API),
  no client: what httpx's client layer adds is `client` minus this.

Printed per round and way: POSTs per second and this process's CPU (`time.process_time`) per
POST and per event. Only ratios between ways and to the relay's own CPU per event measured in
the same sitting mean anything on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import closing

import httpx
import orjson
from httpx_aiohttp import AiohttpTransport

from relay.edges.http_client import build_client
from relay.settings import load

HEADERS = {"content-type": "application/json", "relay-lease-epoch": "1"}


def body(i: int, n: int) -> bytes:
    events = [
        {
            "event_id": f"r{i}-{k}",
            "seq": k,
            "type": "step.completed",
            "terminal": k == n,
            "payload": {"step": k, "data": "x" * 200},
            "created_at": "2026-12-07T06:00:00+00:00",
        }
        for k in range(1, n + 1)
    ]
    return orjson.dumps({"run_id": f"r{i}", "epoch": 1, "events": events})


Post = Callable[[str, bytes], Awaitable[int]]


async def timed(post: Post, url: str, bodies: list[bytes], inflight: int) -> tuple[float, float]:
    """(POSTs per second, CPU seconds per POST) of `inflight` loops sharing `bodies`."""
    work = iter(enumerate(bodies))

    async def loop() -> None:
        for i, b in work:
            status = await post(url.format(run_id=f"r{i}"), b)
            if status != 200:
                raise SystemExit(f"the sink answered {status}")

    wall, cpu = time.monotonic(), time.process_time()
    async with asyncio.TaskGroup() as tg:
        for _ in range(inflight):
            tg.create_task(loop())
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    return len(bodies) / wall, cpu / len(bodies)


async def status_of(response: httpx.Response) -> int:
    """Read a streamed answer to its end and close it, as HttpxSender does; its status."""
    try:
        await response.aread()
    finally:
        await response.aclose()
    return response.status_code


async def one_round(url: str, bodies: list[bytes], inflight: int) -> dict[str, tuple[float, float]]:
    settings = load({"database_url": "postgresql://unused/db", "ingress_url": url}, {})
    out: dict[str, tuple[float, float]] = {}
    async with build_client(settings, inflight, announce=False) as client:

        async def as_the_relay_sends(u: str, b: bytes) -> int:
            request = client.build_request("POST", u, content=b, headers=HEADERS)
            return await status_of(await client.send(request, stream=True))

        out["client"] = await timed(as_the_relay_sends, url, bodies, inflight)
    async with httpx.AsyncClient(transport=AiohttpTransport()) as plain:

        async def post(u: str, b: bytes) -> int:
            return (await plain.post(u, content=b, headers=HEADERS)).status_code

        out["plain"] = await timed(post, url, bodies, inflight)
    async with AiohttpTransport() as transport:

        async def handle(u: str, b: bytes) -> int:
            request = httpx.Request("POST", u, content=b, headers=HEADERS)
            return await status_of(await transport.handle_async_request(request))

        out["transport"] = await timed(handle, url, bodies, inflight)
    return out


def free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--posts", type=int, default=6000)
    p.add_argument("--inflight", type=int, default=32)
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--events", type=int, default=10, help="events per POST (10; 1: tiny_runs)")
    a = p.parse_args()
    port = free_port()
    relay = os.path.join(os.path.dirname(sys.executable), "relay")
    sink = subprocess.Popen(
        [relay, "sink", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        url = f"http://127.0.0.1:{port}/runs/{{run_id}}/events"
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.1)
        bodies = [body(i, a.events) for i in range(a.posts)]
        print(f"{a.posts} POSTs of {len(bodies[0])} bytes, {a.inflight} in flight, {a.loop}")
        for r in range(a.rounds):
            coroutine = one_round(url, bodies, a.inflight)
            if a.loop == "uvloop":
                import uvloop

                result = uvloop.run(coroutine)
            else:
                result = asyncio.run(coroutine)
            for way, (rate, cpu) in result.items():
                print(
                    f"round {r + 1} {way:9} {rate:7.0f} POSTs/s  {cpu * 1e6:6.1f} us CPU/POST"
                    f"  {cpu * 1e6 / a.events:5.1f} us/event"
                )
    finally:
        sink.terminate()
        sink.wait()


if __name__ == "__main__":
    main()
