"""The GLM families: GLM-4.x MoE (``Glm4MoeForCausalLM``: sigmoid routing with e_score_correction_bias,
dense first layer, shared experts) and GLM-5 (``GlmMoeDsaForCausalLM``: DeepSeek-V3.2 MLA + DSA indexer):
tensor plans and ``config.json``.
"""

from __future__ import annotations

from vllm_moe_w8.tiny_models.layout import Plan, TinySizes, embed_and_head, gqa_attention, layer_norms

# ---- GLM-4.x MoE (sigmoid + e_score_correction_bias, dense first layer, shared experts) -------


def glm4_moe(s: TinySizes, v: dict):
    p = Plan()
    embed_and_head(p, "model", s)
    first_dense = 1
    for L in range(s.num_hidden_layers):
        pre = f"model.layers.{L}"
        layer_norms(p, pre, s.hidden_size)
        gqa_attention(p, f"{pre}.self_attn", s, bias=True, qk_norm=False)
        if L < first_dense:
            p.mlp(f"{pre}.mlp", s.hidden_size, s.intermediate_size)
        else:
            glm_moe_block(p, pre, s)
    config = {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "attention_bias": True,
        "attention_dropout": 0.0,
        "bos_token_id": v["bos"],
        "eos_token_id": v["eos"],
        "pad_token_id": v["pad"],
        "first_k_dense_replace": first_dense,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "hidden_size": s.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": s.intermediate_size,
        "max_position_embeddings": 4096,
        "moe_intermediate_size": s.moe_intermediate_size,
        "n_group": 1,
        "n_routed_experts": s.num_experts,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": s.num_attention_heads,
        "num_experts_per_tok": s.num_experts_per_tok,
        "num_hidden_layers": s.num_hidden_layers,
        "num_key_value_heads": s.num_key_value_heads,
        "num_nextn_predict_layers": 0,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "routed_scaling_factor": 2.5,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_qk_norm": False,
        "vocab_size": s.vocab_size,
    }
    return p, config, None


# ---- GLM-5 (GlmMoeDsaForCausalLM: DeepSeek-V3.2 MLA + DSA indexer, sigmoid routing) ---------

# GLM-5's own latent sizes (kv_lora_rank 512 + qk_rope_head_dim 64 = 576): vLLM's CPU MLA decode kernel
# accepts only this head size. index_topk 64: prompts up to 64 tokens attend to every token.
GLM5_MLA = {"q_lora_rank": 256, "kv_lora_rank": 512, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64,
            "v_head_dim": 64, "index_n_heads": 4, "index_head_dim": 128, "index_topk": 64}


def mla_attention(p: Plan, pre: str, s: TinySizes, m: dict, indexer: bool) -> None:
    h, nh = s.hidden_size, s.num_attention_heads
    qk_head = m["qk_nope_head_dim"] + m["qk_rope_head_dim"]
    p.add(f"{pre}.q_a_proj.weight", (m["q_lora_rank"], h), "fp8")
    p.add(f"{pre}.q_a_layernorm.weight", (m["q_lora_rank"],), "norm")
    p.add(f"{pre}.q_b_proj.weight", (nh * qk_head, m["q_lora_rank"]), "fp8")
    p.add(f"{pre}.kv_a_proj_with_mqa.weight", (m["kv_lora_rank"] + m["qk_rope_head_dim"], h), "fp8")
    p.add(f"{pre}.kv_a_layernorm.weight", (m["kv_lora_rank"],), "norm")
    p.add(f"{pre}.kv_b_proj.weight", (nh * (m["qk_nope_head_dim"] + m["v_head_dim"]), m["kv_lora_rank"]), "fp8")
    p.add(f"{pre}.o_proj.weight", (h, nh * m["v_head_dim"]), "fp8")
    if indexer:
        ip = f"{pre}.indexer"
        p.add(f"{ip}.wq_b.weight", (m["index_n_heads"] * m["index_head_dim"], m["q_lora_rank"]), "fp8")
        p.add(f"{ip}.wk.weight", (m["index_head_dim"], h), "fp8")
        p.add(f"{ip}.k_norm.weight", (m["index_head_dim"],), "norm")
        p.add(f"{ip}.k_norm.bias", (m["index_head_dim"],), "bf16")
        p.add(f"{ip}.weights_proj.weight", (m["index_n_heads"], h), "linear")


def glm_moe_block(p: Plan, pre: str, s: TinySizes) -> None:
    """A GLM MoE layer's MLP: the router (weight, e_score_correction_bias), the routed experts, the shared expert."""
    p.add(f"{pre}.mlp.gate.weight", (s.num_experts, s.hidden_size), "linear")
    p.add(f"{pre}.mlp.gate.e_score_correction_bias", (s.num_experts,), "fp32", init="small")
    p.experts(f"{pre}.mlp", s)
    p.mlp(f"{pre}.mlp.shared_experts", s.hidden_size, s.moe_intermediate_size)


def glm_moe_dsa(s: TinySizes, v: dict):
    p = Plan()
    embed_and_head(p, "model", s)
    first_dense = 1
    for L in range(s.num_hidden_layers):
        pre = f"model.layers.{L}"
        layer_norms(p, pre, s.hidden_size)
        mla_attention(p, f"{pre}.self_attn", s, GLM5_MLA, indexer=True)
        if L < first_dense:
            p.mlp(f"{pre}.mlp", s.hidden_size, s.intermediate_size)
        else:
            glm_moe_block(p, pre, s)
    config = {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": v["bos"],
        "eos_token_id": v["eos"],
        "pad_token_id": v["pad"],
        "first_k_dense_replace": first_dense,
        "hidden_act": "silu",
        "hidden_size": s.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": s.intermediate_size,
        **GLM5_MLA,
        "indexer_types": ["full"] * s.num_hidden_layers,
        "layer_types": ["indexed_attention"] * s.num_hidden_layers,
        "mlp_layer_types": ["dense" if L < first_dense else "sparse" for L in range(s.num_hidden_layers)],
        "max_position_embeddings": 4096,
        "moe_intermediate_size": s.moe_intermediate_size,
        "n_group": 1,
        "n_routed_experts": s.num_experts,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": s.num_attention_heads,
        "num_experts_per_tok": s.num_experts_per_tok,
        "num_hidden_layers": s.num_hidden_layers,
        "num_key_value_heads": s.num_attention_heads,
        "num_nextn_predict_layers": 0,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "tie_word_embeddings": False,
        "topk_group": 1,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": s.vocab_size,
    }
    return p, config, None
