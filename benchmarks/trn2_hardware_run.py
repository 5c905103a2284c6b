"""First hardware run of the NKI MoE kernels on a trn2 host: correctness, per-call latency, memory.

Run on a Trainium2 instance with AWS's Neuron SDK (nki, neuronx-cc, torch-neuronx or
libtorch-neuronx-lite) installed:

    python benchmarks/trn2_hardware_run.py                      # Qwen3.5-35B-A3B rank shape, both kernels
    python benchmarks/trn2_hardware_run.py --hidden 4096 --inter 2048 --experts 8    # GLM-5.3-Flash width
    python benchmarks/trn2_hardware_run.py --compile-backend neuron                  # under torch.compile

Steps (each printed; the JSON goes to benchmarks/results/trn2_hardware_run.json):
1. environment: which NKI, which registration API, the device (refuses to run without one, exit 2);
2. AWS's ``nki.simulate`` of each kernel vs the fp32 reference (validates the kernel source against
   the real NKI front end before touching the device);
3. on device, per kernel and token bucket: output vs the fp32 reference on the same repacked weights
   (bound: the bf16 rounding of the activation, as in tests/test_nki_moe_kernels.py) and the per-call
   latency (median of ``--iters`` after warm-up), next to the cost model's estimate and the reference
   implementation's published times;
4. FP8 subnormals: experts made only of subnormal codes, device vs exact decode (does TensorE honour them?);
5. device memory statistics when the runtime exposes them.
It never falls back to CPU: no Neuron device means a clear error, not a number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import RESULTS  # noqa: E402
from vllm_moe_w8.codec import fp8  # noqa: E402
from vllm_moe_w8.neuron_glue import binding as neuron_binding  # noqa: E402
from vllm_moe_w8.kernels import host, launch, nki_api  # noqa: E402
from vllm_moe_w8.op.reference import activate, dequantize_expert, dequantize_w13, reference_moe  # noqa: E402

ACT_BF16_ROUNDOFF = 2.0**-9
BOUND_SLACK = 1.5
REFERENCE_MS = {("output-block", 32): 3.4, ("output-block", 64): 3.6, ("output-block", 128): 2.0, ("pow2", 128): 4.0}


def experts(num_experts, hidden, inter, mode, seed=0, subnormal_only=False):
    gen = torch.Generator().manual_seed(seed)

    def quantise(rows, cols):
        if subnormal_only:  # magnitude codes 1..7: the E4M3 subnormals, same bytes in both formats
            codes = torch.randint(1, 8, (num_experts, rows, cols), generator=gen, dtype=torch.uint8)
            codes |= torch.randint(0, 2, codes.shape, generator=gen, dtype=torch.uint8) << 7
            return codes.view(torch.float8_e4m3fn), torch.ones(num_experts, rows // 128, cols // 128)
        w = torch.randn(num_experts, rows, cols, generator=gen) * 0.02
        t = w.reshape(num_experts, rows // 128, 128, cols // 128, 128)
        s = t.abs().amax(dim=(2, 4)) / fp8.E4M3FN_MAX
        return (t / s[:, :, None, :, None]).to(torch.float8_e4m3fn).reshape(num_experts, rows, cols), s

    (c13, s13), (c2, s2) = quantise(2 * inter, hidden), quantise(hidden, inter)
    g = inter // 128
    out = [[], [], [], []]
    for e in range(num_experts):
        parts = [fp8.repack(c13[e, :inter], s13[e, :g], mode=mode), fp8.repack(c13[e, inter:], s13[e, g:], mode=mode)]
        down = fp8.repack(c2[e], s2[e], mode=mode)
        out[0].append(torch.cat([p.codes for p in parts]))
        out[1].append(torch.cat([p.scale_grid for p in parts]))
        out[2].append(down.codes)
        out[3].append(down.scale_grid)
    return [torch.stack(o) for o in out] + [down.block]


def error_bound(x, tw, ti, w13, s13, w2, s2, block):
    aff = host.dense_affinities(tw, ti, w13.shape[0])
    bound = torch.zeros(x.shape[0], w2.shape[1])
    for e in range(w13.shape[0]):
        rows = aff[:, e].nonzero().flatten()
        if rows.numel():
            gate, up = dequantize_w13(w13, s13, e, block, "e4m3")
            down = dequantize_expert(w2[e], s2[e], block, "e4m3")
            bound[rows] += (activate(x[rows].float() @ gate.T, x[rows].float() @ up.T) * aff[rows, e:e + 1]).abs() @ down.abs().T
    return BOUND_SLACK * ACT_BF16_ROUNDOFF * bound + 1e-6


def routing(tokens, num_experts, top_k, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    w = torch.rand(tokens, top_k, generator=gen)
    return w / w.sum(1, keepdim=True), ids


def compare(out, ref, bound) -> dict:
    err = (out.float().cpu() - ref).abs()
    return {"max_err_over_bound": float((err / bound).max()), "rel_l2": float((out.float().cpu() - ref).norm() / ref.norm().clamp(min=1e-30)),
            "ok": bool((err <= bound).all())}


def sync(device):
    for fn in (getattr(getattr(torch, "accelerator", None), "synchronize", None), getattr(getattr(torch, "neuron", None), "synchronize", None)):
        if fn is not None:
            try:
                fn()
                return
            except Exception:  # noqa: BLE001
                pass


def memory_stats():
    tnx, _ = neuron_binding._import("torch_neuronx")
    for obj in (tnx, getattr(torch, "neuron", None)):
        fn = getattr(obj, "memory_stats", None)
        if fn is not None:
            try:
                return {k: v for k, v in fn().items() if isinstance(v, (int, float))}
            except Exception as exc:  # noqa: BLE001
                return {"error": str(exc)}
    return {"error": "no memory_stats() in torch_neuronx / torch.neuron"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 16, 32, 64, 128, 256])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", default="neuron")
    ap.add_argument("--compile-backend", default=None, help="wrap the call in torch.compile(backend=..., dynamic=False)")
    args = ap.parse_args()
    record = {"args": vars(args), "nki": nki_api.REASON, "backend": nki_api.BACKEND}

    ok, reason = neuron_binding.available()
    print(f"[1] environment: {reason}")
    if not ok:
        print("refusing to run: this script measures Trainium hardware and has nothing to report without it "
              "(for CPU numbers use benchmarks/bench_nki_kernels.py)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    record["results"], record["simulate"] = [], []
    for mode in ("pow2", "output-block"):
        w13, s13, w2, s2, block = experts(args.experts, args.hidden, args.inter, mode)
        kw = host.to_kernel_layout(w13, s13, w2, s2, block[0], block[1], "e4m3")
        x = torch.randn(16, args.hidden).to(torch.bfloat16)
        tw, ti = routing(16, args.experts, args.top_k, 0)
        ref = reference_moe(x, tw, ti, w13, s13, w2, s2, block[0], block[1], "e4m3")
        sim = compare(launch.simulate_moe(x, tw, ti, kw), ref, error_bound(x, tw, ti, w13, s13, w2, s2, block))
        print(f"[2] nki.simulate {mode}: {sim}")
        record["simulate"].append({"kernel": mode, **sim})

        dev = [t.to(device) for t in (w13, s13, w2, s2)]
        call = lambda xd, twd, tid: neuron_binding.fused_moe_neuron(xd, twd, tid, *dev, block[0], block[1], "e4m3")  # noqa: E731
        if args.compile_backend:
            call = torch.compile(call, backend=args.compile_backend, dynamic=False, fullgraph=True)
        for tokens in args.tokens:
            x = torch.randn(tokens, args.hidden).to(torch.bfloat16)
            tw, ti = routing(tokens, args.experts, args.top_k, tokens)
            xd, twd, tid = x.to(device), tw.to(device), ti.to(device)
            t0 = time.perf_counter()
            out = call(xd, twd, tid)
            sync(device)
            first = time.perf_counter() - t0
            ref = reference_moe(x, tw, ti, w13, s13, w2, s2, block[0], block[1], "e4m3")
            check = compare(out.cpu(), ref, error_bound(x, tw, ti, w13, s13, w2, s2, block))
            times = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                call(xd, twd, tid)
                sync(device)
                times.append(time.perf_counter() - t0)
            row = {"kernel": mode, "T": tokens, "bucket": host.chunks(tokens)[0][2], "first_call_s": first,
                   "median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3,
                   "reference_impl_ms": REFERENCE_MS.get((mode, tokens)), **check}
            print(f"[3] {row}")
            record["results"].append(row)

    w13, s13, w2, s2, block = experts(min(args.experts, 4), args.hidden, args.inter, "pow2", subnormal_only=True)
    x = torch.randn(16, args.hidden).to(torch.bfloat16)
    tw, ti = routing(16, w13.shape[0], 1, 1)
    out = neuron_binding.fused_moe_neuron(x.to(device), tw.to(device), ti.to(device), *[t.to(device) for t in (w13, s13, w2, s2)], 128, 128, "e4m3")
    ref = reference_moe(x, tw, ti, w13, s13, w2, s2, 128, 128, "e4m3")
    sub = compare(out.cpu(), ref, error_bound(x, tw, ti, w13, s13, w2, s2, block))
    sub["flushed_to_zero"] = bool(out.float().abs().max().cpu() == 0)
    print(f"[4] FP8 subnormal weights: {sub}")
    record["subnormals"] = sub
    record["memory"] = memory_stats()
    print(f"[5] memory: {record['memory']}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "trn2_hardware_run.json"
    path.write_text(json.dumps(record, indent=2))
    print(f"wrote {path}")
    failed = [r for r in record["results"] + record["simulate"] if not r["ok"]]
    return 1 if failed or not sub["ok"] else 0


if __name__ == "__main__":
    sys.exit(main())
