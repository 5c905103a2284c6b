"""Table of docs/trainium2-kernels.md: prefill on one Qwen3.5-35B-A3B EP=8 rank, dense vs token-grouped vs
block-scheduled kernel, as the cost model prices the interpreter's counts in both scenarios
(``benchmarks/bench_grouped_prefill.py`` -> ``grouped_prefill.json``)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.readme_tables import markdown_table


def _both(r: dict, names: list) -> str:
    """'fitted / documented ms (bounds)' of one row."""
    times = " / ".join(f"{r[f'{n}_ms']:.2f}" for n in names)
    bounds = " / ".join(r[f"{n}_bound"] for n in names)
    return f"{times} ms ({bounds})"


def _with_host(r: dict, names: list) -> str:
    """'kernel + host steps (fitted / documented) ms (kernel alone ...; bounds)' of one row."""
    if not any(r.get(f"{n}_host_ms", 0.0) for n in names):
        return _both(r, names)
    times = " / ".join(f"{r[f'{n}_ms']:.2f}" for n in names)
    alone = " / ".join(f"{r[f'{n}_kernel_ms']:.2f}" for n in names)
    bounds = " / ".join(r[f"{n}_bound"] for n in names)
    return f"{times} ms (kernel {alone}, {bounds})"


def render(results_dir: Path) -> str:
    data = json.loads((results_dir / "grouped_prefill.json").read_text())
    rows, names = data["rows"], data["scenarios"]
    out = []
    for g in (r for r in rows if r["kernel"] == "grouped"):
        key = (g["mode"], g["T"], g["LNC"])
        d = next(r for r in rows if r["kernel"] == "dense" and (r["mode"], r["T"], r["LNC"]) == key)
        b = next(r for r in rows if r["kernel"] == "blocks" and (r["mode"], r["T"], r["LNC"]) == key)
        out.append([
            f"{g['T']:,}", g["mode"], g["LNC"], _with_host(d, names), f"{d['calls']} x 256", _with_host(g, names),
            f"{g['tiles']} ({g['routed_rows']:,} rows)", _with_host(b, names), f"{b['tiles']} of {b['capacity_blocks']}",
            " / ".join(f"{r['hbm_MB']:.0f} + {r['host_MB']:.0f}" for r in (d, g, b)),
            " / ".join(f"{b[f'grouped/this_{n}']:.2f}x" for n in names),
            " / ".join(f"{b[f'grouped/this_kernel_{n}']:.2f}x" for n in names),
        ])
    shape = data["shape"]
    m = data["machine"]
    label = " / ".join(names)
    table = markdown_table(
        ["prefill tokens", "mode", "LNC", f"dense + host steps ({label})", "dense calls",
         f"grouped + host steps ({label})", "grouped tiles", f"blocks + host steps ({label})", "blocks used of capacity",
         "HBM MB kernel + host steps: dense / grouped / blocks", f"grouped / blocks, with host steps ({label})",
         f"grouped / blocks, kernels alone ({label})"], out)
    return (table + f"\nE_local {shape['E_local']} of {shape['E_total']}, H {shape['H']}, I {shape['I']}, top-{shape['top_k']}, "
            "uniform routing; model outputs of `kernels/nki_cpu/cost.py` in both cost scenarios (per call the slowest LNC "
            "program; the pow2 dense and block kernels built with each scenario's engine schedule, "
            f"`kernels/schedule.py`: {data['schedules']['pow2']}), not measurements. Counted by the interpreter on "
            f"{m['cpu_model']} (load {m['loadavg_1_5_15'][0]:.1f}); the dense kernel's counts are one 256-token call times "
            "the number of calls. Host steps (`bench_grouped_prefill.host_steps`): what each kernel leaves outside it, "
            "priced as the device DMA traffic it needs at least (grouped: the gather of the routed bf16 rows into tiles "
            "and the combine of each token's fp32 rows; dense at LNC 2: the sum of the programs' partials; blocks at "
            "LNC 2: the masked sum of the programs' slabs - the rows each program stored read, the output written once, "
            "the grouped combine's rule), split over the LNC cores, added after the kernel; each ends at the fp32 routed "
            "sum `run_routed_experts` returns (the callers' cast to the model's dtype is the same for every kernel and "
            "charged to none).\n")
