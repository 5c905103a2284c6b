"""The fp32 torch reference MoE: plain, slow, obviously right. Used by tests and benchmarks only.

It takes the op's storage (see DEVELOPING.md, "The MoE op"), dequantises each routed expert in full
with :mod:`vllm_moe_w8.codec.fp8`, and computes in float32 (float64 with ``dtype=torch.float64``).
"""

from __future__ import annotations

import math

import torch

from vllm_moe_w8.codec import fp8


def dequantize_expert(codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], code_format: str) -> torch.Tensor:
    """One expert matrix [N, K] (uint8 codes + scale grid) -> float32."""
    shape = (codes.shape[0], codes.shape[1])
    return fp8.decode(codes, code_format) * fp8.expand_scales(scales, shape, block)


def dequantize_w13(w13: torch.Tensor, w13_scales: torch.Tensor, e: int, block, code_format) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and up [I, H] of expert ``e`` (w13 rows [0, I) gate, [I, 2I) up; scale rows split likewise)."""
    inter = w13.shape[1] // 2
    g = math.ceil(inter / block[0])
    gate = dequantize_expert(w13[e, :inter], w13_scales[e, :g], block, code_format)
    up = dequantize_expert(w13[e, inter:], w13_scales[e, g:], block, code_format)
    return gate, up


def activate(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", swiglu_limit: float = 0.0) -> torch.Tensor:
    if activation != "silu":
        raise ValueError(f"unsupported activation {activation!r}; the reference knows 'silu'")
    if swiglu_limit > 0:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(-swiglu_limit, swiglu_limit)
    return torch.nn.functional.silu(gate) * up


def reference_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w13_scales: torch.Tensor,
    w2: torch.Tensor,
    w2_scales: torch.Tensor,
    block_n: int,
    block_k: int,
    code_format: str,
    activation: str = "silu",
    swiglu_limit: float = 0.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The routed sum [T, H] in ``dtype``; ids < 0 contribute nothing."""
    block = (block_n, block_k)
    xf = x.to(dtype)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=dtype)
    for e in sorted(set(int(i) for i in topk_ids.flatten().tolist() if i >= 0)):
        gate, up = dequantize_w13(w13, w13_scales, e, block, code_format)
        down = dequantize_expert(w2[e], w2_scales[e], block, code_format)
        rows, slots = (topk_ids == e).nonzero(as_tuple=True)
        xe = xf[rows]
        h = activate(xe @ gate.to(dtype).T, xe @ up.to(dtype).T, activation, swiglu_limit)
        out.index_add_(0, rows, (h @ down.to(dtype).T) * topk_weights[rows, slots].to(dtype)[:, None])
    return out
