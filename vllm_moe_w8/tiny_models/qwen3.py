"""The Qwen3-MoE family (``Qwen3MoeForCausalLM``): its tensor plan and ``config.json``.
"""

from __future__ import annotations

from vllm_moe_w8.tiny_models.layout import Plan, TinySizes, embed_and_head, gqa_attention, layer_norms

# ---- Qwen3-MoE ------------------------------------------------------------------------------


def qwen3_moe(s: TinySizes, v: dict):
    p = Plan()
    embed_and_head(p, "model", s)
    for L in range(s.num_hidden_layers):
        pre = f"model.layers.{L}"
        layer_norms(p, pre, s.hidden_size)
        gqa_attention(p, f"{pre}.self_attn", s)
        p.add(f"{pre}.mlp.gate.weight", (s.num_experts, s.hidden_size), "linear")
        p.experts(f"{pre}.mlp", s)
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": v["bos"],
        "eos_token_id": v["eos"],
        "decoder_sparse_step": 1,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "hidden_size": s.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": s.intermediate_size,
        "max_position_embeddings": 4096,
        "max_window_layers": s.num_hidden_layers,
        "mlp_only_layers": [],
        "moe_intermediate_size": s.moe_intermediate_size,
        "norm_topk_prob": True,
        "num_attention_heads": s.num_attention_heads,
        "num_experts": s.num_experts,
        "num_experts_per_tok": s.num_experts_per_tok,
        "num_hidden_layers": s.num_hidden_layers,
        "num_key_value_heads": s.num_key_value_heads,
        "output_router_logits": False,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": s.vocab_size,
    }
    return p, config, None
