"""The shared vocabulary of the tiny-model writer: supported architectures and their short names, the tiny
sizes per family, the scale dtypes of the official checkpoints, and the tensor :class:`Plan` with the
building blocks (attention, norms, embeddings) every family uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
    linear_head_dim: int = 64  # Qwen3.5's Gated DeltaNet key/value head dim (the real models: 128)
    num_shards: int = 2
    vocab_size: int = 0  # 0: the tokenizer's size rounded up to a multiple of 64


# Per-family defaults: 8-16 experts, top-k 2-4, 2-3 layers with the real structure.
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


def gqa_attention(p: Plan, pre: str, s: TinySizes, q_gate: bool = False, bias: bool = False, qk_norm: bool = True) -> None:
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


def layer_norms(p: Plan, pre: str, h: int) -> None:
    p.add(f"{pre}.input_layernorm.weight", (h,), "norm")
    p.add(f"{pre}.post_attention_layernorm.weight", (h,), "norm")


def embed_and_head(p: Plan, model: str, s: TinySizes) -> None:
    p.add(f"{model}.embed_tokens.weight", (s.vocab_size, s.hidden_size), "bf16", init="embed")
    p.add(f"{model}.norm.weight", (s.hidden_size,), "norm")
    p.add("lm_head.weight", (s.vocab_size, s.hidden_size), "linear", init="head")
