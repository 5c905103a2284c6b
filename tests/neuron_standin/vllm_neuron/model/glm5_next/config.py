"""STAND-IN: vllm_neuron/model/glm5_next/config.py (fork jinhuang12/vllm-neuron, the latest stored version,
@03352e0): the config reader the model builds from, with the fork's contract.

* ``Glm5NextConfig.from_configs(hf_config, text_neuron_config, vision_neuron_config)`` takes a transformers
  ``PretrainedConfig`` (its ``to_dict()``), a dict or a path to config.json, and nothing else (TypeError); it reads
  ``top_level["text_config"]`` and ``top_level["vision_config"]``: a config without a vision_config is a KeyError.
* Each sub-config keeps only the fields it declares (the rest dropped; ``dtype`` -> ``torch_dtype``), with the
  released checkpoint's defaults (288 experts, top-8, ``swiglu_limit`` 10.0, ``rms_norm_eps`` 1e-5, 45 layers...).
* ``Glm5NextTextConfig`` validates ``layer_types`` (one per layer, only ``KDA_LAYER_TYPE`` / ``DSA_LAYER_TYPE``
  compared by equality; none given: the 3:1 schedule) and the expert counts (>= 1 routed, top-k >= 1, shared >= 0).
  transformers releases with huggingface/transformers#48974 rename ``deepseek_sparse_attention`` to
  ``indexed_attention`` in every config, which this check refuses (the fork cites transformers 5.16.1).
Only the fields the stand-in reads, or the fork's contract checks, are declared."""

import json
import logging
from dataclasses import dataclass, field, fields

import torch
from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

KDA_LAYER_TYPE = "linear_attention"
DSA_LAYER_TYPE = "deepseek_sparse_attention"


class Glm5NextExpertConfigError(ValueError):
    pass


def default_layer_types(n: int) -> list:
    return [DSA_LAYER_TYPE if i % 4 == 3 else KDA_LAYER_TYPE for i in range(n)]


def _sub_config(cls, hf_sub_config, neuron_config=None):
    if isinstance(hf_sub_config, PretrainedConfig):
        values = hf_sub_config.to_dict()
    elif isinstance(hf_sub_config, dict):
        values = hf_sub_config
    else:
        raise TypeError(f"Unsupported config type: {type(hf_sub_config)}")
    names = {f.name for f in fields(cls)}
    kept = {k: v for k, v in values.items() if k in names}
    if "torch_dtype" not in kept and "dtype" in values and "torch_dtype" in names:
        kept["torch_dtype"] = values["dtype"]
    if isinstance(kept.get("torch_dtype"), str):
        kept["torch_dtype"] = getattr(torch, kept["torch_dtype"])
    dropped = sorted(set(values) - names - {"dtype"})
    if dropped:
        logger.warning("%s drops %d keys: %s", cls.__name__, len(dropped), ", ".join(dropped))
    if neuron_config is not None:
        kept["neuron_config"] = neuron_config
    return cls(**kept)


@dataclass
class Glm5NextTextConfig:
    num_hidden_layers: int = 45
    hidden_size: int = 4096
    torch_dtype: torch.dtype = torch.bfloat16
    tie_word_embeddings: bool = False
    first_k_dense_replace: int = 3
    layer_types: list | None = None
    n_routed_experts: int = 288
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 2048
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-05
    neuron_config: object = None

    def __post_init__(self):
        if self.layer_types is None:
            self.layer_types = default_layer_types(self.num_hidden_layers)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                             f"{self.num_hidden_layers}")
        unknown = sorted({t for t in self.layer_types if t not in (KDA_LAYER_TYPE, DSA_LAYER_TYPE)})
        if unknown:
            raise ValueError(f"layer_types carries unrecognised attention families {unknown}; expected only "
                             f"{KDA_LAYER_TYPE!r} and {DSA_LAYER_TYPE!r}")
        if int(self.n_routed_experts) < 1:
            raise Glm5NextExpertConfigError(f"n_routed_experts must be >= 1, got {self.n_routed_experts}")
        if int(self.num_experts_per_tok) < 1:
            raise Glm5NextExpertConfigError(f"num_experts_per_tok must be >= 1, got {self.num_experts_per_tok}")
        if int(self.n_shared_experts) < 0:
            raise Glm5NextExpertConfigError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")


@dataclass
class Glm5NextVisionConfig:
    depth: int = 24
    hidden_size: int = 1024
    num_heads: int = 16
    intermediate_size: int = 4096
    out_hidden_size: int = 4096
    swiglu_limit: float = 10.0
    neuron_config: object = None


@dataclass
class Glm5NextConfig:
    text_config: Glm5NextTextConfig | None = None
    vision_config: Glm5NextVisionConfig | None = None
    tie_word_embeddings: bool = False
    weight_block_size: list | None = field(default_factory=lambda: [128, 128])

    @classmethod
    def from_configs(cls, hf_config, text_neuron_config=None, vision_neuron_config=None):
        if isinstance(hf_config, (str, bytes)):
            with open(hf_config) as f:
                top = json.load(f)
        elif isinstance(hf_config, PretrainedConfig):
            top = hf_config.to_dict()
        elif isinstance(hf_config, dict):
            top = hf_config
        else:
            raise TypeError(f"Unsupported hf_config type: {type(hf_config)}")
        text = _sub_config(Glm5NextTextConfig, top["text_config"], text_neuron_config)
        vision = _sub_config(Glm5NextVisionConfig, top["vision_config"], vision_neuron_config)
        text.tie_word_embeddings = top.get("tie_word_embeddings", False)
        quant = top.get("quantization_config") or {}
        return cls(text, vision, text.tie_word_embeddings, quant.get("weight_block_size"))
