"""STAND-IN: vllm_neuron/model/qwen3_5/flags.py."""

SEQUENCE_PARALLEL = True
