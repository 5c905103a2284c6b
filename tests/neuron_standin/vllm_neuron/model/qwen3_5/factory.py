"""STAND-IN: vllm_neuron/model/qwen3_5/factory.py (from_configs(hf_config, text_neuron_config, vision_neuron_config))."""

import torch.nn as nn


class Qwen3_5ForConditionalGeneration(nn.Module):
    @classmethod
    def from_configs(cls, hf_config, text_neuron_config=None, vision_neuron_config=None):
        from .model import Qwen3_5ForCausalLM

        return Qwen3_5ForCausalLM.from_configs(hf_config, text_neuron_config=text_neuron_config)


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    pass
