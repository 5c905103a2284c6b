"""STAND-IN: vllm_neuron/model/glm_moe_dsa (fork jinhuang12/vllm-neuron, ``__init__.py`` @3a1e231: the same exports)."""

from .config import GlmMoeDsaConfig
from .factory import GlmMoeDsaForCausalLM
from .mlp import GlmMoeDsaSwiGLUMLP
from .moe import GlmMoeDsaMoE, GlmMoeDsaNoAuxRouter, GlmMoeDsaRoutedExperts

__all__ = ["GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", "GlmMoeDsaMoE", "GlmMoeDsaNoAuxRouter",
           "GlmMoeDsaRoutedExperts", "GlmMoeDsaSwiGLUMLP"]
