"""What a model's ``config.json`` says that the checkpoint tools need: the language model's config inside a
multimodal wrapper (:func:`text_config`), its ``quantization_config`` (:func:`quantization_config`) read as
a :class:`QuantFormat`, and the architectures served with the prefix of their routed-expert tensors.
Pure dict reading: imports neither vLLM nor torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Architectures the plugin serves, with the prefix their routed-expert tensors carry
# (CHECKPOINTS.md, "Names"). MTP copies (`mtp.layers.0.` / `model.layers.{num_hidden_layers}.`) are extra.
SUPPORTED_ARCHITECTURES = {
    "Qwen3MoeForCausalLM": ("model.layers.",),
    "Qwen3_5MoeForCausalLM": ("model.layers.", "mtp.layers."),
    "Qwen3_5MoeForConditionalGeneration": ("model.language_model.layers.", "mtp.layers."),
    "Glm4MoeForCausalLM": ("model.layers.",),
    "GlmMoeDsaForCausalLM": ("model.layers.",),
    "Glm5NextForCausalLM": ("model.layers.",),
    "Glm5NextForConditionalGeneration": ("model.language_model.layers.", "model.layers."),
}



def text_config(config: dict) -> dict:
    """The language model's config: ``text_config`` of multimodal wrappers, else the config itself."""
    tc = config.get("text_config")
    if isinstance(tc, dict) and tc.get("hidden_size"):
        merged = dict(tc)
        # Wrappers keep quantization_config / architectures at the top level.
        for key in ("quantization_config", "architectures"):
            if key in config and key not in merged:
                merged[key] = config[key]
        return merged
    return config


def quantization_config(config: dict) -> dict | None:
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    return qc


@dataclass
class QuantFormat:
    """What a checkpoint's quantization_config says about its FP8 weights."""

    kind: str  # "block" | "per-channel" | "neuron-w8" | "none" | "unknown"
    method: str | None
    block: tuple[int, int] | None  # scale tile of expert weights; (1, 0) per-channel
    scale_suffix: str | None  # weight_scale_inv | weight_scale
    skip: list[str] = field(default_factory=list)
    mode: str | None = None  # neuron-w8 only
    code_format: str | None = None  # neuron-w8 only

    def describe(self) -> str:
        if self.kind == "block":
            return f"block FP8 {self.block[0]}x{self.block[1]} ({self.method}, scales '{self.scale_suffix}')"
        if self.kind == "per-channel":
            return f"per-channel FP8 ({self.method}, scales '{self.scale_suffix}' [out, 1])"
        if self.kind == "neuron-w8":
            return f"neuron-w8 pre-converted (mode {self.mode}, codes {self.code_format}, tile {list(self.block)})"
        return {"none": "not quantised", "unknown": f"unknown quantization ({self.method})"}[self.kind]


def quant_format(config: dict) -> QuantFormat:
    qc = quantization_config(config)
    if not qc:
        return QuantFormat("none", None, None, None)
    method = str(qc.get("quant_method", "")).lower()
    skip = list(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or qc.get("ignore") or [])
    if method == "neuron-w8":
        block = tuple(qc.get("expert_block_size") or qc.get("weight_block_size") or (128, 128))
        return QuantFormat("neuron-w8", method, (int(block[0]), int(block[1])), "weight_scale_inv", skip,
                           qc.get("mode"), qc.get("code_format"))
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block:
            return QuantFormat("block", method, (int(block[0]), int(block[1])), "weight_scale_inv", skip)
        return QuantFormat("unknown", "fp8 (per-tensor, no weight_block_size)", None, None, skip)
    if method == "compressed-tensors":
        for group in (qc.get("config_groups") or {}).values():
            w = (group or {}).get("weights") or {}
            if w.get("strategy") == "channel" and str(w.get("type")) == "float" and int(w.get("num_bits", 8)) == 8:
                return QuantFormat("per-channel", method, (1, 0), "weight_scale", skip)
            if w.get("strategy") == "block" and w.get("block_structure"):
                b = w["block_structure"]
                return QuantFormat("block", method, (int(b[0]), int(b[1])), "weight_scale", skip)
        return QuantFormat("unknown", "compressed-tensors (not FP8 channel/block)", None, None, skip)
    return QuantFormat("unknown", method, None, None, skip)
