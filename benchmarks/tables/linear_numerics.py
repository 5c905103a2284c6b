"""docs/trainium2-kernels.md table: the 1-byte linear kernel's measured errors at the seed projections and its gate's
fault twins (``benchmarks/bench_linear_numerics.py`` -> ``linear_numerics.json``)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.readme_tables import markdown_table


def render(results_dir: Path) -> str:
    data = json.loads((results_dir / "linear_numerics.json").read_text())
    faults = data["faults"]
    head = ["projection (one rank, TP=4)", "T (kernel)", "gate err/bound", "max err / sum |x| |W| (exact weights)",
            *[f"fault twin: {f}, err/bound" for f in faults]]
    rows = []
    for r in data["rows"]:
        twin = [f"{r[f'fault {f}']['err_over_bound']:,.3g} ({'passed!' if r[f'fault {f}']['passed'] else 'refused'})"
                for f in faults]
        rows.append([r["shape"], f"{r['T']:,} ({r['path']})", f"{r['err_over_bound']:.4f}"
                     + ("" if r["passed"] else " (failed!)"), f"{r['max_err_over_magnitude']:.1e}", *twin])
    m = data["machine"]
    return (markdown_table(head, rows)
            + f"\nThrough `kernel_launch.run_linear_w8` in the NKI interpreter at LNC {data['lnc']}, checkpoint-like random "
              f"weights (128x128 blocks quantised with amax / 448, every third with amax / 240) and random bf16 x. The "
              f"gate passes below 1; its bound is exact pow2's fp32 accumulation or, for the dequant kernel, the "
              f"bf16-weight reference's (the dequant kernel's error against the exact weights is its bf16 rounding: "
              f"at most 2^-9 = {data['roundoff']['bf16']:.1e} of sum |x| |W|). Run on {m['cpu_model']} "
              f"(load {m['loadavg_1_5_15'][0]:.1f}).\n")
