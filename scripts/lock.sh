#!/usr/bin/env bash
# Refresh the hash-locked requirements of the two images, for every platform (--universal), for
# the image's Python (3.11):
# - deploy/requirements.lock: the core dependencies (pyproject.toml, no extras): the relay image;
# - deploy/requirements-sink.lock: the core plus the `sink` extra, with the core's pins as
#   constraints (the same versions in both): the sink image.
# The images install them with `pip install --require-hashes`; tests/test_lock.py checks that
# each installs. Needs uv (`pip install uv` in any venv, or set UV=/path/to/uv).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
"${UV:-uv}" pip compile pyproject.toml \
    --universal --python-version 3.11 --generate-hashes \
    --custom-compile-command "scripts/lock.sh" \
    -o deploy/requirements.lock
"${UV:-uv}" pip compile pyproject.toml --extra sink -c deploy/requirements.lock \
    --universal --python-version 3.11 --generate-hashes \
    --custom-compile-command "scripts/lock.sh" \
    -o deploy/requirements-sink.lock
