"""The NKI MoE kernels as the CPU interpreter counts them, with the cost model's NeuronCore-v3 time.

Per kernel (pow2, output-block) and token bucket T: HBM bytes moved vs the ideal (each local expert's
weight bytes read once), matmul count, the modelled time per engine and overall, the HBM roofline of
one physical core, and the reference implementation's measured per-call times on trn2
(dstair/neuron-pytorch-native, docs/TRN2_NKI.md; E=32, H=2048, I=512, TP=8/LNC=1). The counts do not
depend on the weight values, so the experts are random valid Trn2 float8_e4m3 codes.

    .venv/bin/python benchmarks/bench_nki_kernels.py            # Qwen3.5-35B-A3B rank shape, T 16..256
    .venv/bin/python benchmarks/bench_nki_kernels.py --quick    # fewer buckets
    .venv/bin/python benchmarks/bench_nki_kernels.py --experts 9 --hidden 4096 --inter 2048   # GLM-5.3-Flash, EP=32
    .venv/bin/python benchmarks/bench_nki_kernels.py --routed   # selective decode vs all-expert (decode goal, threshold)
Writes benchmarks/results/bench_nki_kernels_E{E}_H{H}_I{I}.json (``--routed``: bench_nki_routed_decode.json).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table, write_json  # noqa: E402
from vllm_moe_w8.kernels import host, launch  # noqa: E402
from vllm_moe_w8.kernels import host_routed, schedule  # noqa: E402
from vllm_moe_w8.kernels.nki_cpu import calibration, cost, run  # noqa: E402

# Measured per-call times of the reference implementation on trn2 (docs/TRN2_NKI.md), E=32 H=2048 I=512, eager:
# its coalesced pow2 kernel at B=32/64/128 and its coalesced output-block kernel at B=128 (see calibration.py).
REFERENCE_MS = {("pow2", 32): 3.4, ("pow2", 64): 3.6, ("pow2", 128): 4.0, ("output-block", 128): 2.0}
REFERENCE_SHAPE = (32, 2048, 512)  # (E, H, I) of those measurements
BYTES_TARGET = 1.05  # bytes moved within 5 % of the ideal


def random_experts(num_experts: int, hidden: int, inter: int, mode: str, seed: int = 0) -> host.KernelWeights:
    gen = torch.Generator().manual_seed(seed)

    def codes(*shape):  # finite float8_e4m3 bytes: magnitude < 0x78, any sign
        return torch.randint(0, 0x78, shape, generator=gen, dtype=torch.uint8) | (torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8) << 7)

    g13, g2 = (hidden // 128, inter // 128) if mode == "pow2" else (1, 1)
    block = (128, 128) if mode == "pow2" else (128, 0)
    w13, w2 = codes(num_experts, 2 * inter, hidden), codes(num_experts, hidden, inter)
    s13 = torch.rand(num_experts, 2 * inter // 128, g13, generator=gen) + 0.5
    s2 = torch.rand(num_experts, hidden // 128, g2, generator=gen) + 0.5
    return host.to_kernel_layout(w13, s13, w2, s2, *block, "e4m3")


def measure(kw: host.KernelWeights, tokens: int) -> dict:
    hidden, num_experts = kw.hidden_size, kw.num_experts
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    aff = torch.rand(tokens, num_experts)
    t0 = time.perf_counter()
    _, stats = run(launch.KERNELS[kw.mode], *launch.kernel_args(x, aff, kw))
    wall = time.perf_counter() - t0
    est = cost.estimate(stats)
    ideal = kw.w13.numel() + kw.w2.numel()  # each local expert's FP8 weight bytes, once
    moved = stats.hbm_read_bytes + stats.hbm_write_bytes
    roofline = ideal / cost.HBM_BYTES_PER_S
    flops = 2 * tokens * ideal  # one multiply-add per weight per token (dense over local experts)
    return {
        "kernel": kw.mode, "E": num_experts, "H": hidden, "I": kw.w2.shape[2] * 128, "T": tokens,
        "ideal_MB": ideal / 1e6, "moved_MB": moved / 1e6, "moved/ideal": moved / ideal,
        "matmuls": stats.matmul_count, "transposes": sum(stats.transposes.values()),
        "hbm_ms": est.hbm_s * 1e3, "tensor_ms": est.tensor_s * 1e3, "vector_ms": est.vector_s * 1e3,
        "scalar_ms": est.scalar_s * 1e3, "gpsimd_ms": est.gpsimd_s * 1e3,
        "dma_ms": est.dma_s * 1e3, "model_ms": est.time_s * 1e3, "eager_call_ms": est.call_s * 1e3,
        "serial_ms": est.serial_s * 1e3, "bound": est.bound_by,
        "roofline_ms": roofline * 1e3, "model/roofline": est.time_s / roofline,
        "ref_trn2_ms": REFERENCE_MS.get((kw.mode, tokens)) if (num_experts, hidden, kw.w2.shape[2] * 128) == REFERENCE_SHAPE else None,
        "model_TFLOPs": flops / est.time_s / 1e12,
        "sbuf_KiB": stats.peak_sbuf_bytes / 1024, "psum_banks": stats.peak_psum_banks, "interp_s": wall,
    }


# --- selective decode vs all-expert (issue #20) ----------------------------------------------------------------
DECODE_SHAPES = {"Qwen3.5-35B-A3B EP=8": dict(E=32, E_total=256, H=2048, I=512, k=8),
                 "GLM-5.3-Flash EP=32": dict(E=9, E_total=288, H=4096, I=2048, k=8)}
DECODE_GOAL = 2.0  # T=1: bytes read and modelled time within 2x the routed experts' bytes / HBM time
THRESHOLD_TOKENS = (8, 16, 32, 64, 128)  # the selective-vs-all-expert study's buckets
THRESHOLD_LNC = 2  # ... at the grid the kernels are served at (trn2's default LNC)


def scenarios() -> dict:
    """The cost scenarios to price with (calibration.SCENARIOS: fitted, documented)."""
    return dict(calibration.SCENARIOS)


def _vector_blocks(mode: str, scenario: str) -> int | None:
    """The pow2 engine schedule a host with that scenario's calibration file builds (kernels/schedule.py)."""
    return schedule.SCHEDULES[scenario] if mode == "pow2" else None


def _priced(per_scenario: dict, prefix: str) -> dict:
    """``per_scenario``: scenario -> the program Stats of the run built with that scenario's schedule."""
    out = {}
    for name, sc in scenarios().items():
        worst = max((cost.estimate(s, sc) for s in per_scenario[name]), key=lambda e: e.time_s)
        out[f"{prefix}_{name}_ms"] = worst.time_s * 1e3
        out[f"{prefix}_{name}_bound"] = worst.bound_by
    out[f"{prefix}_read_MB"] = sum(s.hbm_read_bytes for s in per_scenario["fitted"]) / 1e6
    return out


MIN_DMAS_PER_EXPERT = 4  # its w13, w2 and their two scale tensors: four HBM tensors, at least one DMA each
MIN_DMAS_PER_CALL = 3  # the token rows, the routing metadata, the output


def floor_ms(shape: dict, routed_experts: int, routed_bytes: int, sc: calibration.Scenario) -> dict:
    """A lower bound, under one scenario's constants, of any selective dataflow at T=1: the routed experts' bytes
    at the DMA rate plus the fixed cost of the fewest DMAs (MIN_DMAS_*), their descriptor generation on GpSimd, the
    fewest matmuls that stream their FP8 weights (moving, 512 columns each, or stationary, 128 x 128 each: the
    cheaper), and the serial control of one dynamic-loop trip per routed expert and one register load (the bytes
    follow the routing only through a runtime trip count). Nothing else (transposes, scaling, metadata) counted."""
    c = sc.constants
    dmas = MIN_DMAS_PER_EXPERT * routed_experts + MIN_DMAS_PER_CALL
    weights = routed_experts * 3 * shape["H"] * shape["I"]
    moving = -(-weights // (128 * 512)) * cost.matmul_cycles(512, 1, c)
    stationary = -(-weights // (128 * 128)) * cost.matmul_cycles(1, 1, c)
    lanes = {"dma": routed_bytes / c.dma_bytes_per_s + dmas * c.dma_fixed_s, "gpsimd": dmas * c.dge_per_dma_s,
             "tensor": min(moving, stationary) / cost.TENSOR_HZ, "hbm": routed_bytes / cost.HBM_BYTES_PER_S}
    control = routed_experts * c.dynamic_iteration_s + c.register_load_s
    bound = max(lanes, key=lanes.get)
    return {f"floor_{sc.name}_ms": (lanes[bound] + control) * 1e3, f"floor_{sc.name}_bound": bound,
            f"floor_{sc.name}_control_ms": control * 1e3}


def _build(mode: str, scenario: str) -> tuple:
    """(vector_blocks, weights-stationary threshold) of the kernels a host with that scenario's calibration builds."""
    ws = host_routed.WEIGHTS_STATIONARY_MAX_TOKENS_BY_SCENARIO[scenario] if mode == "pow2" else 0
    return _vector_blocks(mode, scenario), ws


def decode_case(label: str, shape: dict, kw: host.KernelWeights, tokens: int, ids: torch.Tensor, weights: torch.Tensor,
                lnc: int = 1) -> dict:
    """Selective decode (at its bucket, ``host_routed.selective_bucket``) and the all-expert kernel (at its bucket)
    on one routing, at grid [lnc], each built as each scenario's host builds it."""
    from vllm_moe_w8.kernels.nki_cpu import launch as nki_launch

    x = torch.randn(tokens, shape["H"]).to(torch.bfloat16)
    bucket, dense_bucket = host_routed.selective_bucket(tokens), host.bucket_for(tokens)

    def padded(rows):
        return (host.pad_rows(x, rows), host.pad_rows(weights, rows),
                torch.cat([ids, ids.new_full((rows - tokens, ids.shape[1]), -1)]))

    xb, wb, ib = padded(bucket)
    xd, wd, idd = padded(dense_bucket)
    used = sorted({int(e) for e in ids.flatten() if e >= 0})
    per_expert = kw.w13[0].numel() + kw.w2[0].numel() + 4 * (kw.w13_scales[0].numel() + kw.w2_scales[0].numel())
    routed = len(used) * per_expert
    t0 = time.perf_counter()
    sel, dense = {}, {}
    by = {n: _build(kw.mode, n) for n in scenarios()}
    for vb, ws in set(by.values()):  # one run per distinct build
        st = []
        launch.simulate_routed(xb, wb, ib, kw, lnc=lnc, stats=st, block=bucket, vector_blocks=vb, stationary_max_tokens=ws)
        sel[vb, ws] = st[0]
        consts = {} if vb is None else {"vector_blocks": vb}
        args = launch.kernel_args(xd, host.dense_affinities(wd, idd, kw.num_experts), kw)
        dense[vb, ws] = nki_launch(launch.KERNELS[kw.mode], (lnc,), *args, lnc=lnc, **consts)[1]
    row = {"shape": label, "mode": kw.mode, "T": tokens, "bucket": bucket, "lnc": lnc, "routed_experts": len(used),
           "routed_MB": routed / 1e6, "routed_hbm_ms": routed / (cost.HBM_BYTES_PER_S * lnc) * 1e3,  # at this grid
           **_priced({n: sel[b] for n, b in by.items()}, "selective"),
           **_priced({n: dense[b] for n, b in by.items()}, "dense"), "interp_s": time.perf_counter() - t0}
    row["selective_read/routed"] = row["selective_read_MB"] / max(row["routed_MB"], 1e-12)
    for name, sc in scenarios().items():
        row[f"selective_{name}/routed_hbm"] = row[f"selective_{name}_ms"] / max(row["routed_hbm_ms"], 1e-12)
        if tokens == 1:
            row.update(floor_ms(shape, len(used), routed, sc))
            row[f"floor_{name}/routed_hbm"] = row[f"floor_{name}_ms"] / max(row["routed_hbm_ms"], 1e-12)
        worst = max((cost.estimate(st, sc) for st in sel[by[name]]), key=lambda e: e.time_s)
        row[f"selective_{name}_lanes_ms"] = {k: v * 1e3 for k, v in worst.lanes.items()}
        row[f"selective_{name}_control_ms"] = worst.control_s * 1e3
    st = sel[by["fitted"]][0]
    row["selective_counters"] = {"dmas": st.dma_count, "matmuls": st.matmul_count, "transposes": sum(st.transposes.values()),
                                 "engine_instructions": sum(st.engine_ops.values()), "dynamic_iterations": st.dynamic_iterations,
                                 "register_loads": st.register_loads, "write_MB": st.hbm_write_bytes / 1e6}
    return row


def routed_decode(quick: bool) -> None:
    rows = []
    for label, shape in DECODE_SHAPES.items():
        e = shape["E"]
        for mode in ("pow2", "output-block"):
            kw = random_experts(shape["E"], shape["H"], shape["I"], mode)
            for routed in (1, 2):  # T=1 with 1 or 2 of its top-k routes on this rank
                ids = torch.tensor([[1, e - 2][:routed] + [-1] * (shape["k"] - routed)])
                rows.append(decode_case(label, shape, kw, 1, ids, torch.full((1, shape["k"]), 1.0 / shape["k"])))
                print(f"  {label} {mode} T=1 routed {routed}: {rows[-1]['selective_read/routed']:.3f} x bytes, "
                      f"{rows[-1]['selective_fitted_ms']:.3f} ms fitted, {rows[-1]['selective_documented_ms']:.3f} ms "
                      "documented", flush=True)
        kw = random_experts(shape["E"], shape["H"], shape["I"], "pow2")
        for tokens in ((16, 128) if quick else THRESHOLD_TOKENS):  # uniform top-k of E_total: the threshold study
            gen = torch.Generator().manual_seed(tokens)
            w, ids = torch.rand(tokens, shape["E_total"], generator=gen).topk(shape["k"], dim=1)
            ids = torch.where(ids < e, ids, -1)
            rows.append(decode_case(label, shape, kw, tokens, ids, w / w.sum(dim=1, keepdim=True), THRESHOLD_LNC))
            print(f"  {label} T={tokens}: selective {rows[-1]['selective_fitted_ms']:.3f} vs dense "
                  f"{rows[-1]['dense_fitted_ms']:.3f} ms fitted; {rows[-1]['selective_documented_ms']:.3f} vs "
                  f"{rows[-1]['dense_documented_ms']:.3f} documented", flush=True)
    names = list(scenarios())
    cols = ["shape", "mode", "T", "routed_experts", "routed_MB", "selective_read_MB", "selective_read/routed", "routed_hbm_ms"]
    cols += [f"selective_{n}_ms" for n in names] + [f"dense_{n}_ms" for n in names] + [f"selective_{n}/routed_hbm" for n in names]
    print_table(rows, cols)
    t1 = [r for r in rows if r["T"] == 1]
    for n in names:
        for mode in ("pow2", "output-block"):
            ok = all(r["selective_read/routed"] <= DECODE_GOAL and r[f"selective_{n}/routed_hbm"] <= DECODE_GOAL
                     for r in t1 if r["mode"] == mode)
            print(f"T=1 goal (<= {DECODE_GOAL}x routed bytes and HBM time), {mode}, scenario {n}: {'OK' if ok else 'MISSED'}")
    print_table(t1, ["shape", "mode", "routed_experts", "routed_hbm_ms"]
                + [c for n in names for c in (f"selective_{n}/routed_hbm", f"floor_{n}/routed_hbm", f"floor_{n}_bound")])
    crossover = {}  # per scenario: the largest decode bucket up to which selective is cheaper at every shape
    for n in names:
        crossover[n] = 0
        for t in sorted({r["T"] for r in rows if r["T"] > 1}):
            if not all(r[f"selective_{n}_ms"] < r[f"dense_{n}_ms"] for r in rows if r["T"] == t):
                break
            crossover[n] = t
    print(f"selective cheaper than all-expert up to T = {crossover}; host_routed.SELECTIVE_MAX_TOKENS_BY_SCENARIO = "
          f"{host_routed.SELECTIVE_MAX_TOKENS_BY_SCENARIO}")
    write_json("bench_nki_routed_decode", {"shapes": DECODE_SHAPES, "rows": rows, "goal": DECODE_GOAL,
                                           "selective_max_tokens": host_routed.SELECTIVE_MAX_TOKENS_BY_SCENARIO,
                                           "selective_cheaper_up_to": min(crossover.values()),
                                           "selective_cheaper_up_to_by_scenario": crossover,
                                           "schedules": {n: _vector_blocks("pow2", n) for n in names},
                                           "floor": floor_ms.__doc__,
                                           "scenarios": names, "method": "interpreter counts; T=1 rows LNC=1, pow2 and output-block; "
                                           f"threshold rows pow2 at LNC={THRESHOLD_LNC} (per call the slowest program); "
                                           "per scenario kernels/nki_cpu/cost.py estimate(), pow2 kernels built with that "
                                           "scenario's engine schedule (kernels/schedule.py) and weights-stationary "
                                           "threshold (host_routed.WEIGHTS_STATIONARY_MAX_TOKENS_BY_SCENARIO)",
                                           "weights_stationary_max_tokens": host_routed.WEIGHTS_STATIONARY_MAX_TOKENS_BY_SCENARIO,
                                           "assumptions": cost.__doc__})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--routed", action="store_true", help="selective decode vs all-expert at the decode shapes")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--tokens", type=int, nargs="*", default=list(host.T_BUCKETS))
    ap.add_argument("--quick", action="store_true", help="T in {32, 128} only")
    args = ap.parse_args()
    if args.routed:
        return routed_decode(args.quick)
    tokens = [32, 128] if args.quick else args.tokens
    rows = []
    for mode in ("output-block", "pow2"):
        kw = random_experts(args.experts, args.hidden, args.inter, mode)
        for t in tokens:
            rows.append(measure(kw, t))
            r = rows[-1]
            print(f"  {mode:12s} T={t:4d}: model {r['model_ms']:.3f} ms ({r['bound']}-bound), moved/ideal {r['moved/ideal']:.4f}", flush=True)
    cols = ["kernel", "T", "moved/ideal", "matmuls", "hbm_ms", "tensor_ms", "vector_ms", "scalar_ms", "gpsimd_ms",
            "dma_ms", "model_ms", "eager_call_ms", "bound", "roofline_ms", "model/roofline", "ref_trn2_ms", "sbuf_KiB", "psum_banks"]
    print(f"\nE={args.experts} H={args.hidden} I={args.inter}; one NeuronCore-v3 (cost model: kernels/nki_cpu/cost.py)")
    print_table(rows, cols)
    worst = max(r["moved/ideal"] for r in rows)
    print(f"\nbytes moved / ideal: worst {worst:.4f} (target <= {BYTES_TARGET}): {'OK' if worst <= BYTES_TARGET else 'MISSED'}")
    write_json(f"bench_nki_kernels_E{args.experts}_H{args.hidden}_I{args.inter}", {"shape": vars(args), "rows": rows, "assumptions": cost.__doc__,
                                     "reference_trn2_ms_source": "docs/TRN2_NKI.md (dstair/neuron-pytorch-native)"})


if __name__ == "__main__":
    main()
