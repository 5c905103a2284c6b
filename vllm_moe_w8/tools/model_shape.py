"""A MoE model's shape read from its ``config.json`` (:func:`model_shape`): layers and which are MoE, experts,
top-k, hidden and intermediate sizes, shared experts, vocabulary, and the attention layout (standard, MLA,
DSA indexer, linear attention). The memory plan (``plan``) and ``convert`` work from it. Pure dict
reading: imports neither torch nor vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_moe_w8.codec.model_config import text_config


class PlanError(ValueError):
    pass


@dataclass
class ModelShape:
    architecture: str
    hidden: int
    layers: int
    moe_layers: list[int]
    dense_layers: list[int]
    experts: int
    top_k: int
    moe_intermediate: int
    dense_intermediate: int
    shared_intermediate: int  # total over shared experts (0 if none)
    vocab: int
    tied_embeddings: bool
    dense_spelling: str
    attention: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    @property
    def routed_params(self) -> int:
        return len(self.moe_layers) * self.experts * 3 * self.hidden * self.moe_intermediate


def _first(cfg: dict, *keys, default=None):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def moe_layer_indices(cfg: dict) -> tuple[list[int], str]:
    """Indices of the sparse (MoE) layers and which config spelling decided it."""
    n = int(cfg["num_hidden_layers"])
    if cfg.get("mlp_layer_types"):
        types = list(cfg["mlp_layer_types"])
        if len(types) != n:
            raise PlanError(f"mlp_layer_types has {len(types)} entries but num_hidden_layers is {n}")
        return [i for i, t in enumerate(types) if t == "sparse"], "mlp_layer_types"
    if cfg.get("first_k_dense_replace") is not None:
        k = int(cfg["first_k_dense_replace"])
        freq = int(cfg.get("moe_layer_freq") or 1)
        return [i for i in range(n) if i >= k and i % freq == 0], "first_k_dense_replace"
    if cfg.get("decoder_sparse_step") is not None or cfg.get("mlp_only_layers") is not None:
        step = int(cfg.get("decoder_sparse_step") or 1)
        only = set(cfg.get("mlp_only_layers") or [])
        return [i for i in range(n) if i not in only and (i + 1) % step == 0], "mlp_only_layers + decoder_sparse_step"
    return list(range(n)), "none (every layer is MoE)"


def attention_layout(cfg: dict) -> dict[str, Any]:
    """How each layer attends: standard / MLA full-attention layers and linear-attention layers."""
    n = int(cfg["num_hidden_layers"])
    types = list(cfg.get("layer_types") or [])
    arch_type = str(cfg.get("model_type", ""))
    if not types and "qwen3_5" in arch_type or (not types and cfg.get("full_attention_interval")):
        interval = int(cfg.get("full_attention_interval") or 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if not types and "glm5_next" in arch_type:
        types = ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)]
    if not types:
        types = ["full_attention"] * n
    full = [i for i, t in enumerate(types) if t != "linear_attention"]
    linear = [i for i, t in enumerate(types) if t == "linear_attention"]
    mla = cfg.get("kv_lora_rank") is not None
    out: dict[str, Any] = {
        "kind": "mla" if mla else "gqa",
        "full_layers": len(full),
        "linear_layers": len(linear),
        "heads": int(_first(cfg, "num_attention_heads", default=0)),
    }
    if mla:
        out.update(
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0),
            qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 0),
            v_head_dim=int(cfg.get("v_head_dim") or 0),
            q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        )
        if cfg.get("index_head_dim") or "dsa" in arch_type or "glm5_next" in arch_type:
            itypes = list(cfg.get("indexer_types") or [])
            indexed = [i for i in full if not itypes or itypes[i] == "full"]
            out.update(index_head_dim=int(cfg.get("index_head_dim") or 128), index_n_heads=int(cfg.get("index_n_heads") or 32),
                       indexer_layers=len(indexed))
    else:
        heads = out["heads"]
        out.update(
            kv_heads=int(_first(cfg, "num_key_value_heads", default=heads)),
            head_dim=int(_first(cfg, "head_dim", default=(int(cfg["hidden_size"]) // heads) if heads else 0)),
            gated_q="qwen3_5" in arch_type or "qwen3_next" in arch_type,
        )
    if linear:
        if cfg.get("linear_num_value_heads") is not None:  # Qwen3.5 / Qwen3-Next Gated DeltaNet
            out["linear"] = dict(
                kind="gated-deltanet",
                key_heads=int(cfg["linear_num_key_heads"]), value_heads=int(cfg["linear_num_value_heads"]),
                key_dim=int(cfg["linear_key_head_dim"]), value_dim=int(cfg["linear_value_head_dim"]),
                conv_kernel=int(cfg.get("linear_conv_kernel_dim") or 4),
            )
        else:  # GLM KDA
            h = int(cfg.get("linear_num_heads") or 64)
            d = int(cfg.get("linear_head_dim") or 128)
            out["linear"] = dict(kind="kda", key_heads=h, value_heads=h, key_dim=d, value_dim=d,
                                 conv_kernel=int(cfg.get("linear_conv_kernel_dim") or 4))
    return out


def model_shape(config: dict) -> ModelShape:
    cfg = text_config(config)
    archs = config.get("architectures") or cfg.get("architectures") or ["?"]
    missing = [k for k in ("hidden_size", "num_hidden_layers", "moe_intermediate_size") if cfg.get(k) is None]
    experts = _first(cfg, "num_experts", "n_routed_experts", "num_local_experts")
    if missing or experts is None:
        raise PlanError(f"config is not a supported MoE config: missing {missing + ([] if experts else ['num_experts/n_routed_experts'])}")
    moe, spelling = moe_layer_indices(cfg)
    n = int(cfg["num_hidden_layers"])
    shared = 0
    if cfg.get("shared_expert_intermediate_size"):
        shared = int(cfg["shared_expert_intermediate_size"])
    elif cfg.get("n_shared_experts"):
        shared = int(cfg["n_shared_experts"]) * int(cfg["moe_intermediate_size"])
    return ModelShape(
        architecture=archs[0],
        hidden=int(cfg["hidden_size"]),
        layers=n,
        moe_layers=moe,
        dense_layers=[i for i in range(n) if i not in set(moe)],
        experts=int(experts),
        top_k=int(_first(cfg, "num_experts_per_tok", "moe_topk", default=0)),
        moe_intermediate=int(cfg["moe_intermediate_size"]),
        dense_intermediate=int(cfg.get("intermediate_size") or 0),
        shared_intermediate=shared,
        vocab=int(cfg.get("vocab_size") or 0),
        tied_embeddings=bool(config.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
        dense_spelling=spelling,
        attention=attention_layout(cfg),
    )
