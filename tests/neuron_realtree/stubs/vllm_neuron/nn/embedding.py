"""STUB (real-tree mode, tests only): replaces ``vllm_neuron/nn/embedding.py`` (not in any stored tree): the
vocabulary-sharded embedding holds ``weight [vocab / TP, hidden]``; its forward is not reproduced."""

import torch
import torch.distributed as dist
from torch import nn

from _placeholder import NeuronOnly


class VocabDimShardedEmbedding(nn.Module):
    def __init__(self, num_embeddings, embedding_dim, dtype=None, device=None, tp_group=None, **_kwargs):
        super().__init__()
        tp = 1
        if dist.is_initialized():
            tp = dist.get_world_size(tp_group if tp_group is not None else dist.group.WORLD)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings // tp, embedding_dim, dtype=dtype, device=device))

    def forward(self, *args, **kwargs):
        raise NeuronOnly("vllm_neuron.nn.embedding.VocabDimShardedEmbedding.forward is not reproduced (real-tree stub)")
