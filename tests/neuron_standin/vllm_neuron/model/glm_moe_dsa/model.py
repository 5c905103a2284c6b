"""STAND-IN: the parts of vllm_neuron/model/glm_moe_dsa/model.py (fork @02ef7111) the glue touches.

``GlmMoeDsaForCausalLM(config, tensor_parallel_size, *, expert_parallel_rank, tp_group)`` builds what the fork
builds, as parameter holders where the fork runs NKI kernels: the vocabulary-sharded embedding, per layer the norms,
the MLA attention and (on the fork's indexer layers) the indexer (attention.py), the dense MLP (layers below
``first_k_dense_replace``) or the MoE block (moe.py: ``expert_parallel_size = tensor_parallel_size``, pure EP over
the TP world), the final norm and the vocabulary-sharded ``lm_head``; it refuses, as the fork's ``__init__`` does, an
on-device sampling config that is not greedy ("GLM-5.2 on-device sampling supports greedy only": the runner's default
``NeuronConfig.from_dict({})`` is not greedy). ``load_weights(checkpoint_path, device, cache_dir)`` in the fork's
order: the manifest (weight_loaders: key count, grammar, headers), ``checkpoint_mappings`` (every parameter to one
load-target key), ``_account_manifest`` (mapped keys == the rank-local plan, ``local_load_plan``'s import-time
``PINNED_EP``), weight loaders (FP8 ``.weight`` -> 240/448 re-rounded float8_e4m3fn bytes of the rank's slice,
refused for a non-FP8 parameter; ``weight_scale_inv`` x 448/240 of the covering blocks; other sharded tensors cut),
``load_sharded_pipelined(..., strict=True)``, ``load_state_dict(strict=True, assign=True)``, router selection
identities. ``load_weights_lite`` reads the index only and plans with this module's own ``PINNED_EP`` name (bound
at import, as the fork's).

Labelled differences: attention, indexer, embedding, LM head and sampler have no forward (never called by the glue);
the forward is the stand-in's own (every MoE layer's post-attention half on the same hidden states, stacked
[moe_layers, T, H]); the ranks are threads, so the TP group is the stand-in's (the fork takes vLLM's) and loading
is always pipelined."""


import re
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from vllm_neuron.parallel import neuron_parallel_state as ps
from vllm_neuron.utils.checkpoints import SafetensorsCheckpoint
from vllm_neuron.utils.weight_loader import SafetensorsWeightLoader, set_weight_loader

from . import weight_loaders as wl
from .attention import INDEXER_LAYERS, GlmMoeDsaAttention, GlmMoeDsaIndexer, GlmMoeDsaRMSNorm
from .block_fp8 import FP8_INVERSE_SCALE_ADJUSTMENT, FP8_STORAGE_SCALE
from .config import GlmMoeDsaConfig
from .mlp import GlmMoeDsaSwiGLUMLP
from .moe import GlmMoeDsaMoE
from .weight_loaders import PINNED_EP


class GlmMoeDsaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx, *, tensor_parallel_size, expert_parallel_size, expert_parallel_rank,
                 collective_group=None, device=None):
        super().__init__()
        if config.num_attention_heads % tensor_parallel_size:
            raise ValueError(f"num_attention_heads={config.num_attention_heads} is not divisible by TP={tensor_parallel_size}")
        self.layer_idx = layer_idx
        self.is_dense = layer_idx < config.first_k_dense_replace
        self.is_moe = not self.is_dense
        self.tp_group, self.world_size = collective_group, tensor_parallel_size
        norm = dict(dtype=config.torch_dtype, device=device)
        self.input_layernorm = GlmMoeDsaRMSNorm(config.hidden_size, config.rms_norm_eps, **norm)
        self.post_attention_layernorm = GlmMoeDsaRMSNorm(config.hidden_size, config.rms_norm_eps, **norm)
        self.self_attn = GlmMoeDsaAttention(config, world=tensor_parallel_size, rank=expert_parallel_rank, device=device)
        if layer_idx in INDEXER_LAYERS:
            self.self_attn.indexer = GlmMoeDsaIndexer(config, device=device)
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


class _VocabSharded(nn.Module):
    """The embedding / LM head's parameter: ``weight [vocab / TP, hidden]`` (vllm_neuron/nn is not in any stored tree)."""

    def __init__(self, vocab, hidden, world, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab // world, hidden, dtype=dtype, device=device))


class GlmMoeDsaModel(nn.Module):
    def __init__(self, config, *, tensor_parallel_size, expert_parallel_size, expert_parallel_rank,
                 collective_group=None, device=None):
        super().__init__()
        self.config = config
        self.embed_tokens = _VocabSharded(config.vocab_size, config.hidden_size, tensor_parallel_size, config.torch_dtype, device)
        self.layers = nn.ModuleList(
            GlmMoeDsaDecoderLayer(config, i, tensor_parallel_size=tensor_parallel_size,
                                  expert_parallel_size=expert_parallel_size, expert_parallel_rank=expert_parallel_rank,
                                  collective_group=collective_group, device=device)
            for i in config.main_layer_indices)
        self.norm = GlmMoeDsaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=config.torch_dtype, device=device)


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
        sampling = getattr(config.neuron_config, "on_device_sampling_config", None)
        if sampling is not None and not sampling.all_greedy:
            raise ValueError("GLM-5.2 on-device sampling supports greedy only")
        self.on_device_sampling_config = sampling
        self.lm_head = _VocabSharded(config.vocab_size, config.hidden_size, tensor_parallel_size, config.torch_dtype, device)
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
            if by_key[key].info.disposition not in (wl.Disposition.LOAD_TARGET, wl.Disposition.FP8_SCALE):
                raise ValueError(f"Parameter maps to non-load target {key}")
            mappings[name] = key
        return mappings

    def _shard_dim(self, key, shape):
        if ".self_attn.indexer." in key:
            return None
        try:
            return wl.tp_shard_spec_for_key(key, shape, world_size=self.tensor_parallel_size).shard_dim
        except ValueError:
            return 0 if key in ("model.embed_tokens.weight", "lm_head.weight") else None

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
        planned = {e.key for e in wl.local_load_plan(manifest, ep_rank=self.rank)}  # its default ep: bound at import
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
        """Index only (no shard is opened): the rank's keys counted with this module's ``PINNED_EP``."""
        index = wl.load_checkpoint_index(Path(checkpoint_path) / "model.safetensors.index.json")
        infos = [wl.classify_checkpoint_key(k) for k in index.key_to_shard]
        local = [i for i in infos if i.disposition is not wl.Disposition.INTENTIONAL_SKIP and PINNED_EP.rank_loads(i, self.rank)]
        self.last_load_report = Counter(i.disposition for i in local)
