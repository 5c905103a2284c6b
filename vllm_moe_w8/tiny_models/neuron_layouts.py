"""Tiny checkpoints in the layouts vllm-neuron's GLM code accepts (``write_checkpoint(..., layout="vllm-neuron")``).

The fork jinhuang12/vllm-neuron checks a GLM-5 checkpoint against a pinned *contract*. Some of its pins are about
size (118,629 index keys, hidden 6144, 256 experts, TP 64: a tiny model relaxes exactly those, in the tests), the
others about layout, which a tiny checkpoint can honour as it is. This module writes the layout ones as the fork
states them (DEVELOPING.md, "vllm-neuron interfaces we use", pins the files):

GLM-5 (``model/glm_moe_dsa``: ``weight_loaders.py`` key grammar and ``GlmMoeDsaCheckpointContract``, ``model.py``,
``attention.py``, ``indexer.py``, ``cache.py``):

* layers ``0 .. first_k_dense_replace - 1`` (3, the contract's value) are dense MLP layers, the rest MoE layers
  (router, routed experts, shared expert); a dense tensor on a MoE layer or an expert tensor on a dense one is an
  ``UnexpectedCheckpointKey`` there;
* indexer tensors (``self_attn.indexer.{wq_b,wk,k_norm,weights_proj}``) only on the contract's indexer layers
  ``(0, 1, 2, 6, 10, ...)``, with the fork's indexer shape: 32 heads of 128 (``GlmMoeDsaIndexer`` defaults), a
  LayerNorm ``k_norm`` with weight and bias;
* MLA with ``kv_lora_rank + qk_rope_head_dim = 576`` (``cache.MLA_CACHE_HEAD_SIZE``), every linear block-FP8 with an
  fp32 ``weight_scale_inv``, except ``weights_proj``, the router gate, norms, embedding and ``lm_head`` (bf16);
* outer keys exactly ``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight``; the index has
  ``metadata.total_size`` (``CheckpointIndex.from_file`` refuses an index without it);
* top-8 routing (the pinned ``num_experts_per_tok``).

GLM-5.3-Flash (``model/glm5_next``, the later stored versions: ``config.py``, ``functional/moe/router.py``):
:func:`glm5_next_config` is config.json in the layout the fork's reader accepts:

* a ``vision_config`` beside the ``text_config`` (``Glm5NextConfig.from_configs`` reads both; a text-only config is
  a KeyError there);
* top-8 routing over 8 .. 512 experts (the fork's noaux_tc router refuses any other top-k);
* ``layer_types`` one per layer from ``linear_attention`` / ``deepseek_sparse_attention``, on the fork's 3:1
  schedule (layer ``i`` is DSA iff ``i % 4 == 3``; transformers releases with huggingface/transformers#48974 rename
  the DSA entry ``indexed_attention``, which the fork's reader refuses: a tiny model of fewer than 4 layers has none);
* the block-FP8 ``quantization_config`` (``e4m3``, dynamic, 128x128).
The tensors the fork's whole model loads (KDA, MLA, mHC) were not read (its ``model_fp8.py`` is not in the real
tree); the writer of the MoE layers' tensors is the tests' (``tests/_glm5next.py``).
"""

from __future__ import annotations

from vllm_moe_w8.tiny_models.glm import glm_moe_block, mla_attention
from vllm_moe_w8.tiny_models.layout import Plan, TinySizes, embed_and_head, layer_norms

GLM5_FIRST_DENSE = 3  # GlmMoeDsaCheckpointContract.first_k_dense_replace
GLM5_INDEXER_LAYERS = (0, 1, 2, 6, 10, 14, 18, 22, 26, 30, 34, 38, 42, 46, 50, 54, 58, 62, 66, 70, 74)  # cache.py
GLM5_MLA = {"q_lora_rank": 256, "kv_lora_rank": 512, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64,
            "v_head_dim": 64, "index_n_heads": 32, "index_head_dim": 128, "index_topk": 64}

# write_checkpoint's defaults per (layout, family), before the caller's overrides.
SIZES = {
    ("vllm-neuron", "glm_moe_dsa"): TinySizes(num_hidden_layers=GLM5_FIRST_DENSE + 1, num_experts=16,
                                              num_experts_per_tok=8, moe_intermediate_size=256,
                                              intermediate_size=512, num_attention_heads=2),
}


def glm_moe_dsa(s: TinySizes, v: dict):
    """GLM-5 in the fork's layout (module docstring); the config keys the fork's ``GlmMoeDsaConfig`` reads."""
    if s.num_hidden_layers <= GLM5_FIRST_DENSE:
        raise ValueError(f"GLM-5 (vllm-neuron layout): num_hidden_layers must exceed first_k_dense_replace "
                         f"{GLM5_FIRST_DENSE} so that a MoE layer exists; got {s.num_hidden_layers}")
    p = Plan()
    embed_and_head(p, "model", s)
    for layer in range(s.num_hidden_layers):
        pre = f"model.layers.{layer}"
        layer_norms(p, pre, s.hidden_size)
        mla_attention(p, f"{pre}.self_attn", s, GLM5_MLA, indexer=layer in GLM5_INDEXER_LAYERS)
        if layer < GLM5_FIRST_DENSE:
            p.mlp(f"{pre}.mlp", s.hidden_size, s.intermediate_size)
        else:
            glm_moe_block(p, pre, s)
    mla = {k: GLM5_MLA[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                    "index_topk")}
    config = {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
        "bos_token_id": v["bos"], "eos_token_id": v["eos"], "pad_token_id": v["pad"],
        "first_k_dense_replace": GLM5_FIRST_DENSE, "hidden_act": "silu", "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size, **mla, "index_n_heads": GLM5_MLA["index_n_heads"],
        "index_head_dim": GLM5_MLA["index_head_dim"], "max_position_embeddings": 4096,
        "moe_intermediate_size": s.moe_intermediate_size, "n_group": 1, "n_routed_experts": s.num_experts,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": s.num_attention_heads,
        "num_experts_per_tok": s.num_experts_per_tok, "num_hidden_layers": s.num_hidden_layers,
        "num_key_value_heads": s.num_attention_heads, "num_nextn_predict_layers": 0, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"}, "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "tie_word_embeddings": False, "topk_group": 1,
        "torch_dtype": "bfloat16", "vocab_size": s.vocab_size,
    }
    return p, config, None


PLANS = {("vllm-neuron", "glm_moe_dsa"): glm_moe_dsa}


GLM5_NEXT_KDA, GLM5_NEXT_DSA = "linear_attention", "deepseek_sparse_attention"  # glm5_next/config.py
GLM5_NEXT_TOP_K = 8  # functional/moe/router.py NOAUX_TC_K
GLM5_NEXT_VISION = {"model_type": "glm5_next_vision", "depth": 1, "hidden_size": 64, "num_heads": 2,
                    "intermediate_size": 128, "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2,
                    "swiglu_limit": 10.0}


def glm5_next_layer_types(num_hidden_layers: int) -> list[str]:
    """The fork's 3:1 KDA/DSA schedule."""
    return [GLM5_NEXT_DSA if i % 4 == 3 else GLM5_NEXT_KDA for i in range(num_hidden_layers)]


def glm5_next_config(text: dict, weight_block_size=(128, 128), modules_to_not_convert=("lm_head", "mlp.gate")) -> dict:
    """config.json of a tiny GLM-5.3-Flash in the layout the fork's reader accepts (module docstring). ``text``: the
    text_config fields (sizes, routing, ``swiglu_limit``...); ``num_experts_per_tok`` must be 8."""
    text = dict(text)
    if int(text.get("num_experts_per_tok", GLM5_NEXT_TOP_K)) != GLM5_NEXT_TOP_K:
        raise ValueError(f"GLM-5.3-Flash (vllm-neuron layout): the fork's router selects exactly {GLM5_NEXT_TOP_K} "
                         f"experts per token; got num_experts_per_tok {text['num_experts_per_tok']}")
    text.setdefault("num_experts_per_tok", GLM5_NEXT_TOP_K)
    text.setdefault("layer_types", glm5_next_layer_types(int(text["num_hidden_layers"])))
    text.setdefault("model_type", "glm5_next_text")
    vision = dict(GLM5_NEXT_VISION, out_hidden_size=int(text["hidden_size"]))
    return {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next", "text_config": text,
            "vision_config": vision, "tie_word_embeddings": False,
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": list(weight_block_size),
                                    "modules_to_not_convert": list(modules_to_not_convert)}}
