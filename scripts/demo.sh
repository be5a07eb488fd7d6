#!/usr/bin/env bash
# Run `relay demo` on this machine: creates .venv and installs the project when needed, then
# starts an embedded PostgreSQL (unless RELAY_DATABASE_URL is set), the reference sink and two
# relay replicas, and reports what arrived. Arguments go to `relay demo` (see --help).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# The install is skipped while pyproject.toml is unchanged since the last one (hash stamp).
if [ ! -x "$root/.venv/bin/python" ]; then
    python3 -m venv "$root/.venv"
fi
stamp="$root/.venv/.ledger-relay-installed"
want="$("$root/.venv/bin/python" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$root/pyproject.toml")"
if [ ! -x "$root/.venv/bin/relay" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    "$root/.venv/bin/python" -m pip install -q -e "$root[dev]"
    echo "$want" > "$stamp"
fi

# No cd: a relative --json path means the caller's directory.
exec "$root/.venv/bin/relay" demo "$@"
