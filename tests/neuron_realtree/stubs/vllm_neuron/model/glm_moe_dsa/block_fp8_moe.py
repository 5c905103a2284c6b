"""STUB (real-tree mode, tests only): replaces jinhuang12/vllm-neuron ``model/glm_moe_dsa/block_fp8_moe.py`` @7d00445
(its selective block-FP8 MoE NKI kernel: needs Neuron hardware; the fork runs it only on a Neuron device with
GLM_ENABLE_EXPERIMENTAL_SELECTIVE_FP8_MOE=1, and neuron-w8 replaces the bank that calls it)."""

from _placeholder import Placeholder

selective_block_fp8_moe_nki = Placeholder("glm_moe_dsa.block_fp8_moe.selective_block_fp8_moe_nki")
