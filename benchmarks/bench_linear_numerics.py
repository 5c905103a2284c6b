"""Measured errors of the 1-byte linear kernel at Qwen3.5-35B-A3B TP=4's projections, and its gate's fault twins.

Each projection (``linear_shapes.seed_linears``: fused parts loaded one by one with ``host_linear.linear_weights`` and
fused) gets checkpoint-like FP8 weights (``linear_shapes.checkpoint_linear``) and random bf16 x, and runs through
``kernel_launch.run_linear_w8`` (the NKI interpreter, LNC 2) at a decode T (the exact pow2 kernel) and a prefill T
(the dequant kernel). Recorded: the gate's max err/bound (``host_linear.gate``: the path's float64 reference and
bound), the max error relative to the output's magnitude sum (|y - y_exact| / sum |x| |W|, the exact weights'
reference for both paths), and the gate's err/bound on the same call with a corrupted copy of the weights (one scale
tile doubled; the largest code of a block with its sign bit flipped; rank 0's codes with rank 1's scale rows),
which must exceed 1.

    .venv/bin/python -m benchmarks.bench_linear_numerics   # -> benchmarks/results/linear_numerics.json
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.linear_shapes import checkpoint_linear, seed_linears
from vllm_moe_w8.kernels import host_linear as hl
from vllm_moe_w8.neuron_glue import kernel_launch

TP, LNC = 4, 2
TOKENS = (1, 512)


def _copy(lw: hl.LinearWeights) -> hl.LinearWeights:
    return hl.LinearWeights(lw.codes.clone(), lw.scales.clone(), lw.name, lw.splits, lw.parts, lw.stats)


def doubled_scale(lw, _spec, _seed):
    bad = _copy(lw)
    bad.scales[1, 2] *= 2
    return bad


def flipped_code(lw, _spec, _seed):
    bad = _copy(lw)
    blk = bad.codes[:, 0, 128:256]
    p, n = divmod(int((blk & 0x7F).to(torch.int32).argmax()), 128)
    bad.codes[p, 0, 128 + n] ^= 0x80
    return bad


def wrong_shard(lw, spec, seed):
    """Every part loaded with the scale rows of the next rank's shard (the same weights at TP = 2 x 4 rows)."""
    parts = []
    for i, (name, n) in enumerate(spec["parts"]):
        codes, scale = checkpoint_linear(2 * n, spec["k"], seed=seed + i)
        parts.append(hl.linear_weights(codes[:n], scale[n // 128:], name=name))
    return hl.fuse(parts, name="wrong") if len(parts) > 1 else parts[0]


FAULTS = {"scale tile doubled": doubled_scale, "code sign flipped": flipped_code, "wrong shard's scales": wrong_shard}


def weights(spec: dict, seed: int) -> hl.LinearWeights:
    """The projection's weights: each part rank 0's shard of a 2 x N checkpoint tensor (so wrong_shard has rank 1's)."""
    parts = []
    for i, (name, n) in enumerate(spec["parts"]):
        codes, scale = checkpoint_linear(2 * n, spec["k"], seed=seed + i)
        parts.append(hl.linear_weights(codes[:n], scale[:n // 128], name=name))
    return hl.fuse(parts, name="fused") if len(parts) > 1 else parts[0]


def measure(name: str, spec: dict, tokens: int, seed: int) -> dict:
    lw = weights(spec, seed)
    x = torch.randn(tokens, spec["k"], generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    y = kernel_launch.run_linear_w8(x, lw, lnc=LNC)
    ok, ratio = hl.gate(y, x, lw)
    rel = float(((y.double() - hl.reference(x, lw)).abs() / hl.magnitude(x, lw).clamp_min(1e-300)).max())
    row = {"shape": name, "T": tokens, "path": hl.path_for(tokens), "passed": ok, "err_over_bound": ratio,
           "max_err_over_magnitude": rel, "blocks_shifted": lw.stats.blocks_shifted, "blocks": lw.stats.blocks}
    for fault, make in FAULTS.items():
        passed, r = hl.gate(kernel_launch.run_linear_w8(x, make(lw, spec, seed), lnc=LNC), x, lw)
        row[f"fault {fault}"] = {"passed": passed, "err_over_bound": r}
    return row


def run(tokens=TOKENS) -> list[dict]:
    rows = []
    for i, (name, spec) in enumerate(seed_linears(TP).items()):
        for t in tokens:
            row = measure(name, spec, t, seed=10 * i + 1)
            rows.append(row)
            print(f"  {name} T={t} ({row['path']}): err/bound {row['err_over_bound']:.4f}, err/magnitude "
                  f"{row['max_err_over_magnitude']:.2e}; faults " + ", ".join(
                      f"{f}: {row[f'fault {f}']['err_over_bound']:.3g}" for f in FAULTS), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import write_json

    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    rows = run()
    bad = [r for r in rows if not r["passed"] or any(r[f"fault {f}"]["passed"] for f in FAULTS)]
    write_json("linear_numerics", {"rows": rows, "tp": TP, "lnc": LNC, "faults": list(FAULTS), "method": __doc__,
                                   "roundoff": {"fp32": hl.FP32_ROUNDOFF, "bf16": hl.BF16_ROUNDOFF}})
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
