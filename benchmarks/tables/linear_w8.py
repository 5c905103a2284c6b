"""docs/trainium2-kernels.md table: the 1-byte linear kernel vs nki-library's BF16 dense kernels per projection and
for all dense layers of a token, both scenarios (``benchmarks/bench_linear.py`` -> ``linear_w8.json``)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.readme_tables import markdown_table

SC = ("fitted", "documented")


def _pair(d: dict, fmt: str = "{:,.1f}") -> str:
    return " / ".join(fmt.format(d[f"{sc}_us"]) for sc in SC)


def _ratio(a: dict, b: dict, prefix_a: str = "", prefix_b: str = "") -> str:
    return " / ".join(f"{a[f'{prefix_a}{sc}_us'] / b[f'{prefix_b}{sc}_us']:.2f}x" for sc in SC)


def render(results_dir: Path) -> str:
    data = json.loads((results_dir / "linear_w8.json").read_text())
    head = ["projection (one rank, TP=4)", "N x K", "T", "neuron-w8 us, fitted / documented (kernel)",
            "AWS BF16 us, fitted / documented (kernel)", "neuron-w8 / BF16, fitted / documented",
            "exact pow2 at prefill instead: us (/ BF16)", "HBM MB per call: neuron-w8 / BF16"]
    rows = []
    shapes = data["shapes"]
    for agg in data["aggregate"]:
        t = agg["T"]
        for r in (r for r in data["rows"] if r["T"] == t):
            ex = r.get("exact")
            rows.append([r["shape"], f"{r['N']:,} x {r['K']:,}", f"{t:,}", f"{_pair(r['ours'])} ({r['ours']['kernel']})",
                         f"{_pair(r['aws'])} ({r['aws']['kernel']})", _ratio(r["ours"], r["aws"]),
                         f"{_pair(ex)} ({_ratio(ex, r['aws'])})" if ex else "-",
                         f"{r['ours']['read_MB']:.2f} / {r['aws']['read_MB']:.2f}"])
        exact = (" / ".join(f"{agg[f'exact_{sc}_us'] / 1e3:,.2f}" for sc in SC) + " ms ("
                 + _ratio(agg, agg, "exact_", "aws_") + ")") if "exact_fitted_us" in agg else "-"
        rows.append(["**all these layers, one forward pass**", "", f"{t:,}",
                     " / ".join(f"{agg[f'ours_{sc}_us'] / 1e3:,.2f}" for sc in SC) + " ms",
                     " / ".join(f"{agg[f'aws_{sc}_us'] / 1e3:,.2f}" for sc in SC) + " ms",
                     f"**{_ratio(agg, agg, 'ours_', 'aws_')}**", exact,
                     f"{agg['ours_read_MB']:.1f} / {agg['aws_read_MB']:.1f}"])
    layers = ", ".join(f"{name} x {s['layers']}" for name, s in shapes.items())
    m = data["machine"]
    return (markdown_table(head, rows)
            + f"\nModel outputs of `kernels/nki_cpu/cost.py` (both scenarios), per call the slower of the LNC={data['lnc']} "
              f"programs, not measurements. neuron-w8: the launch `kernel_launch.run_linear_w8` makes (T padded to its "
              f"bucket; pow2 with each scenario's engine schedule {data['schedules']}); BF16: nki-library "
              f"{data['library']['commit'][:8]}'s `qkv_tkg` / `qkv_cte` / `output_projection_tkg` / `_cte` executed "
              f"unmodified at the real T. \"Dense layers of one token pass\": each projection's call x its layers "
              f"({layers}). Counted by the interpreter on {m['cpu_model']} (load {m['loadavg_1_5_15'][0]:.1f}).\n")
