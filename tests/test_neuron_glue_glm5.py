"""GLM-5 (``GlmMoeDsaForCausalLM``) inside a stand-in of the fork jinhuang12/vllm-neuron's ``model/glm_moe_dsa``
(tests/neuron_standin: NOT vllm-neuron), with neuron-w8's routed experts adopted into its ``GlmMoeDsaRoutedExperts``.

The fork's layout: ``expert_parallel_size = tensor_parallel_size`` (pure EP over the TP world: each rank owns E/world
whole experts, the shared expert and the dense MLP are TP shards of that rank); its router (sigmoid, correction bias
for the selection, normalised x routed_scaling_factor), shared expert and all-reduce stay its own. Each rank (a thread)
is built on meta, loaded through the 4-thread loader, moved and compiled whole (``fullgraph=True, dynamic=False``)
in the runner's order. The fork pins the real GLM-5 (TP 64, hidden 6144, 256 experts...): these tiny models relax
exactly those pins (``relax_fork_pins``), nothing else.

Gates (each with its fault twins below):
* ``REL_TOL`` (test_neuron_glue_experts): a rank's MoE output vs a float64 reference of the GLM-5 MoE: the fork's
  router on the same bf16 logits, routed experts from the checkpoint's exact values, the shared expert from the
  fork's own storage (bytes x 240/448 re-rounded, scales x 448/240; ml_dtypes).
* ``EXACT_BOUND`` (``inexact_values``): every stored routed-expert value vs ml_dtypes' decode of the checkpoint bytes
  times their scale: at most the pow2 repack's rounding of odd subnormals, 2^-9 x the block scale.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import _neuron_standin as st
from test_neuron_glue_compile import _checked_block_schedule
from test_neuron_glue_experts import OUTPUT_BLOCK_REL_TOL, REL_TOL
from vllm_moe_w8.codec import fp8

ARCH = "GlmMoeDsaForCausalLM"
SIZES = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256, num_experts=8, num_experts_per_tok=2,
             num_hidden_layers=2)  # layer 0 dense (first_k_dense_replace 1), layer 1 MoE
MOE_LAYER = 1
EPS = 1e-5  # the tiny config's rms_norm_eps
ROUTED_SCALE = 2.5  # routed_scaling_factor
# The pow2 repack's only rounding: odd-mantissa subnormals / smallest normals, to nearest even: <= 2^-9 x the block
# scale (1 + 2^-10 for the fp32 product). Anything else (a doubled tile, the fork's 240/448 re-rounding) exceeds it.
EXACT_BOUND = 2.0**-9 * (1 + 2.0**-10)
FORK_STORAGE = 240.0 / 448.0  # block_fp8.FP8_STORAGE_SCALE @41758812
T_DECODE = 6  # selective decode
T_PREFILL = 160  # above the 128-token dense bucket: the block prefill kernel


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from vllm_moe_w8 import tiny_models

    return tiny_models.write_checkpoint(tmp_path_factory.mktemp("glm5") / "glm5", ARCH, **SIZES)


@pytest.fixture(scope="module")
def tensors(ckpt):
    return st.checkpoint_tensors(ckpt)


@pytest.fixture()
def glue(monkeypatch):
    yield from st.compiled_glue_fixture(monkeypatch)


def relax_fork_pins(monkeypatch, world: int) -> None:
    """The fork's frozen GLM-5 contract (config values, TP 64, EP 64 over 256 experts) relaxed to this tiny world."""
    from vllm_neuron.model.glm_moe_dsa import config, factory, weight_loaders

    monkeypatch.setattr(config.GlmMoeDsaConfig, "_EXPECTED_VALUES", {})
    monkeypatch.setattr(factory.GlmMoeDsaForCausalLM, "SUPPORTED_TENSOR_PARALLEL_SIZE", world)
    monkeypatch.setattr(weight_loaders, "PINNED_EP", weight_loaders.ExpertParallelContract(SIZES["num_experts"], world))


def build(glue, monkeypatch, path, world, *, recorder=None, compile=True, cpu_compile=False, additional_config=None):
    from vllm_neuron.model.glm_moe_dsa import GlmMoeDsaForCausalLM
    from vllm_neuron.vllm.worker.neuron_model_runner import load_model

    relax_fork_pins(monkeypatch, world)
    glue["config"] = st.vllm_config(path, additional_config=additional_config)
    state = st.make_groups(world, ep=False)  # one TP group; the fork's EP spans it
    cfg = glue["config"].model_config.hf_config

    def one(rank):
        state(rank)
        return load_model(GlmMoeDsaForCausalLM, cfg, None, str(path), backend=recorder or "eager", compile=compile,
                          cpu_compile=cpu_compile)

    return state, one


def hidden(tokens, seed):
    return (torch.randn(tokens, SIZES["hidden_size"], generator=torch.Generator().manual_seed(seed)) * 2).to(torch.bfloat16)


# ---- the float64 reference of the GLM-5 MoE --------------------------------------------------------------------


def fork_storage_dequant(t: dict, name: str) -> torch.Tensor:
    """What the fork's loaders keep for an FP8 weight (ml_dtypes): bytes x 240/448 re-rounded to E4M3FN, scale x 448/240."""
    w = t[name].contiguous().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    stored = (w * np.float32(FORK_STORAGE)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scale = t[name + "_scale_inv"].float().numpy() * np.float32(1 / FORK_STORAGE)
    s_el = np.repeat(np.repeat(scale, 128, axis=0), 128, axis=1)[: w.shape[0], : w.shape[1]]
    return torch.from_numpy(stored.astype(np.float64) * s_el.astype(np.float64))


def route(t, layer, x):
    """The fork's router (GlmMoeDsaNoAuxRouter) on the model-dtype logits, in float64 from there."""
    p = f"model.layers.{layer}.mlp.gate"
    logits = F.linear(x, t[f"{p}.weight"].to(x.dtype))
    scores = torch.sigmoid(logits.double())
    ids = torch.topk(scores + t[f"{p}.e_score_correction_bias"].double(), SIZES["num_experts_per_tok"], dim=-1).indices
    w = scores.gather(1, ids)
    return w / w.sum(-1, keepdim=True) * ROUTED_SCALE, ids


def swiglu(x, g, u, d):
    return (F.silu(x @ g.T) * (x @ u.T)) @ d.T


def reference_moe(t, layer, h, routed_weights=None):
    """float64 GLM-5 MoE output (routed + shared) for hidden states ``h`` (before the post-attention norm)."""
    p = f"model.layers.{layer}"
    x = st.rms_norm(h, t[f"{p}.post_attention_layernorm.weight"], EPS)
    w, ids = route(t, layer, x)
    xd = x.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(SIZES["num_experts"]):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        if rows.numel():
            g, u, d = (routed_weights(e, proj) if routed_weights else st.dequant(t, f"{p}.mlp.experts.{e}.{proj}.weight").double()
                       for proj in ("gate_proj", "up_proj", "down_proj"))
            out.index_add_(0, rows, swiglu(xd[rows], g, u, d) * w[rows, slots][:, None])
    shared = (fork_storage_dequant(t, f"{p}.mlp.shared_experts.{proj}.weight") for proj in ("gate_proj", "up_proj", "down_proj"))
    return out + swiglu(xd, *shared)


# ---- the exactness gate of the stored experts ------------------------------------------------------------------


def stored_experts(block):
    """{(global expert, proj): (stored value fp32 [N, K], per-element scale)} of one adopted block (kernel layout)."""
    from vllm_moe_w8.neuron_glue.loaders import from_kernel_layout

    kw = block.w8_kernel_weights()
    w13, w2 = from_kernel_layout(kw)
    i = SIZES["moe_intermediate_size"]
    out = {}
    for e in range(w13.shape[0]):
        g = block.w8_plan.first_expert + e
        for proj, codes, scales in (("gate_proj", w13[e, :i], kw.w13_scales[e, : i // 128]),
                                    ("up_proj", w13[e, i:], kw.w13_scales[e, i // 128:]),
                                    ("down_proj", w2[e], kw.w2_scales[e])):
            values = torch.from_numpy(codes.numpy().view(ml_dtypes.float8_e4m3).astype(np.float32))
            out[(g, proj)] = values * fp8.expand_scales(scales, tuple(codes.shape), (128, 128))
    return out


def inexact_values(got: torch.Tensor, t: dict, name: str) -> int:
    """The gate: how many stored values differ from ml_dtypes' decode x scale by more than EXACT_BOUND x scale."""
    want = st.ml_dtypes_dequant(t[name], t[name + "_scale_inv"])
    scale_el = fp8.expand_scales(t[name + "_scale_inv"].float(), tuple(want.shape), (128, 128))
    return int(((got - want).abs() > EXACT_BOUND * scale_el).sum())


# ---- tests -------------------------------------------------------------------------------------------------------


def test_the_fork_pins_refuse_a_tiny_model_unrelaxed(glue, ckpt):
    """The stand-in keeps the fork's frozen contract (the tests relax it explicitly): TP 2 and the tiny shape refused."""
    from vllm_neuron.model.glm_moe_dsa import GlmMoeDsaForCausalLM

    cfg = st.hf_config(ckpt)
    with pytest.raises(ValueError, match="tensor_parallel_size=64"):
        GlmMoeDsaForCausalLM.from_configs(cfg, None, 2)
    with pytest.raises(ValueError, match="Unsupported GLM-5.2 architecture values"):
        GlmMoeDsaForCausalLM.from_configs(cfg, None, 64)


def test_start_up_accepts_glm5_and_the_fork_registry_lists_it(glue, ckpt):
    """--quantization neuron-w8 with GLM-5 passes the platform's pre-checks (no longer refused); the stand-in registry
    lists it as the fork's @3a1e231 does, with the factory neuron-w8 wrapped."""
    from vllm_neuron.model.glm_moe_dsa import GlmMoeDsaForCausalLM
    from vllm_neuron.vllm.platform import NeuronPlatform

    from vllm_moe_w8.neuron_glue import interfaces, registration

    config = st.vllm_config(ckpt)
    NeuronPlatform.check_and_update_config(config)
    assert config in NeuronPlatform.checked_configs
    assert ARCH not in interfaces.NOT_REPLACED
    assert getattr(GlmMoeDsaForCausalLM.from_configs, registration.WRAPPED, False)


def test_output_block_mode(glue, monkeypatch, ckpt, tensors):
    """output-block (opt-in, lossy): one scale per 128 output rows, within its stated bound of the reference."""
    world = 2
    state, one = build(glue, monkeypatch, ckpt, world, compile=False,
                       additional_config={"neuron_w8": {"mode": "output-block"}})
    models = st.run_ranks(world, one)
    x = hidden(T_DECODE, 14)
    want = reference_moe(tensors, MOE_LAYER, x)

    def step(rank):
        state(rank)
        block = models[rank].model.layers[MOE_LAYER].mlp.experts
        assert block.w8_kernel_weights().mode == "output-block" and block.w8_w13_scales.shape[-1] == 1
        return models[rank](x, None, True)[0]

    for rank, out in enumerate(st.run_ranks(world, step)):
        assert st.rel_err(out, want) <= OUTPUT_BLOCK_REL_TOL, f"rank {rank}"


def test_compiled_model_traces_whole_matches_reference_and_does_not_recompile(glue, monkeypatch, ckpt, tensors):
    world = 2
    rec = st.Recorder()
    state, one = build(glue, monkeypatch, ckpt, world, recorder=rec)
    models = st.run_ranks(world, one)
    cases = [("decode", T_DECODE, True), ("prefill", T_PREFILL, False)]

    def run(seed, error_on_recompile=False):
        def step(rank):
            state(rank)
            with torch._dynamo.config.patch(error_on_recompile=error_on_recompile):
                return {case: models[rank](hidden(n, seed + n), torch.arange(n), decode) for case, n, decode in cases}

        return st.run_ranks(world, step)

    first = run(1)
    graphs = len(rec.graphs)
    assert graphs == world * len(cases), "one graph per rank and shape: no graph break, no extra compile"
    assert all(rec.kernels(g) == ["moe_w8_blocks_pow2"] for g in rec.graphs), [rec.kernels(g) for g in rec.graphs]
    launch_inputs = [t.meta["example_value"].dtype for g in rec.graphs for n in g.graph.nodes if n.op == "call_function"
                     and n.target in (torch.ops.moe_w8.nki_interpreted, torch.ops.moe_w8.nki_interpreted.default)
                     for t in n.args[2]]
    assert torch.uint8 in launch_inputs and torch.float8_e4m3fn not in launch_inputs, "expert bytes enter as uint8"
    second = run(100, error_on_recompile=True)  # same shapes, other hidden states: another routing
    assert len(rec.graphs) == graphs, "a second routing of the same shape compiled again"
    for outs, seed in ((first, 1), (second, 100)):
        for case, n, _ in cases:
            want = reference_moe(tensors, MOE_LAYER, hidden(n, seed + n))
            for rank, got in enumerate(outs):
                assert got[case].shape == (1, n, SIZES["hidden_size"]) and got[case].dtype == torch.bfloat16
                err = st.rel_err(got[case][0], want)
                assert err <= REL_TOL, f"{case} seed {seed} rank {rank}: {err:.2e}"


def test_routing_really_differs_between_the_two_calls(tensors):
    ids = [route(tensors, MOE_LAYER, st.rms_norm(hidden(T_DECODE, s + T_DECODE), tensors[
        f"model.layers.{MOE_LAYER}.post_attention_layernorm.weight"], EPS))[1] for s in (1, 100)]
    assert not torch.equal(ids[0], ids[1])


def test_fault_twin_a_forward_reading_routing_values_does_not_compile(glue, monkeypatch, ckpt):
    """The compile gate refuses a host check of the routing values in the block kernels' metadata."""
    from vllm_moe_w8.kernels import routing

    monkeypatch.setattr(routing, "block_schedule", _checked_block_schedule(routing.block_schedule))
    state, one = build(glue, monkeypatch, ckpt, 2, recorder=st.Recorder())
    models = st.run_ranks(2, one)

    def step(rank):
        state(rank)
        return models[rank](hidden(T_DECODE, 1), torch.arange(T_DECODE), True)

    with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)) as info:
        st.run_ranks(2, step)
    assert "check_routing" in str(info.value), str(info.value)[:2000]


@pytest.mark.parametrize("world", [2, 4])
def test_threaded_load_places_and_keeps_experts_exactly(glue, monkeypatch, ckpt, tensors, world):
    """Each rank stores exactly its E/world experts (the fork's placement), as uint8 codes whose decode x scales is
    ml_dtypes' decode of the checkpoint x scales (EXACT_BOUND); no float8_e4m3fn expert tensor is left; the fork's
    own FP8 tensors (shared expert, dense MLP) come from its own loaders on the loader threads, untouched by ours."""
    from vllm_neuron.utils import checkpoints

    checkpoints.worker_threads.clear()
    _, one = build(glue, monkeypatch, ckpt, world, compile=False)
    models = st.run_ranks(world, one)
    assert len(checkpoints.worker_threads) > 1, "the fork's parameters were read on the loader's worker threads"
    local = SIZES["num_experts"] // world
    for rank, model in enumerate(models):
        block = model.model.layers[MOE_LAYER].mlp.experts
        assert block.w8_plan.first_expert == rank * local and block.w8_plan.num_local == local
        assert block.w8_w13.dtype == torch.uint8 and block.w8_w2.dtype == torch.uint8
        assert not any(t.dtype == torch.float8_e4m3fn for t in list(block.parameters()) + list(block.buffers()))
        stored = stored_experts(block)
        assert sorted({g for g, _ in stored}) == list(range(rank * local, (rank + 1) * local))
        for (g, proj), got in stored.items():
            assert inexact_values(got, tensors, f"model.layers.{MOE_LAYER}.mlp.experts.{g}.{proj}.weight") == 0, (rank, g, proj)
        assert not fork_bytes_differ(model, tensors, rank, world), rank


def fork_bytes_differ(model, t, rank, world) -> bool:
    """The gate on the fork's own FP8 tensors: the shared expert's gate shard holds exactly the fork's storage of the
    checkpoint bytes (its 240/448 loader on the raw bytes, computed here by torch's float8 cast)."""
    shared = model.model.layers[MOE_LAYER].mlp.shared_experts.gate_proj
    name = f"model.layers.{MOE_LAYER}.mlp.shared_experts.gate_proj.weight"
    rows = SIZES["moe_intermediate_size"] // world
    want = (t[name][rank * rows: (rank + 1) * rows].float() * FORK_STORAGE).to(torch.float8_e4m3fn)
    return shared.weight.dtype != torch.float8_e4m3fn or not torch.equal(shared.weight.view(torch.uint8), want.view(torch.uint8))


def test_fault_twin_the_dequantising_hook_would_corrupt_the_forks_own_fp8(glue, monkeypatch, ckpt, tensors):
    """Why GLM-5 loads without neuron-w8's dequantising slice hook: with it active, the fork's FP8 loader gets
    already-dequantised values and stores other bytes (the gate above refuses them)."""
    from vllm_moe_w8.neuron_glue import model_load

    real = model_load.wrap
    monkeypatch.setattr(model_load, "wrap", lambda *a, dequantise_non_experts=True, **k: real(*a, **k, dequantise_non_experts=True))
    _, one = build(glue, monkeypatch, ckpt, 1, compile=False)
    (model,) = st.run_ranks(1, one)
    assert fork_bytes_differ(model, tensors, 0, 1)


def test_exactness_gate_fault_twins(glue, monkeypatch, ckpt, tensors):
    """EXACT_BOUND refuses the smallest realistic faults of the stored experts: the fork's 240/448 re-rounding in
    place of pow2, and one 128x128 scale tile doubled."""
    _, one = build(glue, monkeypatch, ckpt, 1, compile=False)
    (model,) = st.run_ranks(1, one)
    stored = stored_experts(model.model.layers[MOE_LAYER].mlp.experts)
    name = f"model.layers.{MOE_LAYER}.mlp.experts.3.down_proj.weight"
    assert inexact_values(stored[(3, "down_proj")], tensors, name) == 0
    fork = fork_storage_dequant(tensors, name).float()
    assert inexact_values(fork, tensors, name) > 0
    doubled = stored[(3, "down_proj")].clone()
    doubled[128:256, 0:128] *= 2
    assert inexact_values(doubled, tensors, name) > 0


def test_load_time_self_check_stops_the_fork_rescale(glue, monkeypatch, ckpt):
    """neuron-w8's own load-time self-check (the loader's gate) stops a repack that stored the fork's 240/448 bytes."""
    from vllm_moe_w8.neuron_glue import loaders
    from vllm_moe_w8.vllm_glue.self_check import NumericsSelfCheckError

    real = fp8.repack

    def fork_rescale(weight, scale, mode="pow2", block=None, name=None):
        rep = real(weight, scale, mode, block, name=name)
        w = weight.contiguous().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        codes = (w * np.float32(FORK_STORAGE)).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        return fp8.Repacked(torch.from_numpy(codes.copy()), scale.float() / FORK_STORAGE, rep.mode, rep.block, rep.stats)

    monkeypatch.setattr(loaders.fp8, "repack", fork_rescale)
    _, one = build(glue, monkeypatch, ckpt, 1, compile=False)
    with pytest.raises(NumericsSelfCheckError, match=r"layer 1, expert 0 \(local 0\)"):
        st.run_ranks(1, one)


@pytest.mark.parametrize("world", [2, 4])
def test_rank_loops_match_reference(glue, monkeypatch, ckpt, tensors, world):
    """TP = EP = world (the fork's layout): every rank's decode and prefill output, eager, vs the float64 reference."""
    state, one = build(glue, monkeypatch, ckpt, world, compile=False)
    models = st.run_ranks(world, one)
    dec, pre = hidden(T_DECODE, 11), hidden(T_PREFILL, 12)

    def step(rank):
        state(rank)
        return models[rank](dec, None, True)[0], models[rank](pre, None, False)[0]

    want_dec, want_pre = reference_moe(tensors, MOE_LAYER, dec), reference_moe(tensors, MOE_LAYER, pre)
    for rank, (d, p) in enumerate(st.run_ranks(world, step)):
        assert st.rel_err(d, want_dec) <= REL_TOL, f"decode rank {rank}: {st.rel_err(d, want_dec):.2e}"
        assert st.rel_err(p, want_pre) <= REL_TOL, f"prefill rank {rank}: {st.rel_err(p, want_pre):.2e}"


def test_rel_tol_fault_twins(glue, monkeypatch, ckpt, tensors):
    """REL_TOL refuses: experts placed on the wrong rank (two ranks' stored experts swapped), one scale tile of a
    routed expert doubled, and the fork's 240/448 re-rounded routed experts in the reference."""
    world = 2
    state, one = build(glue, monkeypatch, ckpt, world, compile=False)
    models = st.run_ranks(world, one)
    x = hidden(T_DECODE, 13)
    want = reference_moe(tensors, MOE_LAYER, x)
    blocks = [m.model.layers[MOE_LAYER].mlp.experts for m in models]

    def outputs():
        def step(rank):
            state(rank)
            return models[rank](x, None, True)[0]

        return st.run_ranks(world, step)

    assert all(st.rel_err(o, want) <= REL_TOL for o in outputs())
    kw = [b.w8_kernel_weights() for b in blocks]
    blocks[0].w8_set_weights(kw[1])
    blocks[1].w8_set_weights(kw[0])
    assert all(st.rel_err(o, want) > REL_TOL for o in outputs()), "swapped placement"
    blocks[0].w8_set_weights(kw[0])
    blocks[1].w8_set_weights(kw[1])
    # the local expert most used by this batch, one gate tile doubled
    p = f"model.layers.{MOE_LAYER}"
    _, ids = route(tensors, MOE_LAYER, st.rms_norm(x, tensors[f"{p}.post_attention_layernorm.weight"], EPS))
    busiest = int(torch.bincount(ids.flatten(), minlength=SIZES["num_experts"]).argmax())
    rank, local = divmod(busiest, SIZES["num_experts"] // world)
    scales = kw[rank].w13_scales.clone()
    scales[local, 0, 0] *= 2
    blocks[rank].w8_set_weights(type(kw[rank])(kw[rank].w13, scales, kw[rank].w2, kw[rank].w2_scales, kw[rank].mode))
    assert all(st.rel_err(o, want) > REL_TOL for o in outputs()), "one scale tile doubled"
    fork = reference_moe(tensors, MOE_LAYER, x, routed_weights=lambda e, proj: fork_storage_dequant(
        tensors, f"{p}.mlp.experts.{e}.{proj}.weight"))
    assert st.rel_err(fork, want) > REL_TOL, "the fork's 240/448 routed experts"


def test_cpu_compile_traces_on_meta(glue, monkeypatch, ckpt):
    """VLLM_NEURON_CPU_COMPILE: load_weights_lite, model on meta; decode and prefill buckets trace with the experts'
    meta buffers."""
    rec = st.Recorder()
    state, one = build(glue, monkeypatch, ckpt, 2, recorder=rec, cpu_compile=True)
    state(0)
    model = one(0)
    block = model.model.layers[MOE_LAYER].mlp.experts
    assert block.w8_w13.device.type == "meta" and block.w8_w13.dtype == torch.uint8
    for n, decode in ((1, True), (16, True), (128, True), (256, False)):
        x = torch.empty(n, SIZES["hidden_size"], dtype=torch.bfloat16, device="meta")
        out = model(x, torch.empty(n, dtype=torch.long, device="meta"), decode)
        assert out.device.type == "meta" and out.shape == (1, n, SIZES["hidden_size"])
    assert len(rec.graphs) == 4


def test_without_the_accounting_hook_the_fork_refuses_the_load(glue, monkeypatch, ckpt):
    """Why account_routed_experts exists (its fault twin): the fork's load_weights refuses a mapping that leaves this
    rank's routed-expert keys unaccounted, and names them."""
    import dataclasses

    from vllm_moe_w8.neuron_glue import glm_experts

    bank = glm_experts.BANKS["glm_moe_dsa"]
    monkeypatch.setitem(glm_experts.BANKS, "glm_moe_dsa", dataclasses.replace(bank, prepare_model=None))
    _, one = build(glue, monkeypatch, ckpt, 2, compile=False)
    with pytest.raises(ValueError, match=r"does not exactly account .*missing=\['model\.layers\.1\.mlp\.experts\.[0-7]\."):
        st.run_ranks(2, one)


def test_a_bank_placed_otherwise_is_refused_naming_the_fork(glue, monkeypatch, ckpt):
    """The loader reads experts [r*L, (r+1)*L); a bank whose global_expert_ids differ (a fork that moved its
    placement) is refused at adoption, naming the fork commit read."""
    from vllm_neuron.model.glm_moe_dsa import moe

    from vllm_moe_w8.neuron_glue.interfaces import NeuronGlueError

    monkeypatch.setattr(moe.GlmMoeDsaRoutedExperts, "global_expert_ids",
                        property(lambda self: tuple(range(self.num_local_experts))[::-1]))
    _, one = build(glue, monkeypatch, ckpt, 1, compile=False)
    with pytest.raises(NeuronGlueError, match=r"not the linear placement .*@02ef711"):
        st.run_ranks(1, one)
