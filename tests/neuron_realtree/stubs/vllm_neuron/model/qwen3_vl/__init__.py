"""STUB (real-tree mode, tests only): the qwen3_vl family that the real model/registry.py imports beside the families under
test. Not part of the tree (outside neuron-w8); each class is a placeholder so the registry lists what it lists."""


class Qwen3VLForConditionalGeneration:
    """Placeholder for vllm_neuron.model.qwen3_vl.Qwen3VLForConditionalGeneration (not read)."""
