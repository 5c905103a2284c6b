"""STAND-IN: vllm_neuron/model/qwen3_5/flags.py (fork whn09/vllm-neuron @7ea9927, the stored version): sequence
parallelism is on unless ``VLLM_NEURON_QWEN35_DISABLE_SP=1``, read once at import (it shapes the compiled graph)."""

import os

SEQUENCE_PARALLEL = os.environ.get("VLLM_NEURON_QWEN35_DISABLE_SP") != "1"
