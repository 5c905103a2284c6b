"""Qwen3.5-MoE's shared expert through the routed-expert kernels (neuron_glue/shared_expert.py), in both trees:
the stand-in (CI) and the real vllm-neuron files (``--vllm-neuron-tree``; tests/test_neuron_glue_realtree.py).

Each rank builds and loads the tiny Qwen3.5-MoE the runner's way (tests/_glue_ranks.py); its shared-expert shard,
cut by vllm-neuron's own loader rule, repacked and self-checked by the expert loader, runs through the kernels as
one more expert (TP: the routed bank's last slot; EP: its own one-expert bank) gated by sigmoid(shared_expert_gate).
Gate: every rank's shared partial sum within REL_TOL of the float64 torch shared expert of that rank's shard of the
checkpoint; its fault twins (the gate ignored, the routed expert next to the slot, one scale tile doubled, the
other rank's shard) fail it. The opt-out (``non_expert_layers: bf16``) keeps vllm-neuron's BF16 shared expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import _glue_ranks as gr
import _neuron_standin as st
from test_neuron_glue_experts import REL_TOL
from test_neuron_glue_realtree import CASES, assembled, checkpoints, real_folder, reference, run, tree  # noqa: F401

FAMILY = "qwen3_5_moe"
FAULTS = ("ungated", "slot_off_by_one", "scale_tile_doubled")


def shared_reference(tensors: dict, layer: int, normed: torch.Tensor, plan: dict) -> torch.Tensor:
    """float64 ``sigmoid(x g) * down_r(silu(gate_r x) * up_r x)`` of the rank's shard (rows of gate/up, columns of down)."""
    p = f"model.language_model.layers.{layer}.mlp"
    i_r = plan["intermediate_size"] // plan["tp_degree"]
    lo = plan["tp_rank"] * i_r
    g, u, d = (st.dequant(tensors, f"{p}.shared_expert.{proj}_proj.weight").double() for proj in ("gate", "up", "down"))
    x = normed.double()
    gate = torch.sigmoid(x @ tensors[f"{p}.shared_expert_gate.weight"].double().T)
    return gate * ((F.silu(x @ g[lo:lo + i_r].T) * (x @ u[lo:lo + i_r].T)) @ d[:, lo:lo + i_r].T)


def test_shared_expert_float64_exact_with_its_fault_twins(run, checkpoints):
    ckpt = checkpoints(FAMILY)
    tensors = st.checkpoint_tensors(ckpt)
    worst, closest_fault = 0.0, float("inf")
    for world, ep, layout in ((1, False, "slot"), (2, False, "slot"), (2, True, "bank")):
        results = run(gr.Job(FAMILY, world, ep, str(ckpt), extra="_glue_extras:shared_expert"))
        for res in results:
            rank = res["rank"]
            for layer, per_layer in enumerate(res["extra"]):
                assert per_layer["layout"] == layout, (world, ep, per_layer["layout"])
                plan = per_layer["plan"]
                assert plan["tp_degree"] == world and plan["tp_rank"] == rank  # the shard of the whole TP world
                for name, case in per_layer["cases"].items():
                    want = shared_reference(tensors, layer, case["normed"], plan)
                    err = st.rel_err(case["ok"], want)
                    worst = max(worst, err)
                    where = f"world {world} ep {ep} rank {rank} layer {layer} {name}"
                    assert case["ok"].dtype == torch.bfloat16 and err <= REL_TOL, f"{where}: {err:.2e}"
                    for fault in FAULTS:
                        if fault in case:
                            fault_err = st.rel_err(case[fault], want)
                            closest_fault = min(closest_fault, fault_err)
                            assert fault_err > REL_TOL, f"{where}: fault {fault} passed the gate"
                    if world == 2:  # the other rank's shard (a loader off by one rank) fails the same gate
                        other = dict(plan, tp_rank=1 - rank)
                        assert st.rel_err(case["ok"], shared_reference(tensors, layer, case["normed"], other)) > REL_TOL
    assert worst > 0
    print(f"shared expert through the kernels: worst rel err {worst:.2e} (gate {REL_TOL:.2e}); closest fault twin "
          f"{closest_fault:.2e}")


def test_opt_out_keeps_vllm_neurons_bf16_shared_expert(run, checkpoints):
    """``non_expert_layers: bf16``: the shared expert stays vllm-neuron's (its BF16 parameters loaded, one launch per
    layer: the routed experts only) and the layer still matches the float64 reference."""
    ckpt = checkpoints(FAMILY)
    _, layers, want = reference(FAMILY, ckpt)
    job = gr.Job(FAMILY, 2, False, str(ckpt), cases=CASES[:1], compile=True,
                 additional_config={"neuron_w8": {"non_expert_layers": "bf16"}})
    for res in run(job):
        assert res["shared"] == [None] * len(layers)
        assert all(k == ["moe_w8_blocks_pow2"] * len(layers) for k in res["kernels"]), res["kernels"]
        name, tokens, decode, seed = CASES[0]
        for i, layer in enumerate(layers):
            assert st.rel_err(res["outputs"][name][i], want(layer, gr.hidden(tokens, seed, 256))) <= REL_TOL
