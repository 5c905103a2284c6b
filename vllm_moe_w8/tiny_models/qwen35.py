"""The Qwen3.5-MoE family (hybrid Gated DeltaNet + gated full attention, shared expert; the multimodal
wrapper with a minimal vision tower, and the text-only model): tensor plans and ``config.json``.
"""

from __future__ import annotations

from vllm_moe_w8.tiny_models.layout import Plan, TinySizes, embed_and_head, gqa_attention, layer_norms

# ---- Qwen3.5-MoE (hybrid Gated DeltaNet + gated full attention, shared expert) ----------------

QWEN35_LINEAR_KEY_HEADS = 2
QWEN35_LINEAR_VALUE_HEADS = 4
QWEN35_CONV_KERNEL = 4


def _qwen3_5_text_layers(p: Plan, model: str, s: TinySizes, layer_types: list[str]) -> None:
    h = s.hidden_size
    key_dim = QWEN35_LINEAR_KEY_HEADS * s.linear_head_dim
    value_dim = QWEN35_LINEAR_VALUE_HEADS * s.linear_head_dim
    for L, kind in enumerate(layer_types):
        pre = f"{model}.layers.{L}"
        layer_norms(p, pre, h)
        if kind == "linear_attention":
            la = f"{pre}.linear_attn"
            p.add(f"{la}.in_proj_qkv.weight", (2 * key_dim + value_dim, h), "fp8")
            p.add(f"{la}.in_proj_z.weight", (value_dim, h), "fp8")
            p.add(f"{la}.in_proj_b.weight", (QWEN35_LINEAR_VALUE_HEADS, h), "linear")
            p.add(f"{la}.in_proj_a.weight", (QWEN35_LINEAR_VALUE_HEADS, h), "linear")
            p.add(f"{la}.conv1d.weight", (2 * key_dim + value_dim, 1, QWEN35_CONV_KERNEL), "bf16", init="conv")
            p.add(f"{la}.dt_bias", (QWEN35_LINEAR_VALUE_HEADS,), "bf16", init="ones")
            p.add(f"{la}.A_log", (QWEN35_LINEAR_VALUE_HEADS,), "fp32", init="a_log")
            p.add(f"{la}.norm.weight", (s.linear_head_dim,), "norm")
            p.add(f"{la}.out_proj.weight", (h, value_dim), "fp8")
        else:
            gqa_attention(p, f"{pre}.self_attn", s, q_gate=True)
        p.add(f"{pre}.mlp.gate.weight", (s.num_experts, h), "linear")
        p.experts(f"{pre}.mlp", s)
        p.mlp(f"{pre}.mlp.shared_expert", h, s.shared_intermediate_size)
        p.add(f"{pre}.mlp.shared_expert_gate.weight", (1, h), "linear")


def _qwen3_5_text_config(s: TinySizes, v: dict, layer_types: list[str]) -> dict:
    rotary = int(s.head_dim * 0.25)
    half = rotary // 2
    mrope = [half - 2 * (half // 3), half // 3, half // 3]  # sums to rotary/2, like [11, 11, 10]
    return {
        "model_type": "qwen3_5_moe_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": v["bos"],
        "eos_token_id": v["eos"][0],
        "dtype": "bfloat16",
        "full_attention_interval": 2,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "hidden_size": s.hidden_size,
        "initializer_range": 0.02,
        "layer_types": layer_types,
        "linear_conv_kernel_dim": QWEN35_CONV_KERNEL,
        "linear_key_head_dim": s.linear_head_dim,
        "linear_num_key_heads": QWEN35_LINEAR_KEY_HEADS,
        "linear_num_value_heads": QWEN35_LINEAR_VALUE_HEADS,
        "linear_value_head_dim": s.linear_head_dim,
        "max_position_embeddings": 4096,
        "mlp_only_layers": [],
        "moe_intermediate_size": s.moe_intermediate_size,
        "mtp_num_hidden_layers": 0,
        "num_attention_heads": s.num_attention_heads,
        "num_experts": s.num_experts,
        "num_experts_per_tok": s.num_experts_per_tok,
        "num_hidden_layers": s.num_hidden_layers,
        "num_key_value_heads": s.num_key_value_heads,
        "output_router_logits": False,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": mrope,
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": s.shared_intermediate_size,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": s.vocab_size,
    }


# A minimal vision tower: Qwen3_5MoeForConditionalGeneration builds ``visual`` unless every
# modality's limit is 0, and vLLM refuses a checkpoint that lacks weights it built.
QWEN35_VISION = {"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "patch_size": 16,
                 "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3, "num_position_embeddings": 64}


def _qwen3_5_vision(p: Plan, s: TinySizes) -> dict:
    vc = dict(QWEN35_VISION, out_hidden_size=s.hidden_size, hidden_act="gelu_pytorch_tanh",
              initializer_range=0.02, model_type="qwen3_5_moe", deepstack_visual_indexes=[])
    vh, vi, m = vc["hidden_size"], vc["intermediate_size"], vc["spatial_merge_size"]
    pre = "model.visual"
    p.add(f"{pre}.patch_embed.proj.weight", (vh, vc["in_channels"], vc["temporal_patch_size"], vc["patch_size"], vc["patch_size"]), "bf16")
    p.add(f"{pre}.patch_embed.proj.bias", (vh,), "bf16")
    p.add(f"{pre}.pos_embed.weight", (vc["num_position_embeddings"], vh), "bf16")
    for b in range(vc["depth"]):
        bp = f"{pre}.blocks.{b}"
        for n in ("norm1", "norm2"):
            p.add(f"{bp}.{n}.weight", (vh,), "norm")
            p.add(f"{bp}.{n}.bias", (vh,), "bf16")
        for name, shape in (("attn.qkv", (3 * vh, vh)), ("attn.proj", (vh, vh)),
                            ("mlp.linear_fc1", (vi, vh)), ("mlp.linear_fc2", (vh, vi))):
            p.add(f"{bp}.{name}.weight", shape, "linear")
            p.add(f"{bp}.{name}.bias", (shape[0],), "bf16")
    merged = vh * m * m
    p.add(f"{pre}.merger.norm.weight", (vh,), "norm")
    p.add(f"{pre}.merger.norm.bias", (vh,), "bf16")
    p.add(f"{pre}.merger.linear_fc1.weight", (merged, merged), "linear")
    p.add(f"{pre}.merger.linear_fc1.bias", (merged,), "bf16")
    p.add(f"{pre}.merger.linear_fc2.weight", (s.hidden_size, merged), "linear")
    p.add(f"{pre}.merger.linear_fc2.bias", (s.hidden_size,), "bf16")
    return vc


def _mark_zero_centered_norms(p: Plan) -> None:
    """Qwen3.5's decoder, final and q/k norms are GemmaRMSNorm (scale 1 + w); the GDN output norm is not."""
    for name, _, kind in p.tensors:
        if kind == "norm" and "visual" not in name and "linear_attn.norm" not in name:
            p.init[name] = "zero_centered_norm"


def _qwen3_5_layer_types(s: TinySizes) -> list[str]:
    return ["linear_attention" if (i + 1) % 2 else "full_attention" for i in range(s.num_hidden_layers)]


def qwen3_5_moe(s: TinySizes, v: dict):
    p = Plan()
    layer_types = _qwen3_5_layer_types(s)
    vision = _qwen3_5_vision(p, s)
    embed_and_head(p, "model.language_model", s)
    _qwen3_5_text_layers(p, "model.language_model", s, layer_types)
    _mark_zero_centered_norms(p)
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "image_token_id": v["image_pad"],
        "video_token_id": v["video_pad"],
        "vision_start_token_id": v["vision_start"],
        "vision_end_token_id": v["vision_end"],
        "tie_word_embeddings": False,
        "text_config": _qwen3_5_text_config(s, v, layer_types),
        "vision_config": vision,
        "transformers_version": "5.19.0",
    }
    return p, config, "Qwen3VLProcessor"


def qwen3_5_moe_text(s: TinySizes, v: dict):
    p = Plan()
    layer_types = _qwen3_5_layer_types(s)
    embed_and_head(p, "model", s)  # clean text-only naming (vLLM also strips a `model.language_model.` prefix)
    _qwen3_5_text_layers(p, "model", s, layer_types)
    _mark_zero_centered_norms(p)
    config = _qwen3_5_text_config(s, v, layer_types)
    config = {"architectures": ["Qwen3_5MoeForCausalLM"], **config}
    return p, config, None
