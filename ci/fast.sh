#!/usr/bin/env bash
# The contributor's lane: lint, format check and the unit tests (no vLLM engine, no Triton
# interpreter), in under 2 minutes once ci/setup.sh has made .venv. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
start=$SECONDS
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest -q -m "not e2e and not interpreter" "$@"
echo "fast lane: $((SECONDS - start)) s"
