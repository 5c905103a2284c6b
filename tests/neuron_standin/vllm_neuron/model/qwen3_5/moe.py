"""STAND-IN: vllm_neuron/model/qwen3_5/moe.py Qwen3_5SparseMoeBlock (fork whn09/vllm-neuron @3de9ea3): its
attributes, parameters and loaders, its construction checks, the shared expert and the combine; the routed BF16
kernels are not reproduced (neuron-w8 replaces them).

As the fork: the MoE fields come from ``config.moe`` (``Qwen3_5MoeParams``; ValueError without it),
``norm_topk_prob=False`` is refused, EP is vLLM's ``get_current_vllm_config().parallel_config.enable_expert_parallel``
(TP when there is no current config: AssertionError/RuntimeError), EP with ``data_parallel_size > 1`` is refused, and
the fused kernels' size rules hold (``hidden_size % 256``, ``moe_intermediate_size / tp_degree`` a multiple of 128,
experts over ``ep_degree``, the shared expert over the world). The pins are parameters here
(``HIDDEN_MULTIPLE``, ``INTER_PER_RANK_MULTIPLE``). One stand-in difference: the TP group is the stand-in's
``neuron_parallel_state.get_tp_group()`` (thread groups); the fork takes vLLM's ``get_tp_group()``."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from vllm_neuron.parallel import neuron_parallel_state as ps
from vllm_neuron.utils.weight_loader import set_weight_loader, transposed_shard_loader

from .flags import SEQUENCE_PARALLEL

HIDDEN_MULTIPLE = 256  # the fused decode MoE kernel's hidden_size rule
INTER_PER_RANK_MULTIPLE = 128  # moe_intermediate_size / tp_degree rule of the fused decode kernel


def _expert_parallel() -> tuple[bool, int]:
    from vllm.config import get_current_vllm_config

    try:
        pc = get_current_vllm_config().parallel_config
        return bool(pc.enable_expert_parallel), int(pc.data_parallel_size)
    except (AssertionError, RuntimeError):
        return False, 1


class Qwen3_5SparseMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        moe = config.moe
        if moe is None:
            raise ValueError("Qwen3_5SparseMoeBlock needs config.moe")
        if not moe.norm_topk_prob:
            raise NotImplementedError("norm_topk_prob=False is not implemented")
        self.dtype = config.torch_dtype
        self.eps = config.rms_norm_eps
        self.tp_group = ps.get_tp_group()
        self.world_size = self.tp_group.world_size
        self.hidden_size = config.hidden_size
        self.num_experts = moe.num_experts
        self.top_k = moe.num_experts_per_tok
        self.intermediate_size = moe.moe_intermediate_size
        ep_enabled, dp_size = _expert_parallel()
        if ep_enabled:
            self.ep_degree, self.ep_rank = ps.get_neuron_ep_degree(), ps.get_neuron_ep_rank()
            self.ep_tp_group = ps.get_neuron_ep_tp_group()
            self.tp_degree = self.ep_tp_group.world_size
        else:
            self.ep_degree, self.ep_rank, self.ep_tp_group, self.tp_degree = 1, 0, self.tp_group, self.world_size
        if self.ep_degree > 1 and dp_size > 1:
            raise NotImplementedError("Qwen3.5 expert parallelism across data-parallel replicas is not implemented")
        if self.num_experts % self.ep_degree:
            raise ValueError(f"num_experts={self.num_experts} must be divisible by ep_degree={self.ep_degree}")
        self.num_local_experts = self.num_experts // self.ep_degree
        if self.hidden_size % HIDDEN_MULTIPLE:
            raise NotImplementedError(f"hidden_size={self.hidden_size} must be a multiple of {HIDDEN_MULTIPLE} for the "
                                      "fused decode MoE kernel.")
        if self.intermediate_size % self.tp_degree:
            raise ValueError(f"moe_intermediate_size={self.intermediate_size} must be divisible by tp_degree={self.tp_degree}")
        self.inter_per_rank = self.intermediate_size // self.tp_degree
        if self.inter_per_rank % INTER_PER_RANK_MULTIPLE:
            raise NotImplementedError(f"moe_intermediate_size/tp_degree = {self.inter_per_rank} must be a multiple of "
                                      f"{INTER_PER_RANK_MULTIPLE} for the fused decode MoE kernel")
        shared = moe.shared_expert_intermediate_size
        if shared % self.world_size:
            raise ValueError(f"shared_expert_intermediate_size={shared} must be divisible by tp_size={self.world_size}")
        self.shared_per_rank = shared // self.world_size
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
