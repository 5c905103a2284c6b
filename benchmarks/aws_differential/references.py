"""Numpy references for the AWS kernels (written here from the math the kernels' docs state) and the named bounds
they are compared with.

A bound is a claim (DEVELOPING.md: every tolerance is named and justified): ``bit_exact`` where the arithmetic is
exact in the kernel's dtypes; otherwise an elementwise bound built from the unit roundoff of the dtypes the kernel
stores its intermediates in (bf16 ``2**-8``, fp16 ``2**-11``, fp32 ``2**-24``), times the magnitude of the terms
that rounding touches (sums of ``|a| |b|``, not ``|a b|``, so cancellation cannot hide an error). Each case's bound
is checked against a realistic fault in tests/test_aws_differential.py (the ``accumulate=None`` bug the issue
found: tiled matmuls ~70 % of the output's magnitude off).
"""

from __future__ import annotations

import math

import numpy as np

U = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24, "float64": 0.0}


def f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def unit(dtype) -> float:
    return U[np.dtype(dtype).name]


# --- comparisons: each returns (ok, worst excess over the bound, description) -----------------------------------

def bit_exact(out, ref, mask=None):
    out, ref = np.asarray(out), np.asarray(ref)
    if out.shape != ref.shape:
        return False, math.inf, f"shape {out.shape} != reference {ref.shape}"
    same = (out.astype(np.float64) == ref.astype(np.float64)) | (np.isnan(f64(out)) & np.isnan(f64(ref)))
    if mask is not None:
        same |= ~mask
    return bool(same.all()), float((~same).sum()), f"{int((~same).sum())} of {same.size} elements differ"


def within(out, ref, bound, mask=None):
    out64, ref64 = f64(out), f64(ref)
    if out64.shape != ref64.shape:
        return False, math.inf, f"shape {out64.shape} != reference {ref64.shape}"
    err = np.abs(out64 - ref64)
    err = np.where(np.isnan(err), np.inf, err)
    if mask is not None:
        err = np.where(mask, err, 0.0)
    ratio = err / np.maximum(bound, 1e-300)
    worst = float(ratio.max()) if ratio.size else 0.0
    mag = float(np.abs(ref64).max()) if ref64.size else 0.0
    return worst <= 1.0, worst, f"max |err| {float(err.max()):.3g} (max |ref| {mag:.3g}), {worst:.3g} x the bound"


# --- simple kernels --------------------------------------------------------------------------------------------

def matmul_t(lhsT, rhs):
    """(lhsT.T @ rhs, sum |lhsT.T| |rhs|) in float64."""
    a, b = f64(lhsT), f64(rhs)
    return a.T @ b, np.abs(a).T @ np.abs(b)


def matmul_bound(mag, k, out_dtype, ref):
    """fp32 accumulation of k exact products (k * 2**-24 * magnitude) plus one rounding to the output dtype."""
    return k * U["float32"] * mag + unit(out_dtype) * np.abs(ref)


def transpose2d(a, shape2d):
    p = a.shape[0]
    x, y = shape2d
    return np.transpose(a.reshape(p, x, y), (0, 2, 1)).reshape(p, x * y)


def avgpool2d(a, pool):
    c, h, w = a.shape
    return f64(a).reshape(c, h // pool, pool, w // pool, pool).mean(axis=(2, 4))


def mamba(delta, u, A, B, C):
    """Mamba's selective scan (the math of aws-neuron-sdk nki/examples/fused_mamba/mamba_torch.py, in float64)."""
    d, uu, a, b, c = (f64(x) for x in (delta, u, A, B, C))
    dA = np.exp(d[:, :, None, :] * a[None, :, :, None])
    dBu = d[:, :, None, :] * b[:, None, :, :] * uu[:, :, None, :]
    state = np.zeros(dA.shape[:-1])
    scan = np.empty_like(dA)
    for i in range(dA.shape[-1]):
        state = dA[..., i] * state + dBu[..., i]
        scan[..., i] = state
    return (c[:, None, :, :] * scan).sum(axis=2), (np.abs(c[:, None, :, :]) * np.abs(scan)).sum(axis=2)


def gelu(x):
    from math import erf

    return 0.5 * x * (1.0 + np.vectorize(erf)(x / math.sqrt(2.0)))


def nonzero_with_count(a, offset=0, pad=-1):
    """The instruction's documented behaviour per partition; only partitions 0, 16, ..., 112 are defined."""
    p, n = a.shape
    out = np.full((p, n + 1), pad, dtype=np.int64)
    mask = np.zeros((p, n + 1), dtype=bool)
    for row in range(0, p, 16):
        idx = np.flatnonzero(a[row] != 0)
        out[row, :idx.size] = idx + offset
        out[row, n] = idx.size
        mask[row] = True
    return out, mask


# --- MoE --------------------------------------------------------------------------------------------------------

def act(name: str, g):
    if name == "silu":
        return g / (1.0 + np.exp(-g))
    if name == "swish":  # nki-library's ActFnType.Swish: x * sigmoid(1.702 x) (its moe_tkg_torch.py)
        return g / (1.0 + np.exp(-1.702 * g))
    raise ValueError(name)


def expert_mlp(x, wg, wu, wd, act_name, gate_hi=None, up_lo=None, up_hi=None):
    """(out [T, H], magnitude [T, H]) of one expert in float64; the magnitude bounds what bf16 rounding of the
    gate/up/h intermediates can move: sum_i |wd[i, n]| (|act(g_i)| + 1.2 |g_i|) |u_i| (|act'| <= 1.2 for silu/swish)."""
    g, u = x @ wg, x @ wu
    if gate_hi is not None:
        g = np.minimum(g, gate_hi)
    if up_lo is not None or up_hi is not None:
        u = np.clip(u, -np.inf if up_lo is None else up_lo, np.inf if up_hi is None else up_hi)
    a = act(act_name, g)
    h = a * u
    mag_h = (np.abs(a) + 1.2 * np.abs(g)) * np.abs(u)
    return h @ wd, mag_h @ np.abs(wd)


def moe_bound(mag_h, out_abs, top_k, dtype):
    """bf16/fp16 intermediates: 4 roundings on h (gate, up, act(gate), the product), k + 1 on the output sum."""
    return unit(dtype) * (4.0 * mag_h + (top_k + 1) * out_abs) + 64 * U["float32"] * mag_h
