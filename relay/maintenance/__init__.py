"""Schema management and upkeep: what changes the relay's schema and what prunes it.

migrate.py (`relay migrate`: numbered SQL files from schema/ applied in order under a lock,
functions re-applied on drift, the schema version read and judged), roles.py (the producer and
relay roles it grants, docs/security.md) and retention.py (the background task that prunes
delivered events off the delivery path, DESIGN §4.4). It may import the edges, relay/core/,
settings, names and logs; nothing of the delivery pipeline, serving or the runner.
"""
