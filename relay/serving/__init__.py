"""Serving operators while the relay runs (DESIGN §8.2): what `metrics_addr` answers and what
systemd is told.

server.py (the small HTTP/1.1 server: one request per connection, bounded, guarded),
health.py (`/healthz`, `/readyz`, `/metrics` and the replica report), metrics.py (Prometheus,
`ledger_relay_*`), build.py (which build runs: the version and commit of `build_info` and
`relay --version`), sdnotify.py (systemd `Type=notify`), progress.py (the `RelayView` the runner
hands observers: they read values, never another part's attributes) and ui/ (the read-only
status page). It may import the delivery pipeline's views, the edges, relay/maintenance/ (the
schema version), relay/ops/ (its formatting), relay/admission/, relay/core/, settings and logs;
never the runner or the CLI.
"""
