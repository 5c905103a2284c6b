"""docs/trainium2-kernels.md table: issue #34's goals for the 1-byte linear kernel, per cost scenario, generated from
``linear_w8.json`` (``benchmarks/bench_linear.py``)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.readme_tables import markdown_table

SC = ("fitted", "documented")
DECODE_GOAL = 0.75  # the dense layers' modelled time <= 0.75x BF16's at T = 1..32
PREFILL_GOAL = 1.0  # prefill no slower than BF16


def _verdict(ratio: float, goal: float, where: str) -> str:
    return f"{ratio:.2f}x ({'met' if ratio <= goal else 'missed'}; {where})"


def render(results_dir: Path) -> str:
    data = json.loads((results_dir / "linear_w8.json").read_text())
    aggs = {a["T"]: a for a in data["aggregate"]}
    decode = [t for t in data["decode"] if t in aggs]
    ratio = {(t, sc, side): aggs[t][f"{side}_{sc}_us"] / aggs[t][f"aws_{sc}_us"]
             for t in aggs for sc in SC for side in ("ours", "exact") if f"{side}_{sc}_us" in aggs[t]}
    rows = []
    worst = {sc: max(decode, key=lambda t: ratio[(t, sc, "ours")]) for sc in SC}
    rows.append([f"decode T = {decode[0]}..{decode[-1]}: the dense layers' modelled time <= {DECODE_GOAL}x BF16's",
                 *[_verdict(ratio[(worst[sc], sc, "ours")], DECODE_GOAL, f"worst T = {worst[sc]}") for sc in SC]])
    for t in data["prefill"]:
        rows.append([f"prefill {t:,} tokens: the dense layers no slower than BF16 (served: dequant kernel)",
                     *[_verdict(ratio[(t, sc, "ours")], PREFILL_GOAL, "bf16 weights on chip") for sc in SC]])
        rows.append([f"prefill {t:,} tokens with the exact pow2 kernel instead (not served)",
                     *[_verdict(ratio[(t, sc, "exact")], PREFILL_GOAL, "per-block scale-adds") for sc in SC]])
    one = aggs[decode[0]]
    mb = f"{one['ours_read_MB']:.1f} / {one['aws_read_MB']:.1f} MB ({one['ours_read_MB'] / one['aws_read_MB']:.2f}x)"
    rows.append(["HBM bytes read per decoded token at batch 1 (these layers, one rank): neuron-w8 / BF16", mb, mb])
    return (markdown_table(["goal (issue #34)", "fitted scenario", "documented scenario"], rows)
            + "\nWorst case over the recorded T (the decode bucket pads T = 1..16 to 16); model outputs of "
              "`kernels/nki_cpu/cost.py`, not measurements. Bytes: the interpreter's HBM read counters of one launch per "
              "projection x its layers (`host_linear.read_bytes` gives the same for neuron-w8: codes, scale rows, "
              "bucket-padded x).\n")
