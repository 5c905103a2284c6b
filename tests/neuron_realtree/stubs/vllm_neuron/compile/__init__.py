"""STUB package marker (real-tree mode): vllm_neuron/compile."""
