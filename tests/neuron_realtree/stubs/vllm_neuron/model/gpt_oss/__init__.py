"""STUB (real-tree mode, tests only): the gpt_oss family that the real model/registry.py imports beside the families under
test. Not part of the tree (outside neuron-w8); each class is a placeholder so the registry lists what it lists."""


class GptOssForCausalLM:
    """Placeholder for vllm_neuron.model.gpt_oss.GptOssForCausalLM (not read)."""
