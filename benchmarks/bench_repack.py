"""Repack throughput: each mode's time next to a plain torch copy of the same bytes, per thread count and path.

    .venv/bin/python -m benchmarks.bench_repack [--experts 8] [--rows 1024] [--cols 2048] [--threads 1 2]

The copy (``copy_`` of the codes into a buffer made once, with the same torch thread count: no allocation or
first-touch page faults in it, which made a ``clone()`` swing 2-7 ms between runs here) is the memory-bandwidth
ceiling measured on the same machine in the same run; the target is pow2 at >= 0.25x of it on every path. Paths of pow2: ``native``
(the single-pass C++ body, :mod:`vllm_moe_w8.codec.repack_native`) and ``numpy`` (``VLLM_MOE_W8_REPACK=numpy``,
the fallback). Implementations alternate round by round (order reversed every other round); medians.
Weights are checkpoint-like: each 128x128 block quantised with amax/448, so nearly every block uses
e4m3fn-only codes and pow2 shifts it (the expensive case). Writes ``benchmarks/results/repack-<host>.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks.common import print_table, write_json
from vllm_moe_w8.codec import fp8, repack_native

GOAL = 0.25


def checkpoint_like(experts: int, rows: int, cols: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(experts, rows, cols, generator=g)
    blocks = w.reshape(experts, rows // 128, 128, cols // 128, 128)
    scale = blocks.abs().amax(dim=(2, 4)) / fp8.E4M3FN_MAX
    q = (blocks / scale[:, :, None, :, None]).reshape(experts, rows, cols).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale


def _repack_all(codes, scales, mode, path):
    def f():
        os.environ[repack_native.ENV] = "numpy" if path == "numpy" else "auto"
        for e in range(codes.shape[0]):
            fp8.repack(codes[e], scales[e], mode)
    return f


def interleaved(fns: dict, rounds: int) -> dict:
    for fn in fns.values():
        fn()  # warm-up: build, page-in
    times = {n: [] for n in fns}
    names = list(fns)
    for r in range(rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(v) for n, v in times.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, nargs="+", default=sorted({1, torch.get_num_threads()}))
    ap.add_argument("--output-block", action="store_true", help="also time the lossy output-block mode (slow)")
    args = ap.parse_args(argv)
    codes, scales = checkpoint_like(args.experts, args.rows, args.cols)
    nbytes = codes.numel()
    load_start = os.getloadavg()
    native_ok = repack_native.available()
    print(f"{args.experts} experts x [{args.rows}, {args.cols}] = {nbytes / 1e6:.0f} MB of FP8; native pow2: "
          f"{'yes' if native_ok else 'no (' + str(repack_native.unavailable_reason()) + ')'}; load {load_start[0]:.1f}")
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        dst = torch.empty_like(codes)
        dst.copy_(codes)  # touched once: the copy's pages exist before the timing
        fns = {"copy": lambda dst=dst: dst.copy_(codes)}
        paths = (["native"] if native_ok else []) + ["numpy"]
        for path in paths:
            fns[f"pow2 ({path})"] = _repack_all(codes, scales, "pow2", path)
        fns["lut"] = _repack_all(codes, scales, "lut", "auto")
        if args.output_block:
            fns["output-block (lossy)"] = _repack_all(codes, scales, "output-block", "auto")
        med = interleaved(fns, args.rounds)
        os.environ.pop(repack_native.ENV, None)
        for name, t in med.items():
            ratio = med["copy"] / t
            goal = name.startswith("pow2")
            rows.append({"threads": threads, "what": name, "ms": 1e3 * t, "GB/s": nbytes / t / 1e9,
                         "x copy": ratio, "goal": f">= {GOAL}x: {'met' if ratio >= GOAL else 'NOT met'}" if goal else ""})
    shifted = sum(fp8.repack(codes[e], scales[e]).stats.blocks_shifted for e in range(args.experts))
    print(f"pow2 shifts {shifted} of {scales.numel()} blocks; medians of {args.rounds} interleaved rounds")
    print_table(rows, ["threads", "what", "ms", "GB/s", "x copy", "goal"])
    from vllm_moe_w8.op import native

    host = (native.host_isas() or ["generic"])[0]
    write_json(f"repack-{host}", {"bytes": nbytes, "blocks": scales.numel(), "blocks_shifted": shifted,
                                  "shape": [args.experts, args.rows, args.cols], "rounds": args.rounds,
                                  "loadavg_at_start": list(load_start), "goal": GOAL, "rows": rows})


if __name__ == "__main__":
    main()
