"""Table of docs/trainium2-kernels.md: decode on one rank, the selective (block-scheduled) kernel vs the all-expert
dense kernel, as the cost model prices the interpreter's counts (``benchmarks/bench_nki_kernels.py --routed`` ->
``bench_nki_routed_decode.json``), per cost scenario."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.readme_tables import markdown_table


def render(results_dir: Path) -> str:
    data = json.loads((results_dir / "bench_nki_routed_decode.json").read_text())
    names = data["scenarios"]
    out = []
    for r in data["rows"]:
        out.append([r["shape"], r["mode"], r["T"], r.get("lnc", 1), r["routed_experts"], f"{r['routed_MB']:.1f}",
                    f"{r['selective_read_MB']:.1f} ({r['selective_read/routed']:.2f}x)", f"{r['routed_hbm_ms'] * 1e3:.0f}"]
                   + [f"{r[f'selective_{n}_ms'] * 1e3:.0f} ({r[f'selective_{n}/routed_hbm']:.1f}x, {r[f'selective_{n}_bound']})"
                      for n in names]
                   + [f"{r[f'dense_{n}_ms'] * 1e3:.0f}" for n in names]
                   + [" / ".join(f"{r[f'floor_{n}/routed_hbm']:.2f}x" for n in names) if f"floor_{names[0]}_ms" in r else "-"])
    headers = (["shape", "mode", "T", "LNC", "routed local experts", "their MB", "selective: MB read (x)", "their HBM us (LNC cores)"]
               + [f"selective us, {n} (x HBM, bound)" for n in names] + [f"all-expert us, {n}" for n in names]
               + [f"floor x HBM ({' / '.join(names)})"])
    m = data["machine"]
    return (markdown_table(headers, out) +
            f"\nModel outputs of `kernels/nki_cpu/cost.py` per scenario, not measurements, per call the slowest of the "
            f"LNC programs; T=1 routed to 1 or 2 local experts (one NeuronCore-v3, LNC=1), larger T uniform "
            f"top-{data['shapes'][next(iter(data['shapes']))]['k']} routing at the LNC column's grid; the pow2 kernels "
            f"built with each scenario's engine schedule (`kernels/schedule.py`: {data['schedules']}) and selective "
            f"decode weights-stationary up to T = {data.get('weights_stationary_max_tokens', {})} "
            "(`host_routed.WEIGHTS_STATIONARY_MAX_TOKENS_BY_SCENARIO`). Selective is cheaper than all-expert at both "
            "shapes up to T = "
            f"{data['selective_cheaper_up_to_by_scenario']} and used up to T = {data['selective_max_tokens']} "
            "(`host_routed.SELECTIVE_MAX_TOKENS_BY_SCENARIO`, the calibration file's scenario). "
            f"Counted by the interpreter on {m['cpu_model']} (load {m['loadavg_1_5_15'][0]:.1f}).\n")
