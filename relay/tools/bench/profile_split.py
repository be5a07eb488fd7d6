"""Where the relay's CPU per POST goes: py-spy's raw stacks of `relay run`, in buckets.

Taken as in docs/performance.md (issue 52 item 3):

    cd /tmp && py-spy record --subprocesses -r 200 --format raw -o prof.raw -- \\
        relay bench --only e2e --replicas 1 --e2e-reps 1 --e2e-modes default --json bench.json
    python -m relay.tools.bench.profile_split prof.raw --bench-json bench.json

Only the stacks of `relay run` processes are read. Each sample goes to one bucket: walking its
stack from the innermost frame outwards, the first frame whose module names a part decides
(the HTTP client and its transport, the database driver, the event loop, or a part of the
relay's own code). The standard library below a part is that part's work (`logging` under
`relay.logs` is the relay's logging; `http.cookiejar` under httpx is httpx's), so stdlib
frames other than the loop's are passed over. Samples with an import on the stack are the
process starting and are left out; so are other threads' (the thread pool the loop resolves
names on sits in its queue's wait, which py-spy does not always see as idle).

µs per POST: a bucket's share of the counted samples times the relay's CPU per POST that the
bench measured in its timed window (/proc utime + stime of the `relay run` process: the
`--bench-json` file's e2e figures, or `--cpu-us-per-post`); and, for comparison, the bucket's
samples times the sampling interval over the POSTs, which on a loaded machine also counts time
the relay was runnable but not running.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

HTTP = "HTTP client + transport"
DRIVER = "database driver"
LOOP = "event loop (asyncio, anyio)"
STARTUP = "start-up (imports)"
THREADS = "other threads"
OTHER_LIBS = "other libraries"
RELAY_OTHER = "relay: other"

# The relay's own modules by what they do (most specific prefix first).
RELAY_PARTS: tuple[tuple[str, str], ...] = (
    ("relay.delivery.post_turn", "relay: POST turn, permits, limit"),
    ("relay.delivery.slots", "relay: POST turn, permits, limit"),
    ("relay.admission.", "relay: POST turn, permits, limit"),
    ("relay.edges.tracing", "relay: tracing"),
    ("relay.integrations.otel", "relay: tracing"),
    ("relay.logs", "relay: logs"),
    ("relay.serving.metrics", "relay: metrics"),
    ("relay.delivery.lane", "relay: lane, discovery, holdings"),
    ("relay.delivery.discovery", "relay: lane, discovery, holdings"),
    ("relay.delivery.holdings", "relay: lane, discovery, holdings"),
    ("relay.delivery.stats", "relay: lane, discovery, holdings"),
    ("relay.delivery.", "relay: execute, bookkeeping, complete, acks"),
    ("relay.edges.store", "relay: store"),
    ("relay.edges.listen", "relay: store"),
    ("relay.edges.ingress", "relay: ingress, HTTP client wrapper"),
    ("relay.edges.http_client", "relay: ingress, HTTP client wrapper"),
    ("relay.core.", "relay: core (policy, clock)"),
    ("relay.", RELAY_OTHER),
)
LIBRARIES: dict[str, str] = {
    **dict.fromkeys(
        (
            "httpx",
            "httpcore",
            "h11",
            "h2",
            "aiohttp",
            "httpx_aiohttp",
            "yarl",
            "multidict",
            "propcache",
            "aiohappyeyeballs",
            "aiosignal",
            "frozenlist",
            "httptools",
            "ssl",
        ),
        HTTP,
    ),
    **dict.fromkeys(("psycopg", "psycopg_pool", "psycopg_binary", "psycopg_c"), DRIVER),
    **dict.fromkeys(("asyncio", "anyio", "sniffio", "selectors", "uvloop"), LOOP),
    "opentelemetry": "relay: tracing",
    "prometheus_client": "relay: metrics",
}
# asyncio's transports carry the POSTs' bytes (psycopg reads and writes its own socket).
TRANSPORT_CLASSES = ("_SelectorSocketTransport.", "_SelectorTransport.", "SSLProtocol.")
TRANSPARENT = frozenset(sys.stdlib_module_names) - {"asyncio", "selectors", "ssl"}

PROCESS = re.compile(r'process (\d+):"(.*?)";')
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>.*):\d+\)$")


@dataclass(frozen=True)
class Frame:
    func: str
    module: str  # dotted, from py-spy's file path: "relay.delivery.lane", "asyncio.events"

    @classmethod
    def parse(cls, text: str) -> Frame:
        m = FRAME.match(text)
        if m is None:
            return cls(text, "")
        path = m["file"].removesuffix(".py").removesuffix("/__init__")
        return cls(m["func"], path.replace("/", "."))


def bucket_of_frame(frame: Frame) -> str | None:
    """The part a frame names, or None for one passed over (stdlib, `<string>`, frozen)."""
    module = frame.module
    if module.startswith("relay."):
        return next(name for prefix, name in RELAY_PARTS if module.startswith(prefix))
    top = module.split(".", 1)[0]
    if top == "asyncio" and frame.func.startswith(TRANSPORT_CLASSES):
        return HTTP
    if top in LIBRARIES:
        return LIBRARIES[top]
    if not top or top.startswith("<") or top in TRANSPARENT or top == "relay":
        return None
    return OTHER_LIBS


def bucket_of_stack(frames: list[Frame]) -> str:
    """One sample's bucket; `frames` outermost first, as py-spy writes them."""
    if frames and frames[0].func.startswith("Thread._bootstrap"):
        return THREADS
    if any(f.module.startswith("<frozen importlib") for f in frames):
        return STARTUP
    for frame in reversed(frames):
        name = bucket_of_frame(frame)
        if name is not None:
            return name
    return OTHER_LIBS


def relay_stacks(lines: Iterable[str]) -> Iterator[tuple[list[Frame], int]]:
    """The samples of `relay run` processes in py-spy's raw (collapsed) format: each line a
    stack, frames joined by ';' (outermost first; with --subprocesses led by `process PID:"argv"`
    frames, whose argv may itself hold ';'), then a space and the sample count. A process is a
    `relay run` by its argv, or by a stack of its in `relay.cli.cmd_run`: py-spy may name a
    child by the argv it had before its exec (the bench's own)."""
    samples: list[tuple[str, list[Frame], int]] = []
    relay_pids: set[str] = set()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        last = None
        for last in PROCESS.finditer(stack + ";"):  # noqa: B007 - the innermost process
            pass
        if last is None:
            continue
        rest = (stack + ";")[last.end() :].rstrip(";")
        frames = [Frame.parse(f) for f in rest.split(";") if f]
        if _is_relay_run(last[2]) or any(f == RUN_FRAME for f in frames):
            relay_pids.add(last[1])
        samples.append((last[1], frames, int(count)))
    for pid, frames, n in samples:
        if pid in relay_pids:
            yield frames, n


RUN_FRAME = Frame("cmd_run", "relay.cli")


def _is_relay_run(argv: str) -> bool:
    return "['run']" in argv or argv.rstrip().endswith((" run", "relay run"))


COUNTED_OUT = (STARTUP, THREADS)


def split(lines: Iterable[str]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for frames, n in relay_stacks(lines):
        counts[bucket_of_stack(frames)] += n
    return counts


@dataclass(frozen=True)
class Row:
    bucket: str
    samples: int
    share: float  # of the counted samples (start-up and other threads left out)
    us_per_post_cpu: float | None
    us_per_post_samples: float | None


def rows(
    counts: Counter[str], posts: int | None, cpu_us_per_post: float | None, rate_hz: float
) -> list[Row]:
    counted = sum(n for b, n in counts.items() if b not in COUNTED_OUT) or 1
    out = []
    for bucket, n in sorted(counts.items(), key=lambda kv: (kv[0] in COUNTED_OUT, -kv[1])):
        share = n / counted if bucket not in COUNTED_OUT else 0.0
        by_cpu = share * cpu_us_per_post if cpu_us_per_post and share else None
        by_samples = n / rate_hz * 1e6 / posts if posts else None
        out.append(Row(bucket, n, share, by_cpu, by_samples))
    return out


def from_bench(path: Path) -> tuple[int, float]:
    """(POSTs, the relay's CPU µs per POST) of the default mode's e2e reps in a bench JSON:
    events over events per POST; µs per event times events per POST."""
    report = orjson.loads(path.read_bytes())
    data = report["scenarios"]["e2e"]["samples_s"]
    sizes = data["statement_sizes"]
    reps = data["cpu"]["e2e_eps"]
    events = sum(r["events"] for r in reps)
    per_post = sum(s["events_per_post"] for s in sizes) / len(sizes)
    us_event = sum(r["us_per_event"]["relay"] for r in reps) / len(reps)
    return round(events / per_post), us_event * per_post


def table(out: list[Row]) -> str:
    lines = [
        "| bucket | samples | share | µs/POST (CPU) | µs/POST (samples) |",
        "|---|---|---|---|---|",
    ]

    def us(v: float | None) -> str:
        return f"{v:,.0f}" if v is not None else "–"

    for r in out:
        share = f"{r.share:.1%}" if r.bucket not in COUNTED_OUT else "(left out)"
        lines.append(
            f"| {r.bucket} | {r.samples:,} | {share} | {us(r.us_per_post_cpu)} | "
            f"{us(r.us_per_post_samples)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m relay.tools.bench.profile_split",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("raw", type=Path, nargs="+", help="py-spy --format raw files")
    p.add_argument("--bench-json", type=Path, help="the bench's --json: POSTs and relay CPU")
    p.add_argument("--posts", type=int, help="POSTs the relay made (else from --bench-json)")
    p.add_argument("--cpu-us-per-post", type=float, help="the relay's CPU µs per POST")
    p.add_argument("--rate", type=float, default=200, help="py-spy's -r (200)")
    a = p.parse_args(argv)
    posts, cpu_us = a.posts, a.cpu_us_per_post
    if a.bench_json:
        bench_posts, bench_us = from_bench(a.bench_json)
        posts = posts or bench_posts
        cpu_us = cpu_us or bench_us
    counts: Counter[str] = Counter()
    for path in a.raw:
        with path.open() as f:
            counts += split(f)
    print(table(rows(counts, posts, cpu_us, a.rate)))
    if posts:
        print(f"\n{posts:,} POSTs; relay CPU {cpu_us or 0:,.0f} µs per POST (bench window)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
