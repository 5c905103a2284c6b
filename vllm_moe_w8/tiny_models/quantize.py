"""FP8 quantisation as the official exporters do it (per 128x128 block or per output channel, scale =
amax / 448) and the exact dequantisation the twin uses.
"""

from __future__ import annotations

import math

import torch

from vllm_moe_w8.tiny_models.layout import BLOCK, FP8_MAX

def quantize_block(w: torch.Tensor, scale_dtype: torch.dtype, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (float8_e4m3fn [N, K], scale_inv [ceil(N/b), ceil(K/b)] in scale_dtype).

    Each block's scale is its amax / 448, rounded to ``scale_dtype``; codes are w / scale rounded to
    nearest (clamped at +-448, since a scale rounded down can push the amax a hair above 448).
    """
    n, k = w.shape
    gn, gk = math.ceil(n / block), math.ceil(k / block)
    padded = torch.zeros(gn * block, gk * block, dtype=torch.float32)
    padded[:n, :k] = w
    tiles = padded.view(gn, block, gk, block)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny).to(scale_dtype)
    expanded = scale.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    codes = (w / expanded).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def quantize_channel(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (float8_e4m3fn [N, K], weight_scale [N, 1]): compressed-tensors ``strategy: channel``."""
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny).to(scale_dtype)
    codes = (w / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def dequantize_exact(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float8_e4m3fn [N, K] x scale -> fp32: exact for bf16/fp16 scales, one fp32 rounding for fp32 scales.

    ``block`` (bn, bk) for a block grid (pad-then-crop covers ragged edges); None for per-channel.
    Uses torch's own float8_e4m3fn conversion, independent of this project's codecs.
    """
    w = codes.to(torch.float32)
    s = scale.to(torch.float32)
    n, k = w.shape
    if block is None:
        return w * s.reshape(n, 1)
    bn, bk = block
    gn, gk = s.shape
    padded = torch.zeros(gn * bn, gk * bk, dtype=torch.float32)
    padded[:n, :k] = w
    padded = (padded.view(gn, bn, gk, bk) * s.view(gn, 1, gk, 1)).view(gn * bn, gk * bk)
    return padded[:n, :k].contiguous()
