"""Admission (issue 42, docs/admission.md): how many POSTs the replica may have in flight and
who may send one now, as pure logic with the monotonic clock passed in.

limit.py (the adaptive limit: AIMD against a windowed minimum round trip), permits.py (who may
POST under the limit: a critical reserve, critical waiters first; the POST turn's `Permits`,
relay/delivery/post_turn.py, is its anyio shell), retry_budget.py (retries a bounded share of
the POSTs served) and windows.py (the sliding minimum, maximum and sum under them). Like
relay/core/, it imports nothing of the relay outside itself: no I/O, no settings, no logs.
"""
