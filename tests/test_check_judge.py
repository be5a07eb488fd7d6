"""`relay check`'s ingress line as judged from what the probe got (relay/ops/checks.py
`judge_ingress`): one test per outcome it tells apart, on plain values, no server and no event
loop. tests/test_check.py runs the same probe against real servers."""

from __future__ import annotations

import base64

import pytest

from relay.edges.http_client import Reply, TransportFailure
from relay.ops.checks import Result, ingress_probe, judge_ingress
from relay.settings import ConfigError, Settings, load

TOKEN = "s3cret-token"
WHERE = "https://ingress.example/runs/relay-check/events"  # the probe run's URL, as printed


def settings(**more: str) -> Settings:
    flags = {
        "database_url": "postgresql://app@db/ledger",
        "ingress_url": "https://ingress.example/runs/{run_id}/events",
        "ingress_batch_url": "https://ingress.example/{database}/batches",
        "ingress_token": TOKEN,
    }
    return load({**flags, **more}, environ={})


def judged(
    status: int, body: bytes = b"{}", *, unframed: bool = False, location: str | None = None
) -> Result:
    """The one-database probe's line from this reply."""
    s = settings()
    reply = Reply(status, body, None, unframed=unframed, location=location)
    return judge_ingress(s, ingress_probe(s), reply)


@pytest.mark.parametrize(
    ("status", "body", "unframed"),
    [
        (200, b"{}", False),
        (204, b"", False),  # empty, but framed: told from a reset
        (200, b"ok", True),  # unframed, but with a body: told from a reset
        (409, b"", False),  # the batch's run already has it (DESIGN section 5)
    ],
)
def test_an_accepted_answer_passes(status: int, body: bytes, unframed: bool) -> None:
    got = judged(status, body, unframed=unframed)
    assert got == Result("ingress", True, f"{WHERE} answered {status}")


def test_an_accepted_answer_with_no_body_and_no_framing_fails() -> None:
    got = judged(200, b" \r\n", unframed=True)
    assert got == Result(
        "ingress",
        False,
        f"{WHERE} answered 200 with an empty body and no Content-Length or chunked framing, "
        "which relay run cannot tell from a connection reset: frame the answers",
    )


@pytest.mark.parametrize("status", [400, 413, 422])
def test_a_refused_empty_batch_proves_the_endpoint_takes_posts(status: int) -> None:
    got = judged(status)
    assert got == Result(
        "ingress", True, f"{WHERE} answered {status} (to an empty batch: the endpoint takes POSTs)"
    )


@pytest.mark.parametrize("status", [429, 500, 503, 102])
def test_a_failing_ingress_passes_as_one_relay_run_would_retry(status: int) -> None:
    got = judged(status)
    assert got == Result(
        "ingress",
        True,
        f"{WHERE} answered {status} (relay run would retry: the ingress is failing now)",
    )


@pytest.mark.parametrize("status", [401, 403])
def test_rejected_credentials_name_the_token(status: int) -> None:
    got = judged(status)
    assert got == Result(
        "ingress", False, f"{WHERE} answered {status}: credentials rejected; fix ingress_token"
    )


def test_rejected_credentials_name_the_signing_secret_when_one_is_set() -> None:
    s = settings(signing_secret="whsec_" + base64.b64encode(b"k" * 32).decode())
    got = judge_ingress(s, ingress_probe(s), Reply(401, b"", None))
    assert got == Result(
        "ingress",
        False,
        f"{WHERE} answered 401: credentials rejected; fix ingress_token or signing_secret",
    )


def test_a_redirect_names_where_it_points_without_its_credentials() -> None:
    got = judged(302, location="https://user:pw@elsewhere.example/x?token=abc")
    assert got == Result(
        "ingress",
        False,
        f"{WHERE} answered 302: a redirect to 'https://***@elsewhere.example/x?token=***', "
        "which relay run never follows; set ingress_url to where it points",
    )


def test_a_redirect_with_no_location() -> None:
    got = judged(307)
    assert got == Result(
        "ingress",
        False,
        f"{WHERE} answered 307: a redirect, which relay run never follows; "
        "set ingress_url to where it points",
    )


def test_a_url_that_takes_no_posts() -> None:
    got = judged(405)
    assert got == Result(
        "ingress", False, f"{WHERE} answered 405: this URL does not take POSTs; fix ingress_url"
    )


def test_a_proxy_that_wants_credentials() -> None:
    got = judged(407)
    assert got == Result(
        "ingress",
        False,
        f"{WHERE} answered 407: the proxy wants credentials; "
        "fix ingress_proxy's (or HTTP_PROXY's) user:password",
    )


@pytest.mark.parametrize("status", [404, 410])
def test_no_such_endpoint(status: int) -> None:
    got = judged(status)
    assert got == Result(
        "ingress", False, f"{WHERE} answered {status}: no such endpoint; fix ingress_url (its path)"
    )


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (
            TransportFailure(f"connection refused: [Errno 111] Bearer {TOKEN}\nsecond line"),
            "TransportFailure: connection refused: [Errno 111] Bearer ***",
        ),
        (TimeoutError(), "TimeoutError: "),
        (
            ConfigError("ingress_ca_file: no such file"),
            "ConfigError: ingress_ca_file: no such file",
        ),
    ],
)
def test_no_answer_fails_naming_the_error_without_the_secrets(
    error: TransportFailure | ConfigError | TimeoutError, said: str
) -> None:
    s = settings()
    assert judge_ingress(s, ingress_probe(s), error) == Result("ingress", False, f"{WHERE}: {said}")


def test_the_batch_probe_of_a_fleet_database_names_its_line_setting_and_database() -> None:
    s = settings()
    batch = ingress_probe(s, batch=True, database="shard1")
    got = judge_ingress(s, batch, Reply(404, b"", None))
    assert got == Result(
        "ingress_batch",
        False,
        "https://ingress.example/shard1/batches answered 404: no such endpoint; "
        "fix ingress_batch_url (its path)",
        "shard1",
    )
    ok = judge_ingress(s, batch, Reply(200, b"{}", None))
    assert ok == Result(
        "ingress_batch", True, "https://ingress.example/shard1/batches answered 200", "shard1"
    )
