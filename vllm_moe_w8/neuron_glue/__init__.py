"""neuron-w8 where vLLM really runs on Trainium: inside vllm-neuron (its own model classes, not vLLM's).

Modules: ``interfaces`` (every vllm-neuron name we rely on, the generation/version checks and their
refusals), ``settings`` (selection and options, vllm-neuron's way), ``loaders`` (experts from the FP8
checkpoint in vllm-neuron's TP/EP conventions; other FP8 tensors dequantised), ``experts`` (the
1-byte experts module adopted into vllm-neuron's MoE blocks), ``registration`` (platform and factory
wrapping), ``kernel_launch`` (the NKI kernels launched with ``wrap_nki`` on a Neuron device, in the
interpreter elsewhere), ``kernel_check`` / ``neuron_check`` (the first-run check).

It is the one room that imports AWS's Neuron packages (``nki``, ``torch_neuronx``, ``libtorch_neuronx_lite``,
``vllm_neuron``, ``nkilib``), always lazily or behind an import guard, so importing it on a host without them is
harmless. It may import torch, ``vllm_moe_w8.kernels``, the codec, the op's reference and the vLLM-glue pieces the
Neuron path shares with vLLM's own (checkpoint format, settings, self-check); vLLM only lazily, at registration.
The vLLM glue never imports it (only the package's ``register()`` does).
"""

from __future__ import annotations

import importlib.util


def on_neuron_platform() -> bool:
    """True when vLLM's current platform is vllm-neuron's (imports vLLM only if vllm-neuron is installed)."""
    if importlib.util.find_spec("vllm_neuron") is None:
        return False
    from vllm.platforms import current_platform

    return type(current_platform).__module__.startswith("vllm_neuron")


def register_on_neuron() -> None:
    """The Neuron half of ``vllm_moe_w8.register()``: see :mod:`vllm_moe_w8.neuron_glue.registration`."""
    from vllm.platforms import current_platform

    from vllm_moe_w8.neuron_glue.registration import install

    install(type(current_platform))
