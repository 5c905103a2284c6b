"""Exactness of the Trn2 expert storages for GLM, against the checkpoint's own E4M3FN decode (issue #22).

Three ways to keep a block-FP8 (128x128, amax/448) checkpoint's experts as 1-byte Trn2 ``float8_e4m3`` values:

* **neuron-w8 pow2** (``vllm_moe_w8.codec.fp8.repack``, mode pow2): a block holding an e4m3fn-only code (>= 0x78)
  is halved and its scale doubled; every other block keeps its bytes and scale bit for bit. Stored as uint8.
* **vllm-neuron GLM-5.3-Flash** (fork jinhuang12/vllm-neuron, ``model/glm5_next/weight_loaders_fp8.py`` in its
  stored version with ``_FP8_WEIGHT_DOWNSCALE = 0.5``; the versions @659d671 and @0a5c4ac still used 240/448 there):
  **every** byte ``(w.float() * 0.5).clamp(+-240)`` cast to ``torch.float8_e4m3fn`` (``downscale_fp8_weight_bytes``),
  every block scale ``* 2.0`` then floored at ``MINVAL = 1e-5`` (``compensate_block_scales``), on trn2 (clamp 240);
  Trn2 reads the bytes as ``float8_e4m3`` under the runner's ``--experimental-unsafe-fp8e4m3fn-as-fp8e4m3`` flag.
* **vllm-neuron GLM-5** (same fork, ``model/glm_moe_dsa/block_fp8.py`` @4175881 ``FP8_STORAGE_SCALE = 240/448``,
  applied in ``model.py`` @02ef711 ``_fp8_weight_loader`` / ``_fp8_scale_loader``): every byte
  ``(w.float() * 240/448)`` cast to ``torch.float8_e4m3fn``, every scale ``* 448/240`` (no floor).

The fork's storages are modelled here from those statements (nothing copied): the arithmetic in float32 as torch
does it, the casts by ``ml_dtypes`` (round to nearest even; ``tests/test_glm_fp8_storage.py`` checks them against
torch's own cast), the stored bytes decoded as ``ml_dtypes.float8_e4m3`` (what the Trn2 kernel reads). The truth is
``ml_dtypes.float8_e4m3fn`` decode x the checkpoint's scale, in float64.

Run: ``.venv/bin/python -m benchmarks.bench_glm_fp8_storage`` -> ``benchmarks/results/glm_fp8_storage.json``.
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

FN, E4M3 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3
BLOCK = 128
TRN2_MAX = 240.0
# The fork's constants, as its sources state them (DEVELOPING.md's vllm-neuron table pins the files read).
GLM5NEXT_WEIGHT_FACTOR, GLM5NEXT_SCALE_FACTOR, GLM5NEXT_MINVAL = 0.5, 2.0, 1e-5
GLM5_WEIGHT_FACTOR, GLM5_SCALE_FACTOR = 240.0 / 448.0, 448.0 / 240.0
METHODS = ("neuron-w8 pow2", "fork GLM-5.3-Flash halve", "fork GLM-5 240/448")


# -- the storages ----------------------------------------------------------------------------------------------
def expand(scales: np.ndarray, shape: tuple[int, int], block: tuple[int, int]) -> np.ndarray:
    return np.repeat(np.repeat(scales, block[0], axis=0), block[1], axis=1)[: shape[0], : shape[1]]


def checkpoint_decode(codes: np.ndarray, scales: np.ndarray, block=(BLOCK, BLOCK)) -> np.ndarray:
    """The truth: E4M3FN value x its block's scale, float64."""
    return codes.view(FN).astype(np.float64) * expand(scales.astype(np.float64), codes.shape, block)


def pow2_storage(codes: np.ndarray, scales: np.ndarray, block=(BLOCK, BLOCK)):
    """(Trn2 bytes, float32 scale grid, RepackStats) from the project's own repack."""
    import torch

    from vllm_moe_w8.codec.fp8 import repack

    r = repack(torch.from_numpy(codes.copy()), torch.from_numpy(scales.astype(np.float32)), mode="pow2", block=block)
    return r.codes.numpy(), r.scale_grid.numpy(), r.stats


def fork_storage(codes: np.ndarray, scales: np.ndarray, weight_factor: float, scale_factor: float, minval: float | None):
    """(stored bytes, float32 scales) of a multiply-and-recast storage: float32 product, e4m3fn cast, scale x factor."""
    v = np.clip(codes.view(FN).astype(np.float32) * np.float32(weight_factor), -TRN2_MAX, TRN2_MAX)
    s = scales.astype(np.float32) * np.float32(scale_factor)
    if minval is not None:
        s = np.maximum(s, np.float32(minval))
    return v.astype(FN).view(np.uint8), s


def storage(method: str, codes: np.ndarray, scales: np.ndarray, block=(BLOCK, BLOCK)):
    """(Trn2 bytes, float32 scales) of one of :data:`METHODS`."""
    if method == METHODS[0]:
        return pow2_storage(codes, scales, block)[:2]
    if method == METHODS[1]:
        return fork_storage(codes, scales, GLM5NEXT_WEIGHT_FACTOR, GLM5NEXT_SCALE_FACTOR, GLM5NEXT_MINVAL)
    if method == METHODS[2]:
        return fork_storage(codes, scales, GLM5_WEIGHT_FACTOR, GLM5_SCALE_FACTOR, None)
    raise ValueError(f"unknown storage {method!r}; choose one of {METHODS}")


def bytes_rerounded(method: str, codes: np.ndarray, stored: np.ndarray, block_factor: np.ndarray | None = None) -> int:
    """Values whose stored byte is not the original value times the storage's exact byte factor (1/2, or 15/28 =
    240/448): the re-rounding alone, apart from the scale's float32 rounding. pow2 passes its per-element factor."""
    orig, new = codes.view(FN).astype(np.float64), stored.view(E4M3).astype(np.float64)
    num, den = {METHODS[1]: (1, 2), METHODS[2]: (15, 28)}.get(method, (1, 1))
    if block_factor is not None:
        return int((new != orig * block_factor).sum())  # exact: halving a float64 is exact
    return int((new * den != orig * num).sum())  # small integers x powers of two: exact in float64


def trn2_decode(stored: np.ndarray, scales: np.ndarray, block=(BLOCK, BLOCK)) -> np.ndarray:
    """What the Trn2 kernel computes from stored bytes: float8_e4m3 value x scale, float64."""
    return stored.view(E4M3).astype(np.float64) * expand(scales.astype(np.float64), stored.shape, block)


# -- the comparison ---------------------------------------------------------------------------------------------
def compare(truth: np.ndarray, got: np.ndarray, block=(BLOCK, BLOCK)) -> dict:
    """Fraction of values changed, max |error| per block amax, max relative error, NRMSE, values sent to zero."""
    err = np.abs(got - truth)
    n, k = truth.shape
    bn, bk = block
    t = np.abs(truth).reshape(n // bn, bn, k // bk, bk)
    e = err.reshape(n // bn, bn, k // bk, bk)
    amax = t.max(axis=(1, 3))
    block_err = np.where(amax > 0, e.max(axis=(1, 3)) / np.where(amax > 0, amax, 1), 0)
    nz = truth != 0
    return {
        "values": int(truth.size),
        "values_changed": int((got != truth).sum()),
        "fraction_changed": float((got != truth).mean()),
        "max_error_per_block_amax": float(block_err.max()),
        "max_relative_error": float((err[nz] / np.abs(truth[nz])).max()) if nz.any() else 0.0,
        "nrmse": float(np.sqrt((err**2).sum() / (truth**2).sum())),
        "nonzero_to_zero": int((nz & (got == 0)).sum()),
    }


def code_rows() -> dict[str, tuple[np.ndarray, tuple[int, int]]]:
    """The 254 finite E4M3FN codes as one block, and the 240 codes both formats share (a block without 0x78..0x7E)."""
    mags = np.arange(0x7F, dtype=np.uint8)
    shared = mags[mags < 0x78]
    return {"all 254 finite codes (one block)": (np.stack([mags, mags | 0x80]), (2, mags.size)),
            "240 shared codes (block with no code >= 0x78)": (np.stack([shared, shared | 0x80]), (2, shared.size))}


def changed_magnitudes(codes: np.ndarray, truth: np.ndarray, got: np.ndarray) -> list[str]:
    return sorted({f"0x{int(c) & 0x7F:02X}" for c in codes[got != truth].ravel()})


def quantise_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A real checkpoint's quantiser: per 128x128 block scale = amax / 448 (float32), codes = E4M3FN(w / scale)."""
    n, k = w.shape
    amax = np.abs(w).reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK).max(axis=(1, 3)).astype(np.float32)
    s = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
    q = np.clip(w.astype(np.float32) / expand(s, w.shape, (BLOCK, BLOCK)), -448.0, 448.0)
    return q.astype(FN).view(np.uint8), s


def weight_cases(rng: np.random.Generator, blocks: int) -> dict[str, np.ndarray]:
    """[g*128, g*128] float32 weights: normal, heavy-tailed, and blocks whose magnitudes spread over three decades."""
    g = int(round(blocks**0.5))
    shape = (g * BLOCK, g * BLOCK)
    spread = np.exp(rng.uniform(np.log(1e-4), np.log(1e-1), size=(g, g)))
    return {
        "normal, sigma 0.02": (0.02 * rng.standard_normal(shape)).astype(np.float32),
        "Student-t nu=3 (heavy tails), 0.02": (0.02 * rng.standard_t(3, shape)).astype(np.float32),
        "block sigma log-uniform 1e-4..1e-1, t nu=5": (expand(spread, shape, (BLOCK, BLOCK)) * rng.standard_t(5, shape)).astype(np.float32),
    }


def layout_rows() -> list[dict]:
    """Per-rank routed-expert bytes at the GLM layouts recorded in configs/ (``vllm-moe-w8 plan``)."""
    from vllm_moe_w8.tools.plan import load_model_entry, make_plan

    rows = []
    for stem in ("glm-5.3-flash", "glm-5"):
        entry = load_model_entry(stem)
        for lay in entry.get("layouts", []):
            p = make_plan(entry["config"], tp=lay["tp"], ep_size=lay["ep_size"], lnc=lay["lnc"])
            rows.append({"model": entry["name"], "layout": lay["name"], "tp": p["tp"], "ep": p["ep_size"], "lnc": p["lnc"],
                         "chips": p["chips"], "E_local": p["experts_per_rank"], "I_rank": p["moe_intermediate_per_rank"],
                         "fp8_codes_GB": p["expert_bytes_per_rank_w8_codes"] / 1e9, "fp8_with_scales_GB": p["expert_bytes_per_rank_w8"] / 1e9,
                         "bf16_GB": p["expert_bytes_per_rank_bf16"] / 1e9, "hbm_GB": p["hbm_bytes_per_rank"] / 1e9,
                         "kv_room_w8_GB": p["fit"]["w8"]["free_bytes_for_kv"] / 1e9, "plan": lay["plan"]})
    return rows


def run(blocks: int = 256, seed: int = 0) -> dict:
    out = {"codes": [], "blocks": [], "floored_blocks": {}}
    for case, (codes, block) in code_rows().items():
        scales = np.ones((1, 1), np.float32)
        truth = checkpoint_decode(codes, scales, block)
        for m in METHODS:
            stored, s = storage(m, codes, scales, block)
            got = trn2_decode(stored, s, block)
            factor = expand(scales / s.astype(np.float64), codes.shape, block) if m == METHODS[0] else None
            out["codes"].append({"case": case, "method": m, **compare(truth, got, block),
                                 "bytes_rerounded": bytes_rerounded(m, codes, stored, factor),
                                 "changed_magnitudes": changed_magnitudes(codes, truth, got)})
    rng = np.random.default_rng(seed)
    for case, w in weight_cases(rng, blocks).items():
        codes, scales = quantise_blocks(w)
        truth = checkpoint_decode(codes, scales)
        for m in METHODS:
            stored, s = storage(m, codes, scales)
            factor = expand(scales / s.astype(np.float64), codes.shape, (BLOCK, BLOCK)) if m == METHODS[0] else None
            row = {"case": case, "method": m, "blocks": int(scales.size), **compare(truth, trn2_decode(stored, s)),
                   "bytes_rerounded": bytes_rerounded(m, codes, stored, factor)}
            if m == METHODS[1]:
                row["blocks_floored"] = int((scales.astype(np.float32) * np.float32(GLM5NEXT_SCALE_FACTOR) < np.float32(GLM5NEXT_MINVAL)).sum())
            out["blocks"].append(row)
    out["layouts"] = layout_rows()
    return out


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import print_table, write_json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=256, help="128x128 blocks per weight distribution (a square number)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    res = run(args.blocks, args.seed)
    cols = ["case", "method", "values_changed", "bytes_rerounded", "fraction_changed", "max_error_per_block_amax", "max_relative_error",
            "nrmse", "nonzero_to_zero"]
    print_table([{**r, "changed_magnitudes": len(r["changed_magnitudes"])} for r in res["codes"]], cols + ["changed_magnitudes"])
    print()
    print_table(res["blocks"], cols + ["blocks_floored"])
    print()
    print_table(res["layouts"], ["model", "layout", "tp", "ep", "lnc", "E_local", "I_rank", "fp8_codes_GB", "fp8_with_scales_GB", "bf16_GB", "kv_room_w8_GB"])
    write_json("glm_fp8_storage", {"blocks_per_case": args.blocks, "seed": args.seed, "block": [BLOCK, BLOCK], **res})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
