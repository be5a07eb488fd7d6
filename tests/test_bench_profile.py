"""relay/tools/bench/profile_split.py: py-spy's raw stacks of `relay run`, bucketed per POST.

A tiny raw file written by hand, in py-spy's format (`--subprocesses`: each stack led by its
processes' frames, whose argv holds ';'), with one stack per rule of the bucketing: the
innermost frame that names a part decides, the standard library under a part is that part's,
asyncio's transports carry the POSTs, imports and other threads are left out, and only the
`relay run` process is read.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson
import pytest

from relay.tools.bench import profile_split as ps

BENCH = 'process 100:"/venv/bin/python3 /venv/bin/relay bench --only e2e"'
CODE = "import sys; from relay.cli import main; sys.exit(main([{}]))"
RELAY = 'process 200:"/venv/bin/python3 -c ' + CODE.format("'run'") + '"'
SINK = 'process 300:"/venv/bin/python3 -c ' + CODE.format("'sink'") + '"'
LOOP = ";".join(
    (
        "run (asyncio/runners.py:118)",
        "_run_once (asyncio/base_events.py:1922)",
        "_run (asyncio/events.py:80)",
    )
)
POST = ";".join(
    (
        "Executor._post (relay/delivery/execute.py:212)",
        "IngressClient._send (relay/edges/ingress.py:305)",
    )
)


def stack(*frames: str, process: str = RELAY) -> str:
    return ";".join((BENCH, process, "<module> (<string>:1)", *frames))


RAW = "\n".join(
    [
        # httpx's cookie jar is the standard library's: httpx's work (2 samples)
        stack(
            LOOP,
            POST,
            "AsyncClient.send (httpx/_client.py:1629)",
            "Cookies.extract_cookies (httpx/_models.py:1108)",
            "CookieJar.extract_cookies (http/cookiejar.py:1700)",
        )
        + " 2",
        # the socket write of a POST, asyncio's transport: the HTTP client's (1)
        stack(LOOP, "_SelectorSocketTransport.write (asyncio/selector_events.py:1050)") + " 1",
        # psycopg under the store (3)
        stack(LOOP, "Store._call (relay/edges/store.py:241)", "execute (psycopg/cursor.py:97)")
        + " 3",
        # an anyio cancel scope entered by the relay: the loop's (4)
        stack(
            LOOP,
            POST,
            "CancelScope.__enter__ (anyio/_backends/_asyncio.py:450)",
            "current_task (asyncio/tasks.py:38)",
        )
        + " 4",
        # logging under relay/logs.py: the relay's logs (5)
        stack(LOOP, "info (relay/logs.py:140)", "Logger._log (logging/__init__.py:1610)") + " 5",
        # the relay's own code, innermost: by module (6 + 7 + 8)
        stack(LOOP, "PostTurn.take (relay/delivery/post_turn.py:273)") + " 6",
        stack(LOOP, POST) + " 7",
        stack(LOOP, "Limit.allowed (relay/admission/limit.py:182)") + " 8",
        # the event loop itself (9), and a library with no part of its own (1)
        stack(LOOP, "EpollSelector.select (selectors.py:468)") + " 9",
        stack(LOOP, POST, "retry (tenacity/__init__.py:400)") + " 1",
        # left out: start-up, another thread (10 + 11)
        stack("<module> (relay/cli.py:12)", "_find_and_load (<frozen importlib._bootstrap>:1176)")
        + " 10",
        ";".join((BENCH, RELAY, "Thread._bootstrap (threading.py:1002)", "_worker (x.py:81)"))
        + " 11",
        # not the relay's process: the sink's and the bench's own (12 + 13)
        stack(LOOP, "EpollSelector.select (selectors.py:468)", process=SINK) + " 12",
        ";".join((BENCH, LOOP, "EpollSelector.select (selectors.py:468)")) + " 13",
    ]
)


def test_buckets_by_the_innermost_frame_that_names_a_part() -> None:
    assert ps.split(RAW.splitlines()) == Counter(
        {
            ps.HTTP: 3,
            ps.DRIVER: 3,
            ps.LOOP: 4 + 9,
            "relay: logs": 5,
            "relay: POST turn, permits, limit": 6 + 8,
            "relay: ingress, HTTP client wrapper": 7,
            ps.OTHER_LIBS: 1,
            ps.STARTUP: 10,
            ps.THREADS: 11,
        }
    )


def test_shares_and_us_per_post_leave_out_start_up_and_other_threads(tmp_path: Path) -> None:
    rows = {r.bucket: r for r in ps.rows(ps.split(RAW.splitlines()), 2, 1000.0, 200)}
    counted = 3 + 3 + 13 + 5 + 14 + 7 + 1
    assert rows[ps.LOOP].share == pytest.approx(13 / counted)
    assert rows[ps.LOOP].us_per_post_cpu == pytest.approx(1000.0 * 13 / counted)
    assert rows[ps.LOOP].us_per_post_samples == pytest.approx(13 / 200 * 1e6 / 2)
    assert rows[ps.STARTUP].share == 0 and rows[ps.STARTUP].us_per_post_cpu is None
    assert sum(r.share for r in rows.values()) == pytest.approx(1)


def test_reads_posts_and_cpu_per_post_from_the_bench_json(tmp_path: Path) -> None:
    """The default mode's reps: events over events per POST; µs per event times events per
    POST (two reps: their means)."""
    report = {
        "scenarios": {
            "e2e": {
                "samples_s": {
                    "statement_sizes": [{"events_per_post": 10.0}, {"events_per_post": 8.0}],
                    "cpu": {
                        "e2e_eps": [
                            {"events": 5000, "us_per_event": {"relay": 150.0}},
                            {"events": 4000, "us_per_event": {"relay": 130.0}},
                        ]
                    },
                }
            }
        }
    }
    path = tmp_path / "bench.json"
    path.write_bytes(orjson.dumps(report))
    assert ps.from_bench(path) == (1000, pytest.approx(140.0 * 9.0))
    raw = tmp_path / "prof.raw"
    raw.write_text(RAW + "\n")
    assert ps.main([str(raw), "--bench-json", str(path)]) == 0


def test_a_relay_process_named_by_the_argv_it_had_before_its_exec_is_read() -> None:
    """py-spy may name a child by its parent's argv (sampled between fork and exec): a process
    with a stack in `relay.cli.cmd_run` is a `relay run` all the same, start-up included."""
    early = 'process 400:"/venv/bin/python3 /venv/bin/relay bench --only e2e"'
    raw = [
        stack(LOOP, "cmd_run (relay/cli.py:200)", POST, process=early) + " 3",
        stack("_find_and_load (<frozen importlib._bootstrap>:1176)", process=early) + " 2",
    ]
    assert ps.split(raw) == Counter({"relay: ingress, HTTP client wrapper": 3, ps.STARTUP: 2})
