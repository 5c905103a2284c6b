"""STAND-IN: vllm_neuron/model/qwen3_5/deltanet.py ``Qwen3_5GatedDeltaNet`` (fork whn09/vllm-neuron @7ea9927,
upstream vllm-project/vllm-neuron @b3a5a71): the parameters, their TP loaders and the two methods neuron-w8 replaces,
with the fork's contracts; the recurrence is not reproduced.

As the fork: value and key heads are split over the TP world (``world_size``), ``in_proj_qkv`` / ``conv1d`` hold this
rank's share of each of the [q | k | v] segments (each segment sharded on its own, then concatenated),
``in_proj_z`` its value heads, ``in_proj_ba`` the stacked b then a rows of its value heads, ``out_proj`` is
row-parallel (its rows = this rank's value dims); parameters are stored ``[in, out]``. ``_project(hidden) -> (qkv, z,
beta, g)`` (``beta = sigmoid(b)``, ``g = -exp(A_log) softplus(a + dt_bias)``, float32) and ``_output(core, z,
num_tokens)`` (per-head RMSNorm in float32, times ``norm_weight`` in the model dtype, times ``silu(z)`` in float32,
then ``@ out_proj``). ``forward(hidden_states, positions, attn_metadata)`` dispatches on the layer's metadata as the
fork does (decode: ``max_query_len <= decode_token_threshold``; prefill all-gathers the sequence-parallel input first)
and reduces like it; **its core is the stand-in's own**: one delta-rule step from a zero state per token
(``beta * (q . k) * v`` on the l2-normed heads of ``silu(qkv)``), no convolution, no state pages."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from vllm_neuron.parallel import neuron_parallel_state as ps
from vllm_neuron.utils.weight_loader import SafetensorsWeightLoader, set_weight_loader, sharding_weight_loader

from .flags import SEQUENCE_PARALLEL


def _segments_loader(sizes, num_shards, transposed, squeeze_dim=None):
    """Each of the [q | k | v] segments (global ``sizes`` along the checkpoint's dim 0) sharded, then concatenated."""

    def transform(slices, rank):
        sl, parts, offset = slices[0], [], 0
        for size in sizes:
            per = size // num_shards
            start = offset + (rank % num_shards) * per
            index = [slice(None)] * len(sl.get_shape())
            index[0] = slice(start, start + per)
            parts.append(sl[tuple(index)])
            offset += size
        out = torch.cat(parts, dim=0)
        out = out.squeeze(squeeze_dim) if squeeze_dim is not None else out
        return out.T if transposed else out

    return SafetensorsWeightLoader(transform=transform)


def _stacked_loader(num_shards):
    def transform(slices, rank):
        parts = []
        for sl in slices:
            per = sl.get_shape()[0] // num_shards
            parts.append(sl[(rank % num_shards) * per:(rank % num_shards + 1) * per])
        return torch.cat(parts, dim=0).T

    return SafetensorsWeightLoader(transform=transform)


class Qwen3_5GatedDeltaNet(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx, self.layer_name = layer_idx, f"layers.{layer_idx}.linear_attn"
        self.dtype, self.rms_norm_eps, self.hidden_size = config.torch_dtype, config.rms_norm_eps, config.hidden_size
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.tp_group = ps.get_tp_group()
        self.world_size = self.tp_group.world_size
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.num_k_heads = config.linear_num_key_heads // self.world_size
        self.num_v_heads = config.linear_num_value_heads // self.world_size
        self.num_v_groups = self.num_v_heads // self.num_k_heads
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        gk = config.linear_num_key_heads * self.head_k_dim
        gv = config.linear_num_value_heads * self.head_v_dim
        h = self.hidden_size
        self.in_proj_qkv_weight = nn.Parameter(torch.empty(h, self.conv_dim, dtype=self.dtype))
        self.in_proj_z_weight = nn.Parameter(torch.empty(h, self.value_dim, dtype=self.dtype))
        self.in_proj_ba_weight = nn.Parameter(torch.empty(h, 2 * self.num_v_heads, dtype=self.dtype))
        self.conv1d_weight = nn.Parameter(torch.empty(self.conv_dim, self.conv_kernel_size, dtype=self.dtype))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32))
        self.norm_weight = nn.Parameter(torch.empty(self.head_v_dim, dtype=self.dtype))
        self.out_proj_weight = nn.Parameter(torch.empty(self.value_dim, h, dtype=self.dtype))
        w = self.world_size
        set_weight_loader(self.in_proj_qkv_weight, _segments_loader((gk, gk, gv), w, True))
        set_weight_loader(self.in_proj_z_weight, sharding_weight_loader(1, self.value_dim, w, is_storage_transposed=True))
        set_weight_loader(self.in_proj_ba_weight, _stacked_loader(w))
        set_weight_loader(self.conv1d_weight, _segments_loader((gk, gk, gv), w, False, squeeze_dim=1))
        for p in (self.dt_bias, self.A_log):
            set_weight_loader(p, sharding_weight_loader(0, self.num_v_heads, w))
        set_weight_loader(self.out_proj_weight, sharding_weight_loader(0, self.value_dim, w, is_storage_transposed=True))

    def _project(self, hidden_states):
        hidden_states = hidden_states.to(self.dtype)
        qkv = hidden_states @ self.in_proj_qkv_weight
        z = hidden_states @ self.in_proj_z_weight
        ba = hidden_states @ self.in_proj_ba_weight
        b, a = ba[..., :self.num_v_heads], ba[..., self.num_v_heads:]
        beta = b.float().sigmoid()
        g = -self.A_log.exp() * F.softplus(a.float() + self.dt_bias)
        return qkv, z, beta, g

    def _output(self, core, z, num_tokens):
        core = core.float()
        core = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + self.rms_norm_eps)
        core = self.norm_weight * core.to(self.dtype)
        core = core * F.silu(z.reshape_as(core).float())
        return core.to(self.dtype).reshape(num_tokens, self.value_dim) @ self.out_proj_weight

    def _core(self, qkv, beta):
        """STAND-IN core: one delta-rule step from a zero state per token."""
        t = qkv.shape[0]
        mixed = F.silu(qkv.float())
        q = mixed[:, :self.key_dim].reshape(t, self.num_k_heads, self.head_k_dim)
        k = mixed[:, self.key_dim:2 * self.key_dim].reshape(t, self.num_k_heads, self.head_k_dim)
        v = mixed[:, 2 * self.key_dim:].reshape(t, self.num_v_heads, self.head_v_dim)
        qk = (F.normalize(q, dim=-1) * F.normalize(k, dim=-1)).sum(-1).repeat_interleave(self.num_v_groups, dim=1)
        return (beta * qk)[..., None] * v

    def forward(self, hidden_states, positions, attn_metadata):
        metadata = attn_metadata[self.layer_name]
        decode = metadata["max_query_len"] <= metadata["decode_token_threshold"]
        if not decode and self.world_size > 1 and SEQUENCE_PARALLEL:
            hidden_states = self.tp_group.all_gather(hidden_states, dim=0)
        qkv, z, beta, g = self._project(hidden_states)
        out = self._output(self._core(qkv, beta), z, hidden_states.shape[0])
        if self.world_size > 1:
            out = self.tp_group.reduce_scatter(out, dim=0) if not decode and SEQUENCE_PARALLEL else \
                self.tp_group.all_reduce(out)
        return out
