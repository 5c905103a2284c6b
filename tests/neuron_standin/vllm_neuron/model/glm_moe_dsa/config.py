"""STAND-IN: vllm_neuron/model/glm_moe_dsa/config.py (fork @41758812) GlmMoeDsaConfig.from_configs.

The fork pins the real GLM-5 shape (``_EXPECTED_VALUES``: hidden 6144, 256 experts of I 2048, top-8, ...) and the
checkpoint's block-FP8 ``quantization_config`` and refuses anything else; so does this stand-in. Tests of tiny models
relax ``_EXPECTED_VALUES`` explicitly (the pin is the fork's, the tiny sizes are ours). Only the fields the MoE path
reads are kept (no attention, indexer or rope fields)."""

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch


@dataclass
class GlmMoeDsaConfig:
    model_type: str = "glm_moe_dsa"
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
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
    rms_norm_eps: float = 1e-5
    quantization_config: dict = field(default_factory=dict)
    torch_dtype: torch.dtype = torch.bfloat16
    neuron_config: Any = None

    _EXPECTED_ARCHITECTURE: ClassVar[str] = "GlmMoeDsaForCausalLM"
    _EXPECTED_VALUES: ClassVar[dict] = {
        "model_type": "glm_moe_dsa", "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048,
        "num_hidden_layers": 78, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "hidden_act": "silu", "first_k_dense_replace": 3,
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

    @classmethod
    def from_configs(cls, hf_config, neuron_config=None):
        d = cls._as_dict(hf_config)
        if cls._EXPECTED_ARCHITECTURE not in (d.get("architectures") or []):
            raise ValueError(f"GLM-5.2 requires architectures to contain {cls._EXPECTED_ARCHITECTURE!r}")
        quant = d.get("quantization_config")
        if not isinstance(quant, dict):
            raise TypeError("GLM-5.2 requires the pinned FP8 quantization_config mapping")
        bad = [f"{k}={quant.get(k)!r} (expected {v!r})" for k, v in cls._EXPECTED_QUANTIZATION.items() if quant.get(k) != v]
        if bad:
            raise ValueError("Unsupported GLM-5.2 quantization_config: " + ", ".join(bad))
        names = {f.name for f in fields(cls)}
        kept = {k: v for k, v in d.items() if k in names}
        kept["quantization_config"] = quant
        dtype = kept.get("torch_dtype", d.get("dtype"))
        kept["torch_dtype"] = getattr(torch, dtype) if isinstance(dtype, str) else (dtype or torch.bfloat16)
        kept["neuron_config"] = neuron_config
        return cls(**kept)

    @staticmethod
    def _as_dict(hf_config) -> dict:
        """The fork takes a PretrainedConfig (``to_dict()``), a dict or a path; the stand-in also the tests' namespace."""
        if isinstance(hf_config, dict):
            return dict(hf_config)
        if hasattr(hf_config, "to_dict"):
            return hf_config.to_dict()
        return dict(vars(hf_config))
