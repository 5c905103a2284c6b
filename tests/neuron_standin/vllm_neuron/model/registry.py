"""STAND-IN: vllm_neuron/model/registry.py (get_models() -> [(architecture, factory class)])."""


def get_models():
    from .glm5_next import Glm5NextForConditionalGeneration
    from .glm_moe_dsa import GlmMoeDsaForCausalLM
    from .qwen3_5 import Qwen3_5MoeForConditionalGeneration
    from .qwen3_moe import Qwen3MoeForCausalLM

    return [("Qwen3MoeForCausalLM", Qwen3MoeForCausalLM),
            ("Qwen3_5MoeForConditionalGeneration", Qwen3_5MoeForConditionalGeneration),
            ("Glm5NextForConditionalGeneration", Glm5NextForConditionalGeneration),
            ("GlmMoeDsaForCausalLM", GlmMoeDsaForCausalLM)]  # fork jinhuang12/vllm-neuron model/registry.py @3a1e231
