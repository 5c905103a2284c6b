"""STAND-IN: vllm_neuron/model/glm_moe_dsa/mlp.py (fork @41758812) GlmMoeDsaSwiGLUMLP: one TP shard of a SwiGLU MLP
(gate/up rows, down columns of shard ``tensor_parallel_rank``), block-FP8 when the config is quantised; the caller
sums the ranks' contributions. ``shared_from_config`` sizes it ``moe_intermediate_size * n_shared_experts``."""

import torch.nn.functional as F
from torch import nn

from .block_fp8 import BLOCK_COLS, BLOCK_ROWS, BlockFP8Linear


class GlmMoeDsaSwiGLUMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size, *, tensor_parallel_size=1, tensor_parallel_rank=0,
                 fp8_weights=False, dtype=None, device=None):
        super().__init__()
        if intermediate_size % tensor_parallel_size:
            raise ValueError(f"intermediate_size={intermediate_size} is not divisible by TP={tensor_parallel_size}")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.tensor_parallel_size, self.tensor_parallel_rank = tensor_parallel_size, tensor_parallel_rank
        self.local_intermediate_size = local = intermediate_size // tensor_parallel_size
        start = tensor_parallel_rank * local
        if fp8_weights:
            self.gate_proj = BlockFP8Linear(hidden_size, local, row_offset=start % BLOCK_ROWS, device=device)
            self.up_proj = BlockFP8Linear(hidden_size, local, row_offset=start % BLOCK_ROWS, device=device)
            self.down_proj = BlockFP8Linear(local, hidden_size, col_offset=start % BLOCK_COLS, device=device)
        else:
            self.gate_proj = nn.Linear(hidden_size, local, bias=False, dtype=dtype, device=device)
            self.up_proj = nn.Linear(hidden_size, local, bias=False, dtype=dtype, device=device)
            self.down_proj = nn.Linear(local, hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, hidden_states):
        return self.down_proj(F.silu(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))

    @classmethod
    def dense_from_config(cls, config, *, tensor_parallel_size=64, tensor_parallel_rank=0, device=None):
        return cls(config.hidden_size, config.intermediate_size, tensor_parallel_size=tensor_parallel_size,
                   tensor_parallel_rank=tensor_parallel_rank, fp8_weights=bool(config.quantization_config),
                   dtype=config.torch_dtype, device=device)

    @classmethod
    def shared_from_config(cls, config, *, tensor_parallel_size=64, tensor_parallel_rank=0, device=None):
        return cls(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                   tensor_parallel_size=tensor_parallel_size, tensor_parallel_rank=tensor_parallel_rank,
                   fp8_weights=bool(config.quantization_config), dtype=config.torch_dtype, device=device)
