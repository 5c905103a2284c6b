"""Table of docs/glm-storage.md: modelled per-call kernel time of neuron-w8's served launch vs the vllm-neuron fork's
GLM dataflows (``benchmarks/bench_glm_kernels.py`` -> ``glm_kernels.json``)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.readme_tables import markdown_table

FORK = {"fused_fp8": "fused FP8 (`moe_fused_fp8_kernel`)", "expert_decode": "decode (`expert_decode_kernel`)",
        "glm5_selective": "selective block FP8 (`block_fp8_moe.py`)"}


def _us(r: dict, side: str, sc: str) -> str:
    return f"{r[f'{side}_{sc}_us']:,.0f} ({r[f'{side}_{sc}_bound']})"


def _fused(data: dict) -> str:
    return ", ".join(f"{r['shape'].split(' ', 1)[1]} T={r['T']} {r['fork_fused_fitted_us']:,.0f} / {r['fork_fused_documented_us']:,.0f} us"
                     for r in data["rows"] if "fork_fused_fitted_us" in r)


def render(results_dir: Path) -> str:
    data = json.loads((results_dir / "glm_kernels.json").read_text())
    head = ["shape", "T", "routed local experts (MB)", "neuron-w8 kernel", "neuron-w8 us, fitted", "neuron-w8 us, documented",
            "fork dataflow", "fork us, fitted", "fork us, documented", "fork / neuron-w8 (fitted / documented)",
            "HBM MB read, neuron-w8 / fork"]
    rows = []
    for r in data["rows"]:
        kernels = r["ours_fitted_kernel"] if r["ours_fitted_kernel"] == r["ours_documented_kernel"] else \
            f"{r['ours_fitted_kernel']} / {r['ours_documented_kernel']}"
        kernels += " (I split)" if r.get("ours_split_inter") else ""
        rows.append([r["shape"], f"{r['T']:,}", f"{r['routed_local_experts']} ({r['routed_weight_MB']:.0f})", kernels,
                     _us(r, "ours", "fitted"), _us(r, "ours", "documented"),
                     FORK[r["fork_dataflow"]] + (", executed" if r.get("fork_source") == "executed" else ""),
                     _us(r, "fork", "fitted"), _us(r, "fork", "documented"),
                     f"{r['fork/ours_fitted']:.2f}x / {r['fork/ours_documented']:.2f}x",
                     f"{r['ours_fitted_read_MB']:.0f} / {r['fork_read_MB']:.0f}"])
    m = data["machine"]
    return (markdown_table(head, rows)
            + "\nPer call, the slowest of the LNC=2 programs; model outputs of `kernels/nki_cpu/cost.py` in both scenarios "
            "(bound: the lane that decides), not measurements. neuron-w8: the launch `run_routed_experts` makes (kernel "
            f"per scenario: selective up to T = {data['selective_max_tokens']}, dense up to 128, block prefill beyond; "
            "\"I split\": each routed block's intermediate split across the two programs, `host_routed.split_inter`; pow2 "
            f"engine schedule {data['schedules']}), counted by the interpreter. Fork: its kernels restated as counters "
            "(`kernels/nki_cpu/glm_dataflows.py`: files and commits read, and what is assumed), \"executed\": its "
            "fused kernel run unmodified from its source folder (`--fork-folder`; the restatement counts the same, "
            "counter by counter); GLM-5.3-Flash: its decode kernel "
            "for T <= 64 where that kernel's tiles fit 224 KiB of SBUF per partition as declared, else its fused kernel "
            f"(the fused kernel at the decode rows: {_fused(data)}). Uniform top-8 routing over "
            "all experts (seed T), the same for both; GLM-5.3-Flash with its swiglu_limit. Counted on "
            f"{m['cpu_model']} (load {m['loadavg_1_5_15'][0]:.1f}).\n")
