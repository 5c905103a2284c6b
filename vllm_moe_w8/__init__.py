"""vllm-moe-w8: serve FP8 MoE checkpoints with 1-byte experts (Trainium2 NKI kernels; exact torch path elsewhere).

``import vllm_moe_w8`` is deliberately light: it imports neither vLLM nor torch. vLLM calls
:func:`register` through the ``vllm.general_plugins`` entry point, once in every process it starts.
"""

__version__ = "0.1.0"

QUANTIZATION_NAME = "neuron-w8"

_registered = False


def register() -> None:
    """Register the ``neuron-w8`` quantization method with vLLM (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm_moe_w8.vllm_glue.register import register_with_vllm  # heavy imports stay inside

    register_with_vllm()
    _registered = True
