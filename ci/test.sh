#!/usr/bin/env bash
# Installs what is missing, then runs the whole test suite (unit + real vLLM engines on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
exec .venv/bin/python -m pytest "$@"
