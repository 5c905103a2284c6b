"""vllm-moe-w8: serve FP8 MoE checkpoints with 1-byte experts (Trainium2 NKI kernels; exact torch path elsewhere).

``import vllm_moe_w8`` is deliberately light: it imports neither vLLM nor torch. vLLM calls
:func:`register` through the ``vllm.general_plugins`` entry point, once in every process it starts.

The package is a house of rooms in the order the data flows (DEVELOPING.md draws it): ``codec`` (FP8 formats,
repack, the checkpoint reader), ``vllm_glue`` (the quantization config and layer methods vLLM calls),
``neuron_glue`` (the one room that imports AWS's Neuron packages), ``op`` (the ``moe_w8::fused_moe`` custom
op and its CPU implementation), with ``kernels`` (NKI kernels) below, and beside them ``tools`` (the
``vllm-moe-w8`` command) and ``tiny_models`` (the tiny-checkpoint writer the demo and tests use).
"""

from vllm_moe_w8.about import QUANTIZATION_NAME, __version__

__all__ = ["QUANTIZATION_NAME", "__version__", "register"]

_registered = False


def register() -> None:
    """Register the ``neuron-w8`` quantization method with vLLM (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm_moe_w8.vllm_glue.register import register_with_vllm  # heavy imports stay inside

    register_with_vllm()
    _registered = True
