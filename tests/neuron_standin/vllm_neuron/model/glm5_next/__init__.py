"""STAND-IN: vllm_neuron/model/glm5_next (exports the factory, as fork jinhuang12/vllm-neuron __init__.py @b097661)."""

from .factory import Glm5NextForConditionalGeneration

__all__ = ["Glm5NextForConditionalGeneration"]
