"""README table: prefill on one Qwen3.5-35B-A3B EP=8 rank, dense vs token-grouped kernel, as the cost model
prices the interpreter's counts (``benchmarks/bench_grouped_prefill.py`` -> ``grouped_prefill.json``)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.readme_tables import markdown_table


def render(results_dir: Path) -> str:
    data = json.loads((results_dir / "grouped_prefill.json").read_text())
    rows = data["rows"]
    out = []
    for g in (r for r in rows if r["kernel"] == "grouped"):
        key = (g["mode"], g["T"], g["LNC"])
        d = next(r for r in rows if r["kernel"] == "dense" and (r["mode"], r["T"], r["LNC"]) == key)
        b = next((r for r in rows if r["kernel"] == "blocks" and (r["mode"], r["T"], r["LNC"]) == key), None)
        out.append([
            f"{g['T']:,}", g["mode"], g["LNC"],
            f"{d['model_ms']:.2f} ms ({d['bound']})", f"{d['calls']} x 256", f"{d['hbm_MB']:.0f}",
            f"{g['model_ms']:.2f} ms ({g['bound']})", f"{g['tiles']} ({g['routed_rows']:,} rows)", f"{g['hbm_MB']:.0f}",
            f"{d['model_ms'] / g['model_ms']:.1f}x",
        ] + ([f"{b['model_ms']:.2f} ms ({b['bound']})", f"{b['tiles']} of {b['capacity_blocks']}", f"{b['hbm_MB']:.0f}",
              f"{g['model_ms'] / b['model_ms']:.2f}x"] if b else ["-"] * 4))
    shape = data["shape"]
    m = data["machine"]
    table = markdown_table(
        ["prefill tokens", "mode", "LNC", "dense: modelled", "dense calls", "dense HBM MB", "grouped: modelled",
         "grouped tiles", "grouped HBM MB", "dense / grouped", "blocks: modelled", "blocks used of capacity", "blocks HBM MB",
         "grouped / blocks"], out)
    return (table + f"\nE_local {shape['E_local']} of {shape['E_total']}, H {shape['H']}, I {shape['I']}, top-{shape['top_k']}, "
            "uniform routing; model outputs of `kernels/nki_cpu/cost.py` (per call the slowest LNC program), not "
            f"measurements. Counted by the interpreter on {m['cpu_model']} (load {m['loadavg_1_5_15'][0]:.1f}); the dense "
            "kernel's counts are one 256-token call times the number of calls.\n")
