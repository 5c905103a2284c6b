"""neuron-w8's settings on a Neuron host, read the way vllm-neuron reads its own.

Selection: ``--quantization neuron-w8`` (vLLM's ``model_config.quantization``) or
``--additional-config '{"neuron_config": {"quantization": "neuron-w8"}}'`` (vllm-neuron's
``NeuronConfig.quantization``, which its factories read). Options: the ``neuron_w8`` section of the same
``--additional-config`` (``mode``, ``self_check``, ``self_check_experts``), with the precedence of
:func:`vllm_moe_w8.vllm_glue.settings.runtime_settings` (additional_config > environment > checkpoint > default).

``non_expert_layers`` (additional_config, else ``VLLM_MOE_W8_NON_EXPERT_LAYERS``, else ``w8``): ``w8`` runs the FP8
layers besides the routed experts that neuron-w8 adopts (Qwen3.5-MoE's shared expert, attention q/k/v/o and
Gated-DeltaNet in_proj_qkv / in_proj_z / out_proj) at 1 byte through the NKI kernels; ``bf16`` keeps today's path
for them (dequantised once at load to the model dtype, vllm-neuron's own torch matmuls).

On top of the vLLM-generic rules, the Neuron experts module only stores what an NKI kernel multiplies:
``pow2`` on 128x128 block scales, or ``output-block``. Anything else is refused here, naming the remedy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from vllm_moe_w8.about import QUANTIZATION_NAME
from vllm_moe_w8.neuron_glue import kernel_launch

NEURON_CONFIG_KEY = "neuron_config"
KERNEL_MODES = ("pow2", "output-block")
NON_EXPERT_KEY = "non_expert_layers"
NON_EXPERT_ENV = "VLLM_MOE_W8_NON_EXPERT_LAYERS"
NON_EXPERT_CHOICES = ("w8", "bf16")


@dataclass(frozen=True)
class NeuronW8Settings:
    mode: str
    mode_source: str
    self_check: bool
    self_check_experts: int
    fmt: Any  # vllm_moe_w8.vllm_glue.checkpoint_format.CheckpointFormat
    lnc: int
    swiglu_limit: float = 0.0
    non_expert_layers: str = "w8"  # "w8": adopted non-expert FP8 layers at 1 byte; "bf16": vllm-neuron's BF16 path
    non_expert_source: str = "default"

    @property
    def non_expert_w8(self) -> bool:
        return self.non_expert_layers == "w8"


def _additional_config(vllm_config) -> dict:
    extra = getattr(vllm_config, "additional_config", None) or {}
    return extra if isinstance(extra, dict) else {}


def requested(vllm_config) -> bool:
    """True when this engine was asked to serve with neuron-w8 (either spelling)."""
    if vllm_config is None:
        return False
    quant = getattr(getattr(vllm_config, "model_config", None), "quantization", None)
    if isinstance(quant, str) and quant.lower() == QUANTIZATION_NAME:
        return True
    section = _additional_config(vllm_config).get(NEURON_CONFIG_KEY) or {}
    value = section.get("quantization") if isinstance(section, dict) else getattr(section, "quantization", None)
    return isinstance(value, str) and value.lower() == QUANTIZATION_NAME


def resolve(hf_quant_config: dict | None, additional_config: dict | None, swiglu_limit: float = 0.0) -> NeuronW8Settings:
    """Settings for the Neuron experts module, or ValueError naming the setting and the remedy."""
    from vllm_moe_w8.vllm_glue.checkpoint_format import parse_checkpoint_format
    from vllm_moe_w8.vllm_glue.settings import runtime_settings

    fmt = parse_checkpoint_format(hf_quant_config)
    rt = runtime_settings(fmt, additional_config or {})
    if rt.mode not in KERNEL_MODES:
        raise ValueError(
            f"neuron-w8 on Neuron: mode {rt.mode!r} (from {rt.mode_source}) has no NKI kernel; the Neuron experts module "
            f"stores {' or '.join(KERNEL_MODES)} codes. Set --additional-config '{{\"neuron_w8\": {{\"mode\": \"pow2\"}}}}' "
            "(exact) or \"output-block\" (lossy, fastest)"
        )
    block = tuple(fmt.expert_block)
    if rt.mode == "pow2" and block != (128, 128):
        raise ValueError(
            f"neuron-w8 on Neuron: this checkpoint's expert scales are tiled {block} ({fmt.kind}); the pow2 kernel needs "
            "128x128 block scales. Use --additional-config '{\"neuron_w8\": {\"mode\": \"output-block\"}}' (requantised "
            "per 128 output rows) for per-channel checkpoints"
        )
    if fmt.converted and rt.mode == "output-block" and block != (128, 0):
        raise ValueError(f"neuron-w8 on Neuron: converted checkpoint has expert tiles {block}; output-block needs (128, 0)")
    non_expert, non_expert_source = _non_expert_layers(additional_config)
    return NeuronW8Settings(rt.mode, rt.mode_source, rt.self_check, rt.self_check_experts, fmt, kernel_launch.runtime_lnc(),
                            float(swiglu_limit or 0.0), non_expert, non_expert_source)


def _non_expert_layers(additional_config: dict | None) -> tuple[str, str]:
    """(choice, where it came from): additional_config neuron_w8.non_expert_layers > environment > "w8"."""
    from vllm_moe_w8.vllm_glue.settings import ADDITIONAL_CONFIG_KEY, user_settings

    value = user_settings(additional_config or {}).get(NON_EXPERT_KEY)
    source = f"additional_config {ADDITIONAL_CONFIG_KEY}.{NON_EXPERT_KEY}"
    if value is None and os.environ.get(NON_EXPERT_ENV, "").strip():
        value, source = os.environ[NON_EXPERT_ENV].strip(), f"environment {NON_EXPERT_ENV}"
    if value is None:
        return "w8", "default"
    choice = str(value).strip().lower()
    if choice not in NON_EXPERT_CHOICES:
        raise ValueError(
            f"neuron-w8 on Neuron: {NON_EXPERT_KEY} {value!r} (from {source}) unknown; choose \"w8\" (the FP8 layers "
            "besides the experts at 1 byte through the NKI kernels, the default) or \"bf16\" (vllm-neuron's BF16 "
            "path for them, dequantised once at load)"
        )
    return choice, source
