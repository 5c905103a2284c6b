"""README table: the cost model's constants with their sources (documented or fitted)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.readme_tables import markdown_table

UNITS = {"dma_bytes_per_s": ("GB/s", 1e-9), "dma_fixed_s": ("µs per DMA", 1e6), "dge_per_dma_s": ("µs per DMA", 1e6),
         "matmul_fixed_cycles": ("cycles per matmul", 1.0), "instruction_overhead_cycles": ("cycles, minimum per instruction", 1.0),
         "launch_s": ("ms per eager call", 1e3)}
DOC_UNITS = {"B/s": ("GB/s", 1e-9), "Hz": ("GHz", 1e-9), "B": ("B", 1.0)}


def render(results_dir: Path) -> str:
    rec = json.loads((results_dir / "cost_model.json").read_text())["calibration"]
    rows = []
    for name, d in rec["documented"].items():
        unit, k = DOC_UNITS[d["unit"]]
        rows.append([f"`{name}`", f"{d['value'] * k:.4g} {unit}", d["source"]])
    for name, value in rec["constants"].items():
        unit, k = UNITS[name]
        rows.append([f"`{name}`", f"{value * k:.4g} {unit}", rec["constant_sources"][name]])
    rest = rec["rest_of_graph"]
    rows.append(["rest of the 2-layer graph", f"{rest['device_s'] * 1e3:.2f} ms, {rest['hbm_read_bytes'] / 1e6:.1f} MB read, "
                 f"{rest['dma_transfers']:,.0f} DMAs, TensorE {rest['tensor_busy_s'] * 1e3:.2f} ms",
                 "fitted: BF16 column (time, bytes), coalesced column (DMAs), both FP8 columns (TensorE)"])
    return markdown_table(["constant", "value", "source"], rows)
