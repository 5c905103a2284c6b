"""Write a tiny checkpoint (:func:`write_checkpoint`): the family's tensor plan, weights drawn and quantised,
shards + index, ``config.json``, ``generation_config.json``, tokenizer and (Qwen3.5-VL) processor files.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import torch

from vllm_moe_w8.tiny_models import neuron_layouts
from vllm_moe_w8.tiny_models.glm import glm4_moe, glm_moe_dsa
from vllm_moe_w8.tiny_models.layout import (
    ARCHITECTURES,
    BLOCK,
    DEFAULT_SCALE_DTYPE,
    FAMILY_SIZES,
    FORMATS,
    TinySizes,
    resolve_architecture,
)
from vllm_moe_w8.tiny_models.quantize import quantize_block, quantize_channel
from vllm_moe_w8.tiny_models.qwen3 import qwen3_moe
from vllm_moe_w8.tiny_models.qwen35 import QWEN35_VISION, qwen3_5_moe, qwen3_5_moe_text
from vllm_moe_w8.tiny_models.shards import write_shards
from vllm_moe_w8.tiny_models.tokenizer import write_tokenizer

FAMILIES = {
    "qwen3_moe": qwen3_moe,
    "qwen3_5_moe": qwen3_5_moe,
    "qwen3_5_moe_text": qwen3_5_moe_text,
    "glm4_moe": glm4_moe,
    "glm_moe_dsa": glm_moe_dsa,
}
LAYOUTS = ("official", "vllm-neuron")  # vllm-neuron: the fork's pinned layout contract (tiny_models.neuron_layouts)


def _init_tensor(name: str, shape: tuple[int, ...], kind: str, init: str | None, gen: torch.Generator) -> torch.Tensor:
    if init == "zero_centered_norm":  # Gemma-style RMSNorm: the layer multiplies by (1 + weight)
        return 0.1 * torch.randn(shape, generator=gen)
    if kind == "norm":
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if init == "ones":
        return torch.ones(shape)
    if init == "a_log":
        return torch.log(torch.empty(shape).uniform_(1.0, 16.0, generator=gen))
    if init == "small":
        return 0.01 * torch.randn(shape, generator=gen)
    if init == "embed":
        return torch.randn(shape, generator=gen)
    if init == "conv":
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    fan_in = shape[-1] if len(shape) >= 2 else 1
    if len(shape) == 1:  # biases
        return 0.02 * torch.randn(shape, generator=gen)
    if init == "head":  # sharper logits than 1/sqrt(fan_in) so logprobs are not flat
        return 2.0 * torch.randn(shape, generator=gen) / math.sqrt(fan_in)
    return torch.randn(shape, generator=gen) / math.sqrt(fan_in)


def _quant_config(fmt: str, not_converted: list[str]) -> dict:
    if fmt == "block":
        return {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [BLOCK, BLOCK],
            "modules_to_not_convert": not_converted,
        }
    args = {"actorder": None, "block_structure": None, "group_size": None, "num_bits": 8,
            "observer": "minmax", "observer_kwargs": {}, "symmetric": True, "type": "float"}
    return {
        "config_groups": {
            "group_0": {
                "input_activations": {**args, "dynamic": True, "observer": None, "strategy": "token"},
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {**args, "dynamic": False, "strategy": "channel"},
            }
        },
        "format": "float-quantized",
        "global_compression_ratio": None,
        "ignore": not_converted,
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def module_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


def write_checkpoint(
    path: str | Path,
    arch: str,
    fmt: str = "block",
    scale_dtype: torch.dtype | None = None,
    seed: int = 0,
    layout: str = "official",
    **overrides,
) -> Path:
    """Write a tiny random FP8 checkpoint of ``arch`` in the official layout; return its path.

    ``fmt``: "block" (native FP8, ``weight_block_size`` [128, 128], ``weight_scale_inv``) or
    "channel" (compressed-tensors per-channel, ``weight_scale`` [N, 1]).
    ``scale_dtype``: float32, bfloat16 or float16 (default: the family's official choice).
    ``overrides``: any :class:`TinySizes` field (e.g. ``num_experts=16``, ``num_shards=3``).
    ``layout``: "official" (the released checkpoints' layout, as vLLM's own model classes read it) or
    "vllm-neuron" (the layout contract vllm-neuron's fork code pins, where it differs: :mod:`neuron_layouts`).
    """
    arch = resolve_architecture(arch)
    family = ARCHITECTURES[arch]
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    plan_fn = FAMILIES.get(family) if layout == "official" else neuron_layouts.PLANS.get((layout, family))
    if layout != "official" and plan_fn is None:
        raise ValueError(f"no {layout!r} layout for {arch}; {layout!r} layouts exist for "
                         f"{sorted(f for lay, f in neuron_layouts.PLANS if lay == layout)}")
    if plan_fn is None:
        raise NotImplementedError(
            f"tiny {arch} (GLM-5.3-Flash) checkpoints are not generated: its KDA linear attention runs only as "
            "Triton GPU kernels and its DSA layers are refused by vLLM's CPU build ('Sparse Attention is not "
            "supported on CPU'), so no CPU test could run one; its experts use the same per-expert block-FP8 "
            "layout as GLM-5 (GlmMoeDsaForCausalLM), which is generated")
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if scale_dtype is None:
        scale_dtype = torch.bfloat16 if fmt == "channel" else DEFAULT_SCALE_DTYPE[family]
    if scale_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"scale_dtype must be torch.float32, torch.bfloat16 or torch.float16, got {scale_dtype}")
    unknown = set(overrides) - set(TinySizes.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown size override(s) {sorted(unknown)}; known: {sorted(TinySizes.__dataclass_fields__)}")

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path)
    sizes = replace(neuron_layouts.SIZES.get((layout, family), FAMILY_SIZES[family]), **overrides)
    if sizes.vocab_size == 0:
        sizes = replace(sizes, vocab_size=64 * math.ceil(vocab["size"] / 64))
    if sizes.vocab_size < vocab["size"]:
        raise ValueError(f"vocab_size {sizes.vocab_size} is smaller than the tokenizer's {vocab['size']} tokens")
    if sizes.num_shards < 2:
        raise ValueError("num_shards must be >= 2 (the official checkpoints are sharded)")

    plan, config, processor = plan_fn(sizes, vocab)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    not_converted: list[str] = []
    for name, shape, kind in plan.tensors:
        w = _init_tensor(name, shape, kind, plan.init.get(name), gen)
        if kind == "fp8":
            if fmt == "block":
                codes, scale = quantize_block(w, scale_dtype)
                tensors[name] = codes
                tensors[name + "_scale_inv"] = scale
            else:
                codes, scale = quantize_channel(w, scale_dtype)
                tensors[name] = codes
                tensors[name + "_scale"] = scale
        elif kind == "fp32":
            tensors[name] = w.float()
        else:
            tensors[name] = w.to(torch.bfloat16)
            if kind == "linear":
                not_converted.append(module_of(name))
    write_shards(path, tensors, sizes.num_shards)

    config["quantization_config"] = _quant_config(fmt, not_converted)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    gen_cfg = {"bos_token_id": vocab["bos"], "eos_token_id": vocab["eos"], "pad_token_id": vocab["pad"],
               "transformers_version": "5.19.0"}
    (path / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    if processor == "Qwen3VLProcessor":
        _write_qwen_vl_processor(path)
    return path


def _write_qwen_vl_processor(path: Path) -> None:
    """preprocessor_config.json for the vision tower (patch 16, merge 2), as Qwen3.5 ships it."""
    v = QWEN35_VISION
    pre = {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor",
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
        "rescale_factor": 1 / 255,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "patch_size": v["patch_size"], "temporal_patch_size": v["temporal_patch_size"],
        "merge_size": v["spatial_merge_size"],
        "size": {"shortest_edge": 65536, "longest_edge": 262144},
    }
    (path / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
