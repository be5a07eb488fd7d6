#!/usr/bin/env bash
# Refresh deploy/requirements.lock: the core dependencies (pyproject.toml, no extras) pinned
# with their hashes, for every platform (--universal), for the image's Python (3.11). The image
# installs it with `pip install --require-hashes`; tests/test_lock.py checks that it installs.
# Needs uv (`pip install uv` in any venv, or set UV=/path/to/uv).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
"${UV:-uv}" pip compile pyproject.toml \
    --universal --python-version 3.11 --generate-hashes \
    --custom-compile-command "scripts/lock.sh" \
    -o deploy/requirements.lock
