"""STAND-IN: the parts of vllm_neuron/model/glm_moe_dsa/model.py (fork @02ef7111) the glue touches.

``GlmMoeDsaForCausalLM(config, tensor_parallel_size, *, expert_parallel_rank, tp_group)`` builds its decoder with
``expert_parallel_size = tensor_parallel_size`` (pure EP over the TP world; the shared expert and the dense MLP are
TP shards of that rank); ``rank = expert_parallel_rank``. Its ``load_weights(checkpoint_path, device, cache_dir)``
does what the fork's does, in order: the manifest (index + headers); ``checkpoint_mappings``: every parameter to one
checkpoint key (``mlp.router.gate.*`` -> ``mlp.gate.*``; ``mlp.experts.experts.<local>.*`` ->
``mlp.experts.<global>.*``, refused when absent); ``_account_manifest``: the mapped keys must equal the rank's load
plan exactly (its routed experts and everything shared), else ValueError naming what is missing; weight loaders:
FP8 ``.weight`` -> ``(w.float() * FP8_STORAGE_SCALE).to(float8_e4m3fn)`` of the rank's slice (refused unless the
parameter is float8_e4m3fn), ``weight_scale_inv`` -> ``scale * FP8_INVERSE_SCALE_ADJUSTMENT`` of the covering
blocks, other sharded tensors cut per rank; ``SafetensorsCheckpoint.load_sharded_pipelined(..., strict=True)`` (the
4-thread loader); ``load_state_dict(strict=True, assign=True)``; the routers' selection identities made on
``device``. ``load_weights_lite`` reads the index only.

Labelled differences: no attention, indexer, KV cache, embedding, LM head or sampler (their keys are outside the
stand-in's plan, weight_loaders.py); the RMSNorm is the plain ``weight * x / rms`` form; the forward is the
stand-in's own: every MoE layer's post-attention norm -> ``mlp(flat, is_decode=...)`` -> the all-reduce over the TP
group the decoder does, on the same hidden states, outputs stacked [moe_layers, T, H]. The fork loads with
``load_sharded`` when torch.distributed is not initialised; the stand-in's ranks are threads, so always pipelined."""

import re
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from vllm_neuron.parallel import neuron_parallel_state as ps
from vllm_neuron.utils.checkpoints import SafetensorsCheckpoint
from vllm_neuron.utils.weight_loader import SafetensorsWeightLoader, set_weight_loader

from . import weight_loaders as wl
from .block_fp8 import FP8_INVERSE_SCALE_ADJUSTMENT, FP8_STORAGE_SCALE
from .config import GlmMoeDsaConfig
from .mlp import GlmMoeDsaSwiGLUMLP
from .moe import GlmMoeDsaMoE


class GlmMoeDsaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps, dtype=torch.bfloat16, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, hidden_states):
        h = hidden_states.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(hidden_states.dtype)


class GlmMoeDsaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx, *, tensor_parallel_size, expert_parallel_size, expert_parallel_rank,
                 collective_group=None, device=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_dense = layer_idx < config.first_k_dense_replace
        self.is_moe = not self.is_dense
        self.tp_group, self.world_size = collective_group, tensor_parallel_size
        self.post_attention_layernorm = GlmMoeDsaRMSNorm(config.hidden_size, config.rms_norm_eps, config.torch_dtype, device)
        if self.is_dense:
            self.mlp = GlmMoeDsaSwiGLUMLP.dense_from_config(config, tensor_parallel_size=tensor_parallel_size,
                                                            tensor_parallel_rank=expert_parallel_rank, device=device)
        else:
            self.mlp = GlmMoeDsaMoE(config, tensor_parallel_size=tensor_parallel_size,
                                    expert_parallel_size=expert_parallel_size, expert_parallel_rank=expert_parallel_rank,
                                    device=device)

    def forward(self, hidden_states, *, is_decode=False):
        """STAND-IN (no attention): the post-attention half of the fork's decoder layer, returning the MLP output."""
        mlp_input = self.post_attention_layernorm(hidden_states)
        if self.is_moe:
            out = self.mlp(mlp_input.reshape(-1, mlp_input.shape[-1]), is_decode=is_decode).view_as(mlp_input)
        else:
            out = self.mlp(mlp_input)
        if self.world_size > 1:
            out = self.tp_group.all_reduce(out)
        return out


class GlmMoeDsaModel(nn.Module):
    def __init__(self, config, *, tensor_parallel_size, expert_parallel_size, expert_parallel_rank,
                 collective_group=None, device=None):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(
            GlmMoeDsaDecoderLayer(config, i, tensor_parallel_size=tensor_parallel_size,
                                  expert_parallel_size=expert_parallel_size, expert_parallel_rank=expert_parallel_rank,
                                  collective_group=collective_group, device=device)
            for i in config.main_layer_indices)


class GlmMoeDsaForCausalLM(nn.Module):
    def __init__(self, config, tensor_parallel_size, *, expert_parallel_rank=0, tp_group=None, device=None):
        super().__init__()
        self.config = config
        self.tensor_parallel_size = self.world_size = tensor_parallel_size
        self.rank = expert_parallel_rank
        # the fork: vLLM's TP GroupCoordinator (refused for TP > 1 without torch.distributed); here the thread group
        self.tp_group = None if tensor_parallel_size == 1 else (tp_group or ps.get_tp_group())
        self.model = GlmMoeDsaModel(config, tensor_parallel_size=tensor_parallel_size,
                                    expert_parallel_size=tensor_parallel_size, expert_parallel_rank=expert_parallel_rank,
                                    collective_group=self.tp_group, device=device)
        self.last_load_report = None

    @classmethod
    def from_configs(cls, hf_config, neuron_config, tensor_parallel_size, *, expert_parallel_rank=0, tp_group=None):
        config = GlmMoeDsaConfig.from_configs(hf_config, neuron_config)
        return cls(config, tensor_parallel_size, expert_parallel_rank=expert_parallel_rank, tp_group=tp_group)

    @torch.no_grad()
    def forward(self, hidden_states, positions, is_decode):
        """STAND-IN forward (see the module docstring): [moe_layers, T, H]."""
        return torch.stack([layer(hidden_states, is_decode=is_decode) for layer in self.model.layers if layer.is_moe])

    def _checkpoint_key_for_parameter(self, parameter_name):
        if ".mlp.router.gate." in parameter_name:
            return parameter_name.replace(".mlp.router.gate.", ".mlp.gate.")
        m = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.experts\.(\d+)\.(.+)$", parameter_name)
        if m is not None:
            layer, local = int(m.group(1)), int(m.group(2))
            glob = self.model.layers[layer].mlp.experts.global_expert_ids[local]
            return f"model.layers.{layer}.mlp.experts.{glob}.{m.group(3)}"
        return parameter_name

    def checkpoint_mappings(self, manifest):
        by_key, mappings = manifest.by_key, {}
        for name, _ in self.named_parameters():
            key = self._checkpoint_key_for_parameter(name)
            if key not in by_key:
                raise ValueError(f"No pinned checkpoint tensor for model parameter {name!r}: expected {key!r}")
            mappings[name] = key
        return mappings

    def _shard_dim(self, key, shape):
        try:
            return wl.tp_shard_spec_for_key(key, shape, world_size=self.tensor_parallel_size).shard_dim
        except ValueError:
            return None

    def _fp8_weight_loader(self, key, global_shape, shard_dim):
        world = self.tensor_parallel_size

        def transform(sources, rank):
            if len(sources) != 1:
                raise ValueError(f"FP8 tensor {key} requires one weight")
            local_rank = self.rank if world > 1 else rank
            weight = sources[0][wl.TPShardSpec(global_shape, shard_dim, world).slices_for_rank(local_rank)].float()
            return (weight * FP8_STORAGE_SCALE).to(torch.float8_e4m3fn)

        return SafetensorsWeightLoader(transform=transform)

    def _fp8_scale_loader(self, key, global_shape, shard_dim):
        world = self.tensor_parallel_size

        def transform(sources, rank):
            if len(sources) != 1:
                raise ValueError(f"FP8 scale {key} requires one grid")
            local_rank = self.rank if world > 1 else rank
            cover = wl.scale_slices_for_weight_shard(global_shape, shard_dim=shard_dim, rank=local_rank, world_size=world)
            return sources[0][cover].float() * FP8_INVERSE_SCALE_ADJUSTMENT

        return SafetensorsWeightLoader(transform=transform)

    def _sharding_loader(self, shard_dim, shard_size):
        def transform(sources, rank):
            return sources[0][:].narrow(shard_dim, self.rank * shard_size, shard_size)

        return SafetensorsWeightLoader(transform=transform)

    def _install_weight_loaders(self, manifest, mappings):
        by_key = manifest.by_key
        for name, parameter in self.named_parameters():
            key = mappings[name]
            entry = by_key[key]
            if entry.info.disposition is wl.Disposition.FP8_SCALE:
                weight_key = key.removesuffix("_scale_inv")
                shape = by_key[weight_key].header.shape
                set_weight_loader(parameter, self._fp8_scale_loader(key, shape, self._shard_dim(weight_key, shape)))
                continue
            shard_dim = self._shard_dim(key, entry.header.shape)
            if entry.header.dtype == "F8_E4M3":
                if parameter.dtype is not torch.float8_e4m3fn:
                    raise ValueError(f"FP8 checkpoint tensor {key} maps to non-FP8 parameter {parameter.dtype}")
                set_weight_loader(parameter, self._fp8_weight_loader(key, entry.header.shape, shard_dim))
            elif shard_dim is not None:
                set_weight_loader(parameter, self._sharding_loader(shard_dim, parameter.shape[shard_dim]))

    def _account_manifest(self, manifest, mappings):
        planned = {e.key for e in wl.local_load_plan(manifest, ep_rank=self.rank)}
        mapped = {k for src in mappings.values() for k in (src if isinstance(src, list) else [src])}
        if mapped != planned:
            raise ValueError("Checkpoint mapping does not exactly account for the rank-local plan; "
                             f"missing={sorted(planned - mapped)[:8]}, extra={sorted(mapped - planned)[:8]}")
        return Counter(e.info.disposition for e in manifest.entries if e.key in planned)

    def _materialize_router_selection_identities(self, device):
        for layer in self.model.layers:
            if layer.is_moe:
                router = layer.mlp.router
                router.selection_identity = torch.eye(router.num_experts, dtype=torch.float32, device=device)

    def load_weights(self, checkpoint_path, device, cache_dir=None):
        manifest = wl.load_checkpoint_manifest(Path(checkpoint_path) / "model.safetensors.index.json")
        mappings = self.checkpoint_mappings(manifest)
        report = self._account_manifest(manifest, mappings)
        self._install_weight_loaders(manifest, mappings)
        checkpoint = SafetensorsCheckpoint(checkpoint_path, cache_dir)
        result = checkpoint.load_sharded_pipelined(self.rank, self.world_size, self, mappings, device, strict=True)
        self.load_state_dict(result.state_dict, strict=True, assign=True)
        self._materialize_router_selection_identities(device)
        self.last_load_report = report

    def load_weights_lite(self, checkpoint_path, device, cache_dir=None):
        SafetensorsCheckpoint(checkpoint_path, cache_dir)._ensure_indexed()
