"""STUB (real-tree mode, tests only): replaces ``vllm_neuron/nn`` (no stored vllm-neuron tree has this folder, so it
is not public here). The layers the read model files build, with the parameters their load code maps: a
column-parallel linear holds ``weight [out / TP, in]``, a row-parallel one ``weight [out, in / TP]`` (TP: the
given process group's size when torch.distributed is initialised, else 1), optional ``bias``. Their forward and the
on-device ``Sampler`` are not reproduced (they raise): the glue's tests run the adopted MoE blocks, not these."""

import torch
import torch.distributed as dist
from torch import nn

from _placeholder import NeuronOnly

from .embedding import VocabDimShardedEmbedding  # noqa: F401


def _tp(tp_group):
    if not dist.is_initialized():
        return 1, 0
    group = tp_group if tp_group is not None else dist.group.WORLD
    return dist.get_world_size(group), dist.get_rank(group)


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, bias=False, gather_output=False, dtype=None, device=None,
                 tp_group=None, **_kwargs):
        super().__init__()
        self.tp_size, self.tp_rank = _tp(tp_group)
        self.in_features, self.out_features = in_features, out_features
        self.out_features_per_rank = out_features // self.tp_size
        self.gather_output = gather_output
        self.weight = nn.Parameter(torch.empty(self.out_features_per_rank, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(self.out_features_per_rank, dtype=dtype, device=device)) if bias else None

    def forward(self, *args, **kwargs):
        raise NeuronOnly("vllm_neuron.nn.ColumnParallelLinear.forward is not reproduced (real-tree stub)")


class RowParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, bias=False, input_is_parallel=True, dtype=None, device=None,
                 tp_group=None, **_kwargs):
        super().__init__()
        self.tp_size, self.tp_rank = _tp(tp_group)
        self.in_features, self.out_features = in_features, out_features
        self.in_features_per_rank = in_features // self.tp_size
        self.input_is_parallel = input_is_parallel
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features_per_rank, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    def forward(self, *args, **kwargs):
        raise NeuronOnly("vllm_neuron.nn.RowParallelLinear.forward is not reproduced (real-tree stub)")


class Sampler(nn.Module):
    """On-device sampling (Neuron kernels): built when the model asks for it, never run here."""

    def __init__(self, config=None, *args, process_group=None, **_kwargs):
        super().__init__()
        self.config = config

    def forward(self, *args, **kwargs):
        raise NeuronOnly("vllm_neuron.nn.Sampler is the on-device sampler (real-tree stub)")
