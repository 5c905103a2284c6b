"""STUB (real-tree mode, tests only): replaces ``vllm_neuron.functional.moe.router`` (the NKI router kernel wrapper:
needs Neuron hardware). Only the name the read files import, ``RouterComputationOrder``: an enum whose members are
labelled placeholders (whn09 qwen3_5/moe.py names ``PRENORM_LINEAR_ACT_TOPK_RENORM_SCATTER`` in its forward, which
neuron-w8 replaces)."""

from _placeholder import Placeholder

RouterComputationOrder = Placeholder("vllm_neuron.functional.moe.router.RouterComputationOrder")
