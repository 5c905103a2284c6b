"""STAND-IN: vllm_neuron/model/glm5_next/factory.py (fork jinhuang12/vllm-neuron @382091c and the later stored
version that defines ``_resolve_ep_degree``): the registry's class, whose ``from_configs(hf_config,
text_neuron_config, vision_neuron_config)`` builds the implementation of ``model_fp8``, and the expert-partition
helpers the bank imports. ``_resolve_ep_degree(None)`` asks the parallel state through the module at call time
(``neuron_parallel_state.get_neuron_ep_degree()``: 1 when expert parallelism was never initialised), as the fork."""

from dataclasses import dataclass

import torch.nn as nn



@dataclass(frozen=True)
class ExpertPartition:
    num_experts: int
    tp_degree: int  # the fork's field name; the divisor (the expert-parallel degree since its inc-087)
    counts: tuple
    offsets: tuple

    def local_expert_indices(self, rank: int) -> tuple:
        if not 0 <= rank < self.tp_degree:
            raise ValueError(f"rank {rank} is outside the partition's {self.tp_degree} ranks")
        return tuple(range(self.offsets[rank], self.offsets[rank] + self.counts[rank]))


def require_uniform_expert_partition(num_experts: int, degree: int) -> ExpertPartition:
    if num_experts % degree:
        raise ValueError(f"{num_experts} routed experts do not partition uniformly over degree {degree}")
    n = num_experts // degree
    return ExpertPartition(num_experts, degree, (n,) * degree, tuple(r * n for r in range(degree)))


def _resolve_ep_degree(ep_degree=None) -> int:
    """An explicit degree, else the parallel state's (1 when expert parallelism was never initialised)."""
    if ep_degree is not None:
        return int(ep_degree)
    from vllm_neuron.parallel import neuron_parallel_state

    return int(neuron_parallel_state.get_neuron_ep_degree())


class Glm5NextForConditionalGeneration(nn.Module):
    @classmethod
    def from_configs(cls, hf_config, text_neuron_config=None, vision_neuron_config=None):
        from .model_fp8 import Glm5NextForConditionalGeneration as Model

        return Model.from_configs(hf_config, text_neuron_config=text_neuron_config,
                                  vision_neuron_config=vision_neuron_config)
