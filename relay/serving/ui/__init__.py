"""The status page on `metrics_addr` (issue 17): read-only, served by `relay run` itself.

    GET /                    the page: lanes, rate chart, blocked runs, replicas
    GET /api/status          its data: `relay status --json` plus rate series, lag and reports
    GET /runs/<run_id>       one run: its events in seq order, lease, retry/skip commands
    GET /api/runs/<run_id>   its data

The package: series.py (pure: the in-process rate and lag windows), data.py (the two queries
and the replica report, one bounded statement each, and the pure shaping of their answers),
pool.py (the page's own database connection), coalesce.py (one query shared by many viewers),
page.py (HTML, every value through html.escape), assets.py (the inline CSS and script, which
writes data only through textContent), web.py (routing, who may see the page, ui_token),
fleet.py (a fleet's page: the list of its databases, up or down, and each database's page).
This package imports nothing of relay/tools.
"""
