"""The status page's HTTP side: which paths are its, the optional `ui_token`, and turning the
data layer's documents into responses. relay/health.py serves it on `metrics_addr` next to
/metrics, /healthz and /readyz (which stay open to probes)."""

from __future__ import annotations

import hmac
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlencode

import orjson
import psycopg

from relay import logs
from relay.settings import Secret
from relay.ui import page
from relay.ui.assets import CSP
from relay.ui.data import (
    BLOCKED_PAGE,
    RUN_EVENTS_PAGE,
    Data,
    build_report,
    ingress_state,
    shape_status,
)
from relay.ui.series import LagWindow, RateSeries
from relay.ui.view import status_view

if TYPE_CHECKING:
    from relay.lane import LaneView

COOKIE = "relay_ui_token"
HTML = "text/html; charset=utf-8"
JSON = "application/json"
TEXT = "text/plain; charset=utf-8"
MAX_OFFSET = 10_000


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    target: str  # as sent: path and query, percent-encoded
    headers: Mapping[str, str]  # lower-case names; repeated headers joined with ", " ("; " cookie)

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    @property
    def query(self) -> dict[str, str]:
        _, _, q = self.target.partition("?")
        return {k: v[-1] for k, v in parse_qs(q, keep_blank_values=True).items()}


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


# -- pure: the token ------------------------------------------------------------------------------


def same(given: str, token: str) -> bool:
    return hmac.compare_digest(given.encode(), token.encode())


def cookie_value(header: str, name: str) -> str | None:
    for part in header.split(";"):
        key, sep, value = part.strip().partition("=")
        if sep and key == name:
            return value.strip().strip('"')
    return None


def authorized(token: Secret | None, request: Request) -> bool:
    """No token configured, or the request carries it as a Bearer token or in the cookie."""
    if token is None:
        return True
    secret = token.reveal()
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and same(given.strip(), secret):
        return True
    from_cookie = cookie_value(request.headers.get("cookie", ""), COOKIE)
    return from_cookie is not None and same(from_cookie, secret)


def _offset(query: Mapping[str, str]) -> int:
    try:
        return min(max(int(query.get("offset", "0")), 0), MAX_OFFSET)
    except ValueError:
        return 0


def _html_headers() -> tuple[tuple[str, str], ...]:
    return (
        ("content-security-policy", CSP),
        ("x-content-type-options", "nosniff"),
        ("x-frame-options", "DENY"),
        ("referrer-policy", "no-referrer"),
    )


def _json(doc: Any, status: int = 200) -> Response:
    body = orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS) + b"\n"
    return Response(status, JSON, body, (("x-content-type-options", "nosniff"),))


def _html(status: int, body: bytes) -> Response:
    return Response(status, HTML, body, _html_headers())


class StatusPage:
    """The page's state in this process: the rate series (fed by `report`) and the ingress
    history behind "recovering"."""

    def __init__(
        self, data: Data, *, replica_id: str, token: Secret | None, refresh_seconds: float = 3.0
    ) -> None:
        self.data = data
        self.replica_id = replica_id
        self.token = token
        self.refresh_seconds = refresh_seconds
        self.series = RateSeries()
        self.last_misconfigured: float | None = None
        self._report_failing = False

    @staticmethod
    def handles(path: str) -> bool:
        return path == "/" or path.startswith(("/api/", "/runs/"))

    # -- the report (from the health probe loop) -------------------------------------------------

    async def report(self, lanes: Iterable[LaneView], lag: Mapping[str, LagWindow]) -> None:
        """Write this replica's report and sample the fleet's delivered counts into the rate
        series. Failures are logged once until the next success: the probe reports the
        database's reachability already."""
        now = time.monotonic()
        views = list(lanes)
        misconfigured = any(v.misconfigured for v in views)
        if misconfigured:
            self.last_misconfigured = now
        state = ingress_state(misconfigured, self.last_misconfigured, now)
        quantiles = {lane: w.quantiles(now) for lane, w in lag.items()}
        try:
            counts = await self.data.report(self.replica_id, build_report(views, state, quantiles))
        except (psycopg.Error, OSError, TimeoutError) as exc:
            if not self._report_failing:
                logs.warning("replica_report_failed", error=logs.error_text(exc))
            self._report_failing = True
            return
        self._report_failing = False
        self.series.add(time.monotonic(), counts)

    # -- HTTP ----------------------------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        if request.method not in ("GET", "HEAD"):
            return Response(405, TEXT, b"method not allowed (the status page is read-only)\n")
        query = request.query
        if self.token is not None and "token" in query:
            return self._login(request, query)
        if not authorized(self.token, request):
            return Response(
                401,
                TEXT,
                b"unauthorized: send Authorization: Bearer <ui_token> or open /?token=<ui_token>\n",
                (("www-authenticate", 'Bearer realm="ledger-relay"'),),
            )
        try:
            return await self._route(request.path, query)
        except psycopg.errors.NoDataFound:
            return self._not_found(request.path)
        except (psycopg.Error, OSError, TimeoutError) as exc:
            logs.warning("status_page_failed", error=logs.error_text(exc))
            text = "the database did not answer: see /readyz and the relay's logs"
            if request.path.startswith("/api/"):
                return _json({"error": text}, 503)
            return _html(503, page.message_page(503, text))

    def _login(self, request: Request, query: Mapping[str, str]) -> Response:
        """`?token=` that matches: set the cookie and redirect to the same page without the
        token in its URL (so it stays out of history and referrers); otherwise 401."""
        assert self.token is not None
        if not same(query["token"], self.token.reveal()):
            return Response(401, TEXT, b"unauthorized: wrong token\n")
        rest = {k: v for k, v in query.items() if k != "token"}
        location = request.path + ("?" + urlencode(rest) if rest else "")
        cookie = f"{COOKIE}={self.token.reveal()}; HttpOnly; SameSite=Strict; Path=/"
        return Response(303, TEXT, b"see other\n", (("location", location), ("set-cookie", cookie)))

    def _not_found(self, path: str) -> Response:
        if path.startswith("/api/"):
            return _json({"error": "no such run"}, 404)
        return _html(404, page.message_page(404, "No such run."))

    async def status(self, offset: int = 0) -> dict[str, Any]:
        """What /api/status answers: the data plus the view the page shows (one statement)."""
        doc = await self.data.status(offset, BLOCKED_PAGE)
        data = shape_status(doc, self.series, time.monotonic(), self.replica_id)
        data["view"] = status_view(data)
        return data

    async def _route(self, path: str, query: Mapping[str, str]) -> Response:
        if path == "/":
            data = await self.status(_offset(query))
            return _html(200, page.status_page(data["view"], self.refresh_seconds, BLOCKED_PAGE))
        if path == "/api/status":
            return _json(await self.status(_offset(query)))
        for prefix in ("/runs/", "/api/runs/"):
            if path.startswith(prefix) and len(path) > len(prefix):
                run_id = unquote(path[len(prefix) :], errors="replace")
                try:
                    from_seq = max(int(query.get("from_seq", "1")), 1)
                except ValueError:
                    from_seq = 1
                doc = await self.data.run(run_id, from_seq, RUN_EVENTS_PAGE)
                if prefix == "/api/runs/":
                    return _json(doc)
                return _html(200, page.run_page(doc, RUN_EVENTS_PAGE))
        return self._not_found(path)
