"""STAND-IN: the parameters of vllm_neuron/model/glm_moe_dsa/attention.py (@1ae1cdc, ``GlmMoeDsaAttention``,
``GlmMoeDsaRMSNorm``) and indexer.py (@02ef711, ``GlmMoeDsaIndexer``), as the fork builds them with FP8 weights:
q_a / kv_a_with_mqa whole, q_b / kv_b the rank's rows (column-parallel over the TP world), o_proj the rank's
columns; the fork's MLA cache pin ``kv_lora_rank + qk_rope_head_dim == 576``; the indexer's 32 heads of 128 with a
LayerNorm ``k_norm``. Holders only: their load is the model's (the fork's loaders), their forward is not reproduced
(attention runs NKI kernels there; the stand-in model's forward is its own)."""

import torch
from torch import nn

from .block_fp8 import BLOCK_COLS, BLOCK_ROWS, BlockFP8Linear

MLA_CACHE_HEAD_SIZE = 576
INDEXER_LAYERS = (0, 1, 2) + tuple(range(6, 75, 4))  # cache.MAIN_INDEXER_LAYER_INDICES


class GlmMoeDsaRMSNorm(nn.Module):
    def __init__(self, width, eps=1e-5, *, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, values):
        x = values.float()
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(values.dtype)


def _column(in_features, out_features, world, rank, device):
    local = out_features // world
    return BlockFP8Linear(in_features, local, row_offset=(rank * local) % BLOCK_ROWS, device=device)


def _row(in_features, out_features, world, rank, device):
    local = in_features // world
    return BlockFP8Linear(local, out_features, col_offset=(rank * local) % BLOCK_COLS, device=device)


class GlmMoeDsaAttention(nn.Module):
    def __init__(self, config, *, world, rank, device=None):
        super().__init__()
        if config.kv_lora_rank + config.qk_rope_head_dim != MLA_CACHE_HEAD_SIZE:
            raise ValueError("GLM-5.2 MLA cache must contain 512 latent and 64 rotary values")
        h, heads = config.hidden_size, config.num_attention_heads
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.q_a_proj = BlockFP8Linear(h, config.q_lora_rank, device=device)
        self.q_b_proj = _column(config.q_lora_rank, heads * qk, world, rank, device)
        self.kv_a_proj_with_mqa = BlockFP8Linear(h, config.kv_lora_rank + config.qk_rope_head_dim, device=device)
        self.kv_b_proj = _column(config.kv_lora_rank, heads * (config.qk_nope_head_dim + config.v_head_dim), world, rank, device)
        self.o_proj = _row(heads * config.v_head_dim, h, world, rank, device)
        self.q_a_layernorm = GlmMoeDsaRMSNorm(config.q_lora_rank, config.rms_norm_eps, dtype=config.torch_dtype, device=device)
        self.kv_a_layernorm = GlmMoeDsaRMSNorm(config.kv_lora_rank, config.rms_norm_eps, dtype=config.torch_dtype, device=device)
        self.indexer = None


class GlmMoeDsaIndexer(nn.Module):
    def __init__(self, config, *, num_heads=32, head_dim=128, device=None):
        super().__init__()
        self.wq_b = BlockFP8Linear(config.q_lora_rank, num_heads * head_dim, device=device)
        self.wk = BlockFP8Linear(config.hidden_size, head_dim, device=device)
        self.weights_proj = nn.Linear(config.hidden_size, num_heads, bias=False, dtype=config.torch_dtype, device=device)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6, dtype=config.torch_dtype, device=device)
