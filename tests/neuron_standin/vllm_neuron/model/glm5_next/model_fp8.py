"""STAND-IN: the parts of vllm_neuron/model/glm5_next/model_fp8.py (fork jinhuang12/vllm-neuron; @77c1abaa and the
later stored version DEVELOPING.md names) the glue touches, with the fork's signatures.

* ``Glm5NextForConditionalGeneration.from_configs`` builds from ``config.Glm5NextConfig.from_configs`` (a
  PretrainedConfig / dict / path with a ``vision_config``; the fork's contract, see config.py);
* ``Glm5NextRoutedExperts(text_config, world_size=None, ep_degree=None)``: ``num_routed_experts``,
  ``num_experts_per_tok``, ``tp_degree`` (the world size), ``ep_degree`` (divides the experts), ``expert_partition``,
  ``num_local_experts``, ``swiglu_limit`` (the config reader's default is 10.0); declared (``None``) parameters
  ``router_weight, router_bias, gate_proj_weight, up_proj_weight, down_proj_weight``; ``local_expert_indices``;
  ``route_tokens(hidden [B, S, H], gamma, text_config, eps=None) -> (logits, expert_index, expert_affinities [T, E])``
  = the fork's ``functional.moe.router.noaux_tc_rmsnorm_router_topk`` (top-8 only, bf16 router matmul, the expert
  count from dim 1 of ``router_weight`` [H, E]; see that stand-in); ``prepare_scale_operands``
  (six operands by keyword; ``RELEASED_AFTER_PREP``); ``forward(hidden [T, H], expert_affinities [T, E],
  quant_config, *, block_size, moe_group, tp_degree, expert_parallel_rank, collector)``, which refuses before
  the prep ran and otherwise is not reproduced (the fork's fused FP8 kernel);
* ``Glm5NextMoEBlock.forward(hidden, normed, *, router_gamma, text_config, quant_config, ...)``: route on the pre-norm
  hidden, the bank on the normed one, plus the shared expert (``down(silu(min(g, L)) * clip(u, -L, L))`` on its FP8
  bytes x the scale grids the loader attached);
* ``_SHARD_GEOMETRY``: which declared leaves are sharded, looked up by the declaring module's class *name*
  (``type(module).__name__``), as the fork's ``_shard_geometry_for`` does;
* the model's ``load_weights(path, device, cache_dir, reader=None)`` in the fork's order (``loading.py``), and
  ``load_weights_lite(path, device, cache_dir)`` = ``self.load_weights(path, meta, cache_dir,
  reader=_MetaShapeCheckpoint(...))``, the shape-only rehearsal on meta (reads no tensor data).

The stand-in shards the shared expert's intermediate over the TP world (how the fork shards it is not
reproduced) so that the all-reduce of the stand-in decoder (its own forward) sums the layer exactly once."""

import torch
import torch.nn.functional as F
from torch import nn

from vllm_neuron.parallel import neuron_parallel_state as ps

from . import loading

FP8_SCALE_SUFFIX = "weight_scale_inv"


def _declare_parameters(module, *names):
    for name in names:
        module.register_parameter(name, None)
    module.declared_param_names = (*getattr(module, "declared_param_names", ()), *names)


class Glm5NextBlockQuantRouteError(ValueError):
    pass


# Declaring class NAME -> leaf -> (shard dim in the checkpoint's orientation, divides within the EP group). Keyed by
# name as in the fork; a leaf not named here is replicated. The width comes with the tensor (the fork's deferred
# geometry): full extent / number of shards.
_SHARD_GEOMETRY = {
    "Glm5NextSharedExperts": {"gate_proj_weight": (0, False), "up_proj_weight": (0, False), "down_proj_weight": (1, False)},
    "Glm5NextRoutedExperts": {"gate_proj_weight": (0, True), "up_proj_weight": (0, True), "down_proj_weight": (1, True)},
}


def _shard_geometry_for(module, leaf, world_size):
    """``(shard_dim, num_shards)`` of a declared leaf, or None when replicated (world 1, or one rank per EP group)."""
    if world_size <= 1:
        return None
    declared = _SHARD_GEOMETRY.get(type(module).__name__, {}).get(leaf)
    if declared is None:
        return None
    dim, within_ep = declared
    shards = world_size // max(1, int(getattr(module, "ep_degree", 1))) if within_ep else world_size
    return None if shards <= 1 else (dim, shards)


class Glm5NextQuantConfig:
    """STAND-IN: the resolved blockwise policy (the route selector)."""

    is_block_quantized = True
    block_shape = (128, 128)


class Glm5NextRoutedExperts(nn.Module):
    PREPARED_KERNEL_OPERANDS_ATTR = "_prepared_kernel_operands"
    RELEASED_AFTER_PREP = ("gate_proj_weight", "up_proj_weight", "down_proj_weight", f"gate_proj_{FP8_SCALE_SUFFIX}",
                           f"up_proj_{FP8_SCALE_SUFFIX}", f"down_proj_{FP8_SCALE_SUFFIX}")

    def __init__(self, text_config, world_size=None, ep_degree=None):
        super().__init__()
        from vllm_neuron.model.glm5_next.factory import _resolve_ep_degree, require_uniform_expert_partition

        self.num_routed_experts = int(text_config.n_routed_experts)
        self.num_experts_per_tok = int(text_config.num_experts_per_tok)
        self.tp_degree = ps.get_tp_group().world_size if world_size is None else int(world_size)
        self.ep_degree = _resolve_ep_degree(ep_degree)
        self.expert_partition = require_uniform_expert_partition(self.num_routed_experts, self.ep_degree)
        self.num_local_experts = self.expert_partition.counts[0]
        limit = getattr(text_config, "swiglu_limit", None)
        if limit is None:
            raise Glm5NextBlockQuantRouteError("text_config carries no swiglu_limit")
        self.swiglu_limit = float(limit)
        _declare_parameters(self, "router_weight", "router_bias", "gate_proj_weight", "up_proj_weight", "down_proj_weight")

    def local_expert_indices(self, rank):
        return self.expert_partition.local_expert_indices(rank)

    def route_tokens(self, hidden_states, gamma, text_config, eps=None):
        eps = float(text_config.rms_norm_eps) if eps is None else eps
        from vllm_neuron.functional.moe.router import noaux_tc_rmsnorm_router_topk

        logits, index, affinities, _ = noaux_tc_rmsnorm_router_topk(
            hidden_states=hidden_states, gamma=gamma, router_weights=self.router_weight, correction_bias=self.router_bias,
            top_k=int(text_config.num_experts_per_tok), eps=eps, norm_topk_prob=bool(text_config.norm_topk_prob),
            routed_scaling_factor=float(text_config.routed_scaling_factor))
        return logits, index, affinities

    def prepare_scale_operands(self, gate_proj_weight, up_proj_weight, down_proj_weight, gate_proj_scale, up_proj_scale,
                               down_proj_scale):
        ops = (gate_proj_weight, up_proj_weight, down_proj_weight, gate_proj_scale, up_proj_scale, down_proj_scale)
        if any(t is None for t in ops):
            raise Glm5NextBlockQuantRouteError("prepare_scale_operands needs all six operands")
        packed = {"packed_weights": ops[:3], "packed_scales": ops[3:]}  # the fork packs [E, 3*(I/128), 128, H/128, 128]
        setattr(self, self.PREPARED_KERNEL_OPERANDS_ATTR, packed)
        return len(packed)

    def forward(self, hidden_states, expert_affinities, quant_config, *, block_size=None, moe_group=None, tp_degree=1,
                expert_parallel_rank=0, collector=None):
        if not getattr(self, self.PREPARED_KERNEL_OPERANDS_ATTR, None):
            raise Glm5NextBlockQuantRouteError("prepare_scale_operands() has not run")
        raise NotImplementedError("stand-in: the fork's fused FP8 expert kernel is not reproduced")


class Glm5NextSharedExperts(nn.Module):
    RELEASED_AFTER_PREP = ()
    SCALE_ROUTE_LEAVES = ("gate_proj_weight", "up_proj_weight", "down_proj_weight")

    def __init__(self, text_config):
        super().__init__()
        self.num_shared_experts = int(text_config.n_shared_experts)
        self.swiglu_limit = float(text_config.swiglu_limit)
        world = ps.get_tp_group().world_size
        self.shard_size = int(text_config.moe_intermediate_size) * self.num_shared_experts // world
        _declare_parameters(self, "gate_proj_weight", "up_proj_weight", "down_proj_weight")

    def scale_route_operands(self):
        grids = [getattr(self, f"{leaf[: -len('_weight')]}_{FP8_SCALE_SUFFIX}") for leaf in self.SCALE_ROUTE_LEAVES]
        return (*[getattr(self, leaf) for leaf in self.SCALE_ROUTE_LEAVES], *grids)

    def shared_expert_mm(self, hidden_states, gate_w, up_w, down_w, gate_s, up_s, down_s, quant_config):
        x = hidden_states.float()
        gate = x @ loading.dequantize(gate_w, gate_s).T
        up = x @ loading.dequantize(up_w, up_s).T
        gate, up = gate.clamp(max=self.swiglu_limit), up.clamp(-self.swiglu_limit, self.swiglu_limit)
        return (F.silu(gate) * up) @ loading.dequantize(down_w, down_s).T


class Glm5NextMoEBlock(nn.Module):
    def __init__(self, text_config, world_size=None, ep_degree=None):
        super().__init__()
        self.experts = Glm5NextRoutedExperts(text_config, world_size=world_size, ep_degree=ep_degree)
        if text_config.n_shared_experts:
            self.shared_experts = Glm5NextSharedExperts(text_config)

    def forward(self, hidden_states, normed_hidden_states, *, router_gamma, text_config, quant_config, block_size=None,
                moe_group=None, tp_degree=1, expert_parallel_rank=0, collector=None):
        _, _, affinities = self.experts.route_tokens(hidden_states.unsqueeze(0), router_gamma, text_config)
        routed = self.experts(normed_hidden_states, affinities, quant_config, block_size=block_size, moe_group=moe_group,
                              tp_degree=tp_degree, expert_parallel_rank=expert_parallel_rank)
        shared = getattr(self, "shared_experts", None)
        if shared is None:
            return routed
        return routed + shared.shared_expert_mm(normed_hidden_states, *shared.scale_route_operands(), quant_config)


class Glm5NextDecoderLayer(nn.Module):
    def __init__(self, text_config, layer_idx):
        super().__init__()
        if layer_idx < int(text_config.first_k_dense_replace):
            raise NotImplementedError("stand-in: the dense MLP layers are not reproduced")
        _declare_parameters(self, "post_attention_layernorm_weight")
        self.rms_norm_eps = float(text_config.rms_norm_eps)
        self.mlp = Glm5NextMoEBlock(text_config)


class Glm5NextModel(nn.Module):
    def __init__(self, text_config):
        super().__init__()
        self.layers = nn.ModuleList(Glm5NextDecoderLayer(text_config, i) for i in range(text_config.num_hidden_layers))


class Glm5NextForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config, self.text_config = config, config.text_config
        self.tp_group = ps.get_tp_group()
        self.world_size = self.tp_group.world_size
        self.model = Glm5NextModel(self.text_config)

    @classmethod
    def from_configs(cls, hf_config, text_neuron_config=None, vision_neuron_config=None):
        from .config import Glm5NextConfig

        return cls(Glm5NextConfig.from_configs(hf_config, text_neuron_config, vision_neuron_config))

    def forward(self, hidden_states, *, moe_group=None, tp_degree=1, expert_parallel_rank=0):
        """STAND-IN forward (no attention, no mHC, no KV cache): every layer's MoE block on the same hidden states
        (normalised by its post-attention norm), all-reduced over the TP group, stacked [layers, T, H]."""
        outs, quant_config = [], Glm5NextQuantConfig()
        for layer in self.model.layers:
            gamma = layer.post_attention_layernorm_weight
            x = hidden_states.float()
            normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + layer.rms_norm_eps) * gamma.float())
            out = layer.mlp(hidden_states, normed.to(hidden_states.dtype), router_gamma=gamma, text_config=self.text_config,
                            quant_config=quant_config, moe_group=moe_group, tp_degree=tp_degree,
                            expert_parallel_rank=expert_parallel_rank)
            outs.append(self.tp_group.all_reduce(out) if self.world_size > 1 else out)
        return torch.stack(outs)

    def load_weights(self, checkpoint_path, device, cache_dir=None, reader=None):
        loading.load_weights(self, checkpoint_path, device, cache_dir, reader=reader)

    def load_weights_lite(self, checkpoint_path, device, cache_dir=None):
        """The shape-only rehearsal: the full load on meta, tensors from the headers (no data read)."""
        self.load_weights(checkpoint_path, torch.device("meta"), cache_dir,
                          reader=loading.MetaShapeCheckpoint(checkpoint_path, cache_dir))
