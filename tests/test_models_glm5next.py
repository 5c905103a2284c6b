"""GLM-5.3-Flash (``Glm5NextForCausalLM``) routed experts load into neuron-w8 through vLLM's own ``load_weights``.

vLLM's CPU build cannot *run* GLM-5.3-Flash (its KDA linear attention exists only as Triton GPU kernels,
and constructing an ``indexed_attention`` layer raises "Sparse Attention is not supported on CPU."), so
no ``LLM`` is started here. Instead vLLM's real model class is built in-process on CPU from a tiny
``config.json`` (block-FP8 ``quantization_config``, ``mlp_layer_types`` dense + sparse, 8 experts,
``moe_intermediate_size`` 384, hidden 256, mHC, ``swiglu_limit`` 10) under a ``VllmConfig`` whose
quantization is ``neuron-w8``, with every attention layer KDA (the constructible kind on CPU). Then:

- checkpoint-named FP8 expert tensors (``tiny_models.quantize_block``, fp32 ``weight_scale_inv`` as GLM
  ships) plus each sparse layer's router go through the model's own ``load_weights`` (its
  ``fused_moe_make_expert_params_mapping`` and stacked-parameter loop), under both namings:
  ``model.layers.{L}.mlp.experts.{e}...`` (CausalLM) and ``model.language_model.layers...``
  (ConditionalGeneration, mapped by the wrapper's own ``hf_to_vllm_mapper``);
- ``process_weights_after_loading`` runs on every neuron-w8 MoE layer;
- the stored bytes/scales must equal ``fp8.repack(..., "pow2")`` of the checkpoint tensors, bit for bit;
- one layer's experts through ``torch.ops.moe_w8.fused_moe`` must match ``moe_reference.reference_moe``
  (fp32) and a float64 MoE over the checkpoint dequantised by torch's own FP8 conversion.
"""

from __future__ import annotations

import json
import math
import socket

import pytest
import torch

pytest.importorskip("vllm")

from _plugin_fixtures import rel_err, routing  # noqa: E402

from vllm_moe_w8.codec import fp8  # noqa: E402
from vllm_moe_w8.op import reference as moe_reference  # noqa: E402
from vllm_moe_w8 import tiny_models  # noqa: E402

# In-process (a VllmConfig and the model class, no engine): quick, needs vLLM importable (skip above).

HIDDEN, INTER, EXPERTS, TOP_K = 256, 384, 8, 2
MLP_LAYER_TYPES = ["dense", "sparse", "sparse"]
SPARSE_LAYERS = [i for i, t in enumerate(MLP_LAYER_TYPES) if t == "sparse"]
SWIGLU_LIMIT = 10.0
BLOCK = (128, 128)
# Same op and same stored weights as the fp32 reference, only the fp32 summation order differs.
SUMMATION_RTOL = 1e-5
# fp32 accumulation over H=256 / I=384 vs float64, plus pow2's counted round-to-nearest-even values
# (each <= 2**-9 x its block scale): measured ~1e-6 of max|out| in test_plugin_moe_layer.
EXACT_MODE_RTOL = 1e-5
PROJS = ("gate_proj", "up_proj", "down_proj")
# vLLM's fp32 CPU GEMM over K=256 vs a float64 product of the same (exactly dequantised) weights.
GEMM_RTOL = 1e-5


def tiny_config() -> dict:
    return dict(
        architectures=["Glm5NextForCausalLM"], model_type="glm5_next_text", vocab_size=512, pad_token_id=0,
        hidden_size=HIDDEN, intermediate_size=512, moe_intermediate_size=INTER, num_hidden_layers=len(MLP_LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=EXPERTS,
        num_experts_per_tok=TOP_K, routed_scaling_factor=2.5, n_group=1, topk_group=1, norm_topk_prob=True,
        scoring_func="sigmoid", topk_method="noaux_tc", swiglu_limit=SWIGLU_LIMIT, mlp_layer_types=MLP_LAYER_TYPES,
        kv_lora_rank=128, q_lora_rank=128, qk_rope_head_dim=0, v_head_dim=64, qk_nope_head_dim=64, qk_head_dim=64,
        mla_use_nope=True, index_topk=64, index_head_dim=64, index_n_heads=2, index_kpool=16,
        indexer_rope_interleave=False, indexer_types=["full"] * len(MLP_LAYER_TYPES),
        # Every layer KDA: an "indexed_attention" (sparse MLA) layer cannot be constructed on vLLM's CPU build.
        layer_types=["linear_attention"] * len(MLP_LAYER_TYPES),
        linear_head_dim=64, linear_num_heads=4, linear_conv_kernel_dim=4, mhc=True, hc_mult=4,
        num_nextn_predict_layers=0, max_position_embeddings=4096, torch_dtype="bfloat16",
        quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)},
    )


def expert_checkpoint(seed: int = 0) -> dict:
    """(layer, e, proj) -> (fp8 codes, fp32 weight_scale_inv), quantised as GLM's FP8 checkpoints are."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in SPARSE_LAYERS:
        for e in range(EXPERTS):
            for proj in PROJS:
                shape = (HIDDEN, INTER) if proj == "down_proj" else (INTER, HIDDEN)
                out[layer, e, proj] = tiny_models.quantize_block(torch.randn(shape, generator=gen) * 0.05, torch.float32)
    return out


def router_checkpoint(seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {layer: (torch.randn(EXPERTS, HIDDEN, generator=gen).to(torch.bfloat16), torch.randn(EXPERTS, generator=gen)) for layer in SPARSE_LAYERS}


def checkpoint_items(experts: dict, routers: dict, model_prefix: str):
    for (layer, e, proj), (codes, scale) in experts.items():
        stem = f"{model_prefix}.layers.{layer}.mlp.experts.{e}.{proj}"
        yield f"{stem}.weight", codes
        yield f"{stem}.weight_scale_inv", scale
    for layer, (gate, bias) in routers.items():
        yield f"{model_prefix}.layers.{layer}.mlp.gate.weight", gate
        yield f"{model_prefix}.layers.{layer}.mlp.gate.e_score_correction_bias", bias


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def glm5next(tmp_path_factory):
    """vLLM's ``VllmConfig`` for the tiny GLM-5.3-Flash (quantization neuron-w8) with a 1-rank gloo group."""
    import vllm_moe_w8

    vllm_moe_w8.register()
    from vllm.config import CacheConfig, KernelConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    path = tmp_path_factory.mktemp("glm5next-tiny")
    (path / "config.json").write_text(json.dumps(tiny_config()))
    model_config = ModelConfig(model=str(path), dtype="float32", skip_tokenizer_init=True, quantization="neuron-w8", max_model_len=256)
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(mamba_block_size=256),  # = max_model_len: no prefix caching on a hybrid model
        kernel_config=KernelConfig(enable_jit_warmup=False),  # the mHC warm-up needs tilelang (GPU only)
    )
    owns_group = not ps.model_parallel_is_initialized()
    with set_current_vllm_config(vllm_config):
        if owns_group:
            ps.init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{_free_port()}", local_rank=0, backend="gloo")
            ps.initialize_model_parallel(1, 1)
        yield vllm_config
    if owns_group:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


def build_and_load(vllm_config, naming: str, experts: dict, routers: dict):
    """Build vLLM's Glm5NextForCausalLM, feed it the checkpoint under ``naming``, process the MoE layers."""
    from vllm.config import set_current_vllm_config
    from vllm.models.glm5next import Glm5NextForCausalLM, Glm5NextForConditionalGeneration

    from vllm_moe_w8.vllm_glue.moe_method import NeuronW8MoEMethod

    with set_current_vllm_config(vllm_config):
        # The wrapper builds its text model with prefix "language_model" (which also keeps the layer names
        # in vLLM's static forward context distinct from the CausalLM build in this process).
        model = Glm5NextForCausalLM(vllm_config=vllm_config, prefix="" if naming == "causal" else "language_model")
        if naming == "causal":
            items = list(checkpoint_items(experts, routers, "model"))
        else:
            # The multimodal wrapper maps model.language_model.* -> language_model.model.* with its own
            # hf_to_vllm_mapper, then AutoWeightsLoader hands "model.*" to its language_model (this class).
            mapped = list(Glm5NextForConditionalGeneration.hf_to_vllm_mapper.apply(checkpoint_items(experts, routers, "model.language_model")))
            assert all(name.startswith("language_model.model.layers.") for name, _ in mapped)
            items = [(name.removeprefix("language_model."), t) for name, t in mapped]
        loaded = model.load_weights(iter(items))
        moe_layers = {}
        for name, module in model.named_modules():
            if isinstance(getattr(module, "quant_method", None), NeuronW8MoEMethod):
                module.quant_method.process_weights_after_loading(module)
                moe_layers[int(name.split(".")[2])] = module
    return model, loaded, moe_layers


@pytest.fixture(scope="module")
def checkpoint():
    return expert_checkpoint(), router_checkpoint()


@pytest.fixture(scope="module", params=["causal", "conditional_generation"])
def loaded_model(request, glm5next, checkpoint):
    return (request.param, *build_and_load(glm5next, request.param, *checkpoint))


def test_every_expert_tensor_lands_in_the_model(loaded_model, checkpoint):
    naming, model, loaded, moe_layers = loaded_model
    assert sorted(moe_layers) == SPARSE_LAYERS, "one neuron-w8 MoE layer per 'sparse' entry of mlp_layer_types"
    params = dict(model.named_parameters())
    for layer in SPARSE_LAYERS:
        stem = f"model.layers.{layer}.mlp"
        for p in ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"):
            assert f"{stem}.experts.routed_experts.{p}" in loaded
        assert f"{stem}.gate.weight" in loaded and f"{stem}.gate.e_score_correction_bias" in loaded
        _, routers = checkpoint
        assert torch.equal(params[f"{stem}.gate.weight"].data, routers[layer][0].float())
        assert torch.equal(params[f"{stem}.gate.e_score_correction_bias"].data, routers[layer][1])
    dense = model.model.layers[0].mlp
    assert not hasattr(dense, "experts"), "layer 0 is 'dense' in mlp_layer_types"


def assert_pow2_repack(moe_layers: dict, experts: dict, where: str) -> None:
    """Every MoE layer's stored codes/scales == fp8.repack(checkpoint tensor, "pow2"), bit for bit."""
    g_i = math.ceil(INTER / BLOCK[0])
    assert sorted(moe_layers) == SPARSE_LAYERS
    for layer, module in moe_layers.items():
        method = module.quant_method
        assert (method.mode, method.code_format, tuple(method.block)) == ("pow2", "e4m3", BLOCK)
        w13, w2 = module.w13_weight.data, module.w2_weight.data
        s13, s2 = module.w13_weight_scale_inv.data, module.w2_weight_scale_inv.data
        assert w13.dtype == w2.dtype == torch.uint8 and s13.dtype == s2.dtype == torch.float32
        assert tuple(w13.shape) == (EXPERTS, 2 * INTER, HIDDEN) and tuple(w2.shape) == (EXPERTS, HIDDEN, INTER)
        raw_bytes_kept = 0
        for e in range(EXPERTS):
            want = {proj: fp8.repack(*experts[layer, e, proj], "pow2", BLOCK) for proj in PROJS}
            raw_bytes_kept += torch.equal(w13[e, :INTER], experts[layer, e, "gate_proj"][0].view(torch.uint8))
            at = f"{where} layer {layer} expert {e}"
            assert torch.equal(w13[e, :INTER], want["gate_proj"].codes), at
            assert torch.equal(w13[e, INTER:], want["up_proj"].codes), at
            assert torch.equal(w2[e], want["down_proj"].codes), at
            assert torch.equal(s13[e, :g_i], want["gate_proj"].scale_grid), at
            assert torch.equal(s13[e, g_i:], want["up_proj"].scale_grid), at
            assert torch.equal(s2[e], want["down_proj"].scale_grid), at
        # The comparison above is not vacuous: the repack really rewrote the checkpoint's bytes.
        assert raw_bytes_kept == 0, f"{where} layer {layer}: experts still hold the checkpoint's E4M3FN bytes"


def test_stored_experts_are_the_pow2_repack_of_the_checkpoint(loaded_model, checkpoint):
    naming, model, loaded, moe_layers = loaded_model
    assert_pow2_repack(moe_layers, checkpoint[0], naming)


def test_routed_experts_forward_matches_references(loaded_model, checkpoint):
    import vllm_moe_w8.op.custom_op  # noqa: F401  (registers torch.ops.moe_w8)

    naming, model, loaded, moe_layers = loaded_model
    experts, _ = checkpoint
    layer = SPARSE_LAYERS[-1]
    module = moe_layers[layer]
    method = module.quant_method
    assert getattr(module, "swiglu_limit", None) == SWIGLU_LIMIT, "config.swiglu_limit reaches the routed experts"
    x, w, ids = routing(12, EXPERTS, TOP_K, HIDDEN, seed=3)
    args = (module.w13_weight, module.w13_weight_scale_inv, module.w2_weight, module.w2_weight_scale_inv, *method.block, method.code_format, "silu", SWIGLU_LIMIT)
    out = torch.ops.moe_w8.fused_moe(x, w, ids, *args)
    ref = moe_reference.reference_moe(x, w, ids, *args, dtype=torch.float32)
    assert rel_err(out, ref) < SUMMATION_RTOL
    assert rel_err(method.apply(module, x, w, ids), ref) < SUMMATION_RTOL, "the layer's own apply()"

    # Independent: float64 MoE over the checkpoint dequantised by torch's float8_e4m3fn conversion.
    dense = {proj: [tiny_models.dequantize_exact(*experts[layer, e, proj], BLOCK).double() for e in range(EXPERTS)] for proj in PROJS}
    want = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(TOP_K):
            e = int(ids[t, j])
            gate = (dense["gate_proj"][e] @ x[t].double()).clamp(max=SWIGLU_LIMIT)
            up = (dense["up_proj"][e] @ x[t].double()).clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
            want[t] += float(w[t, j]) * (dense["down_proj"][e] @ (torch.nn.functional.silu(gate) * up))
    assert rel_err(out, want) < EXACT_MODE_RTOL


# KDA's fused in_proj_qkvbfg_a, in the order of the model's stacked_params_mapping: checkpoint name -> rows
# (q/k/v: linear_num_heads * linear_head_dim; b: one per head; f_a/g_a: linear_head_dim).
KDA_SPLIT = (("q_proj", 256), ("k_proj", 256), ("v_proj", 256), ("b_proj", 4), ("f_a_proj", 64), ("g_a_proj", 64))


def complete_checkpoint(params: dict, experts: dict, seed: int = 5) -> dict:
    """A checkpoint (CausalLM naming) for *every* model parameter: FP8 + block scales where GLM-5.3-Flash
    stores FP8 (experts, shared experts, dense MLP), KDA's projections unfused, the rest as the model holds it.
    Non-expert shapes are read from the model's own parameters (no real checkpoint to copy them from)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}

    def fp8_linear(stem, shape):
        out[f"{stem}.weight"], out[f"{stem}.weight_scale_inv"] = tiny_models.quantize_block(torch.randn(shape, generator=gen) * 0.05, torch.float32)

    for name, p in params.items():
        if ".routed_experts." in name or name.endswith(".weight_scale_inv"):
            continue
        if name.endswith(".gate_up_proj.weight"):
            stem = name.removesuffix(".gate_up_proj.weight")
            fp8_linear(f"{stem}.gate_proj", (p.shape[0] // 2, p.shape[1]))
            fp8_linear(f"{stem}.up_proj", (p.shape[0] // 2, p.shape[1]))
        elif name.endswith("mlp.down_proj.weight") or name.endswith("shared_experts.down_proj.weight"):
            fp8_linear(name.removesuffix(".weight"), tuple(p.shape))
        elif name.endswith(".in_proj_qkvbfg_a.weight"):
            assert p.shape[0] == sum(rows for _, rows in KDA_SPLIT)
            stem = name.removesuffix(".in_proj_qkvbfg_a.weight")
            for sub, rows in KDA_SPLIT:
                out[f"{stem}.{sub}.weight"] = torch.randn(rows, p.shape[1], generator=gen).to(torch.bfloat16)
        else:
            fp32 = any(k in name for k in ("hc_", "A_log", "dt_bias", "e_score_correction_bias"))
            out[name] = torch.randn(tuple(p.shape), generator=gen).to(torch.float32 if fp32 else torch.bfloat16)
    out.update(dict(checkpoint_items(experts, {}, "model")))
    return out


def test_complete_checkpoint_loads_every_parameter_through_vllms_loader(glm5next, checkpoint):
    """Every parameter fed (not only experts), then vLLM's own process_weights_after_loading over all modules."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.models.glm5next import Glm5NextForCausalLM

    from vllm_moe_w8.vllm_glue.moe_method import NeuronW8MoEMethod

    experts, _ = checkpoint
    with set_current_vllm_config(glm5next):
        model = Glm5NextForCausalLM(vllm_config=glm5next, prefix="complete")
        params = dict(model.named_parameters())
        ckpt = complete_checkpoint(params, experts)
        loaded = model.load_weights(iter(ckpt.items()))
        assert set(params) - loaded == set(), "parameters the checkpoint did not reach"
        # KDA (checked before processing, which repacks it): the six unfused checkpoint projections were
        # stacked into in_proj_qkvbfg_a in the order of the model's stacked_params_mapping.
        kda = model.model.layers[0].self_attn
        want = torch.cat([ckpt[f"model.layers.0.self_attn.{sub}.weight"] for sub, _ in KDA_SPLIT]).float()
        assert torch.equal(kda.in_proj_qkvbfg_a.weight.data, want)
        assert torch.equal(model.model.layers[0].hc_attn_fn.data, ckpt["model.layers.0.hc_attn_fn"])
        process_weights_after_loading(model, glm5next.model_config, torch.device("cpu"))

    moe_layers = {int(n.split(".")[2]): m for n, m in model.named_modules() if isinstance(getattr(m, "quant_method", None), NeuronW8MoEMethod)}
    assert_pow2_repack(moe_layers, experts, "complete checkpoint")

    layer0 = model.model.layers[0]
    # Dense MLP (layer 0, "dense" in mlp_layer_types): FP8 gate/up dequantised by neuron-w8's linear method and
    # handed to vLLM's CPU GEMM (which repacks the weight, so it is checked through the layer's output).
    want = torch.cat([tiny_models.dequantize_exact(ckpt[f"model.layers.0.mlp.{p}.weight"], ckpt[f"model.layers.0.mlp.{p}.weight_scale_inv"], BLOCK) for p in ("gate_proj", "up_proj")])
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(7))
    with set_current_vllm_config(glm5next):
        got, _ = layer0.mlp.gate_up_proj(x)
    assert rel_err(got, x.double() @ want.double().T) < GEMM_RTOL
