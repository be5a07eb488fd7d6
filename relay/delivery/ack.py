"""Grouped acknowledgements (DESIGN §6): acks of batches that finish close together share one
transaction, so the NOTIFY commit lock is taken once per group rather than once per batch. Each
batch is still fenced by its own token inside the statement; a stale one changes nothing and
does not stop the others.

No timer: while one group's statement runs, the next group accumulates. An ack whose COMMIT
outcome is unknown (connection lost) is resolved by re-reading the rows, never by guessing, for
as long as the lease is trusted; one that did not commit is sent again then (the ingress has
the events: a redelivery would only be a duplicate, DESIGN §9.5).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
import psycopg

from relay import logs
from relay.core import clock
from relay.core.policy import backoff
from relay.edges.store import AckResult, Claim, Store


@dataclass
class _PendingAck:
    claim: Claim
    upto: int
    keep: bool
    done: anyio.Event = field(default_factory=anyio.Event)
    result: AckResult | None = None
    error: BaseException | None = None


class AckGroup:
    """One per lane, owned by its completer (relay/delivery/complete.py, the one writer of results):
    `ack()` from its delivery tasks, `run()` as a background task."""

    def __init__(self, store: Store, max_group: int = 64) -> None:
        self.store = store
        self.max_group = max_group
        self._send, self._recv = anyio.create_memory_object_stream[_PendingAck](10_000)
        self.groups = 0

    async def ack(self, claim: Claim, upto: int, *, keep: bool = False) -> AckResult:
        (result,) = await self.ack_many([(claim, upto, keep)])
        return result

    async def ack_many(self, items: list[tuple[Claim, int, bool]]) -> list[AckResult]:
        """Several acks at once (a multi-run POST's runs): queued together, so they share a
        group, without a task per run."""
        pending = [_PendingAck(claim, upto, keep) for claim, upto, keep in items]
        for item in pending:
            try:
                # Handed straight to the group task waiting for it: `send()` would first yield
                # to the event loop, a task step per ack for nothing.
                self._send.send_nowait(item)
            except anyio.WouldBlock:
                await self._send.send(item)  # 10,000 acks queued: wait for room
        for item in pending:
            await item.done.wait()
        results = []
        for item in pending:
            if item.error is not None:
                raise item.error
            assert item.result is not None
            results.append(item.result)
        return results

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            self.close()

    def close(self) -> None:
        self._send.close()
        self._recv.close()

    async def _run(self) -> None:
        while True:
            first = await self._recv.receive()
            group = [first]
            while len(group) < self.max_group:
                try:
                    group.append(self._recv.receive_nowait())
                except anyio.WouldBlock:
                    break
            try:
                results = await self.store.ack([(p.claim, p.upto, p.keep) for p in group])
            except (psycopg.Error, OSError, TimeoutError) as exc:
                # The outcome may be unknown (connection lost during COMMIT): find out by
                # re-reading the rows, never by guessing.
                logs.warning("ack_outcome_unknown", batches=len(group), error=logs.error_text(exc))
                for p in group:
                    await self._resolve(p, exc)
                continue
            except BaseException as exc:  # every waiter must hear about it
                for p in group:
                    p.error = exc
                    p.done.set()
                raise
            self.groups += 1
            for p, r in zip(group, results, strict=True):
                p.result = r
                p.done.set()

    async def _resolve(self, p: _PendingAck, cause: BaseException) -> None:
        """Find out whether an ack whose outcome is unknown committed, retrying the read while
        the database does not answer and the lease is trusted (a restart or a failover of the
        database takes seconds). One that did not commit is sent again, fenced by the claim's
        token as every ack is: it changes nothing if the lease moved on. So a POST answered
        while the database was away is acked when it is back, not delivered a second time.
        Never resolved while the lease is trusted: the lease is handed back or expires, and a
        redelivery is a duplicate at worst, never a loss."""
        attempt = 0
        while p.claim.trust.remaining(clock.now()) > 0:
            try:
                p.result = await self._reread_or_resend(p)
            except (psycopg.Error, OSError, TimeoutError):
                # No jitter: this is one replica re-reading its own rows, nobody to spread from.
                await anyio.sleep(backoff(attempt, base=0.1, cap=2.0, rand=0.0, jitter=0.0))
                attempt += 1
                continue
            p.done.set()
            return
        p.error = cause
        p.done.set()

    async def _reread_or_resend(self, p: _PendingAck) -> AckResult:
        run_id = p.claim.run_id
        if await self.store.ack_committed(run_id, p.upto):
            logs.info("ack_outcome_resolved", run_id=run_id, upto=p.upto, outcome="acked")
            return AckResult(run_id, "acked", 0, p.upto, None, None)
        logs.info("ack_outcome_resolved", run_id=run_id, upto=p.upto, outcome="not_committed")
        (result,) = await self.store.ack([(p.claim, p.upto, p.keep)])
        logs.info("ack_sent_again", run_id=run_id, upto=p.upto, outcome=result.status)
        return result
