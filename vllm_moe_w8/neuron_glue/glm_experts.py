"""vllm-neuron's GLM routed-expert banks with 1-byte experts (fork jinhuang12/vllm-neuron; DEVELOPING.md pins it).

The swap point is a *routed-expert bank*: a module whose forward receives this rank's (already normalised)
tokens ``hidden [T, H]`` and the router's scattered affinities over **all** experts ``[T, E]`` (the weight of
each selected expert in its column, zero elsewhere, applied after the down projection) and returns this
rank's routed sum ``[T, H]``, with no collective (its caller reduces). GLM-5.3-Flash's
``glm5_next.model_fp8.Glm5NextRoutedExperts`` is one; GLM-5's ``GlmMoeDsaRoutedExperts`` is another (its
adoption builds on this module: a :class:`BankAdoption` entry in :data:`BANKS`).

:func:`adopt` turns a built bank into ours in place: the fork's FP8 expert parameters are released (their
names stay declared as ``None`` so the fork's own load and prep loops find nothing to fill), the kernel
layout of :mod:`vllm_moe_w8.neuron_glue.loaders` becomes the only expert storage, and the class gains the
fork's forward signature in front of its own (:class:`W8Glm5NextRoutedExperts`). The router, the
affinities, the shared expert and the collectives stay the fork's.

:meth:`W8RoutedBank.w8_bank_forward`, the shared computation, is trace-safe: the affinities of this rank's
experts (a column slice at a Python-int rank, an ``index_select`` at a device-tensor rank, so that one graph
serves every rank as the fork intends), their top-k (ids of unrouted slots -1), then
``kernel_launch.run_routed_experts`` with the bank's own ``swiglu_limit``.

Layout (:func:`glm5_next_plan`): ``ep_degree`` divides the experts (linear placement, EP rank from
vllm-neuron's parallel state); the intermediate dim is split over the ``tp_degree / ep_degree`` ranks of an
expert-parallel group (the fork's column: ``get_neuron_ep_tp_group().rank_in_group``, checked against
``rank % (tp_degree / ep_degree)``). The seed TP=32/EP=32 holds 9 whole experts per rank; the fork's
registered TP=64 / ep_degree 16 holds 18 experts x 1/4 of I.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from vllm_moe_w8.neuron_glue import experts, interfaces, kernel_launch
from vllm_moe_w8.neuron_glue.interfaces import MoeTarget, NeuronGlueError
from vllm_moe_w8.neuron_glue.loaders import RankPlan

PARALLEL_STATE = "vllm_neuron.parallel.neuron_parallel_state"
GLM5_NEXT_SOURCE = ("fork jinhuang12/vllm-neuron model/glm5_next (factory.py @382091c, model_fp8.py @77c1abaa and its later "
                    "stored version; DEVELOPING.md, 'vllm-neuron interfaces we use')")


def local_affinities(affinities: torch.Tensor, plan: RankPlan, rank=None) -> torch.Tensor:
    """The columns of this rank's experts ``[T, L]`` fp32 of global affinities ``[T, E]``.

    ``rank``: ``None`` or a Python int (must be the rank the experts were loaded for), or an int64 device tensor
    (the fork's one-graph-for-every-rank form: selected on the device)."""
    aff = affinities.float()
    if plan.ep_degree == 1:
        return aff
    n = plan.num_local
    if torch.is_tensor(rank):
        first = rank.to(device=aff.device, dtype=torch.int64).reshape(-1)[0] * n
        return aff.index_select(1, torch.arange(n, device=aff.device, dtype=torch.int64) + first)
    if rank is not None and int(rank) != plan.ep_rank:
        raise NeuronGlueError(
            f"neuron-w8: the bank was called for expert_parallel_rank {int(rank)} but its experts were loaded for EP "
            f"rank {plan.ep_rank} of {plan.ep_degree} (vllm-neuron's parallel state at adoption)"
        )
    return aff[:, plan.first_expert: plan.first_expert + n]


def topk_of_affinities(local: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], local ids [T, k]) of scattered local affinities; slots without a route: weight 0, id -1."""
    k = min(int(top_k), local.shape[1])
    weights, ids = torch.topk(local, k, dim=-1)
    routed = weights > 0
    return torch.where(routed, weights, torch.zeros_like(weights)), torch.where(routed, ids, torch.full_like(ids, -1))


class W8RoutedBank(experts._W8Routed):
    """A routed-expert bank's computation from global affinities (mixed in front of the fork's class)."""

    w8_top_k: int = 0

    def w8_bank_forward(self, hidden: torch.Tensor, affinities: torch.Tensor, expert_parallel_rank=None,
                        collector: list | None = None) -> torch.Tensor:
        plan = self.w8_plan
        if hidden.dim() != 2 or tuple(affinities.shape) != (hidden.shape[0], plan.num_experts):
            raise NeuronGlueError(
                f"neuron-w8: layer {self.w8_layer}: the bank takes hidden [T, H] and affinities over all "
                f"{plan.num_experts} experts [T, {plan.num_experts}]; got {tuple(hidden.shape)} and {tuple(affinities.shape)}"
            )
        weights, ids = topk_of_affinities(local_affinities(affinities, plan, expert_parallel_rank), self.w8_top_k)
        if collector is not None:
            collector.append(ids)  # device-only reading: this rank's routed local experts per token
        with torch.no_grad():  # inference only, as the fork's forward
            out = self.w8_runner(hidden.detach(), weights.detach(), ids, self.w8_kernel_weights(), lnc=self.w8_settings.lnc,
                                 swiglu_limit=self.w8_settings.swiglu_limit, where=self.w8_backend)
        return out.to(hidden.dtype)


class W8Glm5NextRoutedExperts(W8RoutedBank):
    """``Glm5NextRoutedExperts.forward(hidden_states [T, H], expert_affinities [T, E], quant_config, *, block_size,
    moe_group, tp_degree, expert_parallel_rank, collector)``: this rank's routed sum (its caller reduces)."""

    def forward(self, hidden_states, expert_affinities, quant_config=None, *, block_size=None, moe_group=None,
                tp_degree=1, expert_parallel_rank=0, collector=None):
        # quant_config, block_size, moe_group, tp_degree select and schedule the fork's kernel; ours needs none of them
        return self.w8_bank_forward(hidden_states, expert_affinities, expert_parallel_rank, collector)

    def prepare_scale_operands(self, **operands) -> int:
        """The fork's load-time prep packs its FP8 operands; neuron-w8's loader prepared the experts: nothing to pack."""
        return 0


@dataclass(frozen=True)
class Sizes:
    hidden: int
    intermediate: int


def text_sizes(hf_config) -> Sizes:
    """hidden_size and moe_intermediate_size of the model config (its ``text_config`` when nested)."""
    text = getattr(hf_config, "text_config", None)
    values = {}
    for key in ("hidden_size", "moe_intermediate_size"):
        value = getattr(text, key, None) if text is not None else None
        value = getattr(hf_config, key, None) if value is None else value
        if value is None:
            raise NeuronGlueError(f"neuron-w8 on Neuron: the model's config.json has no {key} (text_config or top level)")
        values[key] = int(value)
    return Sizes(values["hidden_size"], values["moe_intermediate_size"])


def _parallel_state():
    try:
        return importlib.import_module(PARALLEL_STATE)
    except ImportError as e:
        raise NeuronGlueError(f"neuron-w8 on Neuron: {PARALLEL_STATE} is missing ({e}); interface changed") from e


def _tp_group(ps):
    if hasattr(ps, "get_tp_group"):
        return ps.get_tp_group()
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group()


def glm5_next_plan(bank, sizes: Sizes, ps=None) -> RankPlan:
    """This rank's experts and intermediate slice in the fork's layout (module docstring), checked against the bank."""
    ps = _parallel_state() if ps is None else ps
    num, ep, world = int(bank.num_routed_experts), int(bank.ep_degree), int(bank.tp_degree)
    where = (f"neuron-w8 on Neuron: Glm5NextRoutedExperts ({num} experts, tp_degree {world}, ep_degree {ep}; written "
             f"against the {GLM5_NEXT_SOURCE})")
    if ep < 1 or world % ep or num % ep:
        raise NeuronGlueError(f"{where}: ep_degree must divide both the world size and the experts")
    shards = world // ep
    if int(bank.num_local_experts) != num // ep:
        raise NeuronGlueError(f"{where}: num_local_experts {bank.num_local_experts} != {num} / {ep} (interface changed)")
    tp = _tp_group(ps)
    if ep > 1:
        ep_rank, group = int(ps.get_neuron_ep_rank()), ps.get_neuron_ep_tp_group()
        if int(group.world_size) != shards:
            raise NeuronGlueError(f"{where}: the expert-parallel TP group has {group.world_size} ranks, expected {shards}")
        shard = int(group.rank_in_group)
        if shard != int(tp.rank_in_group) % shards:
            raise NeuronGlueError(f"{where}: EP-TP rank {shard} != rank {tp.rank_in_group} % {shards} (the fork's column)")
    else:
        ep_rank, shard = 0, int(tp.rank_in_group) % shards
    return RankPlan(num, ep, ep_rank, shards, shard, sizes.intermediate, sizes.hidden)


def release_declared(block, target: MoeTarget) -> None:
    """The fork's FP8 expert parameters become declared-but-empty (``None``), and leave its list of names to load."""
    for name in target.bf16_params:
        if name in block._parameters:
            block._parameters[name] = None
        elif hasattr(block, name):
            delattr(block, name)
    declared = getattr(block, "declared_param_names", None)
    if declared is not None:
        block.declared_param_names = tuple(n for n in declared if n not in target.bf16_params)


@dataclass(frozen=True)
class BankAdoption:
    """How one fork's bank is adopted: our forward, its rank plan, its SwiGLU bound and top-k, what is released."""

    mixin: type
    plan: Callable  # (bank, Sizes) -> RankPlan
    swiglu_limit: Callable  # bank -> float (0: no clamp)
    top_k: Callable  # bank -> int
    release: Callable = release_declared  # (bank, target) -> None
    prepare_model: Callable | None = None  # (model, [(name, adopted bank)], architecture) -> None, after adoption


BANKS: dict[str, BankAdoption] = {
    "glm5_next": BankAdoption(W8Glm5NextRoutedExperts, glm5_next_plan, lambda b: float(b.swiglu_limit),
                              lambda b: int(b.num_experts_per_tok)),
}


def rank_plan(block, target: MoeTarget, hf_config) -> RankPlan:
    return BANKS[target.kind].plan(block, text_sizes(hf_config))


def adopt(block, target: MoeTarget, module_name: str, plan: RankPlan, settings, architecture: str = "") -> None:
    """Turn one built bank into ours in place (see the module docstring)."""
    bank = BANKS[target.kind]
    interfaces.check_block(block, target, f"{architecture} {module_name}".strip())
    limit = bank.swiglu_limit(block)
    if limit < 0:
        raise NeuronGlueError(f"neuron-w8 on Neuron: {module_name}: swiglu_limit {limit} < 0")
    bank.release(block, target)
    block.__class__ = experts._w8_class(type(block), bank.mixin)
    block.w8_setup(plan, dataclasses.replace(settings, swiglu_limit=limit), experts.layer_index(module_name),
                   kernel_launch.backend(), False)
    block.w8_top_k = bank.top_k(block)
