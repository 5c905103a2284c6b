"""STAND-IN: ``noaux_tc_rmsnorm_router_topk`` of vllm_neuron/functional/moe/router.py (fork jinhuang12/vllm-neuron,
the stored version the later ``glm5_next/model_fp8.py`` calls from ``Glm5NextRoutedExperts.route_tokens``), as its
CPU path computes it (the fork's torch oracle; on Neuron an NKI kernel, launch grid [2]):

* the expert count is ``router_weights.shape[1]`` (the weights are ``[H, E]``);
* ``top_k`` must be exactly ``NOAUX_TC_K`` = 8 (``nisa.max8`` emits 8 values per token) and 8 <= E <= 512, else
  ``NoauxTcRouterError`` - checked before either route, so on CPU too;
* RMSNorm in fp32 with ``eps``, times ``gamma``, cast to ``router_mm_dtype`` (bf16); logits = bf16 operands with fp32
  accumulation; sigmoid scores; the top-8 of scores + correction bias (fp32) selects; the selected *scores* are
  L1-normalised with ``NOAUX_TC_DENOM_EPS`` = 1e-20 in the denominator, times ``routed_scaling_factor``; scattered
  into affinities ``[T, E]`` fp32."""

import torch

NOAUX_TC_K = 8
NOAUX_TC_DENOM_EPS = 1e-20
NOAUX_TC_MAX_EXPERTS = 512


class NoauxTcRouterError(ValueError):
    pass


def _require_extents(num_experts: int, top_k: int) -> None:
    if top_k != NOAUX_TC_K:
        raise NoauxTcRouterError(f"top_k must be exactly {NOAUX_TC_K}, got {top_k}")
    if not NOAUX_TC_K <= num_experts <= NOAUX_TC_MAX_EXPERTS:
        raise NoauxTcRouterError(f"num_experts must be in [{NOAUX_TC_K}, {NOAUX_TC_MAX_EXPERTS}], got {num_experts}")


def noaux_tc_rmsnorm_router_topk(hidden_states, gamma, router_weights, correction_bias, top_k=NOAUX_TC_K, eps=1e-6,
                                 norm_topk_prob=True, routed_scaling_factor=1.0, router_mm_dtype=torch.bfloat16):
    """``(logits [T, E], expert_index [T, 8] int32, affinities [T, E] fp32, substrate_index [T, 8] int32)``."""
    num_experts = int(router_weights.shape[1])
    _require_extents(num_experts, int(top_k))
    bias = correction_bias.reshape(1, -1).to(torch.float32)
    if bias.shape[1] != num_experts:
        raise NoauxTcRouterError(f"correction_bias must be [E] or [1, E] with E={num_experts}, got {tuple(bias.shape)}")
    h = hidden_states.shape[-1]
    x = hidden_states.reshape(-1, h).to(torch.float32)
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma.to(torch.float32).reshape(1, -1))
    logits = normed.to(router_mm_dtype).float() @ router_weights.to(router_mm_dtype).float()
    scores = logits.sigmoid()
    index = torch.topk(scores + bias, k=NOAUX_TC_K, dim=-1, sorted=False)[1]
    weights = scores.gather(1, index)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + NOAUX_TC_DENOM_EPS)
    weights = weights * routed_scaling_factor
    affinities = torch.zeros_like(scores).scatter(1, index, weights)
    substrate = torch.topk(logits, k=NOAUX_TC_K, dim=-1)[1].to(torch.int32)
    return logits, index.to(torch.int32), affinities, substrate
