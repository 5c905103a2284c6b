"""Test helpers for GLM-5.3-Flash under the vllm-neuron stand-in: a tiny checkpoint in the real layout and the float64
reference of its MoE layers (the fork's GLM MoE: noaux_tc routing, clamped SwiGLU experts, shared expert).

The checkpoint: ``config.json`` in the layout the fork's config reader and router accept
(``vllm_moe_w8.tiny_models.neuron_layouts.glm5_next_config``: a ``text_config`` and a ``vision_config``, top-8 over
16 experts, the fork's layer schedule, a top-level block-FP8 ``quantization_config``); text tensors under ``model.language_model.layers.{i}.``: the
post-attention norm, the router (``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``), per-expert
``mlp.experts.{e}.{gate,up,down}_proj.weight`` E4M3FN with fp32 128x128 ``weight_scale_inv`` (amax/448, as real
checkpoints, so every block uses the E4M3FN-only codes), and the shared expert in the same FP8 format.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

import _neuron_standin as st
from vllm_moe_w8 import tiny_models
from vllm_moe_w8.tiny_models.neuron_layouts import glm5_next_config
from vllm_moe_w8.tiny_models.shards import write_shards

ARCH = "Glm5NextForConditionalGeneration"
FACTORY = ("vllm_neuron.model.glm5_next", ARCH)
PREFIX = "model.language_model.layers"
SIZES = dict(hidden_size=256, moe_intermediate_size=256, n_routed_experts=16, num_experts_per_tok=8, n_shared_experts=1,
             num_hidden_layers=2)  # top-8 (the fork's router); 16 experts: 8 per EP rank at EP 2
# The clamp must bite for the swiglu fault twin to mean anything: with these weights the gate/up projections have a
# standard deviation of ~1.5, so a bound of 1.0 clamps a large share of them (asserted in the test).
SWIGLU_LIMIT = 1.0
WEIGHT_STD = 0.1


def text_config(swiglu_limit=SWIGLU_LIMIT) -> dict:
    cfg = dict(SIZES, model_type="glm5_next_text", first_k_dense_replace=0, norm_topk_prob=True, routed_scaling_factor=2.5,
               rms_norm_eps=1e-5, n_group=1, topk_group=1, topk_method="noaux_tc", torch_dtype="bfloat16")
    if swiglu_limit is not None:
        cfg["swiglu_limit"] = swiglu_limit
    return cfg


def write_checkpoint(path: Path, seed: int = 0, swiglu_limit=SWIGLU_LIMIT) -> Path:
    g = torch.Generator().manual_seed(seed)
    h, i, e = SIZES["hidden_size"], SIZES["moe_intermediate_size"], SIZES["n_routed_experts"]
    tensors = {}

    def fp8(name, shape):
        codes, scale = tiny_models.quantize_block(torch.randn(shape, generator=g) * WEIGHT_STD, torch.float32)
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"] = codes, scale

    for layer in range(SIZES["num_hidden_layers"]):
        p = f"{PREFIX}.{layer}"
        tensors[f"{p}.post_attention_layernorm.weight"] = (1 + 0.1 * torch.randn(h, generator=g)).to(torch.bfloat16)
        tensors[f"{p}.mlp.gate.weight"] = (torch.randn(e, h, generator=g) * 0.1).to(torch.bfloat16)
        tensors[f"{p}.mlp.gate.e_score_correction_bias"] = torch.randn(e, generator=g) * 0.05
        for x in range(e):
            for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                fp8(f"{p}.mlp.experts.{x}.{proj}", shape)
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            fp8(f"{p}.mlp.shared_experts.{proj}", shape)
    path.mkdir(parents=True, exist_ok=True)
    write_shards(path, tensors, 2)
    (path / "config.json").write_text(json.dumps(glm5_next_config(text_config(swiglu_limit))))
    return path


def hidden(tokens: int, seed: int) -> torch.Tensor:
    return (torch.randn(tokens, SIZES["hidden_size"], generator=torch.Generator().manual_seed(seed)) * 2).to(torch.bfloat16)


def normed(t: dict, layer: int, x: torch.Tensor) -> torch.Tensor:
    return st.rms_norm(x, t[f"{PREFIX}.{layer}.post_attention_layernorm.weight"], 1e-5)


def route(t: dict, layer: int, x: torch.Tensor) -> torch.Tensor:
    """Scattered affinities [T, E] fp32, as the fork's router makes them (functional/moe/router.py): RMSNorm in fp32
    x gamma, the logits from bf16 operands accumulated in fp32 (the selection is discrete: it must be the fork's),
    sigmoid scores, top-8 of scores + bias, the selected scores / (their sum + 1e-20) x 2.5."""
    p = f"{PREFIX}.{layer}"
    xf = x.float()
    xn = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * t[f"{p}.post_attention_layernorm.weight"].float()
    scores = torch.sigmoid(xn.to(torch.bfloat16).float() @ t[f"{p}.mlp.gate.weight"].to(torch.bfloat16).float().T)
    index = torch.topk(scores + t[f"{p}.mlp.gate.e_score_correction_bias"].float(), SIZES["num_experts_per_tok"], -1).indices
    w = scores.gather(1, index)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * 2.5
    return torch.zeros_like(scores).scatter(1, index, w)


def mlp(xd: torch.Tensor, t: dict, stem: str, limit: float | None) -> torch.Tensor:
    g, u, d = (st.dequant(t, f"{stem}.{proj}.weight").double() for proj in ("gate_proj", "up_proj", "down_proj"))
    gate, up = xd @ g.T, xd @ u.T
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (F.silu(gate) * up) @ d.T


def reference_layer(t: dict, layer: int, x: torch.Tensor, limit: float | None = SWIGLU_LIMIT, shared: bool = True,
                    experts=None) -> torch.Tensor:
    """float64 MoE layer output (routed + shared) for the pre-norm hidden states ``x``; ``experts``: only these
    global experts' routed part (an EP rank's), and then no shared expert."""
    p = f"{PREFIX}.{layer}"
    xd = normed(t, layer, x).double()
    aff = route(t, layer, x).double()
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for e in range(SIZES["n_routed_experts"]) if experts is None else experts:
        rows = aff[:, e].nonzero(as_tuple=True)[0]
        if rows.numel():
            out[rows] += aff[rows, e, None] * mlp(xd[rows], t, f"{p}.mlp.experts.{e}", limit)
    if shared and experts is None:
        out += mlp(xd, t, f"{p}.mlp.shared_experts", limit)
    return out


def clamped_fraction(t: dict, layer: int, x: torch.Tensor, limit: float = SWIGLU_LIMIT) -> float:
    """Share of the routed experts' gate/up pre-activations the SwiGLU bound changes (the fault twin's precondition)."""
    xd, aff = normed(t, layer, x).double(), route(t, layer, x)
    hit = total = 0
    for e in range(SIZES["n_routed_experts"]):
        rows = aff[:, e].nonzero(as_tuple=True)[0]
        for proj in ("gate_proj", "up_proj"):
            v = xd[rows] @ st.dequant(t, f"{PREFIX}.{layer}.mlp.experts.{e}.{proj}.weight").double().T
            hit += int(((v > limit) | ((v < -limit) & (proj == "up_proj"))).sum())
            total += v.numel()
    return hit / total
