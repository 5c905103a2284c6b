"""neuron-w8's settings on a Neuron host, read the way vllm-neuron reads its own.

Selection: ``--quantization neuron-w8`` (vLLM's ``model_config.quantization``) or
``--additional-config '{"neuron_config": {"quantization": "neuron-w8"}}'`` (vllm-neuron's
``NeuronConfig.quantization``, which its factories read). Options: the ``neuron_w8`` section of the same
``--additional-config`` (``mode``, ``self_check``, ``self_check_experts``), with the precedence of
:func:`vllm_moe_w8.vllm_glue.settings.runtime_settings` (additional_config > environment > checkpoint > default).

On top of the vLLM-generic rules, the Neuron experts module only stores what an NKI kernel multiplies:
``pow2`` on 128x128 block scales, or ``output-block``. Anything else is refused here, naming the remedy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_moe_w8.about import QUANTIZATION_NAME
from vllm_moe_w8.neuron_glue import kernel_launch

NEURON_CONFIG_KEY = "neuron_config"
KERNEL_MODES = ("pow2", "output-block")


@dataclass(frozen=True)
class NeuronW8Settings:
    mode: str
    mode_source: str
    self_check: bool
    self_check_experts: int
    fmt: Any  # vllm_moe_w8.vllm_glue.checkpoint_format.CheckpointFormat
    lnc: int
    swiglu_limit: float = 0.0


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
    return NeuronW8Settings(rt.mode, rt.mode_source, rt.self_check, rt.self_check_experts, fmt, kernel_launch.runtime_lnc(),
                            float(swiglu_limit or 0.0))
