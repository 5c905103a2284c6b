"""README table: this project's kernels under the calibrated cost model at Qwen3.5 / GLM-5.3-Flash rank shapes."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.readme_tables import markdown_table


def render(results_dir: Path) -> str:
    rows = json.loads((results_dir / "cost_model.json").read_text())["kernel_choice"]
    cells: dict[tuple, dict] = {}
    for r in rows:
        cells.setdefault((r["model"], r["phase"], r["T"], r["dataflow"]), {})[r["weights"]] = r
    out = []
    for (model, phase, t, dataflow), by in cells.items():
        def ms(w: str) -> str:
            r = by.get(w)
            return f"{r['device_ms']:.2f} ({r['bound']})" if r else "—"
        any_row = next(iter(by.values()))
        fp8 = {w: by[w]["device_ms"] for w in ("fp8 pow2", "fp8 output-block")}
        fastest = min(fp8, key=fp8.get)
        out.append([model, phase, f"{t:,}", dataflow, ms("fp8 pow2"), ms("fp8 output-block"), ms("bf16"),
                    f"{any_row['roofline_ms']:.2f}", f"{fp8[fastest] / any_row['roofline_ms']:.1f}×",
                    f"{by['fp8 pow2']['calls']}"])
    return markdown_table(["shape", "phase", "tokens", "dataflow", "FP8 pow2 ms", "FP8 output-block ms", "BF16 ms",
                           "HBM roofline ms", "best FP8 / roofline", "calls"], out)
