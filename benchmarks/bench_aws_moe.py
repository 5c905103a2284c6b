"""Side by side on one cost model: neuron-w8's served launch vs AWS's own MoE kernels, executed (#31).

Both sides run in the NKI interpreter and are priced by ``kernels/nki_cpu/cost.py`` under both scenarios
(``calibration.SCENARIOS``), per call = the slowest of the LNC=2 programs:

* **neuron-w8**: the launch ``kernel_launch.run_routed_experts`` makes (``benchmarks.bench_glm_kernels.ours``: selective
  decode / dense / block prefill by ``host_routed.schedule_for``), pow2 block-FP8 experts (1 byte per weight).
* **nki-library @d2ad3a57** (unmodified, from a local folder as the differential harness loads it): ``moe_tkg``
  (decode, T <= 128) in both its schedules - selective (each token's local routes; tokens with fewer local routes than
  the most any token has are padded with a zero-affinity route to local expert 0, as the kernel computes every
  (token, slot) pair) and all-expert (every local expert, the [T, E] affinities masked to this rank by ``rank_id``) -
  and ``moe_cte`` (prefill, T >= 128; ``shard_on_i``, block size 256, ``is_tensor_update_accumulating=True`` for
  top-8), each with BF16 weights and with their FP8 path (float8_e4m3 weights, per-row / per-channel fp32 scales).
  ``moe_cte`` gets the blocks the routing needs (``sum_e ceil(rows_e / B)``: an oracle capacity that favours it; a
  launch at nki-library's static capacity ``ceil((T k - (E - 1)) / B) + E - 1`` runs up to k x more blocks).
* **the vllm-neuron GLM fork** (GLM-5.3-Flash only, ``benchmarks.bench_glm_kernels.fork``): its decode kernel where
  its tiles fit SBUF (restated, ``glm_dataflows.expert_decode``: it cannot load here), else its
  ``moe_fused_fp8_kernel`` executed from the same folder (jinhuang12/vllm-neuron @625d6b89; one block per routed
  local expert).

Reduced-but-faithful prefill: ``moe_cte``'s instruction stream is the same for every block (its static loop runs the
same body per block; gathers and scatters move B rows whatever they hold), so its counters are affine in the block
count N for a fixed shape and expert set. The bench runs it at N0 = E_local blocks (one per expert) and N0 + 1, takes
the difference as one block's counters, checks that N0 + 3 blocks predicts a third run's counters exactly, and prices
N(T) = N0 + (N(T) - N0) x one block. Decode and neuron-w8's launches run at the real T.

Weights are zeros with unit scales (no counter depends on values); routing is uniform top-8 over all experts (seed
= T), the rank's local experts kept (``bench_glm_kernels.routing_for``). Model outputs, not measurements.

    .venv/bin/python -m benchmarks.bench_aws_moe <folder of AWS sources>   # -> benchmarks/results/aws_moe.json
"""

from __future__ import annotations

import argparse
import importlib
import math
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

from benchmarks.aws_differential import loader
from benchmarks.aws_differential.case import LIBRARY
from benchmarks import bench_glm_kernels
from benchmarks.bench_glm_kernels import experts as our_experts
from benchmarks.bench_glm_kernels import ours, routing_for
from vllm_moe_w8.kernels.nki_cpu import calibration, cost
from vllm_moe_w8.kernels.nki_cpu import launch as nki_launch
from vllm_moe_w8.kernels.nki_cpu.reference_dataflows import combine, difference

SHAPES = {
    "Qwen3.5-35B-A3B EP=8": dict(E=32, E_total=256, H=2048, I=512, k=8, lnc=2, limit=0.0),
    "GLM-5.3-Flash EP=32": dict(E=9, E_total=288, H=4096, I=2048, k=8, lnc=2, limit=10.0, fork="fused_fp8"),
}
DECODE = (1, 8, 32, 128)
PREFILL = (128, 2048, 8192)
BLOCK = 256
BF16, FP8 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3


def _modules(folder: Path):
    path = loader.source_path(folder, LIBRARY[0], LIBRARY[1], "src/nkilib_src/nkilib/core/moe/moe_tkg/moe_tkg.py")
    root = Path(str(path)[: -len("src/nkilib_src/nkilib/core/moe/moe_tkg/moe_tkg.py")]) / "src"
    tkg = loader.load_package(root, "nkilib_src.nkilib.core.moe.moe_tkg.moe_tkg")
    cte = importlib.import_module("nkilib_src.nkilib.core.moe.moe_cte.moe_cte")
    types = importlib.import_module("nkilib_src.nkilib.core.utils.common_types")
    return tkg, cte, types


def _weights(shape: dict, fp8: bool) -> dict:
    e, h, i = shape["E"], shape["H"], shape["I"]
    dt = FP8 if fp8 else BF16
    return dict(gu=np.zeros((e, h, 2, i), dt), dn=np.zeros((e, i, h), dt),
                gu_scale=np.ones((e, 2, i), np.float32), dn_scale=np.ones((e, h), np.float32))


def _clamps(shape: dict, prefix: str = "") -> dict:
    lim = shape["limit"]
    if not lim:
        return {}
    return {"gate_clamp_upper_limit": lim, "up_clamp_lower_limit": -lim, "up_clamp_upper_limit": lim}


def tkg_kwargs(types, shape: dict, ids: torch.Tensor, w: torch.Tensor, all_expert: bool, fp8: bool) -> dict:
    T, e_local = ids.shape[0], shape["E"]
    wt = _weights(shape, fp8)
    kw = dict(hidden_input=np.zeros((T, shape["H"]), BF16), expert_gate_up_weights=wt["gu"], expert_down_weights=wt["dn"],
              is_all_expert=all_expert, expert_affinities_scaling_mode=types.ExpertAffinityScaleMode.POST_SCALE,
              activation_fn=types.ActFnType.SiLU, **_clamps(shape))
    if fp8:
        kw.update(expert_gate_up_weights_scale=wt["gu_scale"], expert_down_weights_scale=wt["dn_scale"])
    if all_expert:
        aff = np.zeros((T, shape["E_total"]), np.float32)
        local = ids >= 0
        for t in range(T):
            for j in range(ids.shape[1]):
                if local[t, j]:
                    aff[t, int(ids[t, j])] = float(w[t, j])
        kw.update(expert_affinities=aff.astype(BF16), expert_index=np.where(local.numpy(), ids.numpy(), 0).astype(np.int32),
                  rank_id=np.zeros((1, 1), np.uint32))
    else:
        routes = [[(int(ids[t, j]), float(w[t, j])) for j in range(ids.shape[1]) if ids[t, j] >= 0] for t in range(T)]
        k_local = max(1, max(len(r) for r in routes))
        idx, aff = np.zeros((T, k_local), np.int32), np.zeros((T, e_local), np.float32)
        for t, r in enumerate(routes):
            for j, (e, a) in enumerate(r):
                idx[t, j], aff[t, e] = e, a
        kw.update(expert_affinities=aff, expert_index=idx)
    return kw


def cte_kwargs(cte, types, shape: dict, rows_per_expert: list[int], fp8: bool, T: int) -> dict:
    """moe_cte's inputs for T tokens with exactly the blocks these rows need (an expert's rows are distinct tokens)."""
    blocks = [max(1, math.ceil(r / BLOCK)) for r in rows_per_expert]
    n = sum(blocks)
    pos = np.full(n * BLOCK, T, np.int32)
    start = 0
    for r, b in zip(rows_per_expert, blocks):
        pos[start:start + r] = np.arange(r) % T
        start += b * BLOCK
    wt = _weights(shape, fp8)
    kw = dict(hidden_states=np.zeros((T + 1, shape["H"]), BF16),
              expert_affinities_masked=np.zeros(((T + 1) * shape["E"], 1), BF16),
              gate_up_proj_weight=wt["gu"], down_proj_weight=wt["dn"], token_position_to_id=pos,
              block_to_expert=np.repeat(np.arange(shape["E"]), blocks).astype(np.int32), block_size=BLOCK,
              spec=cte.MoECTESpec(implementation=cte.MoECTEImplementation.shard_on_i), is_tensor_update_accumulating=True,
              activation_function=types.ActFnType.SiLU,
              expert_affinities_scaling_mode=types.ExpertAffinityScaleMode.POST_SCALE, **_clamps(shape))
    if fp8:
        kw["quantization_config"] = cte.QuantizationConfig(
            gate_up_proj_scale=np.ones((shape["E"], 1, 2 * shape["I"]), np.float32),
            down_proj_scale=np.ones((shape["E"], 1, shape["H"]), np.float32))
    return kw, n


def _run(fn, kw) -> list:
    _, programs = nki_launch(fn, (2,), lnc=2, **kw)
    return programs


def _same(a, b) -> bool:
    return all(getattr(a, f) == getattr(b, f) for f in ("hbm_read_bytes", "hbm_write_bytes", "dma_count", "dma_runs",
                                                         "matmuls", "transposes", "engine_ops", "indirect_dmas",
                                                         "register_loads", "dynamic_iterations", "hwdge_dmas"))


def cte_model(cte, types, shape: dict, fp8: bool, T: int) -> dict:
    """Per-program (counters at N0 = E blocks, one block's counters) for T tokens (the output's initialisation and
    store scale with T, not N), checked against a run at N0 + 3."""
    e = shape["E"]
    s0 = _run(cte.moe_cte, cte_kwargs(cte, types, shape, [1] * e, fp8, T)[0])
    s1 = _run(cte.moe_cte, cte_kwargs(cte, types, shape, [BLOCK + 1] + [1] * (e - 1), fp8, T)[0])
    per = [difference(b, a) for a, b in zip(s0, s1)]
    s3 = _run(cte.moe_cte, cte_kwargs(cte, types, shape, [3 * BLOCK + 1] + [1] * (e - 1), fp8, T)[0])
    checked = all(_same(combine([(1, a), (3, p)]), c) for a, p, c in zip(s0, per, s3))
    if not checked:
        raise AssertionError(f"moe_cte counters are not affine in the block count at {shape}: the extrapolation is void")
    return {"n0": e, "base": s0, "per_block": per}


def cte_stats(model: dict, n_blocks: int) -> list:
    return [combine([(1, b), (n_blocks - model["n0"], p)]) for b, p in zip(model["base"], model["per_block"])]


def cte_programs(cte, types, shape: dict, fp8: bool, T: int, rows: list[int]) -> tuple[list, int, str]:
    """(per-program Stats, blocks, how): run directly where the routing needs few blocks (T <= 3 B + 1: an expert's
    rows are distinct tokens, so the model's extra blocks need that many), else the affine model at this T."""
    kw, n = cte_kwargs(cte, types, shape, rows, fp8, T)
    if T <= 3 * BLOCK + 1:
        return _run(cte.moe_cte, kw), n, "executed"
    return cte_stats(cte_model(cte, types, shape, fp8, T), n), n, f"extrapolated from {shape['E']}, +1, +3 blocks"


def priced(programs: list) -> dict:
    out = {}
    for name, sc in calibration.SCENARIOS.items():
        worst = max((cost.estimate(s, sc) for s in programs), key=lambda est: est.time_s)
        out[f"{name}_us"], out[f"{name}_bound"] = worst.time_s * 1e6, worst.bound_by
    out["read_MB"] = sum(s.hbm_read_bytes for s in programs) / 1e6
    out["dmas"] = max(s.dma_count for s in programs)
    return out


def rows_local(ids: torch.Tensor, e_local: int) -> list[int]:
    return [int((ids == e).any(dim=1).sum()) for e in range(e_local)]


def fork_row(folder: Path, shape: dict, T: int, ids: torch.Tensor) -> dict:
    """The GLM fork's kernel for this call, priced like the others (its fused kernel executed from ``folder``)."""
    if folder not in bench_glm_kernels.FORK_FOLDER:
        bench_glm_kernels.FORK_FOLDER.append(folder)
    dataflow, programs, _ = bench_glm_kernels.fork(shape, T, ids)
    row = {"fork_dataflow": dataflow, "fork_source": "executed" if dataflow == "fused_fp8" else "restated"}
    row.update({f"fork_{k}": v for k, v in priced(programs).items()})
    return row


def run(folder: Path, decode=DECODE, prefill=PREFILL, shapes=None) -> list[dict]:
    rows = []
    with loader.nki_mapped():
        tkg, cte, types = _modules(folder)
        for label, shape in (shapes or SHAPES).items():
            kw_ours = our_experts(shape)
            for T in sorted(set(decode) | set(prefill)):
                t0 = time.perf_counter()
                w, ids = routing_for(shape, T)
                row = {"shape": label, "T": T, "routed_local_rows": sum(rows_local(ids, shape["E"]))}
                x = torch.zeros(T, shape["H"], dtype=torch.bfloat16)
                for name in calibration.SCENARIOS:
                    which, programs = ours(kw_ours, x, w, ids, shape["lnc"], name, shape["limit"])
                    p = priced(programs)
                    row[f"ours_{name}_us"], row[f"ours_{name}_bound"], row[f"ours_{name}_kernel"] = \
                        p[f"{name}_us"], p[f"{name}_bound"], which
                    row["ours_read_MB"] = p["read_MB"]
                for fp8 in (False, True):
                    tag = "fp8" if fp8 else "bf16"
                    if T in decode:
                        for mode in ("selective", "all_expert"):
                            try:
                                p = priced(_run(tkg.moe_tkg, tkg_kwargs(types, shape, ids, w, mode == "all_expert", fp8)))
                            except AssertionError as exc:  # the kernel's own kernel_assert: it does not take this shape
                                row[f"aws_tkg_{mode}_{tag}_refused"] = str(exc).split("exception: ")[-1].split(" - ")[0]
                                continue
                            row.update({f"aws_tkg_{mode}_{tag}_{k}": v for k, v in p.items()})
                    if T in prefill:
                        programs, n, how = cte_programs(cte, types, shape, fp8, T, rows_local(ids, shape["E"]))
                        row.update({f"aws_cte_{tag}_{k}": v for k, v in priced(programs).items()})
                        row[f"aws_cte_{tag}_blocks"], row[f"aws_cte_{tag}_how"] = n, how
                if "fork" in shape:
                    row.update(fork_row(folder, shape, T, ids))
                row["interp_s"] = round(time.perf_counter() - t0, 1)
                rows.append(row)
                print(f"  {label} T={T}: ours {row['ours_fitted_us']:.0f} / {row['ours_documented_us']:.0f} us; "
                      + ", ".join(f"{k[4:-10]} {v:.0f} / {row[k[:-9] + 'documented_us']:.0f}" for k, v in row.items()
                                  if k.startswith("aws_") and k.endswith("_fitted_us"))
                      + f" [{row['interp_s']} s]", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import write_json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="local folder of AWS's sources (benchmarks/aws_differential layout)")
    ap.add_argument("--quick", action="store_true", help="T in {1, 128} decode, no prefill; prints only")
    args = ap.parse_args(argv)
    rows = run(args.folder, (1, 128), ()) if args.quick else run(args.folder)
    if not args.quick:
        write_json("aws_moe", {"shapes": SHAPES, "decode": list(DECODE), "prefill": list(PREFILL), "block": BLOCK,
                               "rows": rows, "library": {"repo": LIBRARY[0], "commit": LIBRARY[1]},
                               "method": __doc__, "cost_model": cost.__doc__})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
