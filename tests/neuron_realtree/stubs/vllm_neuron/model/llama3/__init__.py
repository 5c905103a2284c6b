"""STUB (real-tree mode, tests only): the llama3 family that the real model/registry.py imports beside the families under
test. Not part of the tree (outside neuron-w8); each class is a placeholder so the registry lists what it lists."""


class Eagle3LlamaForCausalLM:
    """Placeholder for vllm_neuron.model.llama3.Eagle3LlamaForCausalLM (not read)."""

class LlamaForCausalLM:
    """Placeholder for vllm_neuron.model.llama3.LlamaForCausalLM (not read)."""
