#!/usr/bin/env bash
# neuron-w8's vLLM-facing Neuron path on vLLM 0.24.0 (the version vllm-neuron 0.24 pins): sets up
# .venv-vllm024/ if needed (scripts/setup_vllm024_env.sh) and runs tests/vllm024/ there (~2 minutes).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_vllm024_env.sh
exec .venv-vllm024/bin/python -m pytest -q -p no:cacheprovider tests/vllm024 "$@"
