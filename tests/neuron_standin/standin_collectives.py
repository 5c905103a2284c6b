"""STAND-IN (tests only): the collectives of the stand-in's process groups as torch custom ops, so that a
``torch.compile(fullgraph=True)`` of a model calling them traces (vllm-neuron's collectives are traceable ops of
its compile backend). The ranks of a group are threads of this process; each op exchanges through the group's
barrier when executed, and its fake implementation gives the output shape.

Kept outside the ``vllm_neuron`` stand-in package: the tests drop and re-import that package, an op is defined once."""

import threading

import torch

GROUPS: dict = {}  # id -> ThreadGroup (vllm_neuron.parallel.neuron_parallel_state)
_lock = threading.Lock()


def register(group) -> int:
    with _lock:
        key = len(GROUPS) + 1
        GROUPS[key] = group
        return key


@torch.library.custom_op("vllm_neuron_standin::all_gather", mutates_args=())
def all_gather(t: torch.Tensor, group: int, rank: int) -> torch.Tensor:
    """The ranks' tensors concatenated along dim 0, in rank order."""
    return torch.cat(GROUPS[group].exchange(rank, t.contiguous()), dim=0)


@all_gather.register_fake
def _all_gather_fake(t, group, rank):
    return t.new_empty((t.shape[0] * GROUPS[group].world_size,) + tuple(t.shape[1:]))
