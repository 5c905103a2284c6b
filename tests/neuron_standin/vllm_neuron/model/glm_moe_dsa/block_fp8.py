"""STAND-IN: the parts of vllm_neuron/model/glm_moe_dsa/block_fp8.py (fork @41758812) the MoE path touches.

``BlockFP8Linear``: parameters ``weight`` (``torch.float8_e4m3fn`` [out, in]) and ``weight_scale_inv`` (fp32 grid of
128x128 blocks covering the local shard at ``row_offset`` / ``col_offset``). The fork's storage constants
``FP8_STORAGE_SCALE = 240/448`` (bytes re-rounded on load) and ``FP8_INVERSE_SCALE_ADJUSTMENT = 448/240`` (scales).
Forward: the fork's non-Neuron branch (``can_run_kernel`` is false off Neuron): F.linear with the weight
dequantised to the input's dtype. Its NKI kernel is not reproduced."""

import math

import torch
import torch.nn.functional as F
from torch import nn

BLOCK_ROWS = 128
BLOCK_COLS = 128
TRN2_FP8_MAX = 240.0
OCP_FP8_MAX = 448.0
FP8_STORAGE_SCALE = TRN2_FP8_MAX / OCP_FP8_MAX
FP8_INVERSE_SCALE_ADJUSTMENT = OCP_FP8_MAX / TRN2_FP8_MAX


def scale_shape_for_local_weight(weight_shape, row_offset, col_offset):
    return (math.ceil((row_offset + weight_shape[0]) / BLOCK_ROWS), math.ceil((col_offset + weight_shape[1]) / BLOCK_COLS))


def dequantize_block_fp8(weight, weight_scale_inv, *, row_offset=0, col_offset=0):
    expected = scale_shape_for_local_weight(tuple(weight.shape), row_offset, col_offset)
    if tuple(weight_scale_inv.shape) != expected:
        raise ValueError(f"scale shape {tuple(weight_scale_inv.shape)} does not cover weight {tuple(weight.shape)}")
    rows = (torch.arange(weight.shape[0], device=weight.device) + row_offset) // BLOCK_ROWS
    cols = (torch.arange(weight.shape[1], device=weight.device) + col_offset) // BLOCK_COLS
    return weight.float() * weight_scale_inv[rows[:, None], cols[None, :]].float()


def block_fp8_linear(hidden, weight, weight_scale_inv, *, row_offset=0, col_offset=0):
    flat = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    w = dequantize_block_fp8(weight, weight_scale_inv, row_offset=row_offset, col_offset=col_offset).to(flat.dtype)
    return F.linear(flat, w).reshape(*hidden.shape[:-1], weight.shape[0])


class BlockFP8Linear(nn.Module):
    def __init__(self, in_features, out_features, *, row_offset=0, col_offset=0, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.row_offset, self.col_offset = row_offset, col_offset
        self.register_parameter("bias", None)
        shape = (out_features, in_features)
        self.weight = nn.Parameter(torch.empty(shape, dtype=torch.float8_e4m3fn, device=device), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.empty(scale_shape_for_local_weight(shape, row_offset, col_offset), dtype=torch.float32, device=device),
            requires_grad=False)

    def forward(self, hidden):
        return block_fp8_linear(hidden, self.weight, self.weight_scale_inv, row_offset=self.row_offset,
                                col_offset=self.col_offset)
