"""What the operations side reads of a running relay (DESIGN §8.2).

`/healthz`, `/readyz` (relay/serving/health.py), the systemd watchdog (relay/serving/sdnotify.py)
and the metrics collector (relay/serving/metrics.py) are handed a `RelayView` at construction:
callables the runner binds over its own state, read when an observer asks. They never hold the
relay, its lanes or its listener, nor read their attributes ("observers hook in; they do not reach
in"), so none of them imports the runner and the runner imports them all.

Also here, pure: the liveness rule that /healthz and the watchdog share.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from relay.edges.listener import ListenerState
from relay.settings import Settings

if TYPE_CHECKING:
    from psycopg import sql

    from relay.admission.permits import AdmissionView
    from relay.admission.retry_budget import BudgetView
    from relay.delivery.lane import LaneView

SessionQuery = Callable[["sql.Composed", Sequence[Any]], Awaitable[list[tuple[Any, ...]]]]


# The LISTEN connection as observers see it: a copy of its state (up, reconnects, received, and
# while down since when and why, issue 51's fleet page), taken when one asks (`Listener.view`).
ListenerView = ListenerState


@dataclass(frozen=True, slots=True)
class RelayView:
    started: Callable[[], bool]  # every lane is running; false again once a stop is requested
    stop_requested: Callable[[], bool]
    wait_stop_requested: Callable[[], Awaitable[None]]
    lanes: Callable[[], Sequence[LaneView]]  # a snapshot of each lane
    listener: Callable[[], ListenerView | None]  # None until the listener is built
    ingress_ok: Callable[[], bool]  # the ingress is not answering "misconfigured"
    # One statement on the LISTEN session that holds the liveness lock: the replica report,
    # which the database takes only from that session (relay/edges/listener.py). None: no listener.
    on_liveness_session: SessionQuery | None = None
    # The POST turn's adaptive limit, its permits in flight and waiting per lane (None: the
    # fixed limit), and the retry budget (relay/delivery/post_turn.py,
    # relay/admission/retry_budget.py).
    admission: Callable[[], AdmissionView | None] = lambda: None
    retry_budget: Callable[[], BudgetView | None] = lambda: None


def stall_limit(s: Settings) -> float:
    """How long one turn of a lane's loop may legitimately take before the relay counts as
    stuck: a claim that waits for a pool connection (statement_timeout) and then for its round
    trip (statement_timeout + 2 s deadline), a failure backoff (at most 5 poll intervals) and a
    wait for a wake (one poll interval), plus slack. Generous on purpose: a false "stuck" gets
    the process killed."""
    return 2 * s.statement_timeout + 2.0 + 6 * s.poll_interval + 10.0


def loops_alive(turned_at: Sequence[float], since: float, now: float, limit: float) -> bool:
    """Every loop turned within `limit` seconds (a loop that has not turned yet counts from
    `since`, when the relay started serving)."""
    return all(now - max(t, since) <= limit for t in turned_at)
