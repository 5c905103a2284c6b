"""STAND-IN: vllm_neuron/model/glm_moe_dsa/moe.py (fork @02ef7111) - the GLM-5 MoE block the glue adopts.

* ``GlmMoeDsaNoAuxRouter``: ``gate`` (nn.Linear [E, H], the model dtype) with ``gate.e_score_correction_bias`` (fp32);
  ``forward(h) -> (affinities [T, E] fp32, selected_experts [T, k] int32)``: sigmoid scores, the correction bias for
  the selection only (top-k), the selected uncorrected scores normalised (``norm_topk_prob``) and multiplied by
  ``routed_scaling_factor``, scattered into [T, E]. The fork's NKI top-k (``_select_nki``) is not reproduced: off
  Neuron it runs torch.topk, as here.
* ``GlmMoeDsaRoutedExperts(hidden_size, intermediate_size, *, num_experts, top_k, expert_parallel_size,
  expert_parallel_rank, fp8_weights, dtype, device, block_size)``: attributes ``num_local_experts`` (E / EP),
  ``local_expert_start``, ``global_expert_ids``; ``experts`` = ModuleList of ``GlmMoeDsaExpertMLP`` with
  ``BlockFP8Linear`` gate/up/down (full width: pure EP); ``forward(hidden_states, affinities, selected_experts, *,
  is_decode)``: the fork's non-Neuron branch (``_torch_forward``: every local expert times its affinity column). Its
  NKI branches (nkilib moe_tkg / moe_cte, the experimental selective block-FP8 kernel) are not reproduced.
* ``GlmMoeDsaMoE(config, *, tensor_parallel_size, expert_parallel_size, expert_parallel_rank, device)``: ``router``,
  ``experts``, ``shared_experts`` (TP shard ``expert_parallel_rank``); ``forward(h, *, is_decode) = routed + shared``
  (the decoder layer all-reduces)."""

import torch
from torch import nn

from .mlp import GlmMoeDsaSwiGLUMLP


class GlmMoeDsaNoAuxRouter(nn.Module):
    def __init__(self, hidden_size, num_experts, top_k, *, routed_scaling_factor=2.5, norm_topk_prob=True,
                 dtype=torch.float32, device=None):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in 1..{num_experts}")
        self.num_experts, self.top_k = num_experts, top_k
        self.routed_scaling_factor, self.norm_topk_prob = routed_scaling_factor, norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, dtype=dtype, device=device)
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32, device=device))
        self.register_buffer("selection_identity", torch.eye(num_experts, dtype=torch.float32, device=device),
                             persistent=False)

    @property
    def correction_bias(self):
        return self.gate.e_score_correction_bias

    def forward(self, hidden_states):
        scores = torch.sigmoid(self.gate(hidden_states).float())
        _, selected = torch.topk(scores + self.correction_bias, self.top_k, dim=-1, sorted=False)
        selected = selected.to(torch.int32)
        weights = torch.gather(scores, -1, selected.to(torch.long))
        if self.norm_topk_prob:
            denominator = weights.sum(dim=-1, keepdim=True)
            weights = weights / (denominator + (denominator == 0).to(denominator.dtype))
        weights = weights * scores.new_full((), self.routed_scaling_factor)
        # the fork scatters with the int32 ids; torch's CPU scatter wants int64
        affinities = torch.zeros_like(scores).scatter(-1, selected.to(torch.long), weights)
        return affinities, selected


class GlmMoeDsaExpertMLP(GlmMoeDsaSwiGLUMLP):
    """One whole routed expert: the SwiGLU MLP unsharded (TP 1, so no block offsets)."""

    def __init__(self, hidden_size, intermediate_size, *, fp8_weights=False, dtype=torch.bfloat16, device=None):
        super().__init__(hidden_size, intermediate_size, fp8_weights=fp8_weights, dtype=dtype, device=device)


class GlmMoeDsaRoutedExperts(nn.Module):
    def __init__(self, hidden_size, intermediate_size, *, num_experts=256, top_k=8, expert_parallel_size=64,
                 expert_parallel_rank=0, fp8_weights=False, dtype=torch.bfloat16, device=None, block_size=256):
        super().__init__()
        if num_experts % expert_parallel_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by EP={expert_parallel_size}")
        if not 0 <= expert_parallel_rank < expert_parallel_size:
            raise ValueError(f"expert_parallel_rank={expert_parallel_rank} is outside EP={expert_parallel_size}")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.expert_parallel_size, self.expert_parallel_rank = expert_parallel_size, expert_parallel_rank
        self.num_local_experts = num_experts // expert_parallel_size
        self.local_expert_start = expert_parallel_rank * self.num_local_experts
        self.block_size = block_size
        self.experts = nn.ModuleList(
            GlmMoeDsaExpertMLP(hidden_size, intermediate_size, fp8_weights=fp8_weights, dtype=dtype, device=device)
            for _ in range(self.num_local_experts))

    @property
    def global_expert_ids(self):
        return tuple(range(self.local_expert_start, self.local_expert_start + self.num_local_experts))

    def _torch_forward(self, hidden_states, affinities):
        output = torch.zeros_like(hidden_states)
        for local_id, global_id in enumerate(self.global_expert_ids):
            weight = affinities[:, global_id: global_id + 1].to(hidden_states.dtype)
            output = output + self.experts[local_id](hidden_states) * weight
        return output

    def forward(self, hidden_states, affinities, selected_experts, *, is_decode):
        return self._torch_forward(hidden_states, affinities)


class GlmMoeDsaMoE(nn.Module):
    def __init__(self, config, *, tensor_parallel_size=64, expert_parallel_size=64, expert_parallel_rank=0, device=None):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError("GLM-5.2 supports only hidden_act='silu'")
        if config.scoring_func != "sigmoid" or config.topk_method != "noaux_tc":
            raise ValueError("GLM-5.2 requires sigmoid noaux_tc routing")
        if config.n_group != 1 or config.topk_group != 1:
            raise ValueError("GLM-5.2 grouped routing is frozen to one group")
        self.router = GlmMoeDsaNoAuxRouter(
            config.hidden_size, config.n_routed_experts, config.num_experts_per_tok,
            routed_scaling_factor=config.routed_scaling_factor, norm_topk_prob=config.norm_topk_prob,
            dtype=config.torch_dtype, device=device)
        self.experts = GlmMoeDsaRoutedExperts(
            config.hidden_size, config.moe_intermediate_size, num_experts=config.n_routed_experts,
            top_k=config.num_experts_per_tok, expert_parallel_size=expert_parallel_size,
            expert_parallel_rank=expert_parallel_rank, fp8_weights=bool(config.quantization_config),
            dtype=config.torch_dtype, device=device)
        self.shared_experts = GlmMoeDsaSwiGLUMLP.shared_from_config(
            config, tensor_parallel_size=tensor_parallel_size, tensor_parallel_rank=expert_parallel_rank, device=device)

    def forward(self, hidden_states, *, is_decode):
        affinities, selected_experts = self.router(hidden_states)
        routed = self.experts(hidden_states, affinities, selected_experts, is_decode=is_decode)
        shared = self.shared_experts(hidden_states)
        return routed + shared
