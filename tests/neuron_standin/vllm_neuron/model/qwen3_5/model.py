"""STAND-IN: the parts of vllm_neuron/model/qwen3_5/model.py (fork whn09/vllm-neuron @3de9ea3) the glue touches:
layers holding a zero-centred post_attention_layernorm and the MoE block as ``mlp`` (``config.is_moe``; the dense
MLP is not reproduced); from_configs through config.py's ``Qwen3_5Config.from_configs``; load_weights with the
fork's mappings (every text tensor under HF_TEXT_PREFIX, strict=False, then a check that every parameter was
filled, then every tensor cast to the model dtype but ``dt_bias`` / ``A_log``). Like the fork, the model has no
``load_weights_lite`` (the runner then only moves it to meta under ``VLLM_NEURON_CPU_COMPILE``). The mixers
(DeltaNet, gated attention) are not built: the stand-in's layers are the MoE halves."""

import torch
import torch.nn as nn

from vllm_neuron.parallel import neuron_parallel_state as ps
from vllm_neuron.utils.checkpoints import SafetensorsCheckpoint

from .config import Qwen3_5Config
from .moe import Qwen3_5SparseMoeBlock

HF_TEXT_PREFIX = "model.language_model"


class Qwen3_5RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        h = hidden_states.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * (1.0 + self.weight.float())).to(input_dtype)


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.post_attention_layernorm = Qwen3_5RMSNorm(config.hidden_size, config.rms_norm_eps, config.torch_dtype)
        self.is_moe = config.is_moe
        if not self.is_moe:
            raise NotImplementedError("stand-in: the dense Qwen3_5MLP is not reproduced")
        self.mlp = Qwen3_5SparseMoeBlock(config)


class Qwen3_5TextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(config) for _ in range(config.num_hidden_layers))


class Qwen3_5ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.language_model = Qwen3_5TextModel(config)
        self.text_dtype = config.torch_dtype
        self.tp_group = ps.get_tp_group()
        self.world_size, self.rank = self.tp_group.world_size, self.tp_group.rank_in_group

    @classmethod
    def from_configs(cls, hf_config, text_neuron_config=None, vision_neuron_config=None):
        return cls(Qwen3_5Config.from_configs(hf_config, text_neuron_config, vision_neuron_config).text_config)

    def load_weights(self, checkpoint_path, device, cache_dir):
        mappings = {}
        for i in range(len(self.language_model.layers)):
            hf, ours = f"{HF_TEXT_PREFIX}.layers.{i}", f"language_model.layers.{i}"
            mappings[f"{ours}.post_attention_layernorm.weight"] = f"{hf}.post_attention_layernorm.weight"
            mappings[f"{ours}.mlp.experts_gate_up_weight"] = f"{hf}.mlp.experts.gate_up_proj"
            mappings[f"{ours}.mlp.experts_down_weight"] = f"{hf}.mlp.experts.down_proj"
            mappings[f"{ours}.mlp.router_weight"] = f"{hf}.mlp.gate.weight"
            for proj in ("gate", "up", "down"):
                mappings[f"{ours}.mlp.shared_{proj}_proj_weight"] = f"{hf}.mlp.shared_expert.{proj}_proj.weight"
            mappings[f"{ours}.mlp.shared_expert_gate_weight"] = f"{hf}.mlp.shared_expert_gate.weight"
        checkpoint = SafetensorsCheckpoint(checkpoint_path, cache_dir)
        state = checkpoint.load_sharded_pipelined(self.rank, self.world_size, self, mappings, device, strict=False).state_dict
        unfilled = sorted({n for n, _ in self.named_parameters()} - set(state))
        if unfilled:
            raise RuntimeError(f"{len(unfilled)} parameter(s) got no checkpoint tensor: {unfilled[:8]}")
        target, keep_fp32 = self.text_dtype, {"dt_bias", "A_log"}
        for name, tensor in state.items():
            if name.rsplit(".", 1)[-1] in keep_fp32:
                state[name] = tensor.to(torch.float32)
            elif tensor.dtype != target:
                state[name] = tensor.to(target)
        self.load_state_dict(state, strict=False, assign=True)

    def forward(self, hidden_states, positions, is_prefill):
        """STAND-IN forward (no attention): every layer's MoE block (called as Qwen3_5DecoderLayer calls it) on the
        same hidden states, their outputs stacked [layers, T, H]."""
        return torch.stack([layer.mlp(hidden_states, is_prefill, layer.post_attention_layernorm, positions, self.rank)
                            for layer in self.language_model.layers])
