"""One MoE layer on CPU at real shapes: neuron-w8's op (1-byte experts) vs vLLM's own CPU BF16 fused MoE.

Side by side in one run, for each model shape and token count T:

* ``w8``   -- ``vllm_moe_w8.op.cpu.fused_moe_cpu`` (the op's CPU body) with the native variant chosen by
              ``--isa`` (default: the best this CPU runs), experts resident as uint8 codes + float32 scales;
* ``vllm`` -- vLLM's own CPU BF16 MoE kernel ``torch.ops._C.cpu_fused_moe`` (isa "vec", prepacked weights over
              the exactly dequantised experts): what vLLM runs for a BF16 model on this CPU (no AMX here).

Protocol: every call gets a fresh random top-k routing and fresh activations (both implementations see the
same ones), so the routed experts' weights come from memory as successive layers of a real model see them,
not from a cache warmed by the previous call; the implementations alternate call by call (the order flips
every repetition); medians of wall time and of process CPU time. The goals (>= 1.3x vLLM's throughput at
T <= 8, >= 1.0x at every T, expert memory <= 0.51x) are evaluated per row and recorded.

Prints a table and writes ``benchmarks/results/moe_op-<isa>.json`` (CPU model, ISA flags, load average).

    .venv/bin/python -m benchmarks.bench_moe_op --models qwen35 --tokens 1 8 32 128 512
    .venv/bin/python -m benchmarks.bench_moe_op --isa avx2 --tokens 1 8        # the AVX2 variant, forced
    .venv/bin/python -m benchmarks.bench_moe_op --threads 1    # one thread each: no thread scheduling in the ratio
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

GOAL_SMALL_T, GOAL_ANY_T, GOAL_SMALL_T_MAX, GOAL_MEMORY = 1.3, 1.0, 8, 0.51
MODELS = {
    # name: (hidden H, moe intermediate I, routed experts E, top-k)
    "qwen35": ("Qwen3.5-35B-A3B", 2048, 512, 256, 8),
    "glm45air": ("GLM-4.5-Air", 4096, 1408, 128, 8),
}
BLOCK = (128, 128)


def random_experts(e, h, inter, gen):
    """Checkpoint-like e4m3 codes: Gaussian weights quantised so each expert matrix peaks near 240
    (what a pow2 repack of an amax/448-scaled checkpoint gives), and positive scales on a 128x128 grid."""
    def codes(shape):
        out = torch.empty(shape, dtype=torch.uint8)
        for i in range(shape[0]):
            w = torch.randn(shape[1:], generator=gen) * 48.0  # ~5 sigma = 240
            out[i] = w.clamp(-240, 240).to(torch.float8_e4m3fn).view(torch.uint8)
        return out

    w13, w2 = codes((e, 2 * inter, h)), codes((e, h, inter))
    gi, gh = -(-inter // 128), -(-h // 128)
    w13_s = torch.rand((e, 2 * gi, gh), generator=gen) * 1e-4 + 1e-5
    w2_s = torch.rand((e, gh, gi), generator=gen) * 1e-4 + 1e-5
    return w13, w13_s, w2, w2_s


def dequantized_bf16(w13, w13_s, w2, w2_s):
    """The BF16 twin's expert weights (exact fp32 dequantisation, rounded to bf16), one expert at a time."""
    from vllm_moe_w8.op import cpu as cpu_moe

    e, two_i, h = w13.shape
    inter = two_i // 2
    gi = -(-inter // BLOCK[0])
    b13 = torch.empty(w13.shape, dtype=torch.bfloat16)
    b2 = torch.empty(w2.shape, dtype=torch.bfloat16)
    for i in range(e):
        b13[i, :inter] = cpu_moe.dequantize_rows(w13[i, :inter], w13_s[i, :gi], *BLOCK, "e4m3")
        b13[i, inter:] = cpu_moe.dequantize_rows(w13[i, inter:], w13_s[i, gi:], *BLOCK, "e4m3")
        b2[i] = cpu_moe.dequantize_rows(w2[i], w2_s[i], *BLOCK, "e4m3")
    return b13, b2


def vllm_cpu_moe():
    """vLLM's own CPU BF16 fused MoE as (prepack, run), or None if it cannot be called here."""
    try:
        import vllm._custom_ops as ops

        if not hasattr(torch.ops._C, "cpu_fused_moe"):
            return None
    except Exception:
        return None

    def prepack(w13, w2):
        return ops.cpu_prepack_moe_weight(w13, "vec"), ops.cpu_prepack_moe_weight(w2, "vec")

    def run(x, topk_weights, topk_ids, p13, p2):
        out = torch.empty_like(x)
        ops.cpu_fused_moe(out, x, p13, p2, None, None, topk_weights, topk_ids, "silu", "vec")
        return out

    return prepack, run


def fresh_inputs(t, h, e, k, gen):
    """A new routing (softmax top-k of random logits) and new bf16 activations."""
    topk_w, topk_ids = torch.softmax(torch.randn((t, e), generator=gen), -1).topk(k, dim=-1)
    return torch.randn((t, h), generator=gen).to(torch.bfloat16), topk_w, topk_ids.to(torch.int32)


def interleaved(fns: dict, make_inputs, reps: int) -> dict:
    """Per implementation: median wall and CPU seconds over ``reps`` calls, each call with fresh inputs shared
    by all implementations, implementations alternating (order reversed every other repetition)."""
    names = list(fns)
    for fn in fns.values():  # warm-up (page-in, thread pools)
        fn(make_inputs())
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    for rep in range(reps):
        inputs = make_inputs()
        for n in (names if rep % 2 == 0 else names[::-1]):
            c0, t0 = time.process_time(), time.perf_counter()
            fns[n](inputs)
            wall[n].append(time.perf_counter() - t0)
            cpu[n].append(time.process_time() - c0)
    return {n: (statistics.median(wall[n]), statistics.median(cpu[n])) for n in names}


def reps_for(t: int, budget: int) -> int:
    return max(7, min(budget, budget * 8 // max(t, 8)))


def bench_model(key, tokens, reps, check, experts_override=None, seed=0):
    from vllm_moe_w8.op import cpu as cpu_moe

    name, h, inter, e, k = MODELS[key]
    e = experts_override or e
    gen = torch.Generator().manual_seed(seed)
    print(f"  preparing {name} experts (E={e}) ...", flush=True)
    w13, w13_s, w2, w2_s = random_experts(e, h, inter, gen)
    b13, b2 = dequantized_bf16(w13, w13_s, w2, w2_s)
    vllm = vllm_cpu_moe()
    if vllm is None:
        raise SystemExit("vLLM's CPU fused MoE (torch.ops._C.cpu_fused_moe) is not available: nothing to compare with")
    p13, p2 = vllm[0](b13, b2)
    del b13, b2
    resident = {"w8": w13.nbytes + w2.nbytes + w13_s.nbytes + w2_s.nbytes, "vllm": p13.nbytes + p2.nbytes}
    rows = []
    for t in tokens:
        fns = {
            "w8": lambda a: cpu_moe.fused_moe_cpu(a[0], a[1], a[2], w13, w13_s, w2, w2_s, *BLOCK, "e4m3"),
            "vllm": lambda a: vllm[1](a[0], a[1], a[2], p13, p2),
        }
        n = reps_for(t, reps)
        timing = interleaved(fns, lambda: fresh_inputs(t, h, e, k, gen), n)
        row = {"model": name, "T": t, "reps": n}
        for impl, (wall, cpu) in timing.items():
            row[f"{impl}_ms"], row[f"{impl}_cpu_ms"] = 1e3 * wall, 1e3 * cpu
        row["w8_vs_vllm"] = row["vllm_ms"] / row["w8_ms"]  # throughput ratio (> 1: w8 faster)
        row["w8_vs_vllm_cpu"] = row["vllm_cpu_ms"] / row["w8_cpu_ms"]
        row["goal"] = GOAL_SMALL_T if t <= GOAL_SMALL_T_MAX else GOAL_ANY_T
        row["goal_met"] = row["w8_vs_vllm"] >= row["goal"]
        if check and t == tokens[0]:
            x, tw, ti = fresh_inputs(t, h, e, k, gen)
            x = x.float()  # float32 in and out: a bf16 output would hide (or round up) float32-level differences
            exact = cpu_moe.fused_moe_torch(x, tw, ti, w13, w13_s, w2, w2_s, *BLOCK, "e4m3")
            got = cpu_moe.fused_moe_cpu(x, tw, ti, w13, w13_s, w2, w2_s, *BLOCK, "e4m3")
            row["w8_max_rel_err_vs_exact_torch"] = float((got - exact).abs().max() / exact.abs().max())
            row["check_dtype"] = "float32"
        rows.append(row)
        print(_fmt_row(row), flush=True)
    memory = resident["w8"] / resident["vllm"]
    return {"model": name, "H": h, "I": inter, "E": e, "top_k": k, "resident_bytes": resident,
            "memory_ratio": memory, "memory_goal": GOAL_MEMORY, "memory_goal_met": memory <= GOAL_MEMORY, "rows": rows}


def _fmt_row(r):
    return (f"| {r['model']} | {r['T']} | {r['reps']} | {r['w8_ms']:.2f} | {r['vllm_ms']:.2f} | {r['w8_vs_vllm']:.2f}x "
            f"| {r['w8_vs_vllm_cpu']:.2f}x | >= {r['goal']}x: {'met' if r['goal_met'] else 'NOT met'} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["qwen35"], choices=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 128, 512])
    ap.add_argument("--reps", type=int, default=40, help="calls per implementation at T <= 8 (fewer, >= 7, above)")
    ap.add_argument("--experts", type=int, default=None, help="override E (default: the model's)")
    ap.add_argument("--isa", default="auto", help="VLLM_MOE_W8_CPU_ISA for w8: auto, avx512bf16, avx2, torch")
    ap.add_argument("--check", action="store_true", help="also compare w8 with the exact torch path at the first T")
    ap.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads (default: torch's)")
    a = ap.parse_args(argv)
    os.environ["VLLM_MOE_W8_CPU_ISA"] = a.isa
    if a.threads:
        torch.set_num_threads(a.threads)
    from benchmarks.common import write_json
    from vllm_moe_w8.op import cpu as cpu_moe
    from vllm_moe_w8.op import native as cpu_moe_native

    impl = cpu_moe.implementation(MODELS[a.models[0]][1], MODELS[a.models[0]][2], BLOCK[1])  # builds before timing
    isa = impl.removeprefix("native-")
    forced = a.isa != "auto" and cpu_moe_native.host_isas()[:1] != [a.isa]
    print(f"threads={torch.get_num_threads()}  w8 implementation: {impl}{' (forced)' if forced else ''}  "
          f"load average at start: {os.getloadavg()[0]:.1f}")
    print("ratios are throughput ratios w8 / vLLM BF16, medians of interleaved calls with fresh routings")
    print("| model | T | calls | w8 ms | vLLM BF16 ms | w8/vLLM (wall) | w8/vLLM (CPU time) | goal |")
    print("|---|---|---|---|---|---|---|---|")
    results = {"w8_impl": impl, "isa": isa, "forced": forced, "models": []}
    load_start = os.getloadavg()
    for key in a.models:
        res = bench_model(key, a.tokens, a.reps, a.check, a.experts)
        results["models"].append(res)
        rb = res["resident_bytes"]
        print(f"  resident expert bytes {res['model']} (E={res['E']}): w8 {rb['w8'] / 1e6:.0f} MB, vLLM prepacked BF16 "
              f"{rb['vllm'] / 1e6:.0f} MB (w8/vLLM = {res['memory_ratio']:.3f})")
    results["loadavg_at_start"] = list(load_start)
    results["threads_forced"] = a.threads
    write_json(f"moe_op-{isa}{'-forced' if forced else ''}{f'-{a.threads}thread' if a.threads else ''}", results)


if __name__ == "__main__":
    main()
