"""Table of docs/glm-storage.md: Trn2 expert storages for GLM against the checkpoint's E4M3FN decode, and per-rank
expert bytes at the GLM layouts (``benchmarks/bench_glm_fp8_storage.py`` -> ``glm_fp8_storage.json``)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.readme_tables import markdown_table


def _g(x: float) -> str:
    return "0" if x == 0 else f"{x:.2g}"


def _exactness_row(r: dict, magnitudes: bool) -> list:
    mags = r.get("changed_magnitudes", [])
    changed = f"{r['values_changed']:,} of {r['values']:,}"
    if magnitudes:
        changed += f" ({', '.join(mags)})" if 0 < len(mags) <= 8 else f" ({len(mags)} magnitudes)" if mags else ""
    return [r["case"], r["method"], changed, f"{r['fraction_changed']:.2%}", f"{r['bytes_rerounded']:,}",
            _g(r["max_error_per_block_amax"]), _g(r["max_relative_error"]), _g(r["nrmse"]), f"{r['nonzero_to_zero']:,}",
            str(r["blocks_floored"]) if "blocks_floored" in r else "–"]


def render(results_dir: Path) -> str:
    data = json.loads((results_dir / "glm_fp8_storage.json").read_text())
    head = ["values", "storage", "values changed", "share", "bytes re-rounded", "max err / block amax", "max rel. err",
            "NRMSE", "non-zero -> 0", "floored blocks"]
    rows = [_exactness_row(r, True) for r in data["codes"]] + [_exactness_row(r, False) for r in data["blocks"]]
    layouts = markdown_table(
        ["model", "layout", "TP", "EP groups", "LNC", "chips", "experts x I per rank", "FP8 codes GB", "FP8 + scales GB",
         "BF16 GB", "KV room (neuron-w8) GB"],
        [[r["model"], r["layout"], r["tp"], r["ep"], r["lnc"], r["chips"], f"{r['E_local']} x {r['I_rank']}",
          f"{r['fp8_codes_GB']:.2f}", f"{r['fp8_with_scales_GB']:.2f}", f"{r['bf16_GB']:.2f}", f"{r['kv_room_w8_GB']:.2f}"]
         for r in data["layouts"]])
    m = data["machine"]
    blocks = data["blocks"][0]["blocks"]
    return (markdown_table(head, rows)
            + f"\nErrors against the checkpoint's own decode (ml_dtypes `float8_e4m3fn` x scale, float64); stored bytes read as "
            f"ml_dtypes `float8_e4m3` (what the Trn2 kernel reads). Code rows: one block, scale 1. Block rows: {blocks} blocks "
            f"of 128x128 per distribution, each quantised to E4M3FN with amax/448 (seed {data['seed']}). \"bytes re-rounded\": "
            "stored value != original x the storage's exact byte factor (the rest of \"values changed\" is the float32 "
            "rounding of a 448/240 scale, or the MINVAL floor). Computed on "
            f"{m['cpu_model']} (load {m['loadavg_1_5_15'][0]:.1f}); no timing involved.\n\n"
            + layouts
            + "\nRouted experts only, from `vllm-moe-w8 plan` (the `plan` line of each layout is in `configs/*.json`); HBM per "
            "rank 25.77 GB at LNC=2, 90 % usable. The fork's storages keep the same 1 byte + 128x128 float32 scales, so "
            "their bytes at a layout equal neuron-w8's.\n")
