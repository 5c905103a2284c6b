"""STAND-IN: process groups. Upstream's are vLLM GroupCoordinators; here the ranks of a group are the
threads of one test process, and a group offers the GroupCoordinator methods the MoE blocks call:
world_size, rank_in_group, all_reduce(t), all_gather(t, dim), reduce_scatter(t, dim). They are traceable by
torch.compile (one custom op per exchange, ``standin_collectives``), as vllm-neuron's are by its backend."""

import threading

import standin_collectives
import torch


class ThreadGroup:
    """The shared part of a group: one slot per rank and a barrier."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size)
        self.slots = [None] * world_size
        self.key = standin_collectives.register(self)

    def exchange(self, rank: int, tensor: torch.Tensor) -> list:
        self.barrier.wait()
        self.slots[rank] = tensor
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        return got


class GroupCoordinator:
    def __init__(self, group: ThreadGroup, rank_in_group: int):
        self.group, self.rank_in_group, self.world_size = group, rank_in_group, group.world_size

    def _gather(self, t):
        return torch.ops.vllm_neuron_standin.all_gather(t, self.group.key, self.rank_in_group)

    def all_reduce(self, t):
        gathered = self._gather(t).view((self.world_size,) + tuple(t.shape))
        return gathered.float().sum(dim=0).to(t.dtype)

    def all_gather(self, t, dim=0):
        if dim != 0:
            raise NotImplementedError("stand-in: all_gather along dim 0 only")
        return self._gather(t)

    def reduce_scatter(self, t, dim=0):
        total = self.all_reduce(t)
        return total.chunk(self.world_size, dim=dim)[self.rank_in_group].contiguous()


def single() -> GroupCoordinator:
    return GroupCoordinator(ThreadGroup(1), 0)


# What this thread's rank sees (set by the test for each rank thread).
_local = threading.local()


def set_rank_state(tp_group, ep_degree=1, ep_rank=0, ep_tp_group=None):
    """This rank's groups: TP, and expert parallelism's (degree 1: not initialised, as upstream's without EP). Whether
    a model uses EP is vLLM's ``parallel_config.enable_expert_parallel``, which the models read themselves."""
    _local.state = dict(tp_group=tp_group, ep_degree=ep_degree, ep_rank=ep_rank, ep_tp_group=ep_tp_group or tp_group)


def state() -> dict:
    if not hasattr(_local, "state"):
        set_rank_state(single())
    return _local.state


def get_tp_group():
    return state()["tp_group"]


def get_neuron_ep_degree():
    """1 when expert parallelism was not initialised, as upstream."""
    return state()["ep_degree"]


def get_neuron_ep_rank():
    return state()["ep_rank"]


def get_neuron_ep_tp_group():
    """As upstream (@b3a5a71): only exists with expert parallelism (``ep_degree > 1``)."""
    assert state()["ep_degree"] > 1, ("Neuron EP-TP group is not initialized. Call initialize_neuron_parallel_state() "
                                      "with ep_degree > 1.")
    return state()["ep_tp_group"]


def get_neuron_mlp_tp_group():
    return state()["tp_group"]
