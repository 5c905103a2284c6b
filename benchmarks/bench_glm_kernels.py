"""Modelled per-call kernel time at the GLM shapes: neuron-w8's kernels vs the vllm-neuron fork's GLM dataflows (#22).

Both sides are priced by the same calibrated cost model (``kernels/nki_cpu/cost.py``, both scenarios of
``calibration.SCENARIOS``) from the same kind of counters:

* **neuron-w8**: the launch ``neuron_glue.kernel_launch.run_routed_experts`` makes today, counted by the NKI
  interpreter - ``host_routed.schedule_for`` T: selective decode (the block kernel, one block per routed local
  expert, T padded to its decode bucket) up to the scenario's ``SELECTIVE_MAX_TOKENS``, the dense all-expert kernel
  up to 128 tokens, block prefill beyond - with grid [LNC] and each scenario's pow2 engine schedule
  (``kernels/schedule.py``); selective at LNC 2 splits each block's I across the programs where
  ``host_routed.split_inter`` says (``ours_split_inter``). pow2 storage (the default), the model's ``swiglu_limit``.
* **the fork**: its kernels restated as counters (``kernels/nki_cpu/glm_dataflows.py``, which pins the files read
  and says what is assumed): GLM-5.3-Flash's ``moe_fused_fp8_kernel`` (one block per routed local expert, both
  layouts), GLM-5's selective block-FP8 kernel (its E=256/top-8/EP64/4-local contract).

Routing: uniform top-8 over all experts (seed = T), the rank's local experts kept; the same routing for both sides.
Per call: the slowest of the LNC programs. Model outputs, not measurements.

    .venv/bin/python -m benchmarks.bench_glm_kernels            # -> benchmarks/results/glm_kernels.json
    .venv/bin/python -m benchmarks.bench_glm_kernels --quick    # T in {1, 32}, no prefill (not written)
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from vllm_moe_w8.kernels import host, host_routed, launch, schedule
from vllm_moe_w8.kernels.nki_cpu import calibration, cost, glm_dataflows
from vllm_moe_w8.kernels.nki_cpu import launch as nki_launch

SHAPES = {  # E local, E total, H, I per rank, top-k, LNC, swiglu_limit, fork dataflow
    "GLM-5.3-Flash seed TP=32/EP=32": dict(E=9, E_total=288, H=4096, I=2048, k=8, lnc=2, limit=10.0, fork="fused_fp8"),
    "GLM-5.3-Flash fork TP=64/ep 16": dict(E=18, E_total=288, H=4096, I=512, k=8, lnc=2, limit=10.0, fork="fused_fp8"),
    "GLM-5 EP64": dict(E=4, E_total=256, H=6144, I=2048, k=8, lnc=2, limit=0.0, fork="glm5_selective"),
}
TOKENS = (1, 8, 32, 128)
PREFILL = 512  # GLM-5's selective contract: T <= 512


def routing_for(shape: dict, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, k], local topk_ids [T, k], -1 off the rank): uniform top-k over all experts, the first token's
    first route moved to local expert 0 (a decode call always has work on the rank it is priced on)."""
    gen = torch.Generator().manual_seed(tokens)
    w, ids = torch.rand(tokens, shape["E_total"], generator=gen).topk(shape["k"], dim=1)
    ids[0, 0] = 0
    return w / w.sum(dim=1, keepdim=True), torch.where(ids < shape["E"], ids, -1)


def experts(shape: dict, seed: int = 0) -> host.KernelWeights:
    """Zero codes, unit 128x128 scales (the counters do not depend on values)."""
    e, h, i = shape["E"], shape["H"], shape["I"]
    w13, w2 = torch.zeros(e, 2 * i, h, dtype=torch.uint8), torch.zeros(e, h, i, dtype=torch.uint8)
    return host.to_kernel_layout(w13, torch.ones(e, 2 * i // 128, h // 128), w2, torch.ones(e, h // 128, i // 128),
                                 128, 128, "e4m3")


def which_kernel(tokens: int, scenario: str) -> str:
    """``host_routed.schedule_for`` under a scenario's selective threshold."""
    if tokens <= host_routed.SELECTIVE_MAX_TOKENS_BY_SCENARIO[scenario]:
        return "selective"
    return "dense" if tokens <= host_routed.P else "blocks"


def ours(kw: host.KernelWeights, x, topk_weights, topk_ids, lnc: int, scenario: str, limit: float):
    """(kernel name, per-program Stats) of the launch ``run_routed_experts`` makes, built with ``scenario``'s
    threshold and pow2 engine schedule (the same padding and tensors as kernel_launch)."""
    which = which_kernel(x.shape[0], scenario)
    vb = schedule.SCHEDULES[scenario]
    tokens = x.shape[0]
    if which == "dense":
        bucket = host.bucket_for(tokens)
        hidden = host.pad_rows(x.to(torch.bfloat16), bucket)
        aff = host.pad_rows(host.dense_affinities(topk_weights, topk_ids, kw.num_experts), bucket)
        args = launch.kernel_args(hidden, aff, kw)
        _, programs = nki_launch(launch.KERNELS[kw.mode], (lnc,), *args, float(limit), lnc=lnc, vector_blocks=vb)
        return which, programs
    rows = host_routed.selective_bucket(tokens) if which == "selective" else tokens
    pad = rows - tokens
    xp = host.pad_rows(x, rows)
    wp = host.pad_rows(topk_weights, rows)
    ip = torch.cat([topk_ids, topk_ids.new_full((pad, topk_ids.shape[1]), -1)])
    st: list = []
    launch.simulate_routed(xp, wp, ip, kw, lnc=lnc, stats=st, swiglu_limit=limit, vector_blocks=vb,
                           block=rows if which == "selective" else host_routed.P,
                           stationary_max_tokens=host_routed.WEIGHTS_STATIONARY_MAX_TOKENS_BY_SCENARIO[scenario])
    return which, st[0]


def rows_per_expert(topk_ids: torch.Tensor, experts_local: int) -> list[int]:
    """Rows each local expert receives (a token routed twice to one expert counts once, as the kernels merge it)."""
    return [int((topk_ids == e).any(dim=1).sum()) for e in range(experts_local)]


SBUF_BYTES = 224 * 1024  # per partition


def fork_dataflow(shape: dict, tokens: int) -> str:
    """The fork's kernel for this call: GLM-5's selective kernel; GLM-5.3-Flash's decode kernel up to 64 tokens when
    its tiles fit SBUF as declared, else its fused kernel."""
    if shape["fork"] != "fused_fp8":
        return shape["fork"]
    if tokens <= glm_dataflows.EXPERT_DECODE_MAX_TOKENS and \
            glm_dataflows.expert_decode_sbuf_bytes(tokens, shape["H"], shape["I"], shape["lnc"], shape["E"]) <= SBUF_BYTES:
        return "expert_decode"
    return "fused_fp8"


FORK_FOLDER: list = []  # [Path] when --fork-folder is given: the fused kernel is executed, not restated


def counter_differences(executed: list, restated: list) -> list[str]:
    """The counters that differ, program by program, as ``"program p: field executed != restated"`` (the peaks aside:
    a restatement allocates nothing, so its peak SBUF / PSUM are 0 where the executed kernel's are not)."""
    if len(executed) != len(restated):
        return [f"{len(executed)} executed programs vs {len(restated)} restated"]
    fields = [f.name for f in dataclasses.fields(executed[0]) if not f.name.startswith("peak_")]
    return [f"program {p}: {f} {getattr(e, f)!r} != {getattr(r, f)!r}" for p, (e, r) in enumerate(zip(executed, restated))
            for f in fields if getattr(e, f) != getattr(r, f)]


def same_counters(executed: list, restated: list) -> bool:
    """Every counter equal, program by program (:func:`counter_differences` empty)."""
    return not counter_differences(executed, restated)


def executed_fused(routed: list[int], h: int, i: int, lnc: int) -> list:
    """Per-program Stats of the fork's ``moe_fused_fp8_kernel`` itself (jinhuang12/vllm-neuron @625d6b89, loaded from
    the local folder with only the NKI module paths mapped), one block of q = max(routed) rows per routed expert, the
    tiles its launcher picks (``glm_dataflows.select_tiles``); zero operands (no counter depends on values)."""
    import numpy as np

    from benchmarks.aws_differential import loader
    from benchmarks.aws_differential.cases_fork import FORK, FUSED, fused_inputs
    from vllm_moe_w8.kernels.nki_cpu import launch as run_grid

    q, tiles = max(routed), glm_dataflows.select_tiles(h, i, max(routed))
    args, _ = fused_inputs(np.random.default_rng(0), T=max(q, 1), H=h, I=i, E=len(routed), q=q, values=False)
    with loader.nki_mapped():
        module = loader.load_file(loader.source_path(FORK_FOLDER[0], FORK[0], FORK[1], FUSED), "fork_moe_fused_fp8")
        _, programs = run_grid(module.moe_fused_fp8_kernel, (lnc,), *args, BLOCK_M=tiles.m, BLOCK_N=tiles.n,
                               BLOCK_K=tiles.k, lnc=lnc)
    return programs


def fork(shape: dict, tokens: int, topk_ids: torch.Tensor, scale_ops: bool = True, dataflow: str | None = None):
    """(dataflow name, per-program Stats, per-program weight bytes) of the fork's kernel at this routing; the fused
    kernel executed when the fork's source folder is given (its restatement must then count the same)."""
    rows = rows_per_expert(topk_ids, shape["E"])
    weights: list = []
    dataflow = dataflow or fork_dataflow(shape, tokens)
    if dataflow == "expert_decode":
        routed = sum(r > 0 for r in rows)
        return dataflow, glm_dataflows.expert_decode(routed, tokens, shape["H"], shape["I"], shape["E"], shape["lnc"],
                                                     scale_ops, weights), weights
    if dataflow == "fused_fp8":
        routed = [r for r in rows if r > 0] or [1]
        restated = glm_dataflows.fused_fp8(routed, shape["H"], shape["I"], shape["lnc"], scale_ops, weights)
        if FORK_FOLDER and scale_ops:
            programs = executed_fused(routed, shape["H"], shape["I"], shape["lnc"])
            differ = counter_differences(programs, restated)
            if differ:
                raise AssertionError(f"the fork's executed fused kernel and glm_dataflows.fused_fp8 disagree at T={tokens} "
                                     f"({'; '.join(differ[:4])}): the executed one wins - fix or drop the restatement")
            return "fused_fp8", programs, weights
        return "fused_fp8", restated, weights
    return "glm5_selective", glm_dataflows.glm5_selective(rows, tokens, shape["H"], shape["I"], scale_ops, weights), weights


def priced(programs: list, scenario) -> dict:
    worst = max((cost.estimate(s, scenario) for s in programs), key=lambda e: e.time_s)
    return {"us": worst.time_s * 1e6, "bound": worst.bound_by}


def case(label: str, shape: dict, tokens: int, kw: host.KernelWeights) -> dict:
    topk_weights, topk_ids = routing_for(shape, tokens)
    x = torch.zeros(tokens, shape["H"], dtype=torch.bfloat16)
    rows = rows_per_expert(topk_ids, shape["E"])
    routed = sum(r > 0 for r in rows)
    per_expert = 3 * shape["H"] * shape["I"]
    row = {"shape": label, "T": tokens, "E_local": shape["E"], "H": shape["H"], "I": shape["I"], "lnc": shape["lnc"],
           "routed_local_experts": routed, "routed_weight_MB": routed * per_expert / 1e6}
    t0 = time.perf_counter()
    for name, sc in calibration.SCENARIOS.items():
        which, programs = ours(kw, x, topk_weights, topk_ids, shape["lnc"], name, shape["limit"])
        p = priced(programs, sc)
        row[f"ours_{name}_kernel"] = which
        row[f"ours_{name}_us"], row[f"ours_{name}_bound"] = p["us"], p["bound"]
        row[f"ours_{name}_read_MB"] = sum(s.hbm_read_bytes for s in programs) / 1e6
        row[f"ours_{name}_dmas"] = max(s.dma_count for s in programs)
        row[f"ours_{name}_matmuls"] = max(s.matmul_count for s in programs)
    bucket = host_routed.selective_bucket(tokens) if row["ours_fitted_kernel"] == "selective" else 0
    row["ours_split_inter"] = bool(bucket) and host_routed.split_inter(bucket, bucket, shape["lnc"], shape["I"])
    dataflow, programs, weights = fork(shape, tokens, topk_ids)
    row["fork_dataflow"] = dataflow
    row["fork_source"] = "executed" if (FORK_FOLDER and dataflow == "fused_fp8") else "restated"
    row["fork_read_MB"] = sum(s.hbm_read_bytes for s in programs) / 1e6
    row["fork_weight_MB"] = sum(weights) / 1e6
    row["fork_dmas"] = max(s.dma_count for s in programs)
    row["fork_matmuls"] = max(s.matmul_count for s in programs)
    for name, sc in calibration.SCENARIOS.items():
        p = priced(programs, sc)
        row[f"fork_{name}_us"], row[f"fork_{name}_bound"] = p["us"], p["bound"]
        row[f"fork/ours_{name}"] = row[f"fork_{name}_us"] / row[f"ours_{name}_us"]
    if dataflow != "fused_fp8" and shape["fork"] == "fused_fp8":  # the fork's per-block kernel at the same call
        _, fused, _ = fork(shape, tokens, topk_ids, dataflow="fused_fp8")
        for name, sc in calibration.SCENARIOS.items():
            row[f"fork_fused_{name}_us"] = priced(fused, sc)["us"]
    row["interp_s"] = time.perf_counter() - t0
    return row


def run(tokens=TOKENS, prefill: int | None = PREFILL, shapes=None) -> list[dict]:
    rows = []
    for label, shape in (shapes or SHAPES).items():
        kw = experts(shape)
        for t in tuple(tokens) + ((prefill,) if prefill else ()):
            rows.append(case(label, shape, t, kw))
            r = rows[-1]
            print(f"  {label} T={t}: ours {r['ours_fitted_us']:.0f} / {r['ours_documented_us']:.0f} us "
                  f"({r['ours_fitted_kernel']}), fork {r['fork_fitted_us']:.0f} / {r['fork_documented_us']:.0f} us "
                  f"[{r['interp_s']:.0f} s]", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import print_table, write_json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="T in {1, 32}, no prefill; prints only")
    ap.add_argument("--fork-folder", type=Path, help="local folder with the fork's moe_fused_fp8.py "
                    "(benchmarks/aws_differential layout): execute it instead of its restatement")
    args = ap.parse_args(argv)
    if args.fork_folder:
        FORK_FOLDER.append(args.fork_folder)
    rows = run((1, 32), None) if args.quick else run()
    cols = ["shape", "T", "routed_local_experts", "ours_fitted_kernel", "ours_fitted_us", "ours_documented_us",
            "fork_fitted_us", "fork_documented_us", "fork/ours_fitted", "fork/ours_documented", "ours_fitted_read_MB",
            "fork_read_MB"]
    print_table(rows, cols)
    if not args.quick:
        write_json("glm_kernels", {"shapes": SHAPES, "rows": rows, "tokens": list(TOKENS), "prefill": PREFILL,
                                   "schedules": dict(schedule.SCHEDULES),
                                   "selective_max_tokens": host_routed.SELECTIVE_MAX_TOKENS_BY_SCENARIO,
                                   "fork_dataflows": glm_dataflows.__doc__, "cost_model": cost.__doc__})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
