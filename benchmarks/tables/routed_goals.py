"""Table of docs/trainium2-kernels.md: issue #20's goals for the device-scheduled kernels, per cost scenario, from the
recorded JSON (``bench_nki_routed_decode.json``: decode T=1; ``grouped_prefill.json``: prefill 2k/8k, blocks vs
grouped)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.readme_tables import markdown_table


def _verdict(ok: bool) -> str:
    return "met" if ok else "missed"


def render(results_dir: Path) -> str:
    decode = json.loads((results_dir / "bench_nki_routed_decode.json").read_text())
    prefill = json.loads((results_dir / "grouped_prefill.json").read_text())
    names, goal = decode["scenarios"], decode["goal"]
    out = []
    t1 = [r for r in decode["rows"] if r["T"] == 1]
    for shape in decode["shapes"]:
        for mode in ("pow2", "output-block"):
            rs = [r for r in t1 if r["shape"] == shape and r["mode"] == mode]
            worst_bytes = max(r["selective_read/routed"] for r in rs)
            out.append([f"decode T=1, {shape}, {mode}", f"bytes read <= {goal:g}x the routed experts'"]
                       + [f"{worst_bytes:.2f}x ({_verdict(worst_bytes <= goal)})" for _n in names])
            cells = []
            for n in names:
                worst = max(rs, key=lambda r: r[f"selective_{n}/routed_hbm"])
                ratio = worst[f"selective_{n}/routed_hbm"]
                floor = worst.get(f"floor_{n}/routed_hbm")
                note = f"; floor {floor:.2f}x, {worst[f'floor_{n}_bound']}" if floor is not None else ""
                cells.append(f"{ratio:.2f}x ({_verdict(ratio <= goal)}{note})")
            out.append([f"decode T=1, {shape}, {mode}", f"modelled time <= {goal:g}x their HBM time"] + cells)
    for tokens in sorted({r["T"] for r in prefill["rows"]}):
        for mode in ("pow2", "output-block"):
            rs = [r for r in prefill["rows"] if r["kernel"] == "blocks" and r["T"] == tokens and r["mode"] == mode]
            if not rs:
                continue
            cells = []
            for n in names:
                worst = min(r[f"grouped/this_{n}"] for r in rs)
                cells.append(f"{worst:.2f}x ({_verdict(worst >= 1.0)})")
            out.append([f"prefill {tokens:,} tokens, {mode}",
                        "no slower than the grouped kernel (grouped / blocks, host steps included, worst LNC)"] + cells)
    return (markdown_table(["case", "goal"] + [f"{n} scenario" for n in names], out)
            + "\nWorst case over the recorded rows (T=1 routed to 1 or 2 local experts; prefill LNC 1 and 2); model "
              "outputs of `kernels/nki_cpu/cost.py`, not measurements. Floor: `bench_nki_kernels.floor_ms`, the least any "
              "selective dataflow costs under that scenario's constants (the routed bytes at the DMA rate, the fewest "
              "DMAs, the fewest matmuls streaming the FP8 weights, one dynamic-loop trip per routed expert), and the "
              "lane that sets it; a floor above the goal means no dataflow meets it with those constants.\n")
