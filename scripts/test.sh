#!/usr/bin/env bash
# What CI runs, and what a developer runs: lint, format check, strict types, tests.
# Creates .venv and installs the project when needed. Arguments go to pytest.
# Runs every check even after one fails; exits non-zero if any failed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# The install is skipped while pyproject.toml is unchanged since the last one (hash stamp).
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
stamp=.venv/.ledger-relay-installed
want="$(.venv/bin/python -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' pyproject.toml)"
if [ ! -x .venv/bin/relay ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install -q -e '.[dev]'
    echo "$want" > "$stamp"
fi

# The skewed-clock fault scenario needs libfaketime (Debian `faketime`); the alert rules' unit
# tests need promtool (Debian `prometheus`); the status page's browser tests need Chromium and
# its driver (Debian `chromium`, `chromium-driver`); the PgBouncer tests need PgBouncer (Debian
# `pgbouncer`: the tests start their own, the package's service is not used). Best effort, as
# root with apt: without them those tests are skipped with their reason, nothing else changes.
want_pkgs=()
command -v faketime >/dev/null 2>&1 || want_pkgs+=(faketime)
command -v promtool >/dev/null 2>&1 || want_pkgs+=(prometheus)
[ -x /usr/bin/chromium ] || want_pkgs+=(chromium)
[ -x /usr/bin/chromedriver ] || want_pkgs+=(chromium-driver)
command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || want_pkgs+=(pgbouncer)
if [ "${#want_pkgs[@]}" -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    timeout 300 apt-get install -y -q --no-install-recommends "${want_pkgs[@]}" >/dev/null 2>&1 \
        || { timeout 120 apt-get update -q >/dev/null 2>&1 && timeout 300 apt-get install -y -q --no-install-recommends "${want_pkgs[@]}" >/dev/null 2>&1; } \
        || echo "note: ${want_pkgs[*]} could not be installed; the tests needing them will be skipped"
fi

failed=()
check() {  # check LABEL COMMAND...
    local label="$1"
    shift
    echo "==> $label: $*"
    if ! "$@"; then
        failed+=("$label")
    fi
}
check "ruff check" .venv/bin/ruff check .
check "ruff format" .venv/bin/ruff format --check .
check "mypy" .venv/bin/mypy
# The architecture's layers (pyproject.toml, [tool.importlinter]; docs/architecture.md).
check "import layers" .venv/bin/lint-imports --no-cache
# The slowest tests, named in the log: where a fresh-clone run spends its time, and which
# waits run close to their bounds on a loaded machine.
check "pytest" .venv/bin/python -m pytest --durations=20 "$@"
# Planted bugs the tests must catch (issue 14): the bounded subset; `scripts/mutants.py` runs all.
check "mutants" .venv/bin/python scripts/mutants.py --ci

if [ ${#failed[@]} -gt 0 ]; then
    (IFS=,; echo "FAILED: ${failed[*]}" >&2)
    exit 1
fi
echo "all checks passed"
