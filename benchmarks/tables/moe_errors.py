"""Table of docs/cpu-path.md: each CPU path's output error vs a float64 reference (``moe_op-*.json`` recorded with
``--check``)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.readme_tables import markdown_table

LABELS = {"w8": "neuron-w8, the recorded default (w8)", "w8_exact": "neuron-w8, exact h", "w8_4k": "neuron-w8, codes in 4 KiB pages", "vllm_fp8": "vLLM FP8 W8A16",
          "vllm_bf16_amx": "vLLM BF16 amx (BF16 twin)", "vllm_bf16_vec": "vLLM BF16 vec (BF16 twin)"}


def render(results_dir: Path) -> str:
    rows = []
    for path in sorted(results_dir.glob("moe_op-*.json")):
        data = json.loads(path.read_text())
        for model in data["models"]:
            check = model.get("check")
            if not check:
                continue
            for name, err in check["errors"].items():
                base, _, note = name.partition(" (")
                label = LABELS.get(base, base) + (f" ({note}" if note else "")
                if base == "w8":
                    label += f" ({data['w8_impl']}, h {model['w8_h']})"
                rows.append([f"`{path.name}`", label, check["T"], f"{err:.1e}"])
    if not rows:
        return "(no moe_op-*.json recorded with --check yet)\n"
    return ("Error = max |out - float64 reference| / max |reference| over one routing, BF16 in and out unless stated "
            "(the reference uses the exactly dequantised experts).\n\n"
            + markdown_table(["record", "path", "T", "error vs float64"], rows))
