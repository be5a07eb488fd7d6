"""Which proxy a POST goes through, from the environment: `HTTP_PROXY`, `HTTPS_PROXY`,
`ALL_PROXY` and `NO_PROXY` (lowercase names win, as in urllib and curl), read the way httpx's
client reads them with `trust_env` (its `get_environment_proxies` and `URLPattern`, which are
private to httpx: the rules are written out here instead, on public ground).

- A URL's scheme picks `HTTPS_PROXY` or `HTTP_PROXY`, else `ALL_PROXY`; a proxy written without
  a scheme is `http://`.
- `NO_PROXY` is a comma-separated list: `*` turns every proxy off; an IP address matches that
  host, a CIDR block its addresses; `localhost` itself; `example.com` that host and its
  subdomains, `.example.com` only the subdomains; `host:port` only that port; `scheme://host`
  only that scheme.

A pure function of the environment it is given: the relay reads it once at start
(relay/ingress.py `open_sender`, relay/http_httpx.py).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit


def _variable(environ: Mapping[str, str], name: str) -> str:
    """`name_proxy`, lowercase first (an empty lowercase one turns the uppercase one off)."""
    lower = environ.get(f"{name}_proxy")
    if lower is not None:
        return lower.strip()
    return environ.get(f"{name.upper()}_PROXY", "").strip()


@dataclass(frozen=True, slots=True)
class _Bypass:
    scheme: str  # "" for any
    host: str  # lowercase; IPv6 without brackets
    port: int | None
    subdomains: bool  # also any name under `host`
    itself: bool  # `host` itself (not for ".example.com")
    network: ipaddress.IPv4Network | ipaddress.IPv6Network | None = None

    def matches(self, scheme: str, host: str, port: int) -> bool:
        if self.scheme and self.scheme != scheme:
            return False
        if self.port is not None and self.port != port:
            return False
        if self.network is not None:
            try:
                return ipaddress.ip_address(host) in self.network
            except ValueError:
                return False
        if self.itself and host == self.host:
            return True
        return self.subdomains and host.endswith("." + self.host)


def _bypass(entry: str) -> _Bypass | None:
    scheme = ""
    if "://" in entry:
        scheme, _, entry = entry.partition("://")
        scheme = scheme.lower()
        if scheme == "all":
            scheme = ""
    entry = entry.strip().rstrip("/").lower()
    try:
        network = ipaddress.ip_network(entry.strip("[]"), strict=False)
    except ValueError:
        network = None
    if network is not None:
        return _Bypass(scheme, entry, None, False, False, network)
    parts = urlsplit("//" + entry)
    try:
        host, port = parts.hostname or "", parts.port
    except ValueError:
        return None
    if not host:
        return None
    if host.startswith("*"):
        host = host[1:]
    if host.startswith("."):
        return _Bypass(scheme, host[1:], port, subdomains=True, itself=False)
    exact = host == "localhost" or scheme != ""  # as httpx: no subdomains for these
    return _Bypass(scheme, host, port, subdomains=not exact, itself=True)


@dataclass(frozen=True, slots=True)
class ProxyRules:
    proxies: Mapping[str, str]  # "http" / "https" / "all" -> the proxy's URL
    bypass: tuple[_Bypass, ...] = ()

    def for_url(self, url: str) -> str | None:
        """The proxy a POST to `url` goes through, or None: straight to its host."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        proxy = self.proxies.get(scheme) or self.proxies.get("all")
        if proxy is None or not parts.hostname:
            return None
        try:
            port = parts.port or (443 if scheme == "https" else 80)
        except ValueError:
            return None
        host = parts.hostname.lower()
        if any(b.matches(scheme, host, port) for b in self.bypass):
            return None
        return proxy


NO_PROXIES = ProxyRules({})


def proxy_rules(environ: Mapping[str, str]) -> ProxyRules:
    """The proxy rules `environ` sets (NO_PROXIES when it names no proxy)."""
    proxies: dict[str, str] = {}
    for scheme in ("http", "https", "all"):
        value = _variable(environ, scheme)
        if value:
            proxies[scheme] = value if "://" in value else f"http://{value}"
    entries = [e.strip() for e in _variable(environ, "no").split(",") if e.strip()]
    if not proxies or "*" in entries:
        return NO_PROXIES
    return ProxyRules(proxies, tuple(b for b in map(_bypass, entries) if b is not None))
