"""``NeuronW8Config``: the vLLM ``QuantizationConfig`` of the ``neuron-w8`` method.

What it claims (anything else is refused with a message naming what was found and what is supported):

* native block FP8 (``quant_method: fp8``, ``weight_block_size: [128, 128]``, dynamic activations) —
  Qwen3 / Qwen3.5 / GLM-5 / GLM-5.3-Flash FP8 checkpoints;
* compressed-tensors per-channel FP8 (weights ``type: float``, ``num_bits: 8``, ``strategy: channel``,
  ``weight_scale`` [out, 1], dynamic or absent input activations) — GLM-4.5/4.6/4.7-FP8;
* checkpoints converted by ``vllm-moe-w8 convert`` (``quant_method: neuron-w8``, see DEVELOPING.md).

Selection: ``--quantization neuron-w8`` (any case) on such a checkpoint, or a converted checkpoint by
itself, or (opt-in) automatically for block-FP8 / per-channel checkpoints of a supported architecture
when ``VLLM_MOE_W8_AUTO=1``. Without the opt-in vLLM's behaviour is unchanged.

Layer methods: routed experts -> :class:`vllm_moe_w8.vllm_glue.moe_method.NeuronW8MoEMethod` (uint8 codes +
fp32 scales, the ``moe_w8::fused_moe`` op); every other quantised linear layer ->
:class:`vllm_moe_w8.vllm_glue.linear_method.NeuronW8LinearMethod` (dequantised once to the model dtype).
Layers named by ``modules_to_not_convert`` / ``ignored_layers`` / compressed-tensors ``ignore`` stay
unquantised.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from vllm.logger import init_logger
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from vllm_moe_w8.about import QUANTIZATION_NAME
from vllm_moe_w8.vllm_glue.checkpoint_format import (
    CheckpointFormat,
    UnsupportedCheckpoint,
    check_architecture,
    parse_checkpoint_format,
    validate_local_checkpoint,
)
from vllm_moe_w8.vllm_glue.load_summary import LinearLoadSummary, MoELoadSummary
from vllm_moe_w8.vllm_glue.settings import AUTO_ENV, auto_enabled, runtime_settings

logger = init_logger("vllm.neuron_w8")

class NeuronW8Config(QuantizationConfig):
    """vLLM config object of the ``neuron-w8`` method (one per model)."""

    def __init__(self, checkpoint_format: CheckpointFormat | None = None) -> None:
        super().__init__()
        if checkpoint_format is None:
            parse_checkpoint_format(None)  # raises the "no quantization_config" message
        self.format: CheckpointFormat = checkpoint_format
        self.ignored: list[str] = list(checkpoint_format.ignored)
        # Load bookkeeping shared by every MoE layer of this model (first-layer log line, final summary).
        self.load_summary = MoELoadSummary()
        self.linear_summary = LinearLoadSummary()

    # ---- QuantizationConfig interface -------------------------------------------------------
    @classmethod
    def get_name(cls) -> str:
        return QUANTIZATION_NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "NeuronW8Config":
        return cls(parse_checkpoint_format(config))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None) -> str | None:
        user = (user_quant or "").lower() or None
        method = str((hf_quant_cfg or {}).get("quant_method", "")).lower()
        if user == QUANTIZATION_NAME:
            # --quantization neuron-w8 was given: claim the checkpoint, and refuse now (clearly) what cannot be served.
            parse_checkpoint_format(hf_quant_cfg)
            check_architecture(hf_config)
            return QUANTIZATION_NAME
        if user is None and method == QUANTIZATION_NAME:
            check_architecture(hf_config)
            return QUANTIZATION_NAME
        if user is None and method in ("fp8", "compressed-tensors") and auto_enabled():
            try:
                parse_checkpoint_format(hf_quant_cfg)
                check_architecture(hf_config)
            except UnsupportedCheckpoint as exc:
                logger.info("neuron-w8: %s=1 but not claiming this checkpoint: %s", AUTO_ENV, exc)
                return None
            logger.info("neuron-w8: claiming the %s checkpoint automatically (%s=1)", method, AUTO_ENV)
            return QUANTIZATION_NAME
        return None

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: str | None = None):
        """vLLM calls this with the model path while it builds its config, before any engine or weight load."""
        if hf_config is not None:
            check_architecture(hf_config)
        validate_local_checkpoint(model_name, self.format)

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        plain = [p for p in self.ignored if not p.startswith("re:")]
        regex = [p for p in self.ignored if p.startswith("re:")]
        self.ignored = list(hf_to_vllm_mapper.apply_list(plain)) + plain + regex

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from vllm.model_executor.layers.fused_moe import RoutedExperts
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

        if isinstance(layer, LinearBase):
            if self.is_layer_skipped(prefix):
                return UnquantizedLinearMethod()
            from vllm_moe_w8.vllm_glue.linear_method import NeuronW8LinearMethod

            return NeuronW8LinearMethod(self.format, prefix, self.linear_summary)
        if isinstance(layer, RoutedExperts):
            if self.is_layer_skipped(prefix):
                from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod

                return UnquantizedFusedMoEMethod(layer.moe_config)
            from vllm_moe_w8.vllm_glue.moe_method import NeuronW8MoEMethod

            return NeuronW8MoEMethod(layer, prefix, self.format, runtime_settings(self.format), self.load_summary)
        return None

    # ---- skip lists ----------------------------------------------------------------------------
    def _matches(self, name: str) -> bool:
        for pattern in self.ignored:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], name) or re.match(pattern[3:], name):
                    return True
            elif name == pattern or name.endswith("." + pattern) or name.startswith(pattern + "."):
                return True
        return False

    def is_layer_skipped(self, prefix: str) -> bool:
        """True if ``prefix`` (or, for a fused layer, every shard of it) is in the skip list."""
        if not self.ignored:
            return False
        if self._matches(prefix):
            return True
        proj = prefix.rsplit(".", 1)[-1]
        shards = self.packed_modules_mapping.get(proj)
        if not shards:
            return False
        base = prefix[: len(prefix) - len(proj)]
        flags = [self._matches(base + s) for s in shards]
        if all(flags):
            return True
        if any(flags):
            raise ValueError(
                f"neuron-w8: fused layer {prefix!r} mixes skipped and quantised shards "
                f"({dict(zip(shards, flags))}) according to modules_to_not_convert/ignore; such a checkpoint cannot be loaded"
            )
        return False
