"""The calibrated Trn2 cost model: published-vs-modelled calibration, then this project's kernels at model shapes.

1. Calibration (``kernels/nki_cpu/calibrate.py``): the constants fitted to the reference implementation's
   published per-call times and 2-layer profile, and every published figure beside the model's.
2. Kernel choice: ``kernels/moe_w8.py`` counted by the interpreter (1 and 2 experts, scaled to the rank's
   local experts: ``kernels/nki_cpu/moe_dataflows.py``) and costed by the calibrated model, for decode
   (T = 1, 8, 32, 128) and prefill (2k, 8k tokens; dense vs token-grouped), pow2 vs output-block scales, beside
   the BF16 dataflow's modelled time and the HBM roofline (FP8 weight bytes once, plus token rows for prefill).
   Device time is the kernel on one NeuronCore-v3; "eager" adds the fitted launch overhead per call.

    .venv/bin/python -m benchmarks.bench_cost_model
Writes benchmarks/results/cost_model.json (the README's calibration and kernel-choice tables come from it).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table, write_json  # noqa: E402
from vllm_moe_w8.kernels.nki_cpu import calibrate, cost  # noqa: E402
from vllm_moe_w8.kernels.nki_cpu import moe_dataflows as md  # noqa: E402

SHAPES = {
    "Qwen3.5-35B-A3B EP=8": {"E": 32, "H": 2048, "I": 512, "top_k": 8, "experts": 256, "swiglu_limit": 0.0},
    "GLM-5.3-Flash EP=32": {"E": 9, "H": 4096, "I": 2048, "top_k": 8, "experts": 288, "swiglu_limit": 10.0},
}
DECODE_TOKENS = (1, 8, 32, 128)
PREFILL_TOKENS = (2048, 8192)


def _row(model, phase, tokens, dataflow, weights, stats, calls, roofline_s) -> dict:
    est = cost.estimate(stats)
    return {"model": model, "phase": phase, "T": tokens, "dataflow": dataflow, "weights": weights, "calls": calls,
            "device_ms": est.time_s * 1e3, "eager_ms": (est.time_s + calls * est.launch_s) * 1e3, "bound": est.bound_by,
            "dma_transfers": stats.dma_count, "hbm_MB": (stats.hbm_read_bytes + stats.hbm_write_bytes) / 1e6,
            "roofline_ms": roofline_s * 1e3, "device/roofline": est.time_s / roofline_s}


def kernel_choice_rows() -> list[dict]:
    rows = []
    for model, s in SHAPES.items():
        e, h, i, lim = s["E"], s["H"], s["I"], s["swiglu_limit"]
        fp8_roofline = md.weight_bytes(e, h, i) / cost.HBM_BYTES_PER_S
        for t in DECODE_TOKENS:
            for mode in md.MODES:
                rows.append(_row(model, "decode", t, "dense", f"fp8 {mode}", md.decode(mode, e, h, i, t, lim), 1, fp8_roofline))
            rows.append(_row(model, "decode", t, "dense", "bf16", md.bf16_decode(e, h, i, t), 1, fp8_roofline))
            print(f"  {model} decode T={t} done", flush=True)
        for n in PREFILL_TOKENS:
            local_routes = e * md.routes_per_expert(n, s["top_k"], s["experts"])
            roofline = (md.weight_bytes(e, h, i) + local_routes * h * (2 + 4)) / cost.HBM_BYTES_PER_S
            for mode in md.MODES:
                stats, calls = md.dense_prefill(mode, e, h, i, n, lim)
                rows.append(_row(model, "prefill", n, "dense", f"fp8 {mode}", stats, calls, roofline))
                stats, calls = md.grouped_prefill(mode, e, h, i, n, s["top_k"], s["experts"], lim)
                rows.append(_row(model, "prefill", n, "token-grouped", f"fp8 {mode}", stats, calls, roofline))
            rows.append(_row(model, "prefill", n, "token-grouped", "bf16",
                             md.bf16_grouped_prefill(e, h, i, n, s["top_k"], s["experts"]), 1, roofline))
            print(f"  {model} prefill N={n} done", flush=True)
    return rows


def main() -> None:
    t0 = time.perf_counter()
    calibration = calibrate.record()
    print_table(calibration["rows"], ["figure", "kernel", "T", "published", "modelled", "ratio", "role", "within_band"])
    print("constants:", calibration["constants"])
    rows = kernel_choice_rows()
    print_table(rows, ["model", "phase", "T", "dataflow", "weights", "calls", "device_ms", "eager_ms", "bound",
                       "roofline_ms", "device/roofline"])
    missed = [r for r in calibration["rows"] if not r["within_band"]]
    print(f"\ncalibration: {len(calibration['rows']) - len(missed)}/{len(calibration['rows'])} figures within "
          f"{calibration['band']:.0%}; {time.perf_counter() - t0:.0f} s")
    write_json("cost_model", {"calibration": calibration, "kernel_choice": rows, "cost_model_rules": cost.__doc__,
                              "shapes": SHAPES})


if __name__ == "__main__":
    main()
