"""docs/nki-interpreter.md table: neuron-w8's served launch vs nki-library's MoE kernels executed in the interpreter
and the vllm-neuron GLM fork's kernel, all priced by the same cost model (``benchmarks/bench_aws_moe.py`` ->
``aws_moe.json``)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.readme_tables import markdown_table

VARIANTS = {"tkg_selective": "moe_tkg selective", "tkg_all_expert": "moe_tkg all-expert", "cte": "moe_cte shard_on_I"}


def _best(r: dict, tag: str, scenario: str):
    """(variant, us, read MB) of AWS's fastest kernel for this call and weight dtype under ``scenario``."""
    found = []
    for key, name in VARIANTS.items():
        us = r.get(f"aws_{key}_{tag}_{scenario}_us")
        if us is not None:
            found.append((us, name, r[f"aws_{key}_{tag}_read_MB"]))
    return min(found) if found else None


def _us(v: float) -> str:
    """Microseconds: one decimal under 100 (the T=1 cells are within a few percent of each other), else whole."""
    return f"{v:.1f}" if v < 100 else f"{v:,.0f}"


def _cell(best) -> str:
    return f"{_us(best[0])} ({best[1]})" if best else "n/a"


def _fork(r: dict) -> str:
    if "fork_fitted_us" not in r:
        return "-"
    return (f"{_us(r['fork_fitted_us'])} / {_us(r['fork_documented_us'])} ({r['fork_dataflow']}, "
            f"{r['fork_source']})")


def render(results_dir: Path) -> str:
    data = json.loads((results_dir / "aws_moe.json").read_text())
    head = ["shape", "T", "neuron-w8 (pow2 FP8) us, fitted / documented", "AWS BF16, fitted", "AWS BF16, documented",
            "AWS FP8 row/channel, fitted", "AWS FP8, documented", "AWS BF16 / neuron-w8 (fitted / documented)",
            "AWS FP8 / neuron-w8", "vllm-neuron GLM fork us, fitted / documented", "HBM MB read: neuron-w8 / AWS BF16"]
    rows = []
    for r in data["rows"]:
        b = {sc: _best(r, "bf16", sc) for sc in ("fitted", "documented")}
        f = {sc: _best(r, "fp8", sc) for sc in ("fitted", "documented")}
        ours = (r["ours_fitted_us"], r["ours_documented_us"])
        ratio = lambda best: f"{best['fitted'][0] / ours[0]:.2f}x / {best['documented'][0] / ours[1]:.2f}x"  # noqa: E731
        rows.append([r["shape"], f"{r['T']:,}", f"{_us(ours[0])} / {_us(ours[1])} ({r['ours_fitted_kernel']})",
                     _cell(b["fitted"]), _cell(b["documented"]), _cell(f["fitted"]), _cell(f["documented"]),
                     ratio(b), ratio(f), _fork(r), f"{r['ours_read_MB']:.0f} / {b['fitted'][2]:.0f}"])
    m = data["machine"]
    return (markdown_table(head, rows)
            + f"\nModel outputs (kernels/nki_cpu/cost.py, both scenarios), per call the slower of the LNC=2 programs; "
              f"nki-library {data['library']['commit'][:8]} executed unmodified; moe_cte at block size {data['block']} "
              f"with the blocks the routing needs (a static-capacity launch runs up to 8x more); the fork's fused kernel "
              f"executed, its decode kernel restated (it cannot load here). Run on {m['cpu_model']}, "
              f"load {m['loadavg_1_5_15'][0]:.2f}.\n")
