"""The 1-byte linear kernel vs AWS's BF16 dense kernels at Qwen3.5-35B-A3B TP=4 (#34), on one cost model.

Both sides run in the NKI interpreter and are priced by ``kernels/nki_cpu/cost.py`` under both scenarios
(``calibration.SCENARIOS``), per call = the slower of the LNC=2 programs, at the seed model's per-rank shapes
(``benchmarks/linear_shapes.seed_linears``: q+k+v fused, in_proj_qkv+z fused, o_proj, out_proj):

* **neuron-w8**: the launch ``kernel_launch.run_linear_w8`` makes - T padded to ``host_linear.bucket_for``; T <= 128
  the exact pow2 kernel (``linear_w8_pow2``, the programs splitting N) with each scenario's engine schedule
  (``kernels/schedule.py``), longer T the dequant kernel (``linear_w8_dequant``: bf16 weights on chip, the token tiles
  split). At prefill the exact pow2 kernel is priced too (the alternative the dequant path was chosen over); beyond
  2,048 tokens its counters come from runs at 512 and 1,024 tokens (affine in the token tiles: the same instructions
  per tile), the extrapolation checked exactly against the direct 2,048-token run.
* **BF16**: nki-library @d2ad3a57's own dense kernels executed unmodified (``benchmarks/aws_dense.py``): ``qkv_tkg``
  / ``qkv_cte`` for the fused projections (one [K, N] bf16 weight, no norm, no bias), ``output_projection_tkg`` /
  ``_cte`` for o_proj / out_proj, at the real T (no bucket padding); their outputs are bf16, ours fp32.

"Dense layers per decoded token" adds each projection's call time x the layers that launch it (10 full-attention,
30 Gated DeltaNet). Weights are zeros with unit scales (no counter depends on values). Model outputs, not
measurements; the CPU and its load are recorded.

    .venv/bin/python -m benchmarks.bench_linear <folder of AWS sources>   # -> benchmarks/results/linear_w8.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from benchmarks import aws_dense
from benchmarks.aws_differential import loader
from benchmarks.aws_differential.case import LIBRARY
from benchmarks.linear_shapes import n_of, seed_linears
from vllm_moe_w8.kernels import host_linear, schedule
from vllm_moe_w8.kernels.linear_w8 import linear_w8_dequant, linear_w8_pow2
from vllm_moe_w8.kernels.nki_cpu import calibration, cost
from vllm_moe_w8.kernels.nki_cpu import launch as nki_launch
from vllm_moe_w8.kernels.nki_cpu.reference_dataflows import combine, difference

TP, LNC = 4, 2
DECODE = (1, 8, 16, 32)
PREFILL = (2048, 8192)
BF16 = ml_dtypes.bfloat16
SCENARIOS = tuple(calibration.SCENARIOS)
AFFINE_FROM = (512, 1024, 2048)  # the exact prefill's extrapolation: two runs and the checked prediction


def priced(programs: list, scenario: str) -> dict:
    worst = max((cost.estimate(s, calibration.SCENARIOS[scenario]) for s in programs), key=lambda e: e.time_s)
    return {"us": worst.time_s * 1e6, "bound": worst.bound_by}


def read_mb(programs: list) -> float:
    return sum(s.hbm_read_bytes for s in programs) / 1e6


def _our_programs(spec: dict, tokens: int, exact: bool, scenario: str) -> list:
    n, k = n_of(spec), spec["k"]
    bucket = host_linear.bucket_for(tokens, LNC)
    args = (np.zeros((bucket, k), BF16), np.zeros((128, k // 128, n), np.uint8), np.ones((n // 128, k // 128), np.float32))
    consts = {"split_tokens": host_linear.split_tokens(bucket, LNC)}
    if exact:
        consts["vector_blocks"] = schedule.SCHEDULES[scenario]
    return nki_launch(linear_w8_pow2 if exact else linear_w8_dequant, (LNC,), *args, lnc=LNC, **consts)[1]


def _same(a, b) -> bool:
    return all(getattr(a, f) == getattr(b, f) for f in ("hbm_read_bytes", "hbm_write_bytes", "dma_count", "dma_runs",
                                                         "matmuls", "transposes", "engine_ops", "hwdge_dmas"))


def _extrapolated(spec: dict, tokens: int, scenario: str) -> list:
    """Per-program counters at ``tokens`` from AFFINE_FROM's first two runs, refused unless they predict the third."""
    t_a, t_b, t_c = AFFINE_FROM
    a, b, c = (_our_programs(spec, t, True, scenario) for t in AFFINE_FROM)
    step = [difference(y, x) for x, y in zip(a, b)]  # (t_b - t_a) tokens' worth
    per = t_b - t_a
    if not all(_same(combine([(1, x), ((t_c - t_a) // per, d)]), z) for x, d, z in zip(a, step, c)):
        raise AssertionError(f"the exact kernel's counters are not affine in the token tiles at {spec}")
    return [combine([(1, x), ((tokens - t_a) // per, d)]) for x, d in zip(a, step)]


def ours(spec: dict, tokens: int, exact: bool | None = None) -> dict:
    """neuron-w8's launch for ``tokens`` (``exact``: force the pow2 / dequant kernel), priced per scenario (pow2 runs
    with that scenario's engine schedule)."""
    n, k = n_of(spec), spec["k"]
    exact = host_linear.path_for(tokens) == "pow2" if exact is None else exact
    out = {"kernel": "pow2" if exact else "dequant", "bucket": host_linear.bucket_for(tokens, LNC)}
    runs = {}
    for sc in SCENARIOS:
        key = schedule.SCHEDULES[sc] if exact else None
        if key not in runs:
            far = exact and tokens > AFFINE_FROM[-1]
            runs[key] = _extrapolated(spec, tokens, sc) if far else _our_programs(spec, tokens, exact, sc)
            out["how"] = f"extrapolated from {AFFINE_FROM[0]} and {AFFINE_FROM[1]} tokens" if far else "executed"
        p = priced(runs[key], sc)
        out[f"{sc}_us"], out[f"{sc}_bound"] = p["us"], p["bound"]
        out["read_MB"] = read_mb(runs[key])
    assert round(out["read_MB"] * 1e6) == host_linear.read_bytes(n, k, tokens, LNC), "read_bytes disagrees"
    return out


def aws(kernels: dict, spec: dict, tokens: int) -> dict:
    n, k = n_of(spec), spec["k"]
    role = "fused" if len(spec["parts"]) > 1 else "out"
    name, args, kw = aws_dense.call(kernels, role, np.zeros((tokens, k), BF16), np.zeros((k, n), BF16))
    programs = nki_launch(kernels[name], (LNC,), *args, lnc=LNC, **kw)[1]
    out = {"kernel": name, "read_MB": read_mb(programs)}
    for sc in SCENARIOS:
        p = priced(programs, sc)
        out[f"{sc}_us"], out[f"{sc}_bound"] = p["us"], p["bound"]
    return out


def aggregate(rows: list[dict], shapes: dict) -> list[dict]:
    """Per T: the dense layers of one decoded token / one prefill (each projection x its layer count)."""
    out = []
    for t in sorted({r["T"] for r in rows}):
        at = [r for r in rows if r["T"] == t]
        agg = {"T": t}
        for side in ("ours", "aws"):
            for sc in SCENARIOS:
                agg[f"{side}_{sc}_us"] = sum(r[side][f"{sc}_us"] * shapes[r["shape"]]["layers"] for r in at)
            agg[f"{side}_read_MB"] = sum(r[side]["read_MB"] * shapes[r["shape"]]["layers"] for r in at)
        if all("exact" in r for r in at):
            for sc in SCENARIOS:
                agg[f"exact_{sc}_us"] = sum(r["exact"][f"{sc}_us"] * shapes[r["shape"]]["layers"] for r in at)
        out.append(agg)
    return out


def run(folder: Path, decode=DECODE, prefill=PREFILL) -> dict:
    shapes = seed_linears(TP)
    rows = []
    with loader.nki_mapped():
        kernels = aws_dense.load(folder)
        for t in list(decode) + list(prefill):
            for name, spec in shapes.items():
                t0 = time.perf_counter()
                row = {"shape": name, "T": t, "N": n_of(spec), "K": spec["k"], "ours": ours(spec, t),
                       "aws": aws(kernels, spec, t)}
                if t > host_linear.EXACT_MAX_TOKENS:
                    row["exact"] = ours(spec, t, exact=True)
                row["interp_s"] = round(time.perf_counter() - t0, 1)
                rows.append(row)
                print(f"  {name} T={t}: ours {row['ours']['fitted_us']:.1f} / {row['ours']['documented_us']:.1f} us "
                      f"({row['ours']['kernel']}); BF16 {row['aws']['fitted_us']:.1f} / {row['aws']['documented_us']:.1f} "
                      f"({row['aws']['kernel']})" + (f"; exact {row['exact']['fitted_us']:.1f} / "
                                                      f"{row['exact']['documented_us']:.1f}" if "exact" in row else "")
                      + f" [{row['interp_s']} s]", flush=True)
    return {"rows": rows, "aggregate": aggregate(rows, shapes), "shapes": shapes}


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import write_json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="local folder of AWS's sources (benchmarks/aws_differential layout)")
    ap.add_argument("--quick", action="store_true", help="T in {1} decode and 2048 prefill; prints only")
    args = ap.parse_args(argv)
    result = run(args.folder, (1,), (2048,)) if args.quick else run(args.folder)
    for a in result["aggregate"]:
        print(f"dense layers T={a['T']}: ours / BF16 = "
              + ", ".join(f"{sc} {a[f'ours_{sc}_us']:.0f} / {a[f'aws_{sc}_us']:.0f} us "
                          f"({a[f'ours_{sc}_us'] / a[f'aws_{sc}_us']:.2f}x)" for sc in SCENARIOS))
    if not args.quick:
        write_json("linear_w8", {**result, "tp": TP, "lnc": LNC, "decode": list(DECODE), "prefill": list(PREFILL),
                                 "schedules": schedule.SCHEDULES, "library": {"repo": LIBRARY[0], "commit": LIBRARY[1]},
                                 "method": __doc__, "cost_model": cost.__doc__})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
