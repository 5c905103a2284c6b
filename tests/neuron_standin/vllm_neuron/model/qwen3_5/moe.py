"""STAND-IN: vllm_neuron/model/qwen3_5/moe.py Qwen3_5SparseMoeBlock (fork whn09/vllm-neuron @3de9ea3):
its attributes, parameters and loaders, the shared expert and the combine; the routed BF16 kernels are
not reproduced (neuron-w8 replaces them)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from vllm_neuron.parallel import neuron_parallel_state as ps
from vllm_neuron.utils.weight_loader import set_weight_loader, transposed_shard_loader

from .flags import SEQUENCE_PARALLEL


class Qwen3_5SparseMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        st = ps.state()
        self.dtype = config.torch_dtype
        self.eps = config.rms_norm_eps
        self.tp_group = ps.get_tp_group()
        self.world_size = self.tp_group.world_size
        self.hidden_size = config.hidden_size
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.intermediate_size = config.moe_intermediate_size
        if st["ep_enabled"]:
            self.ep_degree, self.ep_rank = ps.get_neuron_ep_degree(), ps.get_neuron_ep_rank()
            self.ep_tp_group = ps.get_neuron_ep_tp_group()
            self.tp_degree = self.ep_tp_group.world_size
        else:
            self.ep_degree, self.ep_rank, self.ep_tp_group, self.tp_degree = 1, 0, self.tp_group, self.world_size
        self.num_local_experts = self.num_experts // self.ep_degree
        self.inter_per_rank = self.intermediate_size // self.tp_degree
        self.shared_per_rank = config.shared_expert_intermediate_size // self.world_size
        h, i_r, s_r = self.hidden_size, self.inter_per_rank, self.shared_per_rank
        self.experts_gate_up_weight = nn.Parameter(torch.empty(self.num_local_experts, h, 2, i_r, dtype=self.dtype))
        self.experts_down_weight = nn.Parameter(torch.empty(self.num_local_experts, i_r, h, dtype=self.dtype))
        self.router_weight = nn.Parameter(torch.empty(self.num_experts, h, dtype=self.dtype))
        self.shared_gate_proj_weight = nn.Parameter(torch.empty(h, s_r, dtype=self.dtype))
        self.shared_up_proj_weight = nn.Parameter(torch.empty(h, s_r, dtype=self.dtype))
        self.shared_down_proj_weight = nn.Parameter(torch.empty(s_r, h, dtype=self.dtype))
        for p in (self.shared_gate_proj_weight, self.shared_up_proj_weight):
            set_weight_loader(p, transposed_shard_loader(1, s_r))
        set_weight_loader(self.shared_down_proj_weight, transposed_shard_loader(0, s_r))
        self.shared_expert_gate_weight = nn.Parameter(torch.empty(1, h, dtype=self.dtype))

    def _shared_expert(self, normed):
        out = (F.silu(normed @ self.shared_gate_proj_weight) * (normed @ self.shared_up_proj_weight)) @ self.shared_down_proj_weight
        gate = normed @ self.shared_expert_gate_weight.transpose(0, 1)
        return out * torch.sigmoid(gate.float()).to(out.dtype)

    def _combine(self, out, is_prefill):
        if self.world_size == 1:
            return out
        if is_prefill and SEQUENCE_PARALLEL:
            return self.tp_group.reduce_scatter(out, dim=0).contiguous()
        return self.tp_group.all_reduce(out)

    def forward(self, hidden_states, is_prefill, norm, positions=None, rank=None):
        raise NotImplementedError("stand-in: the BF16 NKI forward is not reproduced")
