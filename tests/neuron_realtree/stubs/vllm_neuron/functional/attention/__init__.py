"""STUB package marker (real-tree mode): vllm_neuron.functional.attention (Neuron kernel wrappers)."""
