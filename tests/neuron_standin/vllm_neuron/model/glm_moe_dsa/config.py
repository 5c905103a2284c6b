"""STAND-IN: vllm_neuron/model/glm_moe_dsa/config.py (fork @41758812) GlmMoeDsaConfig.from_configs.

As the fork: the HF config is a transformers ``PretrainedConfig`` (``to_dict()``), a dict or a path to a
config.json - anything else is a TypeError (the runner hands a PretrainedConfig; a test namespace is refused there
too); ``architectures`` must name ``GlmMoeDsaForCausalLM``; the block-FP8 ``quantization_config`` (or, when the
launcher cleared it, ``glm52_checkpoint_quantization_config``) is pinned; ``_EXPECTED_VALUES`` pins the released
GLM-5 (sizes and layout alike), read at construction: tests relax its size entries only (tests/_glue_families.py).
The fields are the fork's, so the attention and indexer shapes it builds are the fork's."""

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import torch


@dataclass
class GlmMoeDsaConfig:
    model_type: str = "glm_moe_dsa"
    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    num_nextn_predict_layers: int = 1
    num_attention_heads: int = 64
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    hidden_act: str = "silu"
    first_k_dense_replace: int = 3
    index_topk: int = 2048
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-5
    rope_parameters: dict = field(default_factory=dict)
    quantization_config: dict = field(default_factory=dict)
    torch_dtype: torch.dtype = torch.bfloat16
    neuron_config: Any = None

    _EXPECTED_ARCHITECTURE: ClassVar[str] = "GlmMoeDsaForCausalLM"
    _CHECKPOINT_QUANTIZATION_FIELD: ClassVar[str] = "glm52_checkpoint_quantization_config"
    _EXPECTED_VALUES: ClassVar[dict] = {
        "model_type": "glm_moe_dsa", "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
        "moe_intermediate_size": 2048, "num_attention_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512,
        "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "num_hidden_layers": 78,
        "num_nextn_predict_layers": 1, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "hidden_act": "silu", "first_k_dense_replace": 3,
        "index_topk": 2048, "max_position_embeddings": 1048576,
    }
    _EXPECTED_QUANTIZATION: ClassVar[dict] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                              "weight_block_size": [128, 128]}

    def __post_init__(self):
        bad = [f"{k}={getattr(self, k)!r} (expected {v!r})" for k, v in self._EXPECTED_VALUES.items()
               if getattr(self, k) != v]
        if bad:
            raise ValueError("Unsupported GLM-5.2 architecture values: " + ", ".join(bad))
        if self.torch_dtype is not torch.bfloat16:
            raise ValueError(f"GLM-5.2 requires torch_dtype=torch.bfloat16; got {self.torch_dtype!r}")

    @property
    def main_layer_indices(self):
        return tuple(range(self.num_hidden_layers))

    @property
    def mtp_layer_indices(self):
        return tuple(range(self.num_hidden_layers, self.num_hidden_layers + self.num_nextn_predict_layers))

    @classmethod
    def from_configs(cls, hf_config, neuron_config=None):
        d = cls._as_dict(hf_config)
        if cls._EXPECTED_ARCHITECTURE not in (d.get("architectures") or []):
            raise ValueError(f"GLM-5.2 requires architectures to contain {cls._EXPECTED_ARCHITECTURE!r}")
        quant = d.get("quantization_config")
        if quant is None:
            quant = d.get(cls._CHECKPOINT_QUANTIZATION_FIELD)
        if not isinstance(quant, dict):
            raise TypeError("GLM-5.2 requires the pinned FP8 quantization_config mapping")
        bad = [f"{k}={quant.get(k)!r} (expected {v!r})" for k, v in cls._EXPECTED_QUANTIZATION.items() if quant.get(k) != v]
        if bad:
            raise ValueError("Unsupported GLM-5.2 quantization_config: " + ", ".join(bad))
        names = {f.name for f in fields(cls)}
        kept = {k: v for k, v in d.items() if k in names}
        kept["quantization_config"] = quant
        if "torch_dtype" not in kept and "dtype" in d:
            kept["torch_dtype"] = d["dtype"]
        if isinstance(kept.get("torch_dtype"), str):
            kept["torch_dtype"] = getattr(torch, kept["torch_dtype"])
        kept["neuron_config"] = neuron_config
        return cls(**kept)

    @staticmethod
    def _as_dict(hf_config) -> dict:
        from transformers import PretrainedConfig

        if isinstance(hf_config, (str, Path)):
            return json.loads(Path(hf_config).read_text())
        if isinstance(hf_config, PretrainedConfig):
            return hf_config.to_dict()
        if isinstance(hf_config, dict):
            return dict(hf_config)
        raise TypeError(f"Unsupported config type: {type(hf_config)!r}")
