"""Table of docs/cost-model.md: every published hardware figure of the reference kernels beside both
scenarios' models."""

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


def _modelled(r: dict) -> str:
    text = _fmt(r["figure"], r["modelled"])
    if r["launch_part"]:
        text += f" ({_fmt('x_s', r['modelled'] - r['launch_part'])} + {_fmt('x_s', r['launch_part'])} launch)"
    return text


def render(results_dir: Path) -> str:
    rec = json.loads((results_dir / "cost_model.json").read_text())["calibration"]
    fitted, documented = rec["fitted"]["rows"], rec["documented"]["rows"]
    rows = []
    for f, d in zip(fitted, documented):
        assert (f["figure"], f["kernel"], f["T"]) == (d["figure"], d["kernel"], d["T"])
        role = f["role"] if f["role"] == d["role"] else f"{f['role']} (documented: {d['role']})"
        rows.append([KERNEL_NAMES[f["kernel"]], f["T"], FIGURE_NAMES[f["figure"]], _fmt(f["figure"], f["published"]),
                     _modelled(f), f"{f['ratio']:.2f}", _modelled(d), f"{d['ratio']:.2f}" + ("" if d["within_band"] else " **out**"),
                     role])
    band = rec["fitted"]["band"]
    inside = {k: sum(r["within_band"] for r in rec[k]["rows"]) for k in ("fitted", "documented")}
    return markdown_table(["kernel", "B", "figure", "published", "fitted model", "ratio", "documented model", "ratio",
                           "role"], rows) + (
        f"\nWithin ±{band:.0%}: fitted {inside['fitted']} of {len(fitted)}, documented {inside['documented']} of "
        f"{len(documented)}.\n")
