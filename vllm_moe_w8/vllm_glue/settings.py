"""The ``neuron-w8`` runtime settings: one frozen :class:`RuntimeSettings` per MoE layer.

Resolved by :func:`runtime_settings` from, in order of precedence, vLLM's
``--additional-config '{"neuron_w8": {...}}'``, the environment, the checkpoint's ``quantization_config``,
and the defaults (DEVELOPING.md, "Plugin settings"). The config (``quant_config``) resolves them and
passes them to the methods, which never import the config.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from vllm_moe_w8.codec import fp8
from vllm_moe_w8.vllm_glue.checkpoint_format import CheckpointFormat

AUTO_ENV = "VLLM_MOE_W8_AUTO"

ADDITIONAL_CONFIG_KEY = "neuron_w8"
# non_expert_layers: read by the Neuron glue only (neuron_glue.settings); accepted here so one launch line serves both
SETTINGS_DEFAULTS = {"mode": None, "self_check": True, "self_check_experts": 3, "non_expert_layers": None}
MODE_ENV = "VLLM_MOE_W8_MODE"
SELF_CHECK_ENV = "VLLM_MOE_W8_SELF_CHECK"


@dataclass(frozen=True)
class RuntimeSettings:
    """Resolved user settings. ``mode`` is final (None never escapes :func:`runtime_settings`)."""

    mode: str
    mode_source: str
    self_check: bool
    self_check_experts: int


def _as_bool(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"neuron-w8: {what} must be true or false, got {value!r}")


def user_settings(additional_config: Any = None) -> dict:
    """The ``neuron_w8`` section of vLLM's additional_config (validated keys), or {}."""
    if additional_config is None:
        try:
            from vllm.config import get_current_vllm_config_or_none

            vc = get_current_vllm_config_or_none()
            additional_config = getattr(vc, "additional_config", None) if vc is not None else None
        except ImportError:  # pragma: no cover - vLLM without this helper
            additional_config = None
    section = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY, {}) if isinstance(additional_config, dict) else {}
    if not isinstance(section, dict):
        raise ValueError(f"neuron-w8: additional_config[{ADDITIONAL_CONFIG_KEY!r}] must be an object, got {section!r}")
    unknown = sorted(set(section) - set(SETTINGS_DEFAULTS))
    if unknown:
        raise ValueError(
            f"neuron-w8: unknown additional_config[{ADDITIONAL_CONFIG_KEY!r}] key(s) {unknown}; known keys: "
            f"{sorted(SETTINGS_DEFAULTS)} (automatic claiming is the environment variable {AUTO_ENV}=1: vLLM picks the "
            "quantization method before additional_config is available)"
        )
    return section


def runtime_settings(fmt: CheckpointFormat, additional_config: Any = None) -> RuntimeSettings:
    """Mode and self-check settings, by precedence: additional_config > environment > checkpoint > default.

    A converted checkpoint's mode is fixed (its codes are already in that mode's format): asking for
    another one is an error.
    """
    section = user_settings(additional_config)
    if section.get("mode") is not None:
        mode, source = section["mode"], f"additional_config {ADDITIONAL_CONFIG_KEY}.mode"
    elif os.environ.get(MODE_ENV):
        mode, source = os.environ[MODE_ENV].strip(), f"environment {MODE_ENV}"
    elif fmt.converted:
        mode, source = fmt.mode, "converted checkpoint"
    elif fmt.checkpoint_mode is not None:
        mode, source = fmt.checkpoint_mode, "checkpoint quantization_config.mode"
    else:
        mode, source = "pow2", "default"
    if mode not in fp8.MODES:
        raise ValueError(f"neuron-w8: mode {mode!r} (from {source}) unknown; choose one of {', '.join(fp8.MODES)}")
    if fmt.converted and mode != fmt.mode:
        raise ValueError(
            f"neuron-w8: the checkpoint was converted with mode {fmt.mode!r}, but {source} asks for {mode!r}; "
            "a converted checkpoint's codes are final: drop the setting or convert the original FP8 checkpoint again"
        )
    self_check = section.get("self_check")
    if self_check is None:
        self_check = os.environ.get(SELF_CHECK_ENV, "1")
    n = int(section.get("self_check_experts", SETTINGS_DEFAULTS["self_check_experts"]))
    if n < 0:
        raise ValueError(f"neuron-w8: self_check_experts must be >= 0, got {n}")
    return RuntimeSettings(mode, source, _as_bool(self_check, "self_check"), n)


def auto_enabled() -> bool:
    """Whether the environment opts in to claiming supported FP8 checkpoints without ``--quantization``."""
    return os.environ.get(AUTO_ENV, "").strip().lower() in ("1", "true", "yes", "on")
