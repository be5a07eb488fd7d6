"""The status page's HTTP side: which paths are its, who may see it, and turning the data
layer's documents into responses. relay/serving/health.py serves it on `metrics_addr` next to
/metrics, /healthz and /readyz (which stay open to probes).

Who may see it: with `ui_token` set, whoever sends the token; without one, everyone only when
`metrics_addr` listens on a loopback address (reached through an SSH tunnel or
`kubectl port-forward`), else nobody: a page bound to every interface with no token would show
the fleet to the whole network (issue 32, item 3; docs/operations.md §6a).

The cookie that `/?token=` sets carries `cookie_secret(token)`, an HMAC of the token, never
the token: a browser sends cookies to every port of the host (cookies ignore ports), so any
other service there sees it, and it must not hand over the token that `Authorization: Bearer`
and `/?token=` accept (issue 41). The cookie only opens this page; a token-valued cookie, as
set until 2026-12, opens nothing (its holder opens `/?token=` once more).

What it costs: the status document comes from one `ui_status()` that many viewers share
(relay/serving/ui/coalesce.py: kept `CACHE_SECONDS`, concurrent requests wait for the same fetch),
on the page's own connection (relay/serving/ui/pool.py), and each body made of it is shaped and
rendered once for all of them: a viewer in a tight loop costs the relay's event loop little more
than the HTTP exchange."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlencode

import anyio
import orjson
import psycopg

from relay import logs
from relay.serving.ui import page
from relay.serving.ui.assets import CSP
from relay.serving.ui.coalesce import Coalesced
from relay.serving.ui.data import (
    BLOCKED_PAGE,
    RUN_EVENTS_PAGE,
    Backlog,
    Data,
    backlog_figures,
    build_report,
    claimed_by_class,
    ingress_state,
    limit_figures,
    shape_status,
)
from relay.serving.ui.series import LagWindow, RateSeries
from relay.serving.ui.view import status_view
from relay.settings import Secret

if TYPE_CHECKING:
    from relay.admission.permits import AdmissionView
    from relay.admission.retry_budget import BudgetView
    from relay.delivery.lane import LaneView

COOKIE = "relay_ui_session"
# The cookie's value is HMAC-SHA256(token, COOKIE_LABEL): changing the label logs every viewer out.
COOKIE_LABEL = b"ledger-relay status page cookie v1"
# Every path of the page and of its script's requests (`StatusPage.handles`): "/", "/runs/",
# "/api/". A cookie path cannot leave out /metrics, /healthz and /readyz, which ignore it.
COOKIE_PATH = "/"
HTML = "text/html; charset=utf-8"
JSON = "application/json"
TEXT = "text/plain; charset=utf-8"
MAX_OFFSET = 10_000
CACHE_SECONDS = 1.5  # how long viewers share one `ui_status()` answer


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


def cookie_secret(token: str) -> str:
    """What the page's cookie carries for `token`: derived from it, never the token itself."""
    return hmac.new(token.encode(), COOKIE_LABEL, hashlib.sha256).hexdigest()


def session_cookie(token: str) -> str:
    """The Set-Cookie value of a login: the derived value, out of reach of the page's scripts
    (HttpOnly), sent on no request another site starts (SameSite=Strict)."""
    return f"{COOKIE}={cookie_secret(token)}; HttpOnly; SameSite=Strict; Path={COOKIE_PATH}"


def authorized(token: Secret | None, request: Request) -> bool:
    """No token configured, or the request carries it as a Bearer token, or the cookie carries
    its derived value."""
    if token is None:
        return True
    secret = token.reveal()
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and same(given.strip(), secret):
        return True
    from_cookie = cookie_value(request.headers.get("cookie", ""), COOKIE)
    return from_cookie is not None and same(from_cookie, cookie_secret(secret))


def serves_without_token(metrics_addr_host: str | None) -> bool:
    """Whether the page may be served without `ui_token`: only when `metrics_addr` listens on
    a loopback address. Any other name or address (or every interface) needs the token."""
    if metrics_addr_host is None:
        return False
    if metrics_addr_host == "localhost":
        return True
    try:
        return ipaddress.ip_address(metrics_addr_host).is_loopback
    except ValueError:
        return False


OFF_WITHOUT_TOKEN = (
    b"the status page is off: metrics_addr listens beyond loopback and no ui_token is set"
    b" (set ui_token, or listen on 127.0.0.1 and use a tunnel; /metrics, /healthz and /readyz"
    b" stay open)\n"
)


def gate(token: Secret | None, open_without_token: bool, request: Request) -> Response | None:
    """The answer to a request the page does not serve (a method other than GET and HEAD, a
    page that is off, a login, a request without the token), or None: it may be served."""
    if request.method not in ("GET", "HEAD"):
        return Response(405, TEXT, b"method not allowed (the status page is read-only)\n")
    if token is None and not open_without_token:
        return Response(403, TEXT, OFF_WITHOUT_TOKEN)
    query = request.query
    if token is not None and "token" in query:
        return _login(token, request, query)
    if not authorized(token, request):
        return Response(
            401,
            TEXT,
            b"unauthorized: send Authorization: Bearer <ui_token> or open /?token=<ui_token>\n",
            (("www-authenticate", 'Bearer realm="ledger-relay"'),),
        )
    return None


def _login(token: Secret, request: Request, query: Mapping[str, str]) -> Response:
    """`?token=` that matches: set the cookie and redirect to the same page without the token
    in its URL (so it stays out of history and referrers); otherwise 401."""
    if not same(query["token"], token.reveal()):
        return Response(401, TEXT, b"unauthorized: wrong token\n")
    rest = {k: v for k, v in query.items() if k != "token"}
    location = request.path + ("?" + urlencode(rest) if rest else "")
    cookie = session_cookie(token.reveal())
    return Response(303, TEXT, b"see other\n", (("location", location), ("set-cookie", cookie)))


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


_JSON_HEADERS = (("x-content-type-options", "nosniff"),)


def json_response(doc: Any, status: int = 200) -> Response:
    body = orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS) + b"\n"
    return Response(status, JSON, body, _JSON_HEADERS)


def html_response(status: int, body: bytes) -> Response:
    return Response(status, HTML, body, _html_headers())


class StatusPage:
    """The page's state in this process: the rate series (fed by `report`), the ingress
    history behind "recovering", and the status document its viewers share. `backlog` reads
    the backlog gauges' last refresh; `admission` and `retry_budget` this replica's POST turn
    (RelayView's), `fixed_limit` the POSTs the fixed limit allows; `open_without_token` is
    `serves_without_token`'s answer for `metrics_addr`; `lanes` this replica's lanes (for its
    claims by class); `database` the database's name in a fleet (relay/serving/ui/fleet.py),
    which its pages and their links carry (None: the one-database form)."""

    def __init__(
        self,
        data: Data,
        *,
        replica_id: str,
        token: Secret | None,
        refresh_seconds: float = 3.0,
        backlog: Callable[[], Backlog | None] = lambda: None,
        admission: Callable[[], AdmissionView | None] = lambda: None,
        retry_budget: Callable[[], BudgetView | None] = lambda: None,
        fixed_limit: int = 0,
        open_without_token: bool = True,
        lanes: Callable[[], Iterable[LaneView]] = lambda: (),
        database: str | None = None,
    ) -> None:
        self.data = data
        self.replica_id = replica_id
        self.token = token
        self.refresh_seconds = refresh_seconds
        self.backlog = backlog
        self.admission = admission
        self.retry_budget = retry_budget
        self.fixed_limit = fixed_limit
        self.open_without_token = open_without_token
        self.lanes = lanes
        self.database = database
        self.series = RateSeries()
        self.last_misconfigured: float | None = None
        self._report_failing = False
        # Shared by every viewer for CACHE_SECONDS: the document (one statement per page of
        # blocked runs) and each body made of it (shaped and rendered once, not per request).
        self.docs: Coalesced[int, dict[str, Any]] = Coalesced(
            lambda offset: self.data.status(offset, BLOCKED_PAGE), CACHE_SECONDS
        )
        self.bodies: Coalesced[tuple[str, int], bytes] = Coalesced(self._render, CACHE_SECONDS)

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
            doc = build_report(views, state, quantiles, self.admission(), self.retry_budget())
            counts = await self.data.report(self.replica_id, doc)
        except (psycopg.Error, OSError, TimeoutError) as exc:
            if not self._report_failing:
                logs.warning("replica_report_failed", error=logs.error_text(exc))
            self._report_failing = True
            return
        self._report_failing = False
        self.series.add(time.monotonic(), counts)

    # -- HTTP ----------------------------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        refused = gate(self.token, self.open_without_token, request)
        if refused is not None:
            return refused
        return await self.answer(request)

    async def answer(self, request: Request) -> Response:
        """The answer to a request `gate` let through."""
        try:
            return await self._route(request.path, request.query)
        except psycopg.errors.NoDataFound:
            return self._not_found(request.path)
        except (psycopg.Error, OSError, TimeoutError) as exc:
            logs.warning("status_page_failed", error=logs.error_text(exc))
            text = "the database did not answer: see /readyz and the relay's logs"
            if request.path.startswith("/api/"):
                return json_response({"error": text}, 503)
            return html_response(503, page.message_page(503, text))

    def _not_found(self, path: str) -> Response:
        if path.startswith("/api/"):
            return json_response({"error": "no such run"}, 404)
        return html_response(404, page.message_page(404, "No such run."))

    async def status(self, offset: int = 0) -> dict[str, Any]:
        """What /api/status answers: the shared document (at most one statement per
        CACHE_SECONDS), the lanes' totals from the backlog gauges, this replica's ingress limit
        and claims by class, and the view the page shows."""
        doc = await self.docs.get(offset)
        totals = backlog_figures(self.backlog(), doc.get("held_events"), anyio.current_time())
        data = shape_status({**doc, **totals}, self.series, time.monotonic(), self.replica_id)
        data["ingress_limit"] = limit_figures(
            self.admission(), self.retry_budget(), self.fixed_limit
        )
        data["claimed_by_class"] = claimed_by_class(self.lanes())
        if self.database is not None:  # a fleet's: the page and its links name it
            data["database"] = self.database
        data["view"] = status_view(data)
        return data

    async def _render(self, key: tuple[str, int]) -> bytes:
        """The body of `/` ("html") or `/api/status` ("json") at a blocked-runs offset."""
        kind, offset = key
        data = await self.status(offset)
        if kind == "html":
            return page.status_page(data["view"], self.refresh_seconds, BLOCKED_PAGE)
        return json_response(data).body

    async def _route(self, path: str, query: Mapping[str, str]) -> Response:
        if path == "/":
            return html_response(200, await self.bodies.get(("html", _offset(query))))
        if path == "/api/status":
            body = await self.bodies.get(("json", _offset(query)))
            return Response(200, JSON, body, _JSON_HEADERS)
        for prefix in ("/runs/", "/api/runs/"):
            if path.startswith(prefix) and len(path) > len(prefix):
                run_id = unquote(path[len(prefix) :], errors="replace")
                try:
                    from_seq = max(int(query.get("from_seq", "1")), 1)
                except ValueError:
                    from_seq = 1
                doc = await self.data.run(run_id, from_seq, RUN_EVENTS_PAGE)
                if prefix == "/api/runs/":
                    return json_response(doc)
                return html_response(200, page.run_page(doc, RUN_EVENTS_PAGE, self.database))
        return self._not_found(path)
