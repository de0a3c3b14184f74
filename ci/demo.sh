#!/usr/bin/env bash
# Installs what is missing, then chats with a real model in vLLM (CPU), plugin off then on.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
export VLLM_ALLOW_INSECURE_SERIALIZATION=1
exec .venv/bin/python -m vllm_embed_plugin.tools.demo "$@"
