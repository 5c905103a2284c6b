"""The calibrated Trn2 cost model in both scenarios: published-vs-modelled calibration, then this project's kernels.

Every figure is given under both cost scenarios (``kernels/nki_cpu/calibration.SCENARIOS``): ``fitted`` (today's
calibration) and ``documented`` (AWS's documented matmul issue interval, VectorE ‖ ScalarE, 2N two-input VectorE).
The exact pow2 kernel runs with each scenario's engine schedule (``kernels/schedule.py``); "default schedule" rows
are the schedule a host without a calibration file gets, under the other scenario.

1. Calibration (``kernels/nki_cpu/calibrate.py``): the constants fitted to the reference implementation's
   published per-call times and 2-layer profile, and every published figure beside the model's.
2. Kernel choice: ``kernels/moe_w8.py`` counted by the interpreter (1 and 2 experts, scaled to the rank's
   local experts: ``kernels/nki_cpu/moe_dataflows.py``) and costed by the calibrated model, for decode
   (T = 1, 8, 32, 128) and prefill (2k, 8k tokens; dense vs token-grouped), pow2 vs output-block scales, beside
   the BF16 dataflow's modelled time and the HBM roofline (FP8 weight bytes once, plus token rows for prefill).
   Device time is the kernel on one NeuronCore-v3; "eager" adds the fitted launch overhead per call.

    .venv/bin/python -m benchmarks.bench_cost_model
Writes benchmarks/results/cost_model.json (docs/cost-model.md's calibration and kernel-choice tables come from it).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table, write_json  # noqa: E402
from vllm_moe_w8.kernels import schedule  # noqa: E402
from vllm_moe_w8.kernels.nki_cpu import calibrate, cost  # noqa: E402
from vllm_moe_w8.kernels.nki_cpu import calibration as cal  # noqa: E402
from vllm_moe_w8.kernels.nki_cpu import moe_dataflows as md  # noqa: E402

SHAPES = {
    "Qwen3.5-35B-A3B EP=8": {"E": 32, "H": 2048, "I": 512, "top_k": 8, "experts": 256, "swiglu_limit": 0.0},
    "GLM-5.3-Flash EP=32": {"E": 9, "H": 4096, "I": 2048, "top_k": 8, "experts": 288, "swiglu_limit": 10.0},
}
DECODE_TOKENS = (1, 8, 32, 64, 128)
DEFAULT = "fitted"  # the schedule a host without a calibration file runs (kernels/schedule.py)
PREFILL_TOKENS = (2048, 8192)


def _row(model, phase, tokens, dataflow, weights, stats, calls, roofline_s, scenario, schedule_name="") -> dict:
    est = cost.estimate(stats, cal.SCENARIOS[scenario])
    return {"model": model, "phase": phase, "T": tokens, "dataflow": dataflow, "weights": weights, "scenario": scenario,
            "schedule": schedule_name, "calls": calls,
            "device_ms": est.time_s * 1e3, "eager_ms": (est.time_s + calls * est.launch_s) * 1e3, "bound": est.bound_by,
            "lanes_ms": {k: v * 1e3 for k, v in est.lanes.items()},
            "dma_transfers": stats.dma_count, "hbm_MB": (stats.hbm_read_bytes + stats.hbm_write_bytes) / 1e6,
            "roofline_ms": roofline_s * 1e3, "device/roofline": est.time_s / roofline_s}


def _fp8_rows(model, phase, tokens, dataflow, stats_of, roofline, dequant=False) -> list[dict]:
    """pow2 with each scenario's schedule (+ the default schedule under the other), output-block (and the on-chip
    dequantise-to-BF16 kernel when ``dequant``), in both scenarios."""
    rows = []
    for scenario in cal.SCENARIOS:
        runs = [("fp8 pow2", "pow2", scenario)]
        if scenario != DEFAULT:
            runs.append(("fp8 pow2 (default schedule)", "pow2", DEFAULT))
        runs.append(("fp8 output-block", "output-block", None))
        if dequant:
            runs.append(("fp8 dequant-bf16", md.DEQUANT, None))
        for weights, mode, sched in runs:
            vb = schedule.SCHEDULES[sched] if sched else None
            stats, calls = stats_of(mode, vb)
            rows.append(_row(model, phase, tokens, dataflow, weights, stats, calls, roofline, scenario, sched or ""))
    return rows


def kernel_choice_rows() -> list[dict]:
    rows = []
    for model, s in SHAPES.items():
        e, h, i, lim = s["E"], s["H"], s["I"], s["swiglu_limit"]
        fp8_roofline = md.weight_bytes(e, h, i) / cost.HBM_BYTES_PER_S
        for t in DECODE_TOKENS:
            rows += _fp8_rows(model, "decode", t, "dense", lambda mode, vb: (md.decode(mode, e, h, i, t, lim, vb), 1),
                              fp8_roofline, dequant=True)
            for scenario in cal.SCENARIOS:
                rows.append(_row(model, "decode", t, "dense", "bf16", md.bf16_decode(e, h, i, t), 1, fp8_roofline, scenario))
            print(f"  {model} decode T={t} done", flush=True)
        for n in PREFILL_TOKENS:
            local_routes = e * md.routes_per_expert(n, s["top_k"], s["experts"])
            roofline = (md.weight_bytes(e, h, i) + local_routes * h * (2 + 4)) / cost.HBM_BYTES_PER_S
            rows += _fp8_rows(model, "prefill", n, "dense", lambda mode, vb: md.dense_prefill(mode, e, h, i, n, lim, vb),
                              roofline)
            rows += _fp8_rows(model, "prefill", n, "token-grouped",
                              lambda mode, vb: md.grouped_prefill(mode, e, h, i, n, s["top_k"], s["experts"], lim, vb), roofline)
            for scenario in cal.SCENARIOS:
                rows.append(_row(model, "prefill", n, "token-grouped", "bf16",
                                 md.bf16_grouped_prefill(e, h, i, n, s["top_k"], s["experts"]), 1, roofline, scenario))
            print(f"  {model} prefill N={n} done", flush=True)
    return rows


def main() -> None:
    t0 = time.perf_counter()
    calibration = {name: calibrate.record(sc) for name, sc in cal.SCENARIOS.items()}
    for name, rec in calibration.items():
        print(f"== calibration, {name} scenario")
        print_table(rec["rows"], ["figure", "kernel", "T", "published", "modelled", "ratio", "role", "within_band"])
        print("constants:", rec["constants"])
    rows = kernel_choice_rows()
    print_table(rows, ["model", "phase", "T", "dataflow", "weights", "scenario", "schedule", "calls", "device_ms",
                       "eager_ms", "bound", "roofline_ms", "device/roofline"])
    for name, rec in calibration.items():
        missed = [r for r in rec["rows"] if not r["within_band"]]
        print(f"calibration ({name}): {len(rec['rows']) - len(missed)}/{len(rec['rows'])} figures within {rec['band']:.0%}"
              + (f"; outside: {[(r['figure'], r['kernel']) for r in missed]}" if missed else ""))
    print(f"{time.perf_counter() - t0:.0f} s")
    write_json("cost_model", {"calibration": calibration, "kernel_choice": rows, "cost_model_rules": cost.__doc__,
                              "schedules": schedule.SCHEDULES, "default_schedule": DEFAULT, "shapes": SHAPES})


if __name__ == "__main__":
    main()
