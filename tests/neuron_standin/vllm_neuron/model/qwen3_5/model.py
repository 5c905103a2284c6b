"""STAND-IN: the parts of vllm_neuron/model/qwen3_5/model.py (fork whn09/vllm-neuron @3de9ea3) the glue touches:
layers holding a zero-centred post_attention_layernorm, the MoE block as ``mlp`` (``config.is_moe``; the dense MLP is
not reproduced) and the layer's mixer (``Qwen3_5Attention`` as ``self_attn`` on full-attention layers,
``deltanet.Qwen3_5GatedDeltaNet`` as ``linear_attn`` on the others); from_configs through config.py's
``Qwen3_5Config.from_configs``; load_weights with the fork's mappings (every text tensor under HF_TEXT_PREFIX,
strict=False, then a check that every parameter was filled, then every tensor cast to the model dtype but
``dt_bias`` / ``A_log``). Like the fork, the model has no ``load_weights_lite`` (the runner then only moves it to meta
under ``VLLM_NEURON_CPU_COMPILE``).

``Qwen3_5Attention`` as the fork (and upstream vllm-project/vllm-neuron @aa9b76b, whose query-head replication for a
world wider than the head count it also follows: ``q_replicas``, ``o_size``, ``o_offset``): parameters stored
``[in, out]``, ``q_proj`` whole heads of [query | gate] per rank, KV heads replicated when fewer than the world (the
shard is ``rank // num_kv_replicas``), ``o_proj`` row-parallel; ``_qkv(hidden, cos, sin) -> (q, k, v, gate)`` (q/k
normed per head and partially rotated by ``apply_partial_rotary``, [heads, tokens, head_dim]; gate [tokens, q_size])
and ``_finish(attn_output, gate)`` (``sigmoid(gate)`` then ``@ o_proj``). Its ``forward(hidden_states, positions,
position_embeddings, attn_metadata)`` dispatches and reduces as the fork's; **the attention itself is the stand-in's
own**: causal softmax attention over the prefill's tokens, and at decode each token over itself (no KV pages).

The model's ``forward`` is the stand-in's own (no attention): every layer's MoE block on the same hidden states."""

import torch
import torch.nn as nn

from vllm_neuron.parallel import neuron_parallel_state as ps
from vllm_neuron.utils.checkpoints import SafetensorsCheckpoint

from vllm_neuron.utils.weight_loader import set_weight_loader, sharding_weight_loader, with_rank_override

from .config import Qwen3_5Config
from .deltanet import Qwen3_5GatedDeltaNet
from .flags import SEQUENCE_PARALLEL
from .moe import Qwen3_5SparseMoeBlock

HF_TEXT_PREFIX = "model.language_model"
LINEAR_ATTENTION = "linear_attention"


def apply_partial_rotary(x, cos, sin):
    """Rotate the first ``2 * cos.shape[-1]`` dims of ``x`` [heads, tokens, head_dim] (rotate-half), keep the rest."""
    r = 2 * cos.shape[-1]
    cos, sin = torch.cat((cos, cos), -1).unsqueeze(0), torch.cat((sin, sin), -1).unsqueeze(0)
    rot, rest = x[..., :r], x[..., r:]
    half = torch.cat((-rot[..., r // 2:], rot[..., :r // 2]), -1)
    return torch.cat((rot * cos + half * sin, rest), -1)


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


class Qwen3_5Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx, self.layer_name = layer_idx, f"layers.{layer_idx}.self_attn"
        self.dtype, self.head_dim, self.hidden_size = config.torch_dtype, config.head_dim, config.hidden_size
        self.rms_norm_eps, self.scaling = config.rms_norm_eps, config.head_dim ** -0.5
        self.tp_group = ps.get_tp_group()
        self.world_size, self.rank = self.tp_group.world_size, self.tp_group.rank_in_group
        heads, kv_heads, w = config.num_attention_heads, config.num_key_value_heads, self.world_size
        self.q_replicas = max(1, w // heads)
        self.num_heads_per_rank = max(1, heads // w)
        self.num_kv_heads_per_rank, self.num_kv_replicas = (1, w // kv_heads) if w >= kv_heads else (kv_heads // w, 1)
        self.num_kv_groups = self.num_heads_per_rank // self.num_kv_heads_per_rank
        self.q_size, self.kv_size = self.num_heads_per_rank * self.head_dim, self.num_kv_heads_per_rank * self.head_dim
        self.o_size = self.q_size // self.q_replicas
        self.o_offset = (self.rank % self.q_replicas) * self.o_size
        h = self.hidden_size
        self.q_proj_weight = nn.Parameter(torch.empty(h, 2 * self.q_size, dtype=self.dtype))
        self.k_proj_weight = nn.Parameter(torch.empty(h, self.kv_size, dtype=self.dtype))
        self.v_proj_weight = nn.Parameter(torch.empty(h, self.kv_size, dtype=self.dtype))
        self.o_proj_weight = nn.Parameter(torch.empty(self.o_size, h, dtype=self.dtype))
        self.q_norm = Qwen3_5RMSNorm(self.head_dim, self.rms_norm_eps, self.dtype)
        self.k_norm = Qwen3_5RMSNorm(self.head_dim, self.rms_norm_eps, self.dtype)
        self.kv_pages = None
        q_loader = sharding_weight_loader(1, 2 * self.q_size, w // self.q_replicas, is_storage_transposed=True)
        set_weight_loader(self.q_proj_weight, q_loader if self.q_replicas == 1 else
                          with_rank_override(q_loader, self.rank // self.q_replicas))
        kv_loader = sharding_weight_loader(1, self.kv_size, max(kv_heads // self.num_kv_heads_per_rank, 1),
                                           is_storage_transposed=True)
        for p in (self.k_proj_weight, self.v_proj_weight):
            set_weight_loader(p, with_rank_override(kv_loader, self.rank // self.num_kv_replicas))
        set_weight_loader(self.o_proj_weight, sharding_weight_loader(0, self.o_size, w, is_storage_transposed=True))

    def _qkv(self, hidden_states, cos, sin):
        t = hidden_states.shape[0]
        hidden_states = hidden_states.to(self.dtype)
        q, gate = (hidden_states @ self.q_proj_weight).view(t, self.num_heads_per_rank, 2 * self.head_dim).chunk(2, -1)
        gate = gate.reshape(t, self.q_size)
        q = self.q_norm(q).transpose(0, 1)
        k = self.k_norm((hidden_states @ self.k_proj_weight).view(t, self.num_kv_heads_per_rank, self.head_dim))
        v = (hidden_states @ self.v_proj_weight).view(t, self.num_kv_heads_per_rank, self.head_dim).transpose(0, 1)
        return apply_partial_rotary(q, cos, sin), apply_partial_rotary(k.transpose(0, 1), cos, sin), v, gate

    def _finish(self, attn_output, gate):
        attn_output = attn_output * torch.sigmoid(gate.float()).to(attn_output.dtype)
        if self.q_replicas > 1:
            attn_output = attn_output[:, self.o_offset:self.o_offset + self.o_size]
        return attn_output @ self.o_proj_weight

    def forward(self, hidden_states, positions, position_embeddings, attn_metadata):
        metadata = attn_metadata[self.layer_name]
        decode = metadata["max_query_len"] <= metadata["decode_token_threshold"]
        if not decode and self.world_size > 1 and SEQUENCE_PARALLEL:
            hidden_states = self.tp_group.all_gather(hidden_states, dim=0)
        t = hidden_states.shape[0]
        q, k, v, gate = self._qkv(hidden_states, *position_embeddings)
        k = k.repeat_interleave(self.num_kv_groups, dim=0)
        v = v.repeat_interleave(self.num_kv_groups, dim=0)
        if decode:  # STAND-IN attention: each token over itself
            attn = v
        else:  # STAND-IN attention: causal softmax over the prefill's tokens
            scores = (q.float() @ k.float().transpose(-1, -2)) * self.scaling
            scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
            attn = torch.softmax(scores, dim=-1).to(v.dtype) @ v
        out = self._finish(attn.transpose(0, 1).reshape(t, self.q_size), gate)
        if self.world_size > 1:
            out = self.tp_group.reduce_scatter(out, dim=0) if not decode and SEQUENCE_PARALLEL else \
                self.tp_group.all_reduce(out)
        return out


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.is_linear_attention = config.layer_types[layer_idx] == LINEAR_ATTENTION
        self.input_layernorm = Qwen3_5RMSNorm(config.hidden_size, config.rms_norm_eps, config.torch_dtype)
        if self.is_linear_attention:
            self.linear_attn = Qwen3_5GatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = Qwen3_5Attention(config, layer_idx)
        self.post_attention_layernorm = Qwen3_5RMSNorm(config.hidden_size, config.rms_norm_eps, config.torch_dtype)
        self.is_moe = config.is_moe
        if not self.is_moe:
            raise NotImplementedError("stand-in: the dense Qwen3_5MLP is not reproduced")
        self.mlp = Qwen3_5SparseMoeBlock(config)


class Qwen3_5TextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(config, i) for i in range(config.num_hidden_layers))


class Qwen3_5ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.language_model = Qwen3_5TextModel(config)
        self.text_config = config
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
            mappings[f"{ours}.input_layernorm.weight"] = f"{hf}.input_layernorm.weight"
            if self.language_model.layers[i].is_linear_attention:
                la, la_hf = f"{ours}.linear_attn", f"{hf}.linear_attn"
                for name in ("in_proj_qkv", "in_proj_z", "out_proj", "conv1d"):
                    mappings[f"{la}.{name}_weight"] = f"{la_hf}.{name}.weight"
                mappings[f"{la}.in_proj_ba_weight"] = [f"{la_hf}.in_proj_b.weight", f"{la_hf}.in_proj_a.weight"]
                mappings[f"{la}.norm_weight"] = f"{la_hf}.norm.weight"
                for name in ("dt_bias", "A_log"):
                    mappings[f"{la}.{name}"] = f"{la_hf}.{name}"
            else:
                sa, sa_hf = f"{ours}.self_attn", f"{hf}.self_attn"
                for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    mappings[f"{sa}.{name}_weight"] = f"{sa_hf}.{name}.weight"
                for name in ("q_norm", "k_norm"):
                    mappings[f"{sa}.{name}.weight"] = f"{sa_hf}.{name}.weight"
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
