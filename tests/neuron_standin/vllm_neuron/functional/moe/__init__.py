"""STAND-IN: vllm_neuron/functional/moe (package marker)."""
