"""A lane's deliveries, beside its discovery (issue 42 item 5): for each single claim or
multi-run group the lane holds, its turn to POST (relay/delivery/post_turn.py: the lane's slots, the
replica's permits, critical first), the POST (relay/delivery/execute.py, which renews the leases
while they are on the wire), the results (relay/delivery/complete.py, the one writer of them), and
whatever is left unsettled handed back (DESIGN §4.2-4.3).

The arrows go one way: a delivery calls the three parts, the completer reads the executor's
outcomes, and the lane reads a delivery's end only through the two callbacks it gave: a claim
settled (`settled`, the lane may claim again) and critical work done (`critical_done`, the
lane looks for more at once).

The deliveries run in the lane's delivery tasks (`Deliveries`), kept and reused rather than
started per claim, beside the ack group and the renewer that serve them, in one task group that
lives as long as the lane's loop. The lane asks it to start a delivery, and waits for the claims
it holds to settle when it stops.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
from anyio.abc import TaskGroup

from relay import logs
from relay.admission.retry_budget import RetryBudget
from relay.core import clock
from relay.core.policy import Poison
from relay.delivery.complete import Completer
from relay.delivery.execute import Executor, LeaseLost, Outcome
from relay.delivery.holdings import Holdings
from relay.delivery.post_turn import NO_TURN, PostTurn, Slot, Turn
from relay.delivery.stats import CompleteStats, ExecuteStats
from relay.delivery.wake import Wake
from relay.edges.ingress import IngressClient
from relay.edges.store import AckResult, Held, Store
from relay.edges.tracing import NO_TRACING, Tracer
from relay.settings import Settings


@dataclass(frozen=True)
class Wiring:
    """What a lane's deliveries are wired to beyond the lane (by the runner): the ingress client
    they POST with, the tracer of their spans, the replica's retry budget (None: unbudgeted), and
    the runner's observers of the ingress's readiness (the completer's misconfigured gate) and of
    each ack. The lane hands it to its deliveries as it is."""

    ingress: IngressClient
    tracer: Tracer = NO_TRACING
    budget: RetryBudget | None = None
    on_ready_change: Callable[[bool], None] = lambda ok: None
    observe_ack: Callable[[AckResult], None] = lambda result: None


class Delivery:
    """One per lane: `run(holds)` in one of the lane's delivery tasks per claim or group."""

    def __init__(
        self,
        name: str,
        post_turn: PostTurn,
        executor: Executor,
        completer: Completer,
        holdings: Holdings,
        *,
        settled: Callable[[], None],
        critical_done: Callable[[], None],
    ) -> None:
        self.name = name
        self.post_turn = post_turn
        self.executor = executor
        self.completer = completer
        self.holdings = holdings
        self.settled = settled
        self.critical_done = critical_done

    async def run(self, holds: list[Held]) -> None:
        """One delivery task's job: a turn to POST these claims, their delivery, and whatever
        is left unsettled handed back."""
        turn = NO_TURN
        settled: dict[str, bool] = {}
        try:
            turn = await self.post_turn.take(holds)
            if turn.slot is Slot.POSTING:
                settled = await self._deliver(holds, turn)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            self._error(holds, exc)
        finally:
            for h in holds:
                self.holdings.drop(h)
            if turn.slot is not Slot.HANDED_OFF:  # else the critical lane owns the claim now
                await self._let_go(holds, settled, turn)
            self.settled()

    async def _let_go(self, holds: list[Held], settled: dict[str, bool], turn: Turn) -> None:
        """After a delivery job: hand back the leases it left unsettled, free its turn if it
        took one and still holds it, and wake discovery after critical work."""
        critical_work = self.name == "critical" or _any_critical(holds)
        for h in holds:
            if not settled.get(h.claim.run_id):
                await self.completer.hand_back(h.claim)  # as widened, if it was
        self.post_turn.done(holds)
        turn.free()
        if critical_work:
            self.critical_done()

    def _error(self, holds: list[Held], exc: Exception) -> None:
        if len(holds) == 1:
            who = self.completer.who(holds[0].claim)
            logs.error("delivery_error", **who, error=logs.error_text(exc, 300))
        else:
            logs.error(
                "delivery_error", lane=self.name, runs=len(holds), error=logs.error_text(exc)
            )

    def _abandoned(self, holds: list[Held], in_flight: float) -> None:
        """The POST was cut short (the lane's deliveries cancelled once `shutdown_timeout`
        ran out, the ingress still silent): its answer is never read, so nothing is acked or
        counted as an attempt, and `run()` hands the leases back at once (`next`), so another
        replica, or this one restarted, sends the runs again. The one line that says so."""
        if len(holds) == 1:
            who = self.completer.who(holds[0].claim)
        else:
            runs = [h.claim.run_id for h in holds]
            who = {"lane": self.name, "runs": len(runs), "run_ids": runs}
        logs.warning("post_abandoned", **who, in_flight_s=round(in_flight, 3), next="hand_back")

    async def _deliver(
        self, holds: list[Held], turn: Turn, *, free_early: bool = True
    ) -> dict[str, bool]:
        """Execute, then complete: the executor POSTs the claims (one, or a group in one
        request) and the completer writes what each run's outcome means. Returns, per run,
        whether its lease was settled. The turn is given back early, once only the acks are
        left (`free_early`), and told of every answer."""
        began = clock.now()
        try:
            outcomes = await self.executor.execute(holds, turn.answered)
        except anyio.get_cancelled_exc_class():
            self._abandoned(holds, clock.now() - began)
            raise
        if len(holds) > 1 and _refused_whole(posted := _posted(outcomes)):
            return await self._send_alone(outcomes, posted, turn)
        if free_early and _only_acks_left(outcomes):
            # Pipelining: the ingress has answered and nothing but the (grouped) acks is left,
            # so the next claim's POST need not wait for their commit. The runs stay claimed
            # (and their leases fenced) until the acks settle them.
            turn.free()
        return await self.completer.carry(outcomes)

    async def _send_alone(
        self, outcomes: list[Outcome], posted: list[Outcome], turn: Turn
    ) -> dict[str, bool]:
        """One refusal of a whole multi-run request does not say which run (if any) is poison:
        each run is sent alone to `ingress_url`, in this slot, and only its own answer decides."""
        lost = [o for o in outcomes if isinstance(o.decision, LeaseLost)]
        settled = await self.completer.carry(lost) if lost else {}
        refusal = posted[0].decision
        assert isinstance(refusal, Poison)
        logs.warning(
            "batch_refused", lane=self.name, runs=len(posted), status=refusal.status,
            error=refusal.excerpt[:300],
        )  # fmt: skip
        for outcome in posted:
            settled |= await self._deliver([outcome.held], turn, free_early=False)
        return settled


class Deliveries:
    """One per lane: the tasks its deliveries run in, kept and reused (`start(holds)`), in a
    task group opened for the lane's loop (`running()`) with the ack group and the renewer, and
    the wait for the claims held to settle when the lane stops (`finish()`)."""

    def __init__(
        self,
        name: str,
        settings: Settings,
        store: Store,
        post_turn: PostTurn,
        holdings: Holdings,
        wiring: Wiring,
        *,
        settled: Callable[[], None],
        critical_done: Callable[[], None],
    ) -> None:
        # The lane's executor POSTs (relay/delivery/execute.py) and its completer writes what
        # the answers mean (relay/delivery/complete.py); its delivery calls both, in that order.
        self.executor = Executor(
            settings,
            store,
            wiring.ingress,
            ExecuteStats(),
            lane=name,
            tracer=wiring.tracer,
            budget=wiring.budget,
        )
        self.completer = Completer(
            name,
            settings,
            store,
            CompleteStats(),
            resend=self.executor.resend,
            on_ready_change=wiring.on_ready_change,
            observe_ack=wiring.observe_ack,
            observe=wiring.tracer.observe,
        )
        self.delivery = Delivery(
            name,
            post_turn,
            self.executor,
            self.completer,
            holdings,
            settled=settled,
            critical_done=critical_done,
        )
        self.holdings = holdings
        self._tasks: TaskGroup | None = None
        self._idle_runners = 0  # delivery tasks waiting for their next claim (see start)

    @property
    def started(self) -> bool:
        """The task group is open (or was, the lane's loop having ended): deliveries may start."""
        return self._tasks is not None

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The delivery tasks, the ack group and the renewer, for as long as the body (the lane's
        loop) runs. They are cancelled when the body ends: it calls `finish()` last, so that the
        claims held settle first."""
        self._jobs, self._job_queue = anyio.create_memory_object_stream[list[Held]](math.inf)
        with self._jobs, self._job_queue:
            async with anyio.create_task_group() as tasks:
                self._tasks = tasks
                tasks.start_soon(self.delivery.completer.run)  # the ack group
                tasks.start_soon(self.delivery.executor.run)  # the renewer
                yield
                tasks.cancel_scope.cancel()

    def start(self, holds: list[Held]) -> None:
        """`Delivery.run(holds)` in one of the lane's delivery tasks, kept and reused: a task
        started per claim cost more than the claim's own bookkeeping (docs/performance.md)."""
        if self._idle_runners:
            self._idle_runners -= 1
            self._jobs.send_nowait(holds)  # handed to a runner waiting in receive()
        else:
            assert self._tasks is not None
            self._tasks.start_soon(self._runner, holds)

    async def _runner(self, holds: list[Held]) -> None:
        while True:
            await self.delivery.run(holds)
            self._idle_runners += 1  # counted before waiting: start() hands it the next job
            holds = await self._job_queue.receive()

    async def finish(self, within: float, settled: Wake) -> None:
        """Once the lane stops: wait at most `within` seconds for every claim held, current or
        superseded, to settle; woken by `settled`, which the lane sets as each one does."""
        with anyio.move_on_after(within):
            while self.holdings.unsettled():
                await settled.wait(0.05)


def _posted(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if not isinstance(o.decision, LeaseLost)]


def _only_acks_left(outcomes: list[Outcome]) -> bool:
    """Every run that was POSTed had its whole batch accepted (and one was)."""
    posted = False
    for o in outcomes:  # a loop, not all(): once per POST
        if isinstance(o.decision, LeaseLost):
            continue
        if not o.accepted_whole:
            return False
        posted = True
    return posted


def _any_critical(holds: list[Held]) -> bool:
    for h in holds:  # a loop, not any(): once per POST
        if h.claim.critical:
            return True
    return False


def _refused_whole(posted: list[Outcome]) -> bool:
    """A multi-run request refused as a whole (not run by run in a 2xx reply)."""
    return bool(posted) and posted[0].whole and isinstance(posted[0].decision, Poison)
