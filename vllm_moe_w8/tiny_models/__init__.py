"""Tiny random FP8 MoE checkpoints laid out exactly like the official ones, and their exact twins.

No official FP8 MoE checkpoint is small enough for a test or a demo, so this module writes one:
the same ``config.json`` keys (with ``text_config`` nesting where the real one nests), the same
tensor names, the same choice of which tensors are FP8 and which stay bf16/fp32, the same
``quantization_config``, several ``model-0000N-of-0000M.safetensors`` shards with
``model.safetensors.index.json``, a ``generation_config.json`` and a small byte-level BPE tokenizer
(trained offline with ``tokenizers``) that has a chat template. Only the sizes are tiny: hidden 256,
``moe_intermediate_size`` 384 (so TP=2 gives a ragged 192 per rank), two or three layers.

Weights are drawn in fp32 and quantised as real checkpoints are: one scale per 128x128 block
(``weight_block_size``) or per output channel (compressed-tensors ``strategy: channel``), equal to
the block's amax / 448, so every block uses the E4M3FN-only codes 0x78..0x7E. Scales are stored as
dequantisation multipliers (``weight_scale_inv`` / ``weight_scale``) in the requested dtype.

:func:`write_twin` writes the *independent reference*: the same checkpoint with each FP8 tensor
replaced by its exactly dequantised weight (torch's own float8_e4m3fn conversion times the scale,
pad-then-crop on ragged grids; exact for bf16/fp16 scales, one fp32 rounding for fp32 scales) and no
``quantization_config``; vLLM runs it unquantised.

Imports torch and safetensors; ``tokenizers`` is imported only when a tokenizer is written.
Never imports vLLM.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FP8_MAX = 448.0  # OCP float8_e4m3fn
BLOCK = 128
FORMATS = ("block", "channel")

# Architecture name -> (family, vLLM/HF architecture string). Families share a tensor layout.
ARCHITECTURES = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Glm4MoeForCausalLM": "glm4_moe",
    "GlmMoeDsaForCausalLM": "glm_moe_dsa",
    "Glm5NextForCausalLM": "glm5_next_text",
    "Glm5NextForConditionalGeneration": "glm5_next",
}

# Short names accepted by write_checkpoint (and the demo CLI).
ALIASES = {
    "qwen3-moe": "Qwen3MoeForCausalLM",
    "qwen3.5-moe-text": "Qwen3_5MoeForCausalLM",
    "qwen3.5-moe": "Qwen3_5MoeForConditionalGeneration",
    "glm4-moe": "Glm4MoeForCausalLM",
    "glm5": "GlmMoeDsaForCausalLM",
    "glm5.3-flash-text": "Glm5NextForCausalLM",
    "glm5.3-flash": "Glm5NextForConditionalGeneration",
}


@dataclass(frozen=True)
class TinySizes:
    """Sizes of a tiny model; every field can be overridden by ``write_checkpoint(**overrides)``."""

    hidden_size: int = 256
    moe_intermediate_size: int = 384  # 384 / TP2 = 192: ragged against 128-blocks on purpose
    intermediate_size: int = 512  # dense MLP layers (GLM's first layer)
    shared_intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_experts: int = 8
    num_experts_per_tok: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    num_shards: int = 2
    vocab_size: int = 0  # 0: the tokenizer's size rounded up to a multiple of 64


# Per-family defaults (the brief: 8-16 experts, top-k 2-4, 2-3 layers with the real structure).
FAMILY_SIZES = {
    "qwen3_moe": TinySizes(),
    "qwen3_5_moe": TinySizes(num_experts=16, num_experts_per_tok=4),  # layers: linear + full attention
    "qwen3_5_moe_text": TinySizes(num_experts=16, num_experts_per_tok=4),
    "glm4_moe": TinySizes(num_hidden_layers=3, num_experts=16, num_experts_per_tok=4),  # layer 0 dense
    "glm_moe_dsa": TinySizes(num_hidden_layers=2),
    "glm5_next": TinySizes(num_hidden_layers=2),
    "glm5_next_text": TinySizes(num_hidden_layers=2),
}

# Scale dtype of the official checkpoints: Qwen stores bf16 weight_scale_inv, GLM/DeepSeek fp32,
# compressed-tensors stores the per-channel weight_scale in the weights' original dtype (bf16).
DEFAULT_SCALE_DTYPE = {
    "qwen3_moe": torch.bfloat16,
    "qwen3_5_moe": torch.bfloat16,
    "qwen3_5_moe_text": torch.bfloat16,
    "glm4_moe": torch.float32,
    "glm_moe_dsa": torch.float32,
    "glm5_next": torch.float32,
    "glm5_next_text": torch.float32,
}


def resolve_architecture(arch: str) -> str:
    """Accept an architecture name or a short alias; raise a clear error otherwise."""
    arch = ALIASES.get(arch, arch)
    if arch not in ARCHITECTURES:
        known = ", ".join(list(ARCHITECTURES) + list(ALIASES))
        raise ValueError(f"unknown tiny-model architecture {arch!r}; choose one of: {known}")
    return arch


# --------------------------------------------------------------------------------------------
# Tensor plan: (name, shape, kind). kind: "fp8" (quantised Linear), "linear" (bf16 Linear kept
# unquantised), "bf16" (other bf16 tensors), "norm" (RMSNorm weight ~1), "fp32" (fp32 tensor).
# --------------------------------------------------------------------------------------------


@dataclass
class Plan:
    tensors: list[tuple[str, tuple[int, ...], str]] = field(default_factory=list)
    init: dict[str, str] = field(default_factory=dict)  # name -> special initialiser

    def add(self, name: str, shape: tuple[int, ...], kind: str, init: str | None = None) -> None:
        self.tensors.append((name, tuple(shape), kind))
        if init:
            self.init[name] = init

    def mlp(self, prefix: str, hidden: int, inter: int, kind: str = "fp8") -> None:
        self.add(f"{prefix}.gate_proj.weight", (inter, hidden), kind)
        self.add(f"{prefix}.up_proj.weight", (inter, hidden), kind)
        self.add(f"{prefix}.down_proj.weight", (hidden, inter), kind)

    def experts(self, prefix: str, s: TinySizes) -> None:
        for e in range(s.num_experts):
            self.mlp(f"{prefix}.experts.{e}", s.hidden_size, s.moe_intermediate_size)


def _gqa_attention(p: Plan, pre: str, s: TinySizes, q_gate: bool = False, bias: bool = False, qk_norm: bool = True) -> None:
    h, d = s.hidden_size, s.head_dim
    q_out = s.num_attention_heads * d * (2 if q_gate else 1)
    kv_out = s.num_key_value_heads * d
    p.add(f"{pre}.q_proj.weight", (q_out, h), "fp8")
    p.add(f"{pre}.k_proj.weight", (kv_out, h), "fp8")
    p.add(f"{pre}.v_proj.weight", (kv_out, h), "fp8")
    if bias:
        p.add(f"{pre}.q_proj.bias", (q_out,), "bf16")
        p.add(f"{pre}.k_proj.bias", (kv_out,), "bf16")
        p.add(f"{pre}.v_proj.bias", (kv_out,), "bf16")
    p.add(f"{pre}.o_proj.weight", (h, s.num_attention_heads * d), "fp8")
    if qk_norm:
        p.add(f"{pre}.q_norm.weight", (d,), "norm")
        p.add(f"{pre}.k_norm.weight", (d,), "norm")


def _layer_norms(p: Plan, pre: str, h: int) -> None:
    p.add(f"{pre}.input_layernorm.weight", (h,), "norm")
    p.add(f"{pre}.post_attention_layernorm.weight", (h,), "norm")


def _embed_and_head(p: Plan, model: str, s: TinySizes) -> None:
    p.add(f"{model}.embed_tokens.weight", (s.vocab_size, s.hidden_size), "bf16", init="embed")
    p.add(f"{model}.norm.weight", (s.hidden_size,), "norm")
    p.add("lm_head.weight", (s.vocab_size, s.hidden_size), "linear", init="head")


# ---- Qwen3-MoE ------------------------------------------------------------------------------


def _qwen3_moe(s: TinySizes, v: dict):
    p = Plan()
    _embed_and_head(p, "model", s)
    for L in range(s.num_hidden_layers):
        pre = f"model.layers.{L}"
        _layer_norms(p, pre, s.hidden_size)
        _gqa_attention(p, f"{pre}.self_attn", s)
        p.add(f"{pre}.mlp.gate.weight", (s.num_experts, s.hidden_size), "linear")
        p.experts(f"{pre}.mlp", s)
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": v["bos"],
        "eos_token_id": v["eos"],
        "decoder_sparse_step": 1,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "hidden_size": s.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": s.intermediate_size,
        "max_position_embeddings": 4096,
        "max_window_layers": s.num_hidden_layers,
        "mlp_only_layers": [],
        "moe_intermediate_size": s.moe_intermediate_size,
        "norm_topk_prob": True,
        "num_attention_heads": s.num_attention_heads,
        "num_experts": s.num_experts,
        "num_experts_per_tok": s.num_experts_per_tok,
        "num_hidden_layers": s.num_hidden_layers,
        "num_key_value_heads": s.num_key_value_heads,
        "output_router_logits": False,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": s.vocab_size,
    }
    return p, config, None


# ---- Qwen3.5-MoE (hybrid Gated DeltaNet + gated full attention, shared expert) ----------------

QWEN35_LINEAR_KEY_HEADS = 2
QWEN35_LINEAR_VALUE_HEADS = 4
QWEN35_LINEAR_HEAD_DIM = 64
QWEN35_CONV_KERNEL = 4


def _qwen3_5_text_layers(p: Plan, model: str, s: TinySizes, layer_types: list[str]) -> None:
    h = s.hidden_size
    key_dim = QWEN35_LINEAR_KEY_HEADS * QWEN35_LINEAR_HEAD_DIM
    value_dim = QWEN35_LINEAR_VALUE_HEADS * QWEN35_LINEAR_HEAD_DIM
    for L, kind in enumerate(layer_types):
        pre = f"{model}.layers.{L}"
        _layer_norms(p, pre, h)
        if kind == "linear_attention":
            la = f"{pre}.linear_attn"
            p.add(f"{la}.in_proj_qkv.weight", (2 * key_dim + value_dim, h), "fp8")
            p.add(f"{la}.in_proj_z.weight", (value_dim, h), "fp8")
            p.add(f"{la}.in_proj_b.weight", (QWEN35_LINEAR_VALUE_HEADS, h), "linear")
            p.add(f"{la}.in_proj_a.weight", (QWEN35_LINEAR_VALUE_HEADS, h), "linear")
            p.add(f"{la}.conv1d.weight", (2 * key_dim + value_dim, 1, QWEN35_CONV_KERNEL), "bf16", init="conv")
            p.add(f"{la}.dt_bias", (QWEN35_LINEAR_VALUE_HEADS,), "bf16", init="ones")
            p.add(f"{la}.A_log", (QWEN35_LINEAR_VALUE_HEADS,), "fp32", init="a_log")
            p.add(f"{la}.norm.weight", (QWEN35_LINEAR_HEAD_DIM,), "norm")
            p.add(f"{la}.out_proj.weight", (h, value_dim), "fp8")
        else:
            _gqa_attention(p, f"{pre}.self_attn", s, q_gate=True)
        p.add(f"{pre}.mlp.gate.weight", (s.num_experts, h), "linear")
        p.experts(f"{pre}.mlp", s)
        p.mlp(f"{pre}.mlp.shared_expert", h, s.shared_intermediate_size)
        p.add(f"{pre}.mlp.shared_expert_gate.weight", (1, h), "linear")


def _qwen3_5_text_config(s: TinySizes, v: dict, layer_types: list[str]) -> dict:
    rotary = int(s.head_dim * 0.25)
    half = rotary // 2
    mrope = [half - 2 * (half // 3), half // 3, half // 3]  # sums to rotary/2, like [11, 11, 10]
    return {
        "model_type": "qwen3_5_moe_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": v["bos"],
        "eos_token_id": v["eos"][0],
        "dtype": "bfloat16",
        "full_attention_interval": 2,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "hidden_size": s.hidden_size,
        "initializer_range": 0.02,
        "layer_types": layer_types,
        "linear_conv_kernel_dim": QWEN35_CONV_KERNEL,
        "linear_key_head_dim": QWEN35_LINEAR_HEAD_DIM,
        "linear_num_key_heads": QWEN35_LINEAR_KEY_HEADS,
        "linear_num_value_heads": QWEN35_LINEAR_VALUE_HEADS,
        "linear_value_head_dim": QWEN35_LINEAR_HEAD_DIM,
        "max_position_embeddings": 4096,
        "mlp_only_layers": [],
        "moe_intermediate_size": s.moe_intermediate_size,
        "mtp_num_hidden_layers": 0,
        "num_attention_heads": s.num_attention_heads,
        "num_experts": s.num_experts,
        "num_experts_per_tok": s.num_experts_per_tok,
        "num_hidden_layers": s.num_hidden_layers,
        "num_key_value_heads": s.num_key_value_heads,
        "output_router_logits": False,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": mrope,
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": s.shared_intermediate_size,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": s.vocab_size,
    }


# A minimal vision tower: Qwen3_5MoeForConditionalGeneration builds ``visual`` unless every
# modality's limit is 0, and vLLM refuses a checkpoint that lacks weights it built.
QWEN35_VISION = {"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "patch_size": 16,
                 "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3, "num_position_embeddings": 64}


def _qwen3_5_vision(p: Plan, s: TinySizes) -> dict:
    vc = dict(QWEN35_VISION, out_hidden_size=s.hidden_size, hidden_act="gelu_pytorch_tanh",
              initializer_range=0.02, model_type="qwen3_5_moe", deepstack_visual_indexes=[])
    vh, vi, m = vc["hidden_size"], vc["intermediate_size"], vc["spatial_merge_size"]
    pre = "model.visual"
    p.add(f"{pre}.patch_embed.proj.weight", (vh, vc["in_channels"], vc["temporal_patch_size"], vc["patch_size"], vc["patch_size"]), "bf16")
    p.add(f"{pre}.patch_embed.proj.bias", (vh,), "bf16")
    p.add(f"{pre}.pos_embed.weight", (vc["num_position_embeddings"], vh), "bf16")
    for b in range(vc["depth"]):
        bp = f"{pre}.blocks.{b}"
        for n in ("norm1", "norm2"):
            p.add(f"{bp}.{n}.weight", (vh,), "norm")
            p.add(f"{bp}.{n}.bias", (vh,), "bf16")
        for name, shape in (("attn.qkv", (3 * vh, vh)), ("attn.proj", (vh, vh)),
                            ("mlp.linear_fc1", (vi, vh)), ("mlp.linear_fc2", (vh, vi))):
            p.add(f"{bp}.{name}.weight", shape, "linear")
            p.add(f"{bp}.{name}.bias", (shape[0],), "bf16")
    merged = vh * m * m
    p.add(f"{pre}.merger.norm.weight", (vh,), "norm")
    p.add(f"{pre}.merger.norm.bias", (vh,), "bf16")
    p.add(f"{pre}.merger.linear_fc1.weight", (merged, merged), "linear")
    p.add(f"{pre}.merger.linear_fc1.bias", (merged,), "bf16")
    p.add(f"{pre}.merger.linear_fc2.weight", (s.hidden_size, merged), "linear")
    p.add(f"{pre}.merger.linear_fc2.bias", (s.hidden_size,), "bf16")
    return vc


def _mark_zero_centered_norms(p: Plan) -> None:
    """Qwen3.5's decoder, final and q/k norms are GemmaRMSNorm (scale 1 + w); the GDN output norm is not."""
    for name, _, kind in p.tensors:
        if kind == "norm" and "visual" not in name and "linear_attn.norm" not in name:
            p.init[name] = "zero_centered_norm"


def _qwen3_5_layer_types(s: TinySizes) -> list[str]:
    return ["linear_attention" if (i + 1) % 2 else "full_attention" for i in range(s.num_hidden_layers)]


def _qwen3_5_moe(s: TinySizes, v: dict):
    p = Plan()
    layer_types = _qwen3_5_layer_types(s)
    vision = _qwen3_5_vision(p, s)
    _embed_and_head(p, "model.language_model", s)
    _qwen3_5_text_layers(p, "model.language_model", s, layer_types)
    _mark_zero_centered_norms(p)
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "image_token_id": v["image_pad"],
        "video_token_id": v["video_pad"],
        "vision_start_token_id": v["vision_start"],
        "vision_end_token_id": v["vision_end"],
        "tie_word_embeddings": False,
        "text_config": _qwen3_5_text_config(s, v, layer_types),
        "vision_config": vision,
        "transformers_version": "5.19.0",
    }
    return p, config, "Qwen3VLProcessor"


def _qwen3_5_moe_text(s: TinySizes, v: dict):
    p = Plan()
    layer_types = _qwen3_5_layer_types(s)
    _embed_and_head(p, "model", s)  # clean text-only naming (vLLM also strips a `model.language_model.` prefix)
    _qwen3_5_text_layers(p, "model", s, layer_types)
    _mark_zero_centered_norms(p)
    config = _qwen3_5_text_config(s, v, layer_types)
    config = {"architectures": ["Qwen3_5MoeForCausalLM"], **config}
    return p, config, None


# ---- GLM-4.x MoE (sigmoid + e_score_correction_bias, dense first layer, shared experts) -------


def _glm4_moe(s: TinySizes, v: dict):
    p = Plan()
    _embed_and_head(p, "model", s)
    first_dense = 1
    for L in range(s.num_hidden_layers):
        pre = f"model.layers.{L}"
        _layer_norms(p, pre, s.hidden_size)
        _gqa_attention(p, f"{pre}.self_attn", s, bias=True, qk_norm=False)
        if L < first_dense:
            p.mlp(f"{pre}.mlp", s.hidden_size, s.intermediate_size)
        else:
            p.add(f"{pre}.mlp.gate.weight", (s.num_experts, s.hidden_size), "linear")
            p.add(f"{pre}.mlp.gate.e_score_correction_bias", (s.num_experts,), "fp32", init="small")
            p.experts(f"{pre}.mlp", s)
            p.mlp(f"{pre}.mlp.shared_experts", s.hidden_size, s.moe_intermediate_size)
    config = {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "attention_bias": True,
        "attention_dropout": 0.0,
        "bos_token_id": v["bos"],
        "eos_token_id": v["eos"],
        "pad_token_id": v["pad"],
        "first_k_dense_replace": first_dense,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "hidden_size": s.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": s.intermediate_size,
        "max_position_embeddings": 4096,
        "moe_intermediate_size": s.moe_intermediate_size,
        "n_group": 1,
        "n_routed_experts": s.num_experts,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": s.num_attention_heads,
        "num_experts_per_tok": s.num_experts_per_tok,
        "num_hidden_layers": s.num_hidden_layers,
        "num_key_value_heads": s.num_key_value_heads,
        "num_nextn_predict_layers": 0,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "routed_scaling_factor": 2.5,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_qk_norm": False,
        "vocab_size": s.vocab_size,
    }
    return p, config, None


# ---- GLM-5 (GlmMoeDsaForCausalLM: DeepSeek-V3.2 MLA + DSA indexer, sigmoid routing) ---------

# GLM-5's own latent sizes (kv_lora_rank 512 + qk_rope_head_dim 64 = 576): vLLM's CPU MLA decode kernel
# accepts only this head size. index_topk 64: prompts up to 64 tokens attend to every token.
GLM5_MLA = {"q_lora_rank": 256, "kv_lora_rank": 512, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64,
            "v_head_dim": 64, "index_n_heads": 4, "index_head_dim": 128, "index_topk": 64}


def _mla_attention(p: Plan, pre: str, s: TinySizes, m: dict, indexer: bool) -> None:
    h, nh = s.hidden_size, s.num_attention_heads
    qk_head = m["qk_nope_head_dim"] + m["qk_rope_head_dim"]
    p.add(f"{pre}.q_a_proj.weight", (m["q_lora_rank"], h), "fp8")
    p.add(f"{pre}.q_a_layernorm.weight", (m["q_lora_rank"],), "norm")
    p.add(f"{pre}.q_b_proj.weight", (nh * qk_head, m["q_lora_rank"]), "fp8")
    p.add(f"{pre}.kv_a_proj_with_mqa.weight", (m["kv_lora_rank"] + m["qk_rope_head_dim"], h), "fp8")
    p.add(f"{pre}.kv_a_layernorm.weight", (m["kv_lora_rank"],), "norm")
    p.add(f"{pre}.kv_b_proj.weight", (nh * (m["qk_nope_head_dim"] + m["v_head_dim"]), m["kv_lora_rank"]), "fp8")
    p.add(f"{pre}.o_proj.weight", (h, nh * m["v_head_dim"]), "fp8")
    if indexer:
        ip = f"{pre}.indexer"
        p.add(f"{ip}.wq_b.weight", (m["index_n_heads"] * m["index_head_dim"], m["q_lora_rank"]), "fp8")
        p.add(f"{ip}.wk.weight", (m["index_head_dim"], h), "fp8")
        p.add(f"{ip}.k_norm.weight", (m["index_head_dim"],), "norm")
        p.add(f"{ip}.k_norm.bias", (m["index_head_dim"],), "bf16")
        p.add(f"{ip}.weights_proj.weight", (m["index_n_heads"], h), "linear")


def _glm_moe_block(p: Plan, pre: str, s: TinySizes) -> None:
    p.add(f"{pre}.mlp.gate.weight", (s.num_experts, s.hidden_size), "linear")
    p.add(f"{pre}.mlp.gate.e_score_correction_bias", (s.num_experts,), "fp32", init="small")
    p.experts(f"{pre}.mlp", s)
    p.mlp(f"{pre}.mlp.shared_experts", s.hidden_size, s.moe_intermediate_size)


def _glm_moe_dsa(s: TinySizes, v: dict):
    p = Plan()
    _embed_and_head(p, "model", s)
    first_dense = 1
    for L in range(s.num_hidden_layers):
        pre = f"model.layers.{L}"
        _layer_norms(p, pre, s.hidden_size)
        _mla_attention(p, f"{pre}.self_attn", s, GLM5_MLA, indexer=True)
        if L < first_dense:
            p.mlp(f"{pre}.mlp", s.hidden_size, s.intermediate_size)
        else:
            _glm_moe_block(p, pre, s)
    config = {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": v["bos"],
        "eos_token_id": v["eos"],
        "pad_token_id": v["pad"],
        "first_k_dense_replace": first_dense,
        "hidden_act": "silu",
        "hidden_size": s.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": s.intermediate_size,
        **GLM5_MLA,
        "indexer_types": ["full"] * s.num_hidden_layers,
        "layer_types": ["indexed_attention"] * s.num_hidden_layers,
        "mlp_layer_types": ["dense" if L < first_dense else "sparse" for L in range(s.num_hidden_layers)],
        "max_position_embeddings": 4096,
        "moe_intermediate_size": s.moe_intermediate_size,
        "n_group": 1,
        "n_routed_experts": s.num_experts,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": s.num_attention_heads,
        "num_experts_per_tok": s.num_experts_per_tok,
        "num_hidden_layers": s.num_hidden_layers,
        "num_key_value_heads": s.num_attention_heads,
        "num_nextn_predict_layers": 0,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "tie_word_embeddings": False,
        "topk_group": 1,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": s.vocab_size,
    }
    return p, config, None


FAMILIES = {
    "qwen3_moe": _qwen3_moe,
    "qwen3_5_moe": _qwen3_5_moe,
    "qwen3_5_moe_text": _qwen3_5_moe_text,
    "glm4_moe": _glm4_moe,
    "glm_moe_dsa": _glm_moe_dsa,
}


# --------------------------------------------------------------------------------------------
# Quantisation (as the official exporters do) and exact dequantisation (for the twin)
# --------------------------------------------------------------------------------------------


def quantize_block(w: torch.Tensor, scale_dtype: torch.dtype, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (float8_e4m3fn [N, K], scale_inv [ceil(N/b), ceil(K/b)] in scale_dtype).

    Each block's scale is its amax / 448, rounded to ``scale_dtype``; codes are w / scale rounded to
    nearest (clamped at +-448, since a scale rounded down can push the amax a hair above 448).
    """
    n, k = w.shape
    gn, gk = math.ceil(n / block), math.ceil(k / block)
    padded = torch.zeros(gn * block, gk * block, dtype=torch.float32)
    padded[:n, :k] = w
    tiles = padded.view(gn, block, gk, block)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny).to(scale_dtype)
    expanded = scale.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    codes = (w / expanded).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def quantize_channel(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (float8_e4m3fn [N, K], weight_scale [N, 1]): compressed-tensors ``strategy: channel``."""
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny).to(scale_dtype)
    codes = (w / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def dequantize_exact(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float8_e4m3fn [N, K] x scale -> fp32: exact for bf16/fp16 scales, one fp32 rounding for fp32 scales.

    ``block`` (bn, bk) for a block grid (pad-then-crop covers ragged edges); None for per-channel.
    Uses torch's own float8_e4m3fn conversion, independent of this project's codecs.
    """
    w = codes.to(torch.float32)
    s = scale.to(torch.float32)
    n, k = w.shape
    if block is None:
        return w * s.reshape(n, 1)
    bn, bk = block
    gn, gk = s.shape
    padded = torch.zeros(gn * bn, gk * bk, dtype=torch.float32)
    padded[:n, :k] = w
    padded = (padded.view(gn, bn, gk, bk) * s.view(gn, 1, gk, 1)).view(gn * bn, gk * bk)
    return padded[:n, :k].contiguous()


# --------------------------------------------------------------------------------------------
# Tokenizer: a small byte-level BPE trained offline on a built-in text, with a chat template
# --------------------------------------------------------------------------------------------

TOKENIZER_VOCAB = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- else %}{%- set content = message['content'] | map(attribute='text') | join('') %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TRAINING_TEXT = """\
Mixture of experts models route every token to a few experts out of many. Each expert is a small
feed forward network with a gate projection, an up projection and a down projection. The router
scores the experts with a softmax or a sigmoid, picks the top k, and the layer returns the weighted
sum of the chosen experts. Weights stored in eight bit floating point take one byte per parameter,
half of what bfloat16 needs, so a server can keep twice as many experts in memory. The scale of a
block of one hundred and twenty eight by one hundred and twenty eight weights turns the bytes back
into real numbers. Trainium has its own eight bit format whose largest value is two hundred and
forty, while the open format reaches four hundred and forty eight. Halving a block and doubling its
scale keeps the product the same. The quick brown fox jumps over the lazy dog. Hello, world! How
are you today? I am fine, thank you. What is the capital of France? Paris is the capital of France.
Tell me a story about a robot who learns to paint. Once upon a time there was a small robot in a
quiet town by the sea. It watched the sky every evening and tried to mix the colours of the sunset.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 128 256 448 1024. Code: def main(): return 0; print(x + y).
"""


def write_tokenizer(path: str | Path, vocab_size: int = TOKENIZER_VOCAB) -> dict:
    """Train a byte-level BPE on TRAINING_TEXT and write tokenizer.json + tokenizer_config.json.

    Returns the ids of the special tokens (``bos``, ``eos`` list, ``pad``, vision tokens) and ``size``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TRAINING_TEXT] * 4, trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": True}
            for t in SPECIAL_TOKENS
        },
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2))
    return {
        "bos": ids["<|endoftext|>"],
        "eos": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad": ids["<|endoftext|>"],
        "vision_start": ids["<|vision_start|>"],
        "vision_end": ids["<|vision_end|>"],
        "image_pad": ids["<|image_pad|>"],
        "video_pad": ids["<|video_pad|>"],
        "size": tok.get_vocab_size(),
    }


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


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


def _write_shards(path: Path, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    """Split tensors in order into ``num_shards`` files of about equal bytes + the index."""
    names = list(tensors)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    target = total / num_shards
    shards: list[dict[str, torch.Tensor]] = [{}]
    acc = 0
    for name in names:
        t = tensors[name]
        if acc >= target * len(shards) and len(shards) < num_shards:
            shards.append({})
        shards[-1][name] = t.contiguous()
        acc += t.numel() * t.element_size()
    while len(shards) < num_shards:  # tiny plans: move the last tensor out so every shard exists
        donor = max(shards, key=len)
        last = list(donor)[-1]
        shards.append({last: donor.pop(last)})
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


def write_checkpoint(
    path: str | Path,
    arch: str,
    fmt: str = "block",
    scale_dtype: torch.dtype | None = None,
    seed: int = 0,
    **overrides,
) -> Path:
    """Write a tiny random FP8 checkpoint of ``arch`` in the official layout; return its path.

    ``fmt``: "block" (native FP8, ``weight_block_size`` [128, 128], ``weight_scale_inv``) or
    "channel" (compressed-tensors per-channel, ``weight_scale`` [N, 1]).
    ``scale_dtype``: float32, bfloat16 or float16 (default: the family's official choice).
    ``overrides``: any :class:`TinySizes` field (e.g. ``num_experts=16``, ``num_shards=3``).
    """
    arch = resolve_architecture(arch)
    family = ARCHITECTURES[arch]
    if family not in FAMILIES:
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
    sizes = replace(FAMILY_SIZES[family], **overrides)
    if sizes.vocab_size == 0:
        sizes = replace(sizes, vocab_size=64 * math.ceil(vocab["size"] / 64))
    if sizes.vocab_size < vocab["size"]:
        raise ValueError(f"vocab_size {sizes.vocab_size} is smaller than the tokenizer's {vocab['size']} tokens")
    if sizes.num_shards < 2:
        raise ValueError("num_shards must be >= 2 (the official checkpoints are sharded)")

    plan, config, processor = FAMILIES[family](sizes, vocab)
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
                not_converted.append(_module_of(name))
    _write_shards(path, tensors, sizes.num_shards)

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


# --------------------------------------------------------------------------------------------
# The twin
# --------------------------------------------------------------------------------------------


def _load_all(path: Path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / fname), framework="pt") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    return out


def write_twin(src: str | Path, dst: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Copy ``src`` to ``dst`` with every FP8 weight exactly dequantised to ``dtype`` and no quantization_config.

    fp32 twins are exact for bf16/fp16 scales (a 4-bit x 8/11-bit mantissa product fits fp32) and
    correctly rounded to fp32 for fp32 scales (GLM); bf16 twins round that fp32 product to bf16.
    """
    src, dst = Path(src), Path(dst)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"twin dtype must be float32, bfloat16 or float16, got {dtype}")
    config = json.loads((src / "config.json").read_text())
    qcfg = config.pop("quantization_config", None) or config.get("text_config", {}).pop("quantization_config", None)
    if qcfg is None:
        raise ValueError(f"{src / 'config.json'} has no quantization_config: not an FP8 checkpoint")
    block = tuple(qcfg["weight_block_size"]) if qcfg.get("quant_method") == "fp8" else None
    dst.mkdir(parents=True, exist_ok=True)
    tensors = _load_all(src)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv") or name.endswith("_scale"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = tensors.get(name + "_scale_inv", tensors.get(name + "_scale"))
            if scale is None:
                raise ValueError(f"FP8 tensor {name!r} in {src} has no weight_scale_inv / weight_scale")
            out[name] = dequantize_exact(t, scale, block).to(dtype)
        else:
            out[name] = t
    num_shards = len(set(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"].values()))
    _write_shards(dst, out, num_shards)
    dtype_name = str(dtype).removeprefix("torch.")
    for cfg in (config, config.get("text_config")):
        if cfg is not None:
            for key in ("torch_dtype", "dtype"):
                if key in cfg:
                    cfg[key] = dtype_name
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix == ".json" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    return dst
