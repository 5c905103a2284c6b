"""The adopted families as the Neuron glue tests drive them, the same way in both trees (the stand-in and the real
vllm-neuron files, tests/_realtree.py): checkpoint, configs, the size pins a tiny model relaxes, how the model is
built, which modules are the MoE halves of its decoder layers, and the float64 reference.

A *MoE half* is what the fork's decoder layer does after attention (each family's source is named on its
adapter): the post-attention norm, the MoE block, the collective that reduces its partial sum. Attention itself
runs NKI kernels in every real tree (not on CPU), so the tests call the MoE halves, as the decoder calls them.

Size pins vs layout pins: the real code pins the released model (key count, hidden 6144, 256 experts, TP 64...).
``relax_size_pins`` relaxes exactly the size pins, the way the real code binds them: class attributes read at call
time are set; defaults bound when the module was imported (``load_checkpoint_manifest(expected_key_count=...)``,
``local_load_plan(ep=PINNED_EP)``, a module's own ``PINNED_EP`` name) are re-bound, which is what importing the
module with another pin would do. Layout pins (the key grammar, ``first_k_dense_replace``, routing method, top-k)
stay: the tiny checkpoints are written in the layout they demand (``tiny_models`` ``layout="vllm-neuron"``).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoConfig, PretrainedConfig  # here, not in a rank thread: it imports lazily

import _neuron_standin as st

GLM5_LAYOUT_KEYS = ("model_type", "n_shared_experts", "num_experts_per_tok", "norm_topk_prob", "routed_scaling_factor",
                    "n_group", "topk_group", "topk_method", "scoring_func", "hidden_act", "first_k_dense_replace")
FORK_STORAGE = 240.0 / 448.0  # glm_moe_dsa block_fp8.FP8_STORAGE_SCALE @41758812


def index_key_count(ckpt: Path) -> int:
    return len(json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"])


def hf_config(ckpt: Path):
    """config.json as vLLM hands it to vllm-neuron: a transformers PretrainedConfig."""
    return AutoConfig.from_pretrained(str(ckpt))


def plain_hf_config(ckpt: Path):
    """config.json as a plain PretrainedConfig, every key under its own name (transformers 4.x's ``to_dict()``
    keeps ``num_experts``; 5.x's Qwen3-MoE config renames it ``num_local_experts``, DEVELOPING.md)."""
    return PretrainedConfig.from_dict(json.loads((ckpt / "config.json").read_text()))


@dataclass
class Family:
    name: str
    arch: str
    factory: tuple[str, str]
    write: Callable[[Path], Path]
    neuron_config: dict
    relax: Callable  # (ckpt, world, how) -> None, in the rank's process, after the tree is importable
    build: Callable  # (factory_cls, hf_config, neuron_config) -> model (under torch.device("meta"))
    moe_layers: Callable  # model -> [decoder layer]
    moe_half: Callable  # (model, layer, hidden [T', H], decode: bool, positions [T]) -> [T', H]
    bank: Callable  # layer -> the adopted module holding the experts
    reference: Callable  # (tensors, layer index, hidden [T, H]) -> float64 [T, H]
    config: Callable = hf_config  # ckpt -> the hf_config the runner hands the factory
    sequence_parallel_prefill: bool = False  # prefill input is the rank's chunk of T (Qwen's SP); else all T
    ep_layouts: tuple[bool, ...] = (False,)  # EP as a separate layout (Qwen); GLM-5's EP is its TP


# ---- GLM-5: fork jinhuang12/vllm-neuron model/glm_moe_dsa (model.py @02ef711 GlmMoeDsaDecoderLayer.forward) -------


def _glm5_relax(ckpt: Path, world: int, how: str = "bind") -> None:
    """``how``: "bind" (the size pins re-bound where the fork binds them), "assign" (the module constants assigned
    after import instead: what changes nothing in the fork - the fault twin), "keep-key-count" (all but the index key
    count relaxed)."""
    config = importlib.import_module("vllm_neuron.model.glm_moe_dsa.config")
    factory = importlib.import_module("vllm_neuron.model.glm_moe_dsa.factory")
    wl = importlib.import_module("vllm_neuron.model.glm_moe_dsa.weight_loaders")
    model = importlib.import_module("vllm_neuron.model.glm_moe_dsa.model")
    values = config.GlmMoeDsaConfig._EXPECTED_VALUES
    config.GlmMoeDsaConfig._EXPECTED_VALUES = {k: v for k, v in values.items() if k in GLM5_LAYOUT_KEYS}
    factory.GlmMoeDsaForCausalLM.SUPPORTED_TENSOR_PARALLEL_SIZE = world
    keys = index_key_count(ckpt)
    experts = json.loads((ckpt / "config.json").read_text())["n_routed_experts"]
    ep = wl.ExpertParallelContract(experts, world, world)
    if how == "assign":
        wl.PINNED_INDEX_KEY_COUNT, wl.PINNED_EP = keys, ep
        return
    if how != "keep-key-count":
        wl.load_checkpoint_manifest.__kwdefaults__["expected_key_count"] = keys
        wl.load_checkpoint_index.__kwdefaults__["expected_key_count"] = keys
    wl.local_load_plan.__kwdefaults__["ep"] = ep
    model.PINNED_EP = ep


def _glm5_moe_half(model, layer, hidden, decode, positions):
    x = layer.post_attention_layernorm(hidden)
    out = layer.mlp(x.reshape(-1, x.shape[-1]), is_decode=decode).view_as(x)
    return layer.tp_group.all_reduce(out) if layer.world_size > 1 else out


def fork_storage_dequant(t: dict, name: str) -> torch.Tensor:
    """What the fork's loaders keep for an FP8 weight (ml_dtypes): bytes x 240/448 re-rounded to E4M3FN, scale x 448/240."""
    w = t[name].contiguous().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    stored = (w * np.float32(FORK_STORAGE)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scale = t[name + "_scale_inv"].float().numpy() * np.float32(1 / FORK_STORAGE)
    s_el = np.repeat(np.repeat(scale, 128, axis=0), 128, axis=1)[: w.shape[0], : w.shape[1]]
    return torch.from_numpy(stored.astype(np.float64) * s_el.astype(np.float64))


def _swiglu(x, g, u, d):
    return (F.silu(x @ g.T) * (x @ u.T)) @ d.T


def glm5_reference(t: dict, layer: int, h: torch.Tensor, config: dict, routed=None) -> torch.Tensor:
    """float64 GLM-5 MoE half: the fork's router on the model-dtype logits (sigmoid, correction bias for the
    selection, normalised x routed_scaling_factor), routed experts from the checkpoint's exact values, the shared
    expert as the fork stores it (240/448 re-rounded bytes, scales x 448/240). ``routed(e, proj)``: other routed
    expert weights (a fault twin's)."""
    p = f"model.layers.{layer}"
    x = st.rms_norm(h, t[f"{p}.post_attention_layernorm.weight"], config["rms_norm_eps"])
    logits = F.linear(x, t[f"{p}.mlp.gate.weight"].to(x.dtype))
    scores = torch.sigmoid(logits.double())
    ids = torch.topk(scores + t[f"{p}.mlp.gate.e_score_correction_bias"].double(), config["num_experts_per_tok"], dim=-1).indices
    w = scores.gather(1, ids)
    w = w / w.sum(-1, keepdim=True) * config["routed_scaling_factor"]
    xd = x.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(config["n_routed_experts"]):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        if rows.numel():
            g, u, d = (routed(e, proj) if routed else st.dequant(t, f"{p}.mlp.experts.{e}.{proj}.weight").double()
                       for proj in ("gate_proj", "up_proj", "down_proj"))
            out.index_add_(0, rows, _swiglu(xd[rows], g, u, d) * w[rows, slots][:, None])
    shared = (fork_storage_dequant(t, f"{p}.mlp.shared_experts.{proj}.weight") for proj in ("gate_proj", "up_proj", "down_proj"))
    return out + _swiglu(xd, *shared)


def _glm5_write(path: Path) -> Path:
    from vllm_moe_w8 import tiny_models

    return tiny_models.write_checkpoint(path, "GlmMoeDsaForCausalLM", layout="vllm-neuron")


GLM5 = Family(
    name="glm_moe_dsa", arch="GlmMoeDsaForCausalLM", factory=("vllm_neuron.model.glm_moe_dsa", "GlmMoeDsaForCausalLM"),
    write=_glm5_write, neuron_config={"on_device_sampling_config": {"all_greedy": True}}, relax=_glm5_relax,
    build=lambda cls, hf, nc: cls.from_configs(hf, nc),
    moe_layers=lambda model: [layer for layer in model.model.layers if layer.is_moe],
    moe_half=_glm5_moe_half, bank=lambda layer: layer.mlp.experts,
    reference=None,  # set per checkpoint by the tests (glm5_reference with its config.json)
)

# ---- Qwen3-MoE: upstream model/qwen3_moe/model_bf16.py @5f54272 (Qwen3MoeDecoderLayer: mlp(h, positions, is_decode, rank))


def _qwen3_write(path: Path) -> Path:
    from vllm_moe_w8 import tiny_models

    f = st.FAMILIES["qwen3_moe"]
    return tiny_models.write_checkpoint(path, f["arch"], **f["sizes"])


QWEN3 = Family(
    name="qwen3_moe", arch="Qwen3MoeForCausalLM", factory=("vllm_neuron.model.qwen3_moe", "Qwen3MoeForCausalLM"),
    write=_qwen3_write, neuron_config={}, relax=lambda ckpt, world, how="bind": None,
    build=lambda cls, hf, nc: cls.from_configs(hf, nc),
    moe_layers=lambda model: list(model.model.layers),
    moe_half=lambda model, layer, h, decode, positions: layer.mlp(h, positions=positions, is_decode=decode, rank=None),
    bank=lambda layer: layer.mlp.experts, reference=None, config=plain_hf_config,
    sequence_parallel_prefill=True, ep_layouts=(False, True),
)

# ---- Qwen3.5-MoE: fork whn09/vllm-neuron model/qwen3_5 (model.py @3de9ea3 Qwen3_5DecoderLayer.forward: the MoE block
# takes the un-normalised residual and the layer's post_attention_layernorm; prefill input is the SP share)


def _qwen35_write(path: Path) -> Path:
    from vllm_moe_w8 import tiny_models

    f = st.FAMILIES["qwen3_5_moe"]
    # two layers: a DeltaNet one and a full-attention one, so both mixers' real loaders fill their parameters
    return tiny_models.write_checkpoint(path, f["arch"], **dict(f["sizes"], num_hidden_layers=2))


QWEN35 = Family(
    name="qwen3_5_moe", arch="Qwen3_5MoeForConditionalGeneration",
    factory=("vllm_neuron.model.qwen3_5", "Qwen3_5MoeForConditionalGeneration"),
    write=_qwen35_write, neuron_config={}, relax=lambda ckpt, world, how="bind": None,
    build=lambda cls, hf, nc: cls.from_configs(hf, nc, None),  # no VisionNeuronConfig: the text-only decoder
    moe_layers=lambda model: list(model.language_model.layers),
    moe_half=lambda model, layer, h, decode, positions: layer.mlp(h, is_prefill=not decode,
                                                                  norm=layer.post_attention_layernorm,
                                                                  positions=positions, rank=None),
    bank=lambda layer: layer.mlp, reference=None,
    sequence_parallel_prefill=True, ep_layouts=(False, True),
)

FAMILIES = {f.name: f for f in (GLM5, QWEN3, QWEN35)}


def neuron_config(family: Family, additional: dict | None = None):
    """vllm-neuron's NeuronConfig the runner builds from ``additional_config["neuron_config"]``."""
    nc = importlib.import_module("vllm_neuron.model.neuron_config")
    return nc.NeuronConfig.from_dict(dict(family.neuron_config, **(additional or {})))
