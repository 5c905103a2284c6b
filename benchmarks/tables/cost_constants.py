"""Table of docs/cost-model.md: the cost model's constants in both scenarios, each with its source (documented, fitted,
assumed)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.readme_tables import markdown_table

UNITS = {"dma_bytes_per_s": ("GB/s", 1e-9), "dma_fixed_s": ("µs per DMA", 1e6), "dge_per_dma_s": ("µs per DMA", 1e6),
         "matmul_fixed_cycles": ("cycles per matmul", 1.0), "instruction_overhead_cycles": ("cycles, minimum per instruction", 1.0),
         "launch_s": ("ms per eager call", 1e3), "matmul_min_cycles": ("cycles, minimum per matmul", 1.0),
         "vector_two_input_factor": ("cycles per element, VectorE tensor_tensor", 1.0),
         "parallel_vector_scalar": ("", None), "indirect_descriptor_s": ("µs per extra indexed row", 1e6),
         "register_load_s": ("µs per register load", 1e6), "dynamic_iteration_s": ("µs per dynamic-loop iteration", 1e6)}
DOC_UNITS = {"B/s": ("GB/s", 1e-9), "Hz": ("GHz", 1e-9), "B": ("B", 1.0)}


def _value(name: str, value) -> str:
    unit, k = UNITS[name]
    if k is None:
        return "separate lanes" if value else "one serial lane"
    return f"{value * k:.4g} {unit}"


def render(results_dir: Path) -> str:
    rec = json.loads((results_dir / "cost_model.json").read_text())["calibration"]
    fitted, documented = rec["fitted"], rec["documented"]
    rows = []
    for name, d in fitted["documented"].items():
        unit, k = DOC_UNITS[d["unit"]]
        rows.append([f"`{name}`", f"{d['value'] * k:.4g} {unit}", d["source"], "same", ""])
    for name, value in fitted["constants"].items():
        other = documented["constants"][name]
        same = other == value or (isinstance(value, float) and abs(other - value) <= 1e-9 * abs(value))
        rows.append([f"`{name}`", _value(name, value), fitted["constant_sources"][name],
                     "same" if same else _value(name, other), documented["constant_sources"][name]])
    for label, r in (("fitted", fitted), ("documented", documented)):
        rest = r["rest_of_graph"]
        rows.append([f"rest of the 2-layer graph ({label})",
                     f"{rest['device_s'] * 1e3:.2f} ms, {rest['hbm_read_bytes'] / 1e6:.1f} MB read, "
                     f"{rest['dma_transfers']:,.0f} DMAs, TensorE {rest['tensor_busy_s'] * 1e3:.2f} ms",
                     "fitted: BF16 column (time, bytes), coalesced column (DMAs), "
                     + ("both FP8 columns (TensorE)" if label == "fitted" else "coalesced column (TensorE)"), "", ""])
    return markdown_table(["constant", "fitted scenario", "source", "documented scenario", "source (documented)"], rows)
