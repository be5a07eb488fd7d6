"""The edges: every adapter between the relay and what it talks to, each behind a narrow
interface (DESIGN §4, §5).

The database: store.py (the only way to the outbox tables: the SQL API's calls, one round trip
each, values in and values out; its statements by name in statements.py), listening.py and
listener.py (the LISTEN connection that stays up, and the relay's wakes and liveness lock on
it). The ingress: http_client.py (the one `httpx.AsyncClient`) and ingress.py (the POST: body,
headers, signature, deadlines, answers split per run). Tracing: tracing.py (the port;
relay/integrations/ holds its OpenTelemetry implementation). The edges may import
relay/core/, relay/admission/, settings, names and logs; nothing of the delivery pipeline,
serving or the runner above them.
"""
