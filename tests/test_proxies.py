"""The proxy rules (relay/proxies.py): which proxy a POST goes through, from HTTP_PROXY,
HTTPS_PROXY, ALL_PROXY and NO_PROXY, as httpx's client picks it with `trust_env` — checked on
a table, and against httpx's own (private) rules where they agree, so that a difference shows.
The senders going through a real proxy: tests/test_security.py."""

from __future__ import annotations

import os

import httpx
import pytest

from relay.proxies import NO_PROXIES, proxy_rules
from relay.settings import load
from tests.support import settings

P = "http://proxy:3128"


@pytest.mark.parametrize(
    ("environ", "url", "proxy"),
    [
        ({}, "http://ingress/runs/1", None),
        ({"HTTP_PROXY": P}, "http://ingress/runs/1", P),
        ({"HTTP_PROXY": P}, "https://ingress/runs/1", None),
        ({"HTTPS_PROXY": P}, "https://ingress/runs/1", P),
        ({"ALL_PROXY": P}, "https://ingress/runs/1", P),
        ({"HTTPS_PROXY": "proxy:3128"}, "https://ingress/", P),  # no scheme: http://
        ({"http_proxy": P, "HTTP_PROXY": "http://other:1"}, "http://ingress/", P),
        ({"http_proxy": "", "HTTP_PROXY": P}, "http://ingress/", None),  # lowercase wins
        ({"HTTP_PROXY": P, "NO_PROXY": "*"}, "http://ingress/", None),
        ({"HTTP_PROXY": P, "NO_PROXY": "ingress"}, "http://ingress:8080/", None),
        ({"HTTP_PROXY": P, "NO_PROXY": "internal"}, "http://a.internal/", None),
        ({"HTTP_PROXY": P, "NO_PROXY": "internal"}, "http://ainternal/", P),
        ({"HTTP_PROXY": P, "NO_PROXY": ".internal"}, "http://internal/", P),
        ({"HTTP_PROXY": P, "NO_PROXY": ".internal"}, "http://a.internal/", None),
        ({"HTTP_PROXY": P, "NO_PROXY": "localhost"}, "http://localhost/", None),
        ({"HTTP_PROXY": P, "NO_PROXY": "localhost"}, "http://a.localhost/", P),
        ({"HTTP_PROXY": P, "NO_PROXY": "127.0.0.1"}, "http://127.0.0.1:9/", None),
        ({"HTTP_PROXY": P, "NO_PROXY": "127.0.0.1"}, "http://127.0.0.2/", P),
        ({"HTTP_PROXY": P, "NO_PROXY": "10.0.0.0/8"}, "http://10.1.2.3/", None),
        ({"HTTP_PROXY": P, "NO_PROXY": "::1"}, "http://[::1]:80/", None),
        ({"HTTP_PROXY": P, "NO_PROXY": "ingress:8080"}, "http://ingress:8080/", None),
        ({"HTTP_PROXY": P, "NO_PROXY": "ingress:8080"}, "http://ingress:8081/", P),
        ({"ALL_PROXY": P, "NO_PROXY": "https://ingress"}, "https://ingress/", None),
        ({"ALL_PROXY": P, "NO_PROXY": "https://ingress"}, "http://ingress/", P),
        ({"HTTP_PROXY": P, "NO_PROXY": " a , ingress "}, "http://INGRESS/", None),
    ],
)
def test_the_proxy_a_url_goes_through(environ: dict[str, str], url: str, proxy: str | None) -> None:
    assert proxy_rules(environ).for_url(url) == proxy


def test_no_proxy_named_is_no_rules() -> None:
    assert proxy_rules({"NO_PROXY": "ingress"}) is NO_PROXIES
    assert proxy_rules({"HTTP_PROXY": P, "no_proxy": "x,*"}) is NO_PROXIES


ENVIRONMENTS = [
    {"HTTP_PROXY": P, "HTTPS_PROXY": "http://tls-proxy:1", "NO_PROXY": "internal,127.0.0.1"},
    {"ALL_PROXY": P, "NO_PROXY": ".example.com,localhost,::1,ingress:8443"},
]
URLS = [
    "http://internal/x",
    "https://a.internal/x",
    "https://internal.example/x",
    "http://127.0.0.1:8000/x",
    "https://example.com/",
    "https://a.example.com/",
    "http://localhost:1/",
    "http://[::1]/",
    "https://ingress:8443/",
    "https://ingress/",
]


@pytest.mark.parametrize("environ", ENVIRONMENTS)
def test_the_rules_choose_as_httpx_does(
    environ: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """httpx's client with `trust_env` (its private get_environment_proxies and URLPattern, used
    here only to compare) picks the same proxy for each URL."""
    from httpx._utils import URLPattern, get_environment_proxies

    for name in list(os.environ):
        if name.lower().endswith("_proxy"):
            monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    mounts = sorted((URLPattern(k), v) for k, v in get_environment_proxies().items())
    ours = proxy_rules(environ)
    for url in URLS:
        theirs = next((v for p, v in mounts if p.matches(httpx.URL(url))), None)
        assert ours.for_url(url) == theirs, url


def test_the_sender_choice_hands_a_proxied_ingress_to_httpx() -> None:
    """relay/ingress.py `sender_for`: decided from the proxy rules of the ingress URLs."""
    from relay.ingress import sender_for

    base = settings("postgresql://x/y", "relay", "http://ingress")
    rules = proxy_rules({"HTTP_PROXY": P})
    assert sender_for(base, NO_PROXIES) == ("httptools", None)
    assert sender_for(base, rules) == ("httpx", P)
    assert sender_for(base, proxy_rules({"HTTP_PROXY": P, "NO_PROXY": "ingress"})) == (
        "httptools",
        None,
    )
    https = load(
        {
            "database_url": "postgresql://x/y",
            "ingress_url": "https://ingress/runs/{run_id}",
            "ingress_batch_url": "http://batch/b",
            "http_transport": "httpx",
        },
        {},
    )
    assert sender_for(https, rules) == ("httpx", P)  # the batch URL is proxied
