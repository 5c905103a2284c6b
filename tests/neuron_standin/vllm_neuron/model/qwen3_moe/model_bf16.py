"""STAND-IN: the parts of vllm_neuron/model/qwen3_moe/model_bf16.py (@5f54272) the glue touches.

``Qwen3MoeExperts`` has upstream's attributes, parameters (names, shapes, dtypes) and forward signature;
its BF16 forward is not reproduced (neuron-w8 replaces it). The decoder keeps one attention weight
(o_proj, FP8 in the checkpoint) so the dequantisation of non-expert tensors is exercised; ``load_weights``
maps checkpoint names as upstream does for the tensors present here."""

from types import SimpleNamespace

import torch
from torch import nn

from vllm_neuron.parallel import neuron_parallel_state as ps
from vllm_neuron.utils.checkpoints import SafetensorsCheckpoint
from vllm_neuron.utils.weight_loader import set_weight_loader, transposed_shard_loader


class Qwen3MoeRMSNorm(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(config.hidden_size, dtype=config.torch_dtype))
        self.variance_epsilon = config.rms_norm_eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * h).to(input_dtype)


class Qwen3MoeExperts(nn.Module):
    def __init__(self, config):
        super().__init__()
        from vllm.config import get_current_vllm_config

        self.tp_group = ps.get_tp_group()
        self.rank = self.tp_group.rank_in_group
        # as upstream: expert parallelism is vLLM's flag, read from the config being built (raises when none is set)
        self.ep_enabled = get_current_vllm_config().parallel_config.enable_expert_parallel
        self.dp_size = 1
        self.mlp_dp_size = 1
        self.cross_dp_ep = False
        if self.ep_enabled:
            self.ep_degree = ps.get_neuron_ep_degree()
            self.ep_rank = ps.get_neuron_ep_rank()
            self.ep_tp_group = ps.get_neuron_ep_tp_group()
            self.tp_degree = self.ep_tp_group.world_size
        else:
            self.ep_degree, self.ep_rank = 1, 0
            self.tp_degree = ps.get_neuron_mlp_tp_group().world_size
            self.ep_tp_group = self.tp_group
        self.moe_group = self.tp_group
        self.total_num_experts = config.num_experts
        self.num_local_experts = config.num_experts // self.ep_degree
        self.num_experts_per_token = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.moe_intermediate_size
        self.rms_norm_eps = config.rms_norm_eps
        self.intermediate_size_per_rank = self.intermediate_size // self.tp_degree
        self.block_size = 256
        self.post_attention_layernorm = Qwen3MoeRMSNorm(config)
        self.router_weight = nn.Parameter(torch.empty(self.total_num_experts, self.hidden_size, dtype=torch.bfloat16))
        self.gate_up_proj_weight = nn.Parameter(torch.empty(
            self.num_local_experts, self.hidden_size, self.intermediate_size_per_rank * 2, dtype=config.torch_dtype))
        self.down_proj_weight = nn.Parameter(torch.empty(
            self.num_local_experts, self.intermediate_size_per_rank, self.hidden_size, dtype=config.torch_dtype))

    def forward(self, hidden_states, positions, is_decode, rank):
        raise NotImplementedError("stand-in: the BF16 NKI forward is not reproduced")


class Qwen3MoeMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.experts = Qwen3MoeExperts(config)
        self.dtype = config.torch_dtype

    def forward(self, hidden_states, positions, is_decode, rank):
        hidden_states = hidden_states.to(self.dtype)
        return self.experts(hidden_states, positions=positions, is_decode=is_decode, rank=rank)


class Qwen3MoeAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        world = ps.get_tp_group().world_size
        width = config.num_attention_heads * config.head_dim // world
        self.o_proj_weight = nn.Parameter(torch.empty(width, config.hidden_size, dtype=config.torch_dtype))
        set_weight_loader(self.o_proj_weight, transposed_shard_loader(0, width))


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = Qwen3MoeAttention(config)
        self.mlp = Qwen3MoeMLP(config)


class Qwen3MoeModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(Qwen3MoeDecoderLayer(config) for _ in range(config.num_hidden_layers))


class Qwen3MoeForCausalLM(nn.Module):
    def __init__(self, config, batch_size):
        super().__init__()
        self.config = config
        self.model = Qwen3MoeModel(config)
        self.tp_group = ps.get_tp_group()
        self.world_size = self.tp_group.world_size
        self.rank = self.tp_group.rank_in_group

    def forward(self, hidden_states, positions, is_decode):
        """STAND-IN forward (no attention, no KV cache): every layer's MoE block on the same hidden states, their
        outputs stacked [layers, T, H], so a compiled call exercises each block as the real graph does."""
        return torch.stack([layer.mlp(hidden_states, positions, is_decode, self.rank) for layer in self.model.layers])

    @classmethod
    def from_configs(cls, hf_config, neuron_config):
        fields = ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "moe_intermediate_size",
                  "rms_norm_eps", "num_experts", "num_experts_per_tok", "norm_topk_prob")
        config = SimpleNamespace(**{f: getattr(hf_config, f) for f in fields}, torch_dtype=torch.bfloat16,
                                 neuron_config=neuron_config)
        return cls(config, batch_size=1)

    def load_weights(self, checkpoint_path, device, cache_dir):
        mappings = {}
        for layer_id in range(len(self.model.layers)):
            p = f"model.layers.{layer_id}"
            mappings[f"{p}.self_attn.o_proj_weight"] = f"{p}.self_attn.o_proj.weight"
            mappings[f"{p}.mlp.experts.post_attention_layernorm.weight"] = f"{p}.post_attention_layernorm.weight"
            mappings[f"{p}.mlp.experts.router_weight"] = f"{p}.mlp.gate.weight"
            e = self.config.num_experts
            mappings[f"{p}.mlp.experts.gate_up_proj_weight"] = (
                [f"{p}.mlp.experts.{i}.gate_proj.weight" for i in range(e)]
                + [f"{p}.mlp.experts.{i}.up_proj.weight" for i in range(e)])
            mappings[f"{p}.mlp.experts.down_proj_weight"] = [f"{p}.mlp.experts.{i}.down_proj.weight" for i in range(e)]
        checkpoint = SafetensorsCheckpoint(checkpoint_path, cache_dir)
        state = checkpoint.load_sharded_pipelined(self.rank, self.world_size, self, mappings, device).state_dict
        self.load_state_dict(state, strict=False, assign=True)

    def load_weights_lite(self, checkpoint_path, device, cache_dir):
        """Used by the runner under VLLM_NEURON_CPU_COMPILE: index only (upstream also reads KV-cache scales)."""
        SafetensorsCheckpoint(checkpoint_path, cache_dir)._ensure_indexed()
