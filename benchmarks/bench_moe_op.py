"""One MoE layer on CPU at real shapes: neuron-w8's op (1-byte experts) vs BF16 MoEs over the same weights.

Side by side in one run, for each model shape and token count T (random top-k routing):

* ``w8``      -- ``vllm_moe_w8.op.cpu.fused_moe_cpu`` (the op's CPU body; native kernel where it builds),
                 experts resident as uint8 codes + float32 scales;
* ``bf16``    -- a BF16 torch MoE over the dequantised weights written the way vLLM's CPU torch path did
                 it (tokens sorted by expert, per-expert ``F.linear`` / SiLU-and-mul / ``F.linear``, weighted sum);
* ``vllm``    -- vLLM's own CPU BF16 MoE kernel, ``torch.ops._C.cpu_fused_moe`` (isa "vec", prepacked
                 weights), what vLLM runs for a BF16 model on this CPU (no AMX here).

Prints a table (median wall ms per layer call; throughput ratios w8 vs bf16 and vs vllm, by wall time and by
process CPU time -- the latter is steadier on a shared machine) and writes JSON to
benchmarks/results/bench_moe_op.json. ``--check`` also verifies w8 against the exact torch path at T=1.

    .venv/bin/python benchmarks/bench_moe_op.py                       # both models, T = 1 8 32 128 512
    .venv/bin/python benchmarks/bench_moe_op.py --models qwen35 --tokens 1 8 --min-time 0.5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_moe_w8.op import cpu as cpu_moe

MODELS = {
    # name: (hidden H, moe intermediate I, routed experts E, top-k)
    "qwen35": ("Qwen3.5-35B-A3B", 2048, 512, 256, 8),
    "glm45air": ("GLM-4.5-Air", 4096, 1408, 128, 8),
}
BLOCK = (128, 128)
RESULTS = Path(__file__).resolve().parent / "results"


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


def torch_bf16_moe(x, topk_weights, topk_ids, w13, w2):
    """BF16 MoE in torch, grouped by expert like vLLM's CPU torch path."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    order = flat.argsort()
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    sorted_x = x[order // k]
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        gate_up = F.linear(sorted_x[start:start + n], w13[e])
        g, u = gate_up.chunk(2, dim=-1)
        outs.append(F.linear(F.silu(g) * u, w2[e]))
        start += n
    y = torch.empty(t * k, w2.shape[1], dtype=x.dtype)
    y[order] = torch.cat(outs)
    return (y.view(t, k, -1).float() * topk_weights.unsqueeze(-1)).sum(1).to(x.dtype)


def vllm_cpu_moe():
    """vLLM's own CPU BF16 fused MoE (prepack, run) or None if it cannot be called here."""
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


def timed(fn, min_time, max_reps=50):
    """Median wall time and median process CPU time (all threads) of fn's calls."""
    fn()  # warm-up
    wall, cpu = [], []
    while len(wall) < 3 or (sum(wall) < min_time and len(wall) < max_reps):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def bench_model(key, tokens, min_time, check, experts_override=None, seed=0):
    name, h, inter, e, k = MODELS[key]
    e = experts_override or e
    gen = torch.Generator().manual_seed(seed)
    w13, w13_s, w2, w2_s = random_experts(e, h, inter, gen)
    b13, b2 = dequantized_bf16(w13, w13_s, w2, w2_s)
    vllm = vllm_cpu_moe()
    p13 = p2 = None
    if vllm:
        p13, p2 = vllm[0](b13, b2)
    resident = {
        "w8": w13.nbytes + w2.nbytes + w13_s.nbytes + w2_s.nbytes,
        "bf16": b13.nbytes + b2.nbytes,
        "vllm": (p13.nbytes + p2.nbytes) if vllm else None,
    }
    rows = []
    for t in tokens:
        logits = torch.randn((t, e), generator=gen)
        topk_w, topk_ids = torch.softmax(logits, -1).topk(k, dim=-1)
        topk_ids = topk_ids.to(torch.int32)
        x = (torch.randn((t, h), generator=gen)).to(torch.bfloat16)
        args = (x, topk_w, topk_ids, w13, w13_s, w2, w2_s, *BLOCK, "e4m3")
        row = {"model": name, "T": t, "experts_hit": int(topk_ids.unique().numel())}
        runs = {
            "w8": lambda: cpu_moe.fused_moe_cpu(*args),
            "bf16": lambda: torch_bf16_moe(x, topk_w, topk_ids, b13, b2),
        }
        if vllm:
            runs["vllm"] = lambda: vllm[1](x, topk_w, topk_ids, p13, p2)
        for impl, fn in runs.items():
            wall, cpu = timed(fn, min_time)
            row[f"{impl}_ms"], row[f"{impl}_cpu_ms"] = 1e3 * wall, 1e3 * cpu
        for base in ("bf16", "vllm"):
            if f"{base}_ms" in row:
                row[f"w8_vs_{base}"] = row[f"{base}_ms"] / row["w8_ms"]  # throughput ratio (>1: w8 faster)
                row[f"w8_vs_{base}_cpu"] = row[f"{base}_cpu_ms"] / row["w8_cpu_ms"]
        if check and t == tokens[0]:
            exact = cpu_moe.fused_moe_torch(x.float(), *args[1:])
            got = cpu_moe.fused_moe_cpu(x.float(), *args[1:])
            row["w8_max_rel_err_vs_exact_torch"] = float((got - exact).abs().max() / exact.abs().max())
            print(f"  check T={t}: max |w8 - exact torch path| / max |exact| = {row['w8_max_rel_err_vs_exact_torch']:.2e}")
        rows.append(row)
        print(_fmt_row(row), flush=True)
    return {"model": name, "H": h, "I": inter, "E": e, "top_k": k, "resident_bytes": resident, "rows": rows}


def _fmt_row(r):
    def f(key, fmt):
        return format(r[key], fmt) if r.get(key) is not None else "n/a"

    return (f"| {r['model']} | {r['T']} | {r['experts_hit']} | {f('w8_ms', '.2f')} | {f('bf16_ms', '.2f')} | {f('vllm_ms', '.2f')} "
            f"| {f('w8_vs_bf16', '.2f')}x | {f('w8_vs_vllm', '.2f')}x | {f('w8_vs_bf16_cpu', '.2f')}x | {f('w8_vs_vllm_cpu', '.2f')}x |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 128, 512])
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds of repeats per measurement (median taken)")
    ap.add_argument("--experts", type=int, default=None, help="override E (memory only; default: the model's)")
    ap.add_argument("--check", action="store_true", help="also compare w8 with the exact torch path at the first T")
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_moe_op.json")
    ap.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads (default: torch's)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    cpu_moe.native_available()  # build before timing
    from vllm_moe_w8.op import native as cpu_moe_native

    impl = "native" if cpu_moe.native_available() else f"torch ({cpu_moe_native.unavailable_reason()})"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"threads={torch.get_num_threads()}  w8 implementation: {impl}  load average at start: {load:.1f}")
    print("ratios are throughput ratios, measured side by side (>= 1: neuron-w8 is at least as fast)")
    print("| model | T | experts hit | w8 ms | bf16 ms | vllm ms | w8/bf16 | w8/vllm | w8/bf16 (CPU time) | w8/vllm (CPU time) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    results = {"threads": torch.get_num_threads(), "w8_impl": impl, "load_average": load, "models": []}
    for key in a.models:
        res = bench_model(key, a.tokens, a.min_time, a.check, a.experts)
        results["models"].append(res)
        rb = res["resident_bytes"]
        print(f"  resident expert bytes {res['model']} (E={res['E']}): w8 {rb['w8'] / 1e6:.0f} MB, bf16 {rb['bf16'] / 1e6:.0f} MB"
              + (f", vllm prepacked {rb['vllm'] / 1e6:.0f} MB" if rb["vllm"] else "")
              + f"  (w8/bf16 = {rb['w8'] / rb['bf16']:.3f})")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
