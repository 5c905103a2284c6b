"""vllm-moe-w8: serve FP8 MoE checkpoints with 1-byte experts (Trainium2 NKI kernels; exact torch path elsewhere).

``import vllm_moe_w8`` is deliberately light: it imports neither vLLM nor torch. vLLM calls
:func:`register` through the ``vllm.general_plugins`` entry point, once in every process it starts.
"""

__version__ = "0.1.0"

QUANTIZATION_NAME = "neuron-w8"

_registered = False


def register() -> None:
    """Register the ``neuron-w8`` quantization method with vLLM (idempotent).

    On vllm-neuron's platform (vLLM 0.24 there) the name is registered for vLLM's checks and the
    Neuron glue takes over (:mod:`vllm_moe_w8.neuron_glue`); elsewhere the vLLM-generic MoE method
    serves it (vLLM 0.32).
    """
    global _registered
    if _registered:
        return
    from vllm_moe_w8.neuron_glue import on_neuron_platform  # heavy imports stay inside
    from vllm_moe_w8.vllm_plugin import register_with_vllm

    if on_neuron_platform():
        from vllm_moe_w8.neuron_glue import register_on_neuron

        register_with_vllm(neuron=True)
        register_on_neuron()
    else:
        register_with_vllm()
    _registered = True
