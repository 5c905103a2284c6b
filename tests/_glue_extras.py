"""Checks run on a loaded rank in either tree (``_glue_ranks.Job(extra="_glue_extras:<fn>")``): each returns tensors
the test judges against its float64 reference. The fault variants are applied in the rank and undone after, so one
load serves the gate and its fault twins."""

from __future__ import annotations

import torch

import _glue_ranks as gr

SHARED_CASES = (("decode", 6, 11), ("prefill", 160, 12))  # selective decode; the block prefill kernel


def shared_expert(model, family, rank, job) -> dict:
    """Per MoE layer and case: the normed input and this rank's shared-expert partial sum through the kernels
    (``w8_shared_expert``), plus its fault variants: gate ignored, the routed expert next to the slot, one scale
    tile of its gate projection doubled."""
    out = []
    with torch.no_grad():
        for layer in family.moe_layers(model):
            out.append(_shared_layer(family, layer))
    return out


def _shared_layer(family, layer) -> dict:
    bank = family.bank(layer)
    res = {"layout": bank.w8_shared.layout, "plan": bank.w8_shared.plan.__dict__.copy(), "cases": {}}
    size = bank.hidden_size
    for name, tokens, seed in SHARED_CASES:
        normed = layer.post_attention_layernorm(gr.hidden(tokens, seed, size).to(bank.dtype))
        case = {"normed": normed, "ok": bank.w8_shared_expert(normed)}
        # faults on this rank's bank only (stand-in ranks are threads of one process)
        bank.w8_shared_affinity = lambda x: torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
        try:
            case["ungated"] = bank.w8_shared_expert(normed)
        finally:
            del bank.w8_shared_affinity
        if bank.w8_shared.layout == "slot":
            bank.w8_shared_ids = lambda ids: torch.full_like(ids[:, :1], bank.w8_plan.num_local - 1)
            try:
                case["slot_off_by_one"] = bank.w8_shared_expert(normed)
            finally:
                del bank.w8_shared_ids
        scales = bank.w8_w13_scales if bank.w8_shared.layout == "slot" else bank.w8_shared_w13_scales
        index = (scales.shape[0] - 1, 0, 0)  # the shared expert's first gate tile
        scales[index] *= 2
        try:
            case["scale_tile_doubled"] = bank.w8_shared_expert(normed)
        finally:
            scales[index] /= 2
        res["cases"][name] = case
    return res
