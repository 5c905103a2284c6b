"""Table of docs/cost-model.md: this project's kernels under both cost scenarios at Qwen3.5 / GLM-5.3-Flash
rank shapes."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.readme_tables import markdown_table


def render(results_dir: Path) -> str:
    rows = json.loads((results_dir / "cost_model.json").read_text())["kernel_choice"]
    cells: dict[tuple, dict] = {}
    for r in rows:
        cells.setdefault((r["model"], r["phase"], r["T"], r["dataflow"], r["scenario"]), {})[r["weights"]] = r
    out = []
    for (model, phase, t, dataflow, scenario), by in cells.items():
        def ms(w: str) -> str:
            r = by.get(w)
            return f"{r['device_ms']:.2f} ({r['bound']})" if r else "—"

        pow2, bf16 = by["fp8 pow2"], by.get("bf16")
        default = by.get("fp8 pow2 (default schedule)")
        ratio = f"{pow2['device_ms'] / bf16['device_ms']:.2f}" if bf16 else "—"
        default_cell = f"{default['device_ms']:.2f} ({default['device_ms'] / bf16['device_ms']:.2f})" if default and bf16 else "—"
        out.append([model, phase, f"{t:,}", dataflow, scenario, ms("fp8 pow2"), ratio, default_cell, ms("fp8 output-block"),
                    ms("fp8 dequant-bf16"), ms("bf16"), f"{pow2['roofline_ms']:.2f}", f"{pow2['device/roofline']:.2f}×",
                    f"{pow2['calls']}"])
    return markdown_table(["shape", "phase", "tokens", "dataflow", "scenario", "FP8 pow2 ms", "pow2 / BF16",
                           "pow2, default schedule ms (/ BF16)", "FP8 output-block ms", "FP8 dequant-bf16 ms", "BF16 ms",
                           "HBM roofline ms", "pow2 / roofline", "calls"], out)
