"""STUB (real-tree mode, tests only): replaces ``vllm_neuron/nn/embedding.py`` (not in any stored tree): the
vocabulary-sharded embedding holds ``weight [ceil(vocab / TP), hidden]`` (TP: the given process group's size when
torch.distributed is initialised, else 1), with the attributes the read models size their loaders from
(``vocab_size_per_rank``, ``tp_size``). Both spellings of its arguments are taken (GLM-5 passes them positionally,
Qwen3-MoE as ``vocab_size=`` / ``embed_dim=``). Its forward is not reproduced."""

import math

import torch
import torch.distributed as dist
from torch import nn

from _placeholder import NeuronOnly


class VocabDimShardedEmbedding(nn.Module):
    def __init__(self, vocab_size=None, embed_dim=None, dtype=None, device=None, tp_group=None, **kwargs):
        super().__init__()
        vocab_size = kwargs.pop("num_embeddings", vocab_size)
        embed_dim = kwargs.pop("embedding_dim", embed_dim)
        self.tp_size = dist.get_world_size(tp_group if tp_group is not None else dist.group.WORLD) if dist.is_initialized() else 1
        self.vocab_size, self.embed_dim = vocab_size, embed_dim
        self.vocab_size_per_rank = math.ceil(vocab_size / self.tp_size)
        self.weight = nn.Parameter(torch.empty(self.vocab_size_per_rank, embed_dim, dtype=dtype, device=device))

    def forward(self, *args, **kwargs):
        raise NeuronOnly("vllm_neuron.nn.embedding.VocabDimShardedEmbedding.forward is not reproduced (real-tree stub)")
