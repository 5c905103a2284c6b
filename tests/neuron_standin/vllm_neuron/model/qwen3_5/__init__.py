"""STAND-IN: vllm_neuron/model/qwen3_5 with its MoE variant (as fork whn09/vllm-neuron @3de9ea3)."""

from .factory import Qwen3_5MoeForConditionalGeneration

__all__ = ["Qwen3_5MoeForConditionalGeneration"]
