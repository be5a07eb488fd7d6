"""The delivery pipeline: from a due run in the outbox to its events acknowledged (DESIGN §4.2,
§5, §6). Each lane is three parts, as River's producer, job executor and completer
(docs/architecture.md), and a claim moves down them in this order:

- fetch: lane.py (claims, hand-over of terminal runs), discovery.py (the ordinary lane's claims
  of due work: which class first, how many, the spacing of empty passes), targets.py (the
  critical lane's claims by id of targeted terminals), holdings.py (what a lane holds), wake.py
  (the coalescing wake-up);
- the POST turn: deliveries.py (a lane's delivery tasks: turn, POST, results, hand-back),
  post_turn.py (a slot of the lane's, then a permit of the replica's), slots.py;
- execute: execute.py (widen, renew, POST, quick retries; one `Outcome` per run; writes
  nothing), bookkeeping.py (the tries' retry budget and limit samples), renewal.py, retries.py;
- complete: complete.py (the one writer of results), ack.py (grouped acks), release.py (the
  fenced writes that give a claim back), narrowing.py (finding a poison event), pause.py (the
  pause gate); stats.py counts each part's work.

It may import the edges, relay/admission/, relay/core/, settings and logs; never serving, the
runner, the operator tools or the tools wing (pyproject.toml, `[tool.importlinter]`).
"""
