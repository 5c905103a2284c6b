"""STAND-IN: the one behaviour of vllm_neuron/model/qwen3_5/config.py the glue relies on (fork whn09/vllm-neuron
@3de9ea3, ``Qwen3_5Config.from_hf``): the text decoder is read from the HF config's nested ``text_config``, and a
config without one (the flat config.json of a text-only ``Qwen3_5MoeForCausalLM`` checkpoint) raises ValueError
"Qwen3.5 config is missing text_config". Only the MoE fields the stand-in block reads are kept."""

from dataclasses import dataclass
from types import SimpleNamespace

import torch

TEXT_FIELDS = ("hidden_size", "num_hidden_layers", "moe_intermediate_size", "shared_expert_intermediate_size",
               "rms_norm_eps", "num_experts", "num_experts_per_tok")


@dataclass
class Qwen3_5Config:
    text_config: SimpleNamespace

    @classmethod
    def from_hf(cls, hf_config):
        text_cfg = getattr(hf_config, "text_config", None)
        if text_cfg is None:
            raise ValueError("Qwen3.5 config is missing text_config")
        return cls(SimpleNamespace(**{f: getattr(text_cfg, f) for f in TEXT_FIELDS}, torch_dtype=torch.bfloat16))
