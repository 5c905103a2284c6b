"""STAND-IN: vllm_neuron/model/qwen3_5/config.py (fork whn09/vllm-neuron @3de9ea3): ``Qwen3_5Config.from_hf`` /
``from_configs`` with the checks the fork makes of a checkpoint's layout, and the fields the stand-in block reads.

* ``Qwen3_5Config.from_hf``: the text decoder comes from the HF config's nested ``text_config``; a config without one
  (the flat config.json of a text-only ``Qwen3_5MoeForCausalLM`` checkpoint) raises ValueError "Qwen3.5 config is
  missing text_config".
* ``Qwen3_5TextConfig.from_hf``: ``rope_parameters`` must have ``rope_type`` "default" and ``mrope_interleaved``;
  ``layer_types`` only "linear_attention" / "full_attention", one per layer; ``mlp_only_layers`` empty;
  ``attn_output_gate`` set; ``torch_dtype`` from ``dtype`` / ``torch_dtype`` (default bf16).
* ``Qwen3_5MoeParams.from_hf`` (``text_config.moe``; None for a dense checkpoint): ``num_experts``,
  ``num_experts_per_tok``, ``moe_intermediate_size``, ``shared_expert_intermediate_size`` (required),
  ``norm_topk_prob`` (default True); ``decoder_sparse_step`` 1 and ``scoring_func`` "softmax" only.
The mixer fields the stand-in's attention and DeltaNet read are kept under the fork's names (``head_dim``,
``num_attention_heads``, ``num_key_value_heads``, ``linear_*``); ``torch_dtype`` may be replaced (``dataclasses.replace``)
to build a float64 twin of a mixer, as the fork's dataclass allows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


@dataclass
class Qwen3_5MoeParams:
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool = True

    @classmethod
    def from_hf(cls, text_cfg):
        num_experts = getattr(text_cfg, "num_experts", None)
        if not num_experts:
            return None
        if tuple(getattr(text_cfg, "mlp_only_layers", ()) or ()):
            raise NotImplementedError("mlp_only_layers is not implemented for the MoE variant; every layer must be sparse.")
        step = getattr(text_cfg, "decoder_sparse_step", 1)
        if step != 1:
            raise NotImplementedError(f"decoder_sparse_step={step} is not implemented; every layer must be sparse.")
        scoring = getattr(text_cfg, "scoring_func", "softmax")
        if scoring != "softmax":
            raise NotImplementedError(f"router scoring_func={scoring!r} is not implemented; only 'softmax' has been validated.")
        shared = getattr(text_cfg, "shared_expert_intermediate_size", None)
        if not shared:
            raise NotImplementedError("Qwen3.5-MoE without a shared expert is not implemented; the checkpoint is expected "
                                      "to carry shared_expert_intermediate_size.")
        return cls(int(num_experts), int(text_cfg.num_experts_per_tok), int(text_cfg.moe_intermediate_size), int(shared),
                   bool(getattr(text_cfg, "norm_topk_prob", True)))


def _dtype_of(cfg, default):
    raw = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if raw is None:
        return default
    return raw if isinstance(raw, torch.dtype) else getattr(torch, str(raw).replace("torch.", ""))


@dataclass
class Qwen3_5TextConfig:
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple
    rms_norm_eps: float
    torch_dtype: torch.dtype
    moe: Qwen3_5MoeParams | None = None
    neuron_config: object | None = None
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    @classmethod
    def from_hf(cls, text_cfg):
        rope = getattr(text_cfg, "rope_parameters", None) or {}
        rope = rope if isinstance(rope, dict) else dict(rope)
        if rope.get("rope_type", "default") != "default":
            raise NotImplementedError(f"Qwen3.5 rope_type {rope.get('rope_type')!r} is not implemented")
        if not rope.get("mrope_interleaved", False):
            raise NotImplementedError("Qwen3.5 with mrope_interleaved=False is not implemented")
        layer_types = tuple(getattr(text_cfg, "layer_types"))
        unknown = set(layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION}
        if unknown:
            raise NotImplementedError(f"unknown Qwen3.5 layer types {sorted(unknown)}")
        if len(layer_types) != text_cfg.num_hidden_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries but num_hidden_layers is {text_cfg.num_hidden_layers}")
        if tuple(getattr(text_cfg, "mlp_only_layers", ()) or ()):
            raise NotImplementedError("mlp_only_layers is not implemented; this port assumes every layer has both a mixer and an MLP.")
        moe = Qwen3_5MoeParams.from_hf(text_cfg)
        if moe is None and not getattr(text_cfg, "intermediate_size", None):
            raise ValueError("a dense Qwen3.5 checkpoint must carry intermediate_size, and a sparse one must carry "
                             "num_experts; this config has neither.")
        if not getattr(text_cfg, "attn_output_gate", False):
            raise NotImplementedError("Qwen3.5 without attn_output_gate is not implemented")
        mixers = {k: int(getattr(text_cfg, k)) for k in (
            "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")}
        return cls(text_cfg.hidden_size, text_cfg.num_hidden_layers, layer_types, text_cfg.rms_norm_eps,
                   _dtype_of(text_cfg, torch.bfloat16), moe, **mixers)


@dataclass
class Qwen3_5Config:
    text_config: Qwen3_5TextConfig
    neuron_config: object | None = None

    @classmethod
    def from_hf(cls, hf_config, *, include_vision: bool = True):
        text_cfg = getattr(hf_config, "text_config", None)
        if text_cfg is None:
            raise ValueError("Qwen3.5 config is missing text_config")
        return cls(Qwen3_5TextConfig.from_hf(text_cfg))

    @classmethod
    def from_configs(cls, hf_config, text_neuron_config=None, vision_neuron_config=None, *, include_vision=None):
        config = cls.from_hf(hf_config)
        config.text_config.neuron_config = config.neuron_config = text_neuron_config
        return config
