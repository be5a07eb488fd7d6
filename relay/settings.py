"""Configuration (DESIGN §7): every option is a CLI flag and an environment variable RELAY_<NAME>;
secrets also accept RELAY_<NAME>_FILE and systemd credentials ($CREDENTIALS_DIRECTORY/<name>).

Parsing is pure: `load(flags, environ)` returns Settings or raises ConfigError with one line
naming the option. Secrets are wrapped in `Secret` so they never print.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import socket
import ssl
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from relay.names import validate_schema_name


class ConfigError(ValueError):
    """Invalid configuration; the message names the option."""


class Secret:
    """A string that does not print."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(text: str) -> float:
    """'30s', '500ms', '5m', '24h', '1d' or plain seconds ('1.5') -> seconds."""
    m = _DURATION_RE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a duration (e.g. 500ms, 30s, 5m, 24h)")
    return float(m.group(1)) * _UNITS[m.group(2)]


_SCHEME_RE = re.compile(r"\s*[A-Za-z][A-Za-z0-9+.\-]*://")
# A libpq key=value conninfo starts with a keyword and '='.
_CONNINFO_RE = re.compile(r"\s*[A-Za-z_]+\s*=")
# A `password=` (or the client key's `sslpassword=`) parameter of a URL query (libpq URIs
# accept both) ...
_QUERY_PASSWORD_RE = re.compile(r"(?i)([?&](?:ssl)?password=)[^&#]*")
# ... and of a libpq key=value conninfo: a quoted value with backslash escapes, or a bare one
# up to whitespace (a backslash escapes a space there too).
_DSN_PASSWORD_RE = re.compile(
    r"(?i)((?<!\S)(?:ssl)?password\s*=\s*)(?:'(?:[^'\\]|\\.)*'?|(?:\\.|[^\s\\])*\\?)", re.S
)
# A parameter's name in a key=value conninfo, and in a database URL's query.
_CONNINFO_NAME_RE = re.compile(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)\s*=")
_QUERY_NAME_RE = re.compile(r"(?:^|&)([^&=]*)=")
# Query parameters of an http URL whose name says they carry a credential (`?code=` of a
# serverless function, `?token=`, `?api_key=`, `?sig=` ...).
_HTTP_QUERY_SECRET_RE = re.compile(
    r"(?i)([?&][\w.\-]*(?:token|key|secret|password|passwd|pwd|sig|signature|auth|code|"
    r"credential)[\w.\-]*=)[^&#]*"
)


def redact_url(url: str) -> str:
    """A database URL or key=value conninfo, or an http URL, with any password (and the whole
    userinfo of http URLs, and query parameters named like credentials) replaced by ***.

    Text-based rather than `urlsplit`: libpq takes everything up to the first '/' after
    `scheme://` as the authority (so an unencoded '?' or '#' in a password is still the
    password) and accepts several comma-separated host:port pairs, which `urlsplit` can
    neither split right nor give a port for. A value that is neither (no `scheme://`, e.g. a
    URL whose scheme was left out) loses everything before its last '@'.
    """
    m = _SCHEME_RE.match(url)
    if m is None:
        if _CONNINFO_RE.match(url) or any(c.isspace() for c in url):
            # A conninfo, or free text (relay/logs.py's redact_text): the `password=` rule.
            return _QUERY_PASSWORD_RE.sub(r"\1***", _DSN_PASSWORD_RE.sub(r"\1***", url))
        _, at, rest = url.rpartition("@")
        return _QUERY_PASSWORD_RE.sub(r"\1***", f"***@{rest}" if at else url)
    head, rest = m.group(0), url[m.end() :]
    http = head.strip().lower().startswith("http")
    end = len(rest)
    for stop in "/?#" if http else "/":
        i = rest.find(stop)
        if i != -1:
            end = min(end, i)
    if not http and ("@" in rest[end:] or ("@" not in rest[:end] and _bad_port(rest[:end]))):
        # An unencoded '/' in a password ends libpq's authority early: no '@' before the first
        # '/' yet a port that is no number, or an '@' after it (`app:Kq7v@/Zx9w@host/db`: the
        # password's tail would show as the database's name; hypothesis found it in CI). Mask
        # up to the last '@'; a '@' in the query's values masks the hosts too, shown as less
        # rather than a password shown.
        last_at = rest.rfind("@")
        if last_at != -1:
            slash = rest.find("/", last_at)
            end = len(rest) if slash == -1 else slash
    authority, tail = rest[:end], rest[end:]
    userinfo, at, hosts = authority.rpartition("@")
    if at:
        if http:
            authority = f"***@{hosts}"
        elif ":" in userinfo:
            authority = f"{userinfo.partition(':')[0]}:***@{hosts}"
    text = _QUERY_PASSWORD_RE.sub(r"\1***", head + authority + tail)
    return _HTTP_QUERY_SECRET_RE.sub(r"\1***", text) if http else text


def _bad_port(authority: str) -> bool:
    """Whether a (multi-)host authority has a port that is not a number."""
    for host in authority.split(","):
        port = host.rpartition("]")[2].partition(":")[2]
        if port and not port.isdigit():
            return True
    return False


def passwords_in(url: str) -> list[str]:
    """The passwords a database URL or conninfo carries (`password`, `sslpassword`), as libpq
    reads them: for scrubbing error texts that may quote them in any form."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        parts = conninfo_to_dict(url)
    except Exception:  # unparseable: nothing libpq would send or quote
        return []
    return [str(v) for k in ("password", "sslpassword") if (v := parts.get(k))]


def scrub(text: str, secrets: Sequence[str]) -> str:
    """`text` with every secret replaced by *** (the longest first: one secret may hold another)."""
    for secret in sorted(secrets, key=len, reverse=True):
        if secret:
            text = text.replace(secret, "***")
    return text


def configured_secrets(s: Settings) -> list[str]:
    """Every secret the settings hold, for `scrub`: each secret option's value, and the
    passwords inside the database URLs as libpq reads them (a server may quote one alone, e.g.
    percent-decoded). How an http URL's userinfo travels is the HTTP client's to add
    (relay/edges/http_client.py `sent_secrets`)."""
    out: list[str] = []
    for name in sorted(SECRET_OPTIONS):
        value = getattr(s, name)
        for secret in value if isinstance(value, tuple) else (value,):
            if secret is not None:
                out.append(secret.reveal())
    for url in (s.database_url, s.listen_database_url):
        if url is not None:
            out.extend(passwords_in(url.reveal()))
    return [x for x in out if x]


def _default_replica_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True, repr=False)
class Settings:
    database_url: Secret
    ingress_url: str
    schema: str = "relay"
    listen_database_url: Secret | None = None
    ingress_batch_url: str | None = None
    ingress_token: Secret | None = None
    signing_secret: tuple[Secret, ...] = ()
    ingress_ca_file: str | None = None
    http_transport: str = (
        "aiohttp"  # the transport under httpx's client (relay/edges/http_client.py)
    )
    http2: bool = False
    # Whether a connection to the ingress carries more than one POST; None (unset, or `auto`):
    # the transport's default, on for aiohttp's and off for httpx's own, which over HTTP/1.1 may
    # read a copy of an answer as the next POST's (relay/edges/http_client.py `keepalive_for`;
    # issue 48 item 1, docs/security.md)
    ingress_keepalive: bool | None = None
    event_loop: str = "auto"  # auto (uvloop where installed), uvloop or asyncio: relay/core/loop.py
    ingress_proxy: Secret | None = None  # else the environment's (HTTP_PROXY ...), read by httpx
    batch_size: int = 100
    lease_ttl: float = 30.0
    concurrency: int = 32
    critical_concurrency: int = 4
    # POSTs in flight per replica: "adaptive" follows what the ingress takes, up to concurrency +
    # critical_concurrency (relay/delivery/post_turn.py, docs/admission.md); "fixed" is each lane's
    # own concurrency, whatever the ingress does (the relay before issue 42)
    post_limit: str = "adaptive"
    claim_runs: int = 64
    # Memory bounds (issue 13): payload bytes per POST (a claim's prefix stops early at it; a
    # single larger event still goes alone), and payload bytes one lane holds claimed but not yet
    # acknowledged. With the defaults a replica's peak RSS stays under 256 MB whatever the payload
    # sizes (docs/operations.md, tests/test_memory.py), as long as max_payload_bytes (the
    # producer-side limit, 256 KiB) is at most max_batch_bytes.
    max_batch_bytes: int = 1024 * 1024
    max_lane_bytes: int = 32 * 1024 * 1024
    poll_interval: float = 1.0
    http_timeout: float = 10.0
    max_backoff: float = 300.0
    shutdown_timeout: float = 20.0
    startup_timeout: float = 0.0  # 0: wait for the database forever (relay/startup.py)
    # With the list form (relay/databases.py): the most connections one replica opens to one
    # PostgreSQL server across the databases on it; 0: no budget (docs/sharding.md)
    server_connections: int = 0
    retention: float = 86400.0
    statement_timeout: float = 10.0
    metrics_addr: str | None = None
    ui_token: Secret | None = None
    log_format: str = "json"
    log_level: str = "info"
    replica_id: str = field(default_factory=_default_replica_id)

    @property
    def post_ceiling(self) -> int:
        """POSTs in flight both lanes may have at once: the adaptive limit's ceiling, and what
        the fixed limit always allows."""
        return self.concurrency + self.critical_concurrency

    @property
    def terminal_channel(self) -> str:
        return f"{self.schema}_terminal"

    def __repr__(self) -> str:
        # Through describe(): secrets masked and an ingress URL's userinfo redacted, so a
        # Settings in a traceback or a debugger prints nothing secret.
        shown = ", ".join(f"{k}={v!r}" for k, v in describe(self).items())
        return f"Settings({shown})"


SECRET_OPTIONS = frozenset(
    {
        "database_url",
        "listen_database_url",
        "ingress_token",
        "signing_secret",
        "ui_token",
        "ingress_proxy",
    }
)


def _int_in(lo: int, hi: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"must be an integer, got {text!r}") from None
        if not lo <= value <= hi:
            raise ValueError(f"must be between {lo} and {hi}, got {value}")
        return value

    return parse


_BYTES_RE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB)?\s*$")
_BYTE_UNITS = {None: 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}


def _bytes_in(lo: int, hi: int) -> Callable[[str], int]:
    """'1MiB', '512KiB', '1048576' -> bytes, within [lo, hi]."""

    def parse(text: str) -> int:
        m = _BYTES_RE.match(text)
        if not m:
            raise ValueError(f"{text!r} is not a size (e.g. 1048576, 512KiB, 1MiB, 1GiB)")
        value = int(m.group(1)) * _BYTE_UNITS[m.group(2)]
        if not lo <= value <= hi:
            raise ValueError(f"must be between {lo} and {hi} bytes, got {value}")
        return value

    return parse


def _duration_in(lo: float, hi: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = parse_duration(text)
        if not lo <= value <= hi:
            raise ValueError(f"must be between {lo:g}s and {hi:g}s, got {value:g}s")
        return value

    return parse


def _http_url(text: str) -> str:
    """An http(s) URL, as the relay's HTTP client will take it."""
    _http_url_shape(text)
    _usable_by_httpx(text)
    return text


def _http_url_shape(text: str) -> None:
    """An http or https scheme and a host; anything else is refused without its userinfo."""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        scheme = _SCHEME_RE.match(text)
        if scheme is None:  # what it holds is unknown: it may be a token
            raise ValueError(
                "must be an http(s) URL, e.g. https://ingress.internal/runs/{run_id}/events "
                "(the value is not shown: it has no scheme)"
            )
        # Redacted as an http URL (its whole userinfo masked), whatever its scheme.
        shown = scheme.group(0) + redact_url("http://" + text[scheme.end() :])[len("http://") :]
        raise ValueError(f"must be an http(s) URL, got {shown!r}")


# A run id put in the ingress URL template at start, to see the URL a POST goes to.
SAMPLE_RUN_ID = "sample-run"


def _usable_by_httpx(url: str) -> None:
    """The URL parsed by httpx, as every POST will be: a port that is no number (a typo such as
    `:80a80`) or out of range, or a host httpx cannot encode, fails here at start. Found at the
    first POST instead, it is a transport error that `relay run` retries forever.

    httpx's reason quotes the part it refused (the port, the host); with an '@' anywhere in the
    URL that part may be a password's start (an unencoded '/' ends the authority early), so it
    is then left out."""
    import httpx

    try:
        port = httpx.URL(url).port
    except httpx.InvalidURL as exc:
        why = "httpx's reason is not shown: the URL has userinfo" if "@" in url else str(exc)
        raise ValueError(f"is not a URL the HTTP client can send to ({why})") from None
    if port is not None and not 1 <= port <= 65535:
        shown = "" if "@" in url else f", got {port}"
        raise ValueError(f"its port must be from 1 to 65535{shown}")


def _ingress_template(text: str) -> str:
    _http_url_shape(text)
    if "{run_id}" not in text:
        raise ValueError(
            "must contain {run_id}, e.g. https://ingress.internal/runs/{run_id}/events"
        )
    # The run id is a producer's choice: it may pick the path (or query), never the scheme,
    # host or port that receive the POST, its bearer token and its signature. The database's
    # name (issue 51) is the operator's, yet kept to the same place: one host for all.
    if "{" in urlsplit(text).netloc:
        raise ValueError(
            "{run_id} and {database} may stand only in the path or query, not in the host or port"
        )
    # render_url substitutes the literal texts "{run_id}" and "{database}" (not str.format): any
    # other brace, including "{run_id.x}", "{run_id[0]}" or an escaped "{{run_id}}", would reach
    # the URL.
    rest = text.replace("{run_id}", "").replace("{database}", "")
    if "{" in rest or "}" in rest:
        raise ValueError("may contain no placeholder other than {run_id} and {database}")
    _usable_by_httpx(text.replace("{run_id}", SAMPLE_RUN_ID).replace("{database}", "default"))
    return text


def _batch_template(text: str) -> str:
    """`ingress_batch_url`: an http(s) URL that may name `{database}` (issue 51), in the path or
    query only, as `ingress_url` may; no `{run_id}`, since one POST to it carries several runs."""
    _http_url_shape(text)
    if "{" in urlsplit(text).netloc:
        raise ValueError("{database} may stand only in the path or query, not in the host or port")
    rest = text.replace("{database}", "")
    if "{" in rest or "}" in rest:
        raise ValueError(
            "may contain no placeholder other than {database} (a POST to it carries several "
            "runs: no {run_id})"
        )
    _usable_by_httpx(text.replace("{database}", "default"))
    return text


def _choice(*options: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.lower() not in options:
            raise ValueError(f"must be one of {', '.join(options)}, got {text!r}")
        return text.lower()

    return parse


def _http_transport(text: str) -> str:
    """`aiohttp` or `httpx`; the retired names of earlier releases (`httptools`, `httpcore`) are
    kept as given, so a rolling upgrade starts, and relay/edges/http_client.py says what replaces
    them."""
    return _choice("aiohttp", "httpx", "httptools", "httpcore")(text.strip())


def _boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"must be true or false, got {text!r}")


def _keepalive(text: str) -> bool | None:
    """`true` or `false` as set; `auto` is the unset default (None): the transport decides."""
    if text.strip().lower() == "auto":
        return None
    try:
        return _boolean(text)
    except ValueError:
        raise ValueError(f"must be true, false or auto, got {text!r}") from None


def _proxy_url(text: str) -> Secret:
    """A proxy URL (http, https, socks5, socks5h); its userinfo is a credential, hence secret."""
    scheme = urlsplit(text.strip()).scheme.lower()
    if scheme not in ("http", "https", "socks5", "socks5h"):
        raise ValueError(
            f"must be an http://, https:// or socks5:// URL, got {redact_url(text.strip())!r}"
        )
    return Secret(text.strip())


def _database_url(text: str) -> Secret:
    """A PostgreSQL URL or conninfo, parsed here: libpq's parse errors quote the password.

    A value that does not parse is not echoed at all: nothing says which part of it is the
    password (a URL without its scheme, a password file given by mistake). One that parses is
    shown redacted, and only when the host is wrong."""
    from psycopg.conninfo import conninfo_to_dict

    if not text.strip():
        raise ValueError("must not be empty")
    if "\x00" in text:
        # libpq reads a C string: it would connect with what comes before the NUL and the rest
        # would be shown as if it were no secret (a password's second half, say).
        raise ValueError(
            "contains a NUL character, which libpq cannot take (the value is not shown: it may "
            "hold a password)"
        )
    try:
        parts = conninfo_to_dict(text)
    except Exception:  # psycopg.ProgrammingError, whose message quotes the URL
        if unknown := _unknown_parameter(text):
            raise ValueError(unknown) from None
        raise ValueError(
            "is not a PostgreSQL URL (postgresql://USER:PASSWORD@HOST:PORT/DBNAME) or key=value "
            f"conninfo{_url_hint(text)} (the value is not shown: it may hold a password)"
        ) from None
    host = str(parts.get("host") or "")
    if any(c in host for c in "@?#/") and not host.startswith("/"):
        # An unencoded '@' in a password makes libpq read the rest of it as the host.
        raise ValueError(
            f"its host part is not a host name ({redact_url(text)!r}): "
            "percent-encode '@', '?', '#' and '/' in a password (e.g. %40 for '@')"
        )
    if any(p.strip() and not p.strip().isdigit() for p in str(parts.get("port") or "").split(",")):
        # An unencoded '/' (or '?', '#') in a password ends libpq's authority early: the
        # password's start becomes the port. Neither is shown.
        raise ValueError(
            "its port is not a number: percent-encode '/', '?', '#' and '@' in a password "
            "(e.g. %2F for '/') (the value is not shown: it may hold a password)"
        )
    if problem := _libpq_value_problem(parts):
        raise ValueError(problem)
    return Secret(text)


# The values libpq takes for the parameters that have a fixed set of them (the libpq manual,
# "Parameter Key Words"), and whether it compares them ignoring case. libpq checks them only
# when it connects, where a wrong one reads as an outage: `relay run` would wait forever.
LIBPQ_CHOICES: dict[str, tuple[tuple[str, ...], bool]] = {
    "sslmode": (("disable", "allow", "prefer", "require", "verify-ca", "verify-full"), False),
    "gssencmode": (("disable", "prefer", "require"), False),
    "channel_binding": (("disable", "prefer", "require"), False),
    "sslnegotiation": (("postgres", "direct"), False),
    "sslcertmode": (("disable", "allow", "require"), False),
    "load_balance_hosts": (("disable", "random"), False),
    "target_session_attrs": (
        ("any", "read-write", "read-only", "primary", "standby", "prefer-standby"),
        True,
    ),
    "ssl_min_protocol_version": (("TLSv1", "TLSv1.1", "TLSv1.2", "TLSv1.3"), True),
    "ssl_max_protocol_version": (("TLSv1", "TLSv1.1", "TLSv1.2", "TLSv1.3"), True),
}
# Parameters libpq reads as an integer (seconds, counts); ports are checked on their own.
LIBPQ_INTEGERS = frozenset(
    {
        "connect_timeout",
        "keepalives",
        "keepalives_idle",
        "keepalives_interval",
        "keepalives_count",
        "tcp_user_timeout",
    }
)


def _libpq_value_problem(parts: Mapping[str, Any]) -> str | None:
    """What libpq would refuse when connecting, in the parameters it parsed: a value outside a
    parameter's fixed set, an integer parameter that is not one, a port outside 1 to 65535.
    None of these values is a secret: each is named with its parameter. An empty value is
    left to libpq, as if unset."""
    for key, (choices, any_case) in LIBPQ_CHOICES.items():
        value = parts.get(key)
        if not value:
            continue
        known = [c.lower() for c in choices] if any_case else list(choices)
        if (str(value).lower() if any_case else str(value)) not in known:
            return f"{key}={value!r} is not one of libpq's values: {', '.join(choices)}"
    for key in sorted(LIBPQ_INTEGERS & parts.keys()):
        if str(parts[key]).strip() and not str(parts[key]).strip().lstrip("-").isdigit():
            return f"{key}={parts[key]!r} is not an integer"
    for port in str(parts.get("port") or "").split(","):
        if port.strip() and not 1 <= int(port) <= 65535:
            return f"port {port.strip()} is not from 1 to 65535"
    return None


def _unknown_parameter(text: str) -> str | None:
    """Which parameter of a database URL or conninfo libpq does not know (`sslmod=`,
    `pasword=`), with the one it resembles; None when there is none or when the name might be
    a password's part (what follows is never named)."""
    from psycopg import pq

    known = sorted(option.keyword.decode() for option in pq.Conninfo.get_defaults())
    names = _parameter_names(text)
    if _SCHEME_RE.match(text) is None and not set(names) & set(known):
        return None  # no known name: not evidently a conninfo (a password given as the URL?)
    for before, name in zip([None, *names], names, strict=False):
        if name in known or name == "ssl":  # a URL's ?ssl=true, libpq's alias of sslmode
            continue
        if before in ("password", "sslpassword"):
            return None  # the password's rest, after a blank or an unencoded '&'?
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return f"libpq has no parameter {name!r}{hint}"
    return None


def _parameter_names(text: str) -> list[str]:
    """The parameter names of a key=value conninfo, or of a database URL's query: its part
    after the first '?' that follows the last '@', so that no part of a password is taken for
    one, whatever it holds unencoded ('?', '&', '/': the query libpq read may then be the
    password's rest, and none is found)."""
    scheme = _SCHEME_RE.match(text)
    if scheme is None:
        return _CONNINFO_NAME_RE.findall(text)
    query = text[scheme.end() :].rpartition("@")[2].partition("?")[2]
    return _QUERY_NAME_RE.findall(query)


def _url_hint(text: str) -> str:
    """What is likely wrong with a database URL that does not parse, without quoting it."""
    stripped = text.strip()
    if stripped != text or stripped.startswith("\ufeff"):
        return ": it starts or ends with blanks or a byte-order mark"
    if "://" not in text and "=" not in text and "@" in text:
        return ": it has no scheme (postgresql://)"
    return ""


def _ingress_token(text: str) -> Secret:
    token = text.strip()
    if any(not " " <= c <= "~" for c in token):
        # An HTTP client refuses such a header value, quoting it in its error.
        raise ValueError(
            "must be one line of printable ASCII (the value is not shown: it is a secret)"
        )
    return Secret(token)


MIN_SIGNING_KEY_BYTES = 24


def _signing_secrets(text: str) -> tuple[Secret, ...]:
    out = []
    for item in text.replace(",", " ").split():
        if not item.startswith("whsec_"):
            raise ValueError("each secret must start with whsec_ (Standard Webhooks)")
        import base64
        import binascii

        try:
            key = base64.b64decode(item[len("whsec_") :], validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("a whsec_ secret must be base64 after the prefix") from None
        if len(key) < MIN_SIGNING_KEY_BYTES:
            # An empty or tiny HMAC key is one anyone can guess: forged signatures.
            raise ValueError(
                f"a whsec_ key must be at least {MIN_SIGNING_KEY_BYTES} bytes after base64 "
                f"decoding (Standard Webhooks: 24 to 64), got {len(key)}"
            )
        out.append(Secret(item))
    return tuple(out)


def _ca_file(text: str) -> str:
    """A PEM file of CA certificates the ingress's certificate must chain to (instead of the
    system's): loaded once here so a missing or broken file fails at start."""
    try:
        ssl.create_default_context(cafile=text)
    except FileNotFoundError:
        raise ValueError(f"{text!r} does not exist") from None
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"{text!r} is not a readable PEM file of CA certificates: {exc}") from None
    return text


def _ui_token(text: str) -> Secret:  # a guessable token is no lock: `openssl rand -hex 16`
    if len(text.strip()) < 16:
        raise ValueError("must be at least 16 characters")
    return Secret(text.strip())


def _addr(text: str) -> str:
    _host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"must be HOST:PORT, got {text!r}")
    return text


PARSERS: dict[str, Callable[[str], Any]] = {
    "database_url": _database_url,
    "ingress_url": _ingress_template,
    "listen_database_url": _database_url,
    "schema": validate_schema_name,
    "ingress_batch_url": _batch_template,
    "ingress_token": _ingress_token,
    "signing_secret": _signing_secrets,
    "ingress_ca_file": _ca_file,
    "http_transport": _http_transport,
    "http2": _boolean,
    "ingress_keepalive": _keepalive,
    "event_loop": _choice("auto", "uvloop", "asyncio"),
    "ingress_proxy": _proxy_url,
    "batch_size": _int_in(1, 10_000),
    "lease_ttl": _duration_in(1.0, 3600.0),
    "concurrency": _int_in(1, 1024),
    "critical_concurrency": _int_in(1, 256),
    "post_limit": _choice("adaptive", "fixed"),
    "claim_runs": _int_in(1, 1000),
    "max_batch_bytes": _bytes_in(1024, 1024**3),
    "max_lane_bytes": _bytes_in(1024, 64 * 1024**3),
    "poll_interval": _duration_in(0.01, 3600.0),
    "http_timeout": _duration_in(0.05, 600.0),
    "max_backoff": _duration_in(0.1, 86400.0),
    "shutdown_timeout": _duration_in(0.0, 3600.0),
    "startup_timeout": _duration_in(0.0, 7 * 86400.0),
    "server_connections": _int_in(0, 100_000),
    "retention": _duration_in(0.0, 365 * 86400.0),
    "statement_timeout": _duration_in(0.1, 600.0),
    "metrics_addr": _addr,
    "ui_token": _ui_token,
    "log_format": _choice("json", "text"),
    "log_level": _choice("debug", "info", "warning", "error"),
    "replica_id": lambda t: t,
}

REQUIRED = ("database_url", "ingress_url")


class Subcommands(Protocol):
    """What argparse's `add_subparsers()` returns, as far as registering a command needs it (its
    class is a private name of argparse's): relay/ops/checks.py and relay/ops/commands.py."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...


def env_name(option: str) -> str:
    return f"RELAY_{option.upper()}"


def flag_name(option: str) -> str:
    return "--" + option.replace("_", "-")


# RELAY_* variables the project's own tests and tools read (tests/, scripts/, relay bench): not
# options of `relay run`, yet no typo either.
TOOL_VARIABLES = frozenset(
    {
        "RELAY_TEST_DATABASE_URL",
        "RELAY_FAULTS_FAILOVERS",
        "RELAY_FAULTS_REPORT",
        "RELAY_FAULTS_SCALE",
        "RELAY_FAULTS_SOAK_SECONDS",
        "RELAY_UPGRADE_SECONDS",
        "RELAY_UI_SCREENSHOT",
    }
)


# The list form of the database (relay/databases.py, issue 51): read beside the options.
LIST_VARIABLES = frozenset({"RELAY_DATABASES", "RELAY_DATABASES_FILE"})


def option_variables() -> frozenset[str]:
    """Every RELAY_* variable an option is read from: RELAY_<NAME>, and RELAY_<NAME>_FILE of
    the secrets; and the list form's two."""
    names = {env_name(o) for o in PARSERS}
    return frozenset(names | {env_name(o) + "_FILE" for o in SECRET_OPTIONS} | LIST_VARIABLES)


def unknown_variables(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """The RELAY_* variables no option is read from, each with the option variable its name
    is closest to (a typo's likely intent), or None."""
    known = option_variables()
    out: list[tuple[str, str | None]] = []
    for name in sorted(environ):
        if name.startswith("RELAY_") and name not in known and name not in TOOL_VARIABLES:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
            out.append((name, close[0] if close else None))
    return out


def unknown_variables_warning(unknown: Sequence[tuple[str, str | None]]) -> str:
    """One line naming them. A warning, not an error: during a rolling upgrade a unit file
    may already set an option this (older) relay does not have (docs/operations.md)."""
    named = ", ".join(f"{n} (did you mean {m}?)" if m else n for n, m in unknown)
    return f"ignored, no option of this relay reads them: {named}"


def _raw_value(
    option: str, flags: Mapping[str, str | None], environ: Mapping[str, str]
) -> str | None:
    """Flag, then RELAY_<NAME>, then (secrets) RELAY_<NAME>_FILE, then systemd credentials."""
    value = flags.get(option)
    if value is not None:
        return value
    value = environ.get(env_name(option))
    if value is not None:
        return value
    found = secret_file(option, flags, environ)
    return None if found is None else _read_secret(*found)


def secret_file(
    option: str, flags: Mapping[str, str | None], environ: Mapping[str, str]
) -> tuple[Path, str] | None:
    """The file a secret option is read from, and how it was named: RELAY_<NAME>_FILE, else
    systemd's $CREDENTIALS_DIRECTORY/<name>; None when a flag or RELAY_<NAME> gives the value
    (or the option is no secret, or no file is named)."""
    if option not in SECRET_OPTIONS or flags.get(option) is not None:
        return None
    if environ.get(env_name(option)) is not None:
        return None
    path = environ.get(env_name(option) + "_FILE")
    if path:
        return Path(path), f"{env_name(option)}_FILE"
    creds = environ.get("CREDENTIALS_DIRECTORY")
    if creds and (cred := Path(creds) / option).is_file():
        return cred, f"{option} (CREDENTIALS_DIRECTORY)"
    return None


def open_to_others(mode: int, owner: int, euid: int) -> bool:
    """Whether a secret file's mode lets users other than the relay's read or change it, by
    libpq's rule for a client key (`sslkey`): none of group's or others' bits when the relay's
    user owns it; group read alone allowed when another user (root) does, which is how a
    secret manager hands a file to a service's group (Kubernetes' `defaultMode: 0440` with
    `fsGroup`); others' bits never."""
    if mode & stat.S_IRWXO:
        return True
    if owner == euid:
        return bool(mode & stat.S_IRWXG)
    return bool(mode & (stat.S_IWGRP | stat.S_IXGRP))


def exposed_secret_files(
    options: Sequence[str], flags: Mapping[str, str | None], environ: Mapping[str, str]
) -> list[tuple[str, Path, int]]:
    """Each secret file these options are read from that is open to others (`open_to_others`):
    its source (RELAY_<NAME>_FILE, ...), path and permission bits; with `database_url`, the list
    form's RELAY_DATABASES_FILE too. A file that cannot be read is left to `load` (or the list's
    parser), which refuses it."""
    named = [found for option in options if (found := secret_file(option, flags, environ))]
    # The list form's file holds every database's URL, passwords included (issue 51).
    if "database_url" in options and (listed := environ.get("RELAY_DATABASES_FILE")):
        named.append((Path(listed), "RELAY_DATABASES_FILE"))
    out = []
    for path, source in named:
        try:
            st = path.stat()
        except OSError:
            continue
        if open_to_others(st.st_mode, st.st_uid, os.geteuid()):
            out.append((source, path, stat.S_IMODE(st.st_mode)))
    return out


def exposed_secret_file_warning(source: str, path: Path, mode: int) -> str:
    """One line naming the file and its mode. A warning, not a refusal (docs/configuration.md):
    Kubernetes mounts a Secret's files 0644 unless told otherwise, and a relay that refused
    them would not start on a default install."""
    return (
        f"{source}: {path} has mode {mode:04o}: other users can read it or change it; make it "
        "0600 or 0400 (0440 owned by root for a service's group)"
    )


def _read_secret(path: Path, source: str) -> str:
    # Neither error may carry the file's content: UnicodeDecodeError's message quotes a byte.
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: cannot read {path}: not UTF-8 text") from None


def option_value(
    option: str, flags: Mapping[str, str | None], environ: Mapping[str, str]
) -> Any | None:
    """One option read and parsed the way `load` does (flag, environment, secret file,
    credentials), for commands that need only it (`relay sink --signing-secret`)."""
    raw = _raw_value(option, flags, environ)
    if raw is None:
        return None
    try:
        return PARSERS[option](raw)
    except ValueError as exc:
        raise ConfigError(f"{option} ({flag_name(option)} / {env_name(option)}): {exc}") from None


def load(flags: Mapping[str, str | None], environ: Mapping[str, str] | None = None) -> Settings:
    """Build Settings from parsed flags (option name -> raw string or None) and the environment."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for option, parse in PARSERS.items():
        raw = _raw_value(option, flags, env)
        if raw is None:
            if option in REQUIRED:
                raise ConfigError(
                    f"{option}: required; set {flag_name(option)} or {env_name(option)}"
                )
            continue
        try:
            values[option] = parse(raw)
        except ValueError as exc:
            raise ConfigError(
                f"{option} ({flag_name(option)} / {env_name(option)}): {exc}"
            ) from None
    settings = Settings(**values)
    return _check_relations(settings)


def _check_relations(s: Settings) -> Settings:
    from relay.core.policy import lease_margin

    if s.lease_ttl <= s.http_timeout + lease_margin(s.lease_ttl):
        raise ConfigError(
            f"lease_ttl ({s.lease_ttl:g}s) must exceed http_timeout ({s.http_timeout:g}s) plus its "
            f"safety margin ({lease_margin(s.lease_ttl):g}s): raise lease_ttl or lower http_timeout"
        )
    if s.max_lane_bytes < s.max_batch_bytes:
        raise ConfigError(
            f"max_lane_bytes ({s.max_lane_bytes}) must be at least max_batch_bytes "
            f"({s.max_batch_bytes}): a lane must hold one whole batch"
        )
    return s


def describe(s: Settings) -> dict[str, Any]:
    """The settings as printable values, secrets masked (for `relay check` and logs)."""
    out: dict[str, Any] = {}
    for f in fields(s):
        value = getattr(s, f.name)
        if f.name in SECRET_OPTIONS:
            if f.name in ("database_url", "listen_database_url", "ingress_proxy") and value:
                value = redact_url(value.reveal())
            elif value:
                value = "***"
            else:
                value = None
        elif f.name in ("ingress_url", "ingress_batch_url") and value is not None:
            value = redact_url(value)  # userinfo in an http URL is a credential too
        out[f.name] = value
    return out
