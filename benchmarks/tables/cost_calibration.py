"""README table: every published hardware figure of the reference kernels beside the calibrated model's."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.readme_tables import markdown_table

KERNEL_NAMES = {"bf16": "BF16 control", "first_pow2": "first pow2", "coalesced_pow2": "coalesced pow2",
                "coalesced_output_block": "coalesced output-block"}
FIGURE_NAMES = {"call_s": "per call, eager", "device_s": "device time (2 layers)", "hbm_read_bytes": "HBM reads",
                "dma_bytes": "DMA bytes", "dma_transfers": "DMA transfers", "dma_active_s": "DMA active time",
                "gpsimd_s": "GPSIMD active time", "tensor_occupancy": "TensorE occupancy"}


def _fmt(figure: str, v: float) -> str:
    if figure.endswith("_s"):
        return f"{v * 1e3:.2f} ms"
    if figure.endswith("bytes"):
        return f"{v / 1e6:.1f} MB"
    if figure == "tensor_occupancy":
        return f"{v:.1%}"
    return f"{v:,.0f}"


def render(results_dir: Path) -> str:
    rec = json.loads((results_dir / "cost_model.json").read_text())["calibration"]
    rows = []
    for r in rec["rows"]:
        modelled = _fmt(r["figure"], r["modelled"])
        if r["launch_part"]:
            modelled += f" ({_fmt('x_s', r['modelled'] - r['launch_part'])} kernel + {_fmt('x_s', r['launch_part'])} launch)"
        rows.append([KERNEL_NAMES[r["kernel"]], r["T"], FIGURE_NAMES[r["figure"]], _fmt(r["figure"], r["published"]), modelled,
                     f"{r['ratio']:.2f}", r["role"]])
    inside = sum(r["within_band"] for r in rec["rows"])
    return markdown_table(["kernel", "B", "figure", "published", "modelled", "modelled / published", "role"], rows) + (
        f"\n{inside} of {len(rec['rows'])} figures within ±{rec['band']:.0%}.\n")
