"""The vllm-neuron fork's GLM expert kernels (jinhuang12/vllm-neuron) the harness can load with only the NKI module
paths mapped: ``functional/moe/moe_fused_fp8.py`` (imports nki only). Its siblings cannot be: ``expert_decode.py``
imports ``vllm_neuron.utils.neuron_utils`` and the package-relative ``fused_fp8_pack``, ``model/glm_moe_dsa/
block_fp8_moe.py`` imports ``libtorch_neuronx_lite`` (Neuron's runtime) - they stay restated
(``kernels/nki_cpu/glm_dataflows.py``)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from . import references as R
from .case import Case

FORK = ("jinhuang12/vllm-neuron", "625d6b89ca6f3be3cec838dae1c57a31d4cfd23d")
FUSED = "vllm_neuron/functional/moe/moe_fused_fp8.py"
FP8, BF16 = ml_dtypes.float8_e4m3, ml_dtypes.bfloat16


def fused_inputs(rng, *, T, H, I, E, q, limit=10.0, values=True):  # noqa: E741
    """The kernel's documented operands: hidden [T+1, H] (last row zero), packed FP8 weights [E, 3 I/128, 128, H/128,
    128] and fp32 scales [E, 3 I/128, H/128], one block of q rows per expert (token ids or -1), affinities
    [(T+1) E, 1] (the last E zero), SwiGLU bounds [128, 3]."""
    ni, nh = I // 128, H // 128
    hidden = np.zeros((T + 1, H), np.float32)
    if values:
        hidden[:T] = rng.standard_normal((T, H))
    weights = (rng.integers(-8, 9, (E, 3 * ni, 128, nh, 128)) * (0.25 if values else 0)).astype(FP8)
    scales = (rng.random((E, 3 * ni, nh)) * H ** -0.5 + 0.01).astype(np.float32)
    row_ids = np.full((E, q), -1, np.int32)
    aff = np.zeros(((T + 1) * E, 1), np.float32)
    for e in range(E):
        toks = rng.choice(T, size=min(q, T), replace=False)[: rng.integers(1, min(q, T) + 1)]
        row_ids[e, :toks.size] = toks
        aff[toks * E + e, 0] = rng.random(toks.size)
    bounds = np.tile(np.array([[limit, -limit, limit]], np.float32), (128, 1))
    return (hidden.astype(BF16), weights, scales, row_ids, np.arange(E, dtype=np.int32).reshape(E, 1), aff, bounds), {}


def fused_reference(hidden, weights, scales, row_ids, expert_ids, aff, bounds):
    """out[b, r] = aff(token, e) * down(silu(min(g, L)) * clip(u, -L, L)) for the block's expert e, the packed
    panels dequantised tile by tile (panel p, hidden block hb: weights[e, p, h mod 128, hb, i mod 128] x
    scales[e, p, hb]; down panels [i mod 128, hb, h mod 128])."""
    E, panels, _, nh, _ = weights.shape
    ni, T = panels // 3, hidden.shape[0] - 1
    w, s = R.f64(weights), R.f64(scales)
    x = R.f64(hidden)
    blocks, q = row_ids.shape
    out, mag, absout = np.zeros((blocks, q, nh * 128)), np.zeros((blocks, q, nh * 128)), np.zeros((blocks, q, nh * 128))
    for b in range(blocks):
        e = int(expert_ids[b, 0])
        tile = w[e] * s[e][:, None, :, None]  # [panels, 128, nh, 128]
        wg = tile[:ni].transpose(2, 1, 0, 3).reshape(nh * 128, ni * 128)  # [h, i]
        wu = tile[ni:2 * ni].transpose(2, 1, 0, 3).reshape(nh * 128, ni * 128)
        wd = tile[2 * ni:].transpose(0, 1, 2, 3).reshape(ni * 128, nh, 128).reshape(ni * 128, nh * 128)  # [i, h]
        for r in range(q):
            tok = int(row_ids[b, r]) if row_ids[b, r] >= 0 else T
            a = float(aff[tok * E + e, 0])
            y, m = R.expert_mlp(x[tok:tok + 1], wg, wu, wd, "silu", float(bounds[0, 0]), float(bounds[0, 1]),
                                float(bounds[0, 2]))
            out[b, r], mag[b, r], absout[b, r] = a * y[0], abs(a) * m[0], abs(a * y[0])
    return out, mag, absout


def _fused_case():
    def make(_m, rng):
        return fused_inputs(rng, T=6, H=512, I=256, E=3, q=4)

    def check(outs, args, _kw):
        ref, mag, absout = fused_reference(*args)
        return R.within(outs[0], ref, R.moe_bound(mag, absout, 1, BF16))

    return Case("fork-moe-fused-fp8", FORK, FUSED, "moe_fused_fp8_kernel", make, check, grid=2,
                bound="bf16 activation: 2^-8 (4 sum|wd||h terms| + 2 |a y|)", tags=("moe", "glm"))


CASES = [_fused_case()]
