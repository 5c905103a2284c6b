"""Qwen3.5-MoE's shared expert through the routed-expert kernels (issue #34).

vllm-neuron's ``Qwen3_5SparseMoeBlock`` (fork whn09/vllm-neuron ``model/qwen3_5/moe.py`` @3de9ea3) keeps the shared
expert as three BF16 parameters, each rank a TP shard of its intermediate dim over the whole TP world
(``shared_per_rank`` = S / world), and adds ``sigmoid(shared_expert_gate(x)) * SwiGLU(x)`` in torch
(``_shared_expert``). A shard is an expert: gate/up rows and down columns of one SwiGLU MLP. With
``non_expert_layers`` ``w8`` (the default) neuron-w8 releases the three parameters (vllm-neuron neither loads
nor casts them), keeps their weight loaders, and at load reads the shared expert's FP8 bytes and block scales,
cuts them with those loaders' own TP rule (:mod:`tp_probe`), repacks and self-checks them with the expert loader
(:func:`vllm_moe_w8.neuron_glue.loaders.load_layer_experts`) and runs the shard as one more expert whose
affinity is ``sigmoid(x @ shared_expert_gate)`` (fp32; the gate weight stays vllm-neuron's, BF16 as stored):

* ``slot`` - no expert parallelism and the shard has the routed experts' per-rank shape (Qwen3.5-35B-A3B at
  TP=4: S / 4 = I / 4 = 128): the shard is local expert ``L`` of the routed bank, every token routed to it, and
  routed experts and shared expert are one kernel launch;
* ``bank`` - otherwise (EP: whole routed experts, a TP shard of the shared one): a one-expert bank, a second launch.

A shard the kernels cannot take (its rows or the hidden size not a multiple of 128; Qwen3.5-35B-A3B at TP=8:
512 / 8 = 64) keeps vllm-neuron's BF16 shared expert, and the load log says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_moe_w8.kernels.host import P, KernelWeights
from vllm_moe_w8.neuron_glue import tp_probe
from vllm_moe_w8.neuron_glue.loaders import RankPlan

PARAMS = {"gate_proj": "shared_gate_proj_weight", "up_proj": "shared_up_proj_weight", "down_proj": "shared_down_proj_weight"}
GATE_PARAM = "shared_expert_gate_weight"
BUFFERS = ("w8_shared_w13", "w8_shared_w13_scales", "w8_shared_w2", "w8_shared_w2_scales")
WEIGHT_LOADER = ("vllm_neuron.utils.weight_loader", "get_weight_loader")


@dataclass(frozen=True)
class SharedPlan:
    layout: str  # "slot" | "bank"
    plan: RankPlan  # one expert of I = the whole shared intermediate size, TP over the world
    loaders: dict  # proj -> vllm-neuron's weight loader of the released parameter
    rank: int  # the rank vllm-neuron's load passes those loaders (the block's TP-group rank)


def decide(block, routed: RankPlan, settings) -> tuple[SharedPlan | None, str]:
    """(plan, why) for one adopted Qwen3.5 block: None keeps vllm-neuron's BF16 shared expert."""
    if not settings.non_expert_w8:
        return None, f"BF16, vllm-neuron's torch SwiGLU (non_expert_layers bf16 from {settings.non_expert_source})"
    world, per_rank, h = int(block.world_size), int(block.shared_per_rank), int(block.hidden_size)
    if per_rank % P or h % P:
        return None, (f"BF16, vllm-neuron's torch SwiGLU: its shard ({per_rank} of {per_rank * world} rows per rank over "
                      f"TP {world}) is not a multiple of {P}, which the expert kernels need")
    from importlib import import_module

    get = getattr(import_module(WEIGHT_LOADER[0]), WEIGHT_LOADER[1])
    loaders = {proj: get(getattr(block, name)) for proj, name in PARAMS.items()}
    rank = int(block.tp_group.rank_in_group)
    plan = RankPlan(1, 1, 0, world, rank % world, per_rank * world, h)
    layout = "slot" if routed.ep_degree == 1 and per_rank == routed.inter_per_rank else "bank"
    why = ("1 byte, one more expert of the routed bank (one launch)" if layout == "slot"
           else "1 byte, its own one-expert bank (a second launch)")
    return SharedPlan(layout, plan, loaders, rank), why


def cutter(shared: SharedPlan, where: str):
    """``cut(proj, weight, scale)`` for ``loaders.load_layer_experts``: vllm-neuron's own loader decides the rows and
    columns (:mod:`tp_probe`); they must be the contiguous shard the plan's shape implies."""

    def cut(proj, weight, scale):
        c = tp_probe.cut(shared.loaders[proj], tuple(weight.shape), shared.rank, f"{where} {proj}")
        inter = c.cols if proj == "down_proj" else c.rows
        if len(tp_probe.runs(inter)) != 1 or inter.numel() != shared.plan.inter_per_rank:
            raise ValueError(f"neuron-w8: {where} {proj}: vllm-neuron's loader gives this rank {inter.numel()} "
                             f"intermediate rows in {len(tp_probe.runs(inter))} runs; expected one shard of "
                             f"{shared.plan.inter_per_rank}")
        return tp_probe.take(weight, scale, c.rows, c.cols, f"{where} {proj}")

    return cut


def reader(source, layer: int):
    stem = f"{source.prefix}{layer}.mlp.shared_expert"
    return lambda _layer, _expert: source.read_mlp(stem)


def affinity(normed: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """The shared expert's weight per token, ``sigmoid(x @ gate.T)`` [T, 1] fp32 (vllm-neuron's gate, BF16 weight)."""
    return torch.sigmoid(normed.float() @ gate_weight.float().T)


def in_slot(routed: KernelWeights, shared: KernelWeights) -> KernelWeights:
    """The routed bank with the shared expert appended as its last local expert."""
    return KernelWeights(*(torch.cat([a, b]) for a, b in ((routed.w13, shared.w13), (routed.w13_scales, shared.w13_scales),
                                                         (routed.w2, shared.w2), (routed.w2_scales, shared.w2_scales))),
                         routed.mode)

