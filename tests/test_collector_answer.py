"""A collector that never ends its answer (issue 48 item 3): what the OTLP exporter reads of an
answer is bounded. A collector answered each export with a chunked 200 whose body never ended,
and the stock exporter's session read the whole of it into memory (a relay grew from 783 MB to
2.4 GB in 25 s). The relay's exporter (relay/integrations/otel.py `exporter`) reads at most
`ANSWER_LIMIT` bytes of a body and then drops the connection.

Measured in bytes, never in time: what the collector managed to write before the exporter hung
up (the sockets' buffers take some past the limit, far from what it offers), and the peak of
the Python heap while the export ran."""

from __future__ import annotations

import os
import socket
import threading
import tracemalloc
from collections.abc import Iterator

import pytest

from relay.edges.tracing import CREDENTIAL_PROVIDERS, Delivery, config_from_env
from relay.integrations import start_tracing
from relay.settings import ConfigError

otel = pytest.importorskip("relay.integrations.otel", reason="the otel extra is not installed")
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SpanExportResult  # noqa: E402

OFFERED = 64 * 1024 * 1024  # what the collector writes of a body at most, then it ends it
CHUNK = 64 * 1024
# The most the collector may get written before the exporter hangs up: the limit, and what the
# two sockets' buffers took meanwhile (a few MiB on loopback), far below OFFERED.
BOUNDED = OFFERED // 4


class EndlessCollector:
    """An OTLP/HTTP endpoint on a real socket that reads each request whole and answers `200`
    with a chunked body of CHUNK-sized chunks, until the client stops reading (a write fails) or
    OFFERED bytes are written, when it ends the body. It counts what it wrote of each answer."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.written: list[int] = []  # body bytes written, one entry per answer that ended
        self.answered = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(client,), daemon=True).start()

    @staticmethod
    def _read_request(client: socket.socket) -> bool:
        data = b""
        while b"\r\n\r\n" not in data:
            got = client.recv(65536)
            if not got:
                return False
            data += got
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(body) < length:
            got = client.recv(65536)
            if not got:
                return False
            body += got
        return True

    def _answer(self, client: socket.socket) -> None:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, CHUNK)
        chunk = b"%x\r\n" % CHUNK + b"x" * CHUNK + b"\r\n"
        with client:
            while self._read_request(client):
                written = 0
                try:
                    client.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\n")
                    client.sendall(b"transfer-encoding: chunked\r\n\r\n")
                    while written < OFFERED:
                        client.sendall(chunk)
                        written += CHUNK
                    client.sendall(b"0\r\n\r\n")
                except OSError:
                    return
                finally:
                    self.written.append(written)
                    self.answered.set()

    def stop(self) -> None:
        self.listener.close()


@pytest.fixture
def endless() -> Iterator[EndlessCollector]:
    collector = EndlessCollector()
    yield collector
    collector.stop()


@pytest.fixture(autouse=True)
def _no_otel_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)


def test_the_exporter_reads_an_endless_answer_only_up_to_its_limit(
    endless: EndlessCollector, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One export to the endless collector: it is a 200, so the export succeeds; the collector
    got little of its body written before the exporter hung up, and the heap never held it."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endless.url + "/v1/traces")
    span = TracerProvider().get_tracer("t").start_span("s")
    span.end()
    exporter = otel.exporter()
    tracemalloc.start()
    try:
        result = exporter.export([span])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        exporter.shutdown()
    assert result is SpanExportResult.SUCCESS
    assert endless.answered.wait(30)  # a hang detector: the collector saw its write fail
    (written,) = endless.written
    assert written < BOUNDED, f"the collector wrote {written} bytes: the exporter read on"
    assert peak < BOUNDED, f"the heap peaked at {peak} bytes during the export"


def test_the_relays_tracer_exports_through_the_bounded_session(
    endless: EndlessCollector, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tracer `relay run` starts from the standard variables: its flush at shutdown exports
    a delivery's spans to the endless collector, which gets no further than the limit."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endless.url)
    tracer = start_tracing(os.environ)
    span = tracer.delivery(Delivery("ordinary", "r1", 1, 1, 1, 1, 1, (None,), None))
    with span.post(endless.url + "/ingress") as post:  # ended here: the span to export
        post.answered(200)
    assert tracer.shutdown(60)  # a hang detector: the flush ended
    # The collector counts an answer once its write fails, which may be after the flush ended.
    assert endless.answered.wait(30), "nothing was exported"
    assert all(w < BOUNDED for w in endless.written), endless.written


@pytest.mark.parametrize("variable", CREDENTIAL_PROVIDERS)
def test_a_credential_provider_session_is_refused_not_ignored(variable: str) -> None:
    """The SDK's credential provider would hand the exporter a session of its own in place of
    the bounded one: the relay refuses the variable at start, naming it."""
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", variable: "google"}
    with pytest.raises(ConfigError, match=variable):
        config_from_env(environ)
