"""The demo's I/O shell: `Demo` owns every process and thread it starts (PostgreSQL, the
sink, the producers, the replicas) and stops them on any exit."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from relay.maintenance.migrate import migrate
from relay.settings import redact_url
from relay.tools.absurd import install_absurd
from relay.tools.demo.replicas import REPLICA_STOP_TIMEOUT, Replica, count_log_events
from relay.tools.demo.report import Report, build_report
from relay.tools.demo.workload import (
    QUEUE,
    Producer,
    RunPlan,
    Tally,
    live_rate,
    plan_workload,
    run_producers,
)
from relay.tools.sink import Sink, SinkThread

POLL_INTERVAL = 0.25


class DemoFailed(Exception):
    """The demo could not finish; the message says why and where to look."""


@dataclass
class Options:
    runs: int
    replicas: int
    producers: int
    schema: str
    rate: float | None
    timeout: float
    seed: int
    json_path: Path | None
    database_url: str | None
    linger: float = 0.0  # seconds the replicas (and their status pages) stay up after delivery


class Demo:
    def __init__(self, opts: Options, console: Console) -> None:
        self.o = opts
        self.console = console
        self.stack = contextlib.ExitStack()
        self.tmp = Path(tempfile.mkdtemp(prefix="relay-demo-"))
        self.keep_logs = False
        self.stop_producers = threading.Event()
        self.producers: list[Producer] = []
        self.replicas: list[Replica] = []
        self.tally = Tally()
        self.prefix = f"{opts.schema}-{secrets.token_hex(3)}-"
        self.url = ""
        self.clock_offset = 0.0  # database clock minus this machine's
        self.deadline = float("inf")
        self.live_rate = 0.0
        self.page_urls: list[str] = []  # each replica's status page (relay/serving/ui/)

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        self.stop_producers.set()
        for p in self.producers:
            p.join(5)
        for r in self.replicas:
            r.terminate()
        for r in self.replicas:
            if r.exit_code is None and r.proc.returncode is None:
                r.wait(REPLICA_STOP_TIMEOUT)
        self.stack.close()
        if self.keep_logs and any(r.log_path.stat().st_size for r in self.replicas):
            shutil.rmtree(self.tmp / "pg", ignore_errors=True)
            self.console.print(f"replica logs kept in {self.tmp / 'logs'}")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def run(self) -> Report:
        started = time.monotonic()
        self._database()
        sink_url, sink = self._sink()
        plans = plan_workload(self.o.runs, self.prefix, self.o.seed)
        total = sum(p.events for p in plans)
        self.console.print(
            f"workload: {len(plans):,} runs, {total:,} events (--seed {self.o.seed}); "
            f"run ids start with {self.prefix!r}"
        )
        half = len(plans) // 2
        with self._progress() as progress:
            enq = progress.add_task("enqueued", total=total, info="")
            dlv = progress.add_task("delivered", total=total, info="")
            # 1. A backlog, as after an outage: half the runs, committed before any relay runs.
            self.producers = run_producers(
                self.url, self.o.schema, plans[:half], self.tally, self.stop_producers,
                n=self.o.producers, live=False, rate=0, seed=self.o.seed,
            )  # fmt: skip
            while any(p.is_alive() for p in self.producers):
                progress.update(enq, completed=len(self.tally), info="backlog, before the relays")
                time.sleep(0.1)
            self._check_producers()
            # 2. The replicas start and drain it: timed from the first receipt at the sink to
            # the last acknowledgement, which is what the live pace below is derived from.
            self._start_replicas(sink_url)
            self.deadline = time.monotonic() + self.o.timeout
            drain = self._wait_acked(progress, enq, dlv, total, sink, "draining the backlog")
            # Live traffic must not start before every replica can hear it: each one's /readyz
            # says its LISTEN connection is up (and its database, schema and ingress are fine).
            self._wait_ready(progress, enq)
            # 3. Live traffic while they run, paced below what the drain showed they can take,
            # so its latency is the relay's own and not time spent queued behind a backlog.
            live = plans[half:]
            per_tx = sum(p.events for p in live) / max(1, sum(len(p.transactions) for p in live))
            self.live_rate = live_rate(half, drain, per_tx) if self.o.rate is None else self.o.rate
            self.producers += run_producers(
                self.url, self.o.schema, live, self.tally, self.stop_producers,
                n=self.o.producers, live=True, rate=self.live_rate, seed=self.o.seed + 1000,
            )  # fmt: skip
            pace = f"{self.live_rate:,.0f}/s" if self.live_rate > 0 else "unpaced"
            self._wait_acked(progress, enq, dlv, total, sink, f"live, {pace}")
        self._linger()
        codes = self._stop_replicas()
        return self._report(plans, sink, codes, time.monotonic() - started)

    # -- steps -------------------------------------------------------------------------------

    def _database(self) -> None:
        url = self.o.database_url
        if not url:
            with warnings.catch_warnings():
                # pgserver's platformdirs warns about XDG_RUNTIME_DIR; the demo does not use it.
                warnings.simplefilter("ignore")
                from relay.tools.embedded import EmbeddedPostgres

                try:
                    server = EmbeddedPostgres(self.tmp / "pg", durable=True)
                except RuntimeError as exc:  # no PostgreSQL binaries
                    raise DemoFailed(str(exc)) from None
            with self.console.status("starting an embedded PostgreSQL…"):
                self.stack.callback(server.stop)
                try:
                    url = server.start()
                except (OSError, subprocess.SubprocessError) as exc:
                    detail = getattr(exc, "stderr", None) or b""
                    text = detail.decode(errors="replace") if isinstance(detail, bytes) else ""
                    raise DemoFailed(
                        f"cannot start an embedded PostgreSQL ({exc}) {text.strip()[-500:]}\n"
                        "set RELAY_DATABASE_URL to use an existing server"
                    ) from None
            self.console.print(f"embedded PostgreSQL at {url} (data in {server.datadir})")
        else:
            self.console.print(f"PostgreSQL at {redact_url(url)} (RELAY_DATABASE_URL)")
        self.url = url
        with self.console.status("migrating…"):
            result = migrate(url, self.o.schema)
        self.console.print(f"schema {self.o.schema} at version {result.version}")
        if install_absurd(url, (QUEUE,)):
            self.console.print("installed the Absurd schema")
        with psycopg.connect(url, autocommit=True) as conn:
            self.clock_offset = _clock_offset(conn)
        self.console.print(f"Absurd queue {QUEUE!r} ready")

    def _sink(self) -> tuple[str, SinkThread]:
        sink = Sink()
        sink.state.keep_received = False
        thread = SinkThread(sink)
        base = thread.start()
        self.stack.callback(thread.stop)
        self.console.print(f"reference sink at {base}")
        return f"{base}/runs/{{run_id}}/events", thread

    def _start_replicas(self, ingress_url: str) -> None:
        base = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
        (self.tmp / "logs").mkdir(exist_ok=True)
        tag = secrets.token_hex(2)
        for i in range(self.o.replicas):
            env = {
                **base,
                "RELAY_DATABASE_URL": self.url,
                "RELAY_INGRESS_URL": ingress_url,
                "RELAY_SCHEMA": self.o.schema,
                "RELAY_LOG_LEVEL": "warning",
                "RELAY_REPLICA_ID": f"demo-{tag}-{i + 1}",
            }
            port = _free_port()
            env["RELAY_METRICS_ADDR"] = f"127.0.0.1:{port}"
            self.page_urls.append(f"http://127.0.0.1:{port}/")
            path = self.tmp / "logs" / f"replica-{i + 1}.log"
            self.replicas.append(Replica(i + 1, env, path))
        self.console.print(
            f"started {self.o.replicas} relay replicas (logs in {self.tmp / 'logs'})"
        )
        others = (
            f" (every replica serves one: {', '.join(self.page_urls[1:])})"
            if len(self.page_urls) > 1
            else ""
        )
        self.console.print(f"status page: {self.page_urls[0]}{others}", soft_wrap=True)

    def _linger(self) -> None:
        """Keep the replicas, and so their status pages, up for --linger seconds."""
        if self.o.linger <= 0:
            return
        self.console.print(
            f"everything delivered; the status page stays up for {self.o.linger:g} s at "
            f"{self.page_urls[0]} (Ctrl-C stops everything)",
            soft_wrap=True,
        )
        time.sleep(self.o.linger)

    def _wait_acked(
        self,
        progress: Progress,
        enq: TaskID,
        dlv: TaskID,
        total: int,
        sink: SinkThread,
        phase: str,
    ) -> float | None:
        """Wait until the producers are done and every committed event is acknowledged.
        Returns the seconds from the phase's first receipt at the sink to then (None if none)."""
        count_q = sql.SQL(
            "select count(*) filter (where state = 'delivered'),"
            " count(*) filter (where state = 'failed') from {}.events"
            " where starts_with(run_id, %s)"
        ).format(sql.Identifier(self.o.schema))
        baseline = sink.stats()["unique_events"]
        first_receipt: float | None = None
        with psycopg.connect(self.url, autocommit=True, application_name="relay-demo") as conn:
            while True:
                self._check_producers()
                self._check_replicas()
                row = conn.execute(count_q, (self.prefix,)).fetchone()
                acked, failed = (int(row[0]), int(row[1])) if row else (0, 0)
                stats = sink.stats()
                now = time.monotonic()
                if first_receipt is None and stats["unique_events"] > baseline:
                    first_receipt = now - POLL_INTERVAL / 2
                enqueued = len(self.tally)
                producing = any(p.is_alive() for p in self.producers)
                progress.update(enq, completed=enqueued, info=phase)
                progress.update(
                    dlv,
                    completed=min(stats["unique_events"], total),
                    info=f"acked {acked:,} · duplicates {stats['duplicates']:,}",
                )
                if failed:
                    raise DemoFailed(
                        f"{failed} event(s) failed and blocked their runs: "
                        f"inspect with `relay inspect` (schema {self.o.schema})"
                    )
                if not producing and acked >= enqueued:
                    return None if first_receipt is None else now - first_receipt
                if now > self.deadline:
                    raise DemoFailed(
                        f"timed out after {self.o.timeout:g} s: {acked:,} of {enqueued:,} events "
                        f"acknowledged ({stats['unique_events']:,} at the sink)"
                    )
                time.sleep(POLL_INTERVAL)

    def _wait_ready(self, progress: Progress, enq: TaskID) -> None:
        """Wait until every replica's /readyz answers 200: started, database and schema fine,
        LISTEN connection up, ingress not misconfigured. A replica that is not ready by the
        deadline fails the demo, with what its /readyz said."""
        progress.update(enq, info="waiting for every replica to be ready (LISTEN up)")
        pending = {url + "readyz" for url in self.page_urls}
        last: dict[str, str] = {}
        while pending:
            self._check_replicas()
            for url in sorted(pending):
                status, body = _get(url)
                if status == 200:
                    pending.discard(url)
                else:
                    last[url] = body or f"no answer ({status})"
            if not pending:
                return
            if time.monotonic() > self.deadline:
                said = "; ".join(f"{u}: {last.get(u, '')[:200]}" for u in sorted(pending))
                raise DemoFailed(f"replicas not ready after {self.o.timeout:g} s: {said}")
            time.sleep(0.05)

    def _check_producers(self) -> None:
        for p in self.producers:
            if p.error is not None:
                raise DemoFailed(f"a producer failed: {type(p.error).__name__}: {p.error}")

    def _check_replicas(self) -> None:
        for r in self.replicas:
            code = r.proc.poll()
            if code is not None:
                raise DemoFailed(
                    f"relay replica {r.index} exited with code {code}; its log ends:\n{r.tail()}"
                )

    def _stop_replicas(self) -> list[int | None]:
        with self.console.status("stopping the replicas (SIGTERM)…"):
            for r in self.replicas:
                r.terminate()
            return [r.wait(REPLICA_STOP_TIMEOUT) for r in self.replicas]

    def _report(
        self, plans: Sequence[RunPlan], sink: SinkThread, codes: list[int | None], wall: float
    ) -> Report:
        schema = sql.Identifier(self.o.schema)
        with psycopg.connect(self.url, autocommit=True) as conn:
            rows = conn.execute(
                sql.SQL(
                    "select event_id, extract(epoch from created_at)::float8 from {}.events"
                    " where starts_with(run_id, %s)"
                ).format(schema),
                (self.prefix,),
            ).fetchall()
            failed = conn.execute(
                sql.SQL(
                    "select count(*) from {}.events where starts_with(run_id, %s)"
                    " and state = 'failed'"
                ).format(schema),
                (self.prefix,),
            ).fetchone()
            wakes = conn.execute(
                sql.SQL("select count(*) from absurd.{} where starts_with(event_name, %s)").format(
                    sql.Identifier(f"e_{QUEUE}")
                ),
                (f"run-created:{self.prefix}",),
            ).fetchone()
        created_at = {r[0]: float(r[1]) - self.clock_offset for r in rows}
        # The replicas have exited: nothing writes the sink's state any more.
        state = sink.sink.state
        report = build_report(
            runs=len(plans),
            committed=self.tally.committed,
            created_at=created_at,
            deliveries=state.deliveries,
            first_seen_at=state.first_seen_at,
            first_order=state.first_order,
            wakes=int(wakes[0]) if wakes else 0,
            replica_exit_codes=codes,
            replica_log_events=count_log_events([r.log_path for r in self.replicas]),
            failed_events=int(failed[0]) if failed else 0,
            live_rate_eps=self.live_rate,
            wall_s=wall,
        )
        report.seed = self.o.seed
        if report.replica_log_events or not report.ok:
            self.keep_logs = True
        return report

    def _progress(self) -> Progress:
        return Progress(
            TextColumn("[bold]{task.description:>9}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self.console,
        )


def _free_port() -> int:
    """A free local TCP port for a replica's metrics_addr (a moment's race with other
    programs is acceptable for a demo: the replica then fails to start and says why)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> tuple[int, str]:
    """(status, body) of a GET on one of the replicas' endpoints; (0, "") while it is down."""
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return answer.status, answer.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError:
        return 0, ""


def _clock_offset(conn: psycopg.Connection[Any], samples: int = 5) -> float:
    """The database clock minus this machine's, from the sample with the shortest round trip."""
    best: tuple[float, float] | None = None
    for _ in range(samples):
        t0 = time.time()
        row = conn.execute("select extract(epoch from clock_timestamp())::float8").fetchone()
        t1 = time.time()
        assert row is not None
        rtt, offset = t1 - t0, float(row[0]) - (t0 + t1) / 2
        if best is None or rtt < best[0]:
            best = (rtt, offset)
    assert best is not None
    return best[1]
