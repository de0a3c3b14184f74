#!/usr/bin/env bash
# The GPU test lane, for a machine with an NVIDIA GPU (run from the repository root):
#     bash ci/gpu_tests.sh [SHARDS] [pytest files...]
# Most of its time is Triton compiling one kernel per format, width and tile, which is CPU
# work, so the tests are split into SHARDS pytest processes (default 8) sharing the GPU.
# Logs go to $OUT (default gpu_tests_out); the exit code is non-zero if any shard failed.
set -uo pipefail
cd "$(dirname "$0")/.."
shards="${1:-8}"
shift || true
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(tests/test_compile.py tests/test_kernels.py tests/test_gemm.py tests/test_machete.py)
out="${OUT:-gpu_tests_out}"
mkdir -p "$out"
python3 -m pytest --collect-only -q "${files[@]}" | grep '::' >"$out/ids.txt"
echo "$(wc -l <"$out/ids.txt") tests in $shards shards"
# Round-robin, so each shard gets a share of every file's slow cases.
for i in $(seq 0 $((shards - 1))); do
    awk -v n="$shards" -v i="$i" 'NR % n == i' "$out/ids.txt" >"$out/shard$i.txt"
done
start=$SECONDS
pids=()
for i in $(seq 0 $((shards - 1))); do
    [ -s "$out/shard$i.txt" ] || continue
    mapfile -t ids <"$out/shard$i.txt"  # one id per line: ids hold spaces, e.g. "(97, 576)"
    python3 -m pytest -q -p no:cacheprovider "${ids[@]}" >"$out/shard$i.log" 2>&1 &
    pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
for i in $(seq 0 $((shards - 1))); do
    [ -f "$out/shard$i.log" ] && echo "shard $i: $(tail -n 1 "$out/shard$i.log")"
done
grep -h -E '^(FAILED|ERROR) ' "$out"/shard*.log || true
# The failing shards' logs in one file, so a caller that fetches few files still sees why.
grep -l -E '^(FAILED|ERROR) ' "$out"/shard*.log | xargs -r cat >"$out/failures.log"
echo "GPU tests: $((SECONDS - start)) s, $([ $status = 0 ] && echo passed || echo FAILED)"
exit $status
