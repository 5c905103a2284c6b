"""STAND-IN: vllm_neuron/model/qwen3_moe/factory.py (from_configs picks the BF16 implementation)."""

import torch.nn as nn


class Qwen3MoeForCausalLM(nn.Module):
    @classmethod
    def from_configs(cls, hf_config, neuron_config):
        from .model_bf16 import Qwen3MoeForCausalLM as Model

        return Model.from_configs(hf_config, neuron_config)
