"""Repack throughput: GB/s of FP8 expert weight repacked, per mode, next to a plain torch copy of the same bytes.

    .venv/bin/python benchmarks/bench_repack.py [--experts 8] [--rows 1024] [--cols 2048]

The copy is the memory-bandwidth ceiling measured on the same machine in the same run; the target is
pow2 at >= 25 % of it. Weights are checkpoint-like: each 128x128 block quantised with amax/448, so
nearly every block uses e4m3fn-only codes and pow2 shifts it (the expensive case).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import best_of, print_table, write_json
from vllm_moe_w8.codec import fp8


def checkpoint_like(experts: int, rows: int, cols: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(experts, rows, cols, generator=g)
    blocks = w.reshape(experts, rows // 128, 128, cols // 128, 128)
    scale = blocks.abs().amax(dim=(2, 4)) / fp8.E4M3FN_MAX
    q = (blocks / scale[:, :, None, :, None]).reshape(experts, rows, cols).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    codes, scales = checkpoint_like(args.experts, args.rows, args.cols)
    nbytes = codes.numel()

    def copy():
        codes.clone()

    def run(mode):
        def f():
            for e in range(args.experts):
                fp8.repack(codes[e], scales[e], mode)
        return f

    t_copy = best_of(copy, args.repeat)
    rows = [{"what": "torch copy (ceiling)", "seconds": t_copy, "GB/s": nbytes / t_copy / 1e9, "share of copy": 1.0}]
    for mode in fp8.MODES:
        t = best_of(run(mode), args.repeat)
        rows.append({"what": f"repack {mode}", "seconds": t, "GB/s": nbytes / t / 1e9, "share of copy": t_copy / t})
    shifted = sum(fp8.repack(codes[e], scales[e]).stats.blocks_shifted for e in range(args.experts))
    print(f"{args.experts} experts x [{args.rows}, {args.cols}] = {nbytes / 1e6:.0f} MB of FP8; "
          f"pow2 shifts {shifted} of {scales.numel()} blocks; torch threads {torch.get_num_threads()}")
    print_table(rows, ["what", "seconds", "GB/s", "share of copy"])
    write_json("repack", {"bytes": nbytes, "blocks": scales.numel(), "blocks_shifted": shifted, "rows": rows,
                          "target": "pow2 >= 0.25 of copy"})


if __name__ == "__main__":
    main()
