"""STAND-IN: vllm_neuron/model/qwen3_moe (exports the factory, as upstream @b1873d6)."""

from . import model_bf16  # noqa: F401
from .factory import Qwen3MoeForCausalLM

__all__ = ["Qwen3MoeForCausalLM"]
