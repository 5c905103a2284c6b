"""GLM-5 (``GlmMoeDsaForCausalLM``) inside a stand-in of the fork jinhuang12/vllm-neuron's ``model/glm_moe_dsa``
(tests/neuron_standin: NOT vllm-neuron), with neuron-w8's routed experts adopted into its ``GlmMoeDsaRoutedExperts``.

The fork's layout: ``expert_parallel_size = tensor_parallel_size`` (pure EP over the TP world: each rank owns E/world
whole experts, the shared expert and the dense MLP are TP shards of that rank); its router (sigmoid, correction bias
for the selection, normalised x routed_scaling_factor), shared expert and all-reduce stay its own. Each rank (a thread)
is built on meta, loaded through the 4-thread loader, moved and compiled whole (``fullgraph=True, dynamic=False``)
in the runner's order. The fork pins the real GLM-5 (TP 64, hidden 6144, 256 experts, 118,629 index keys...): the
tiny checkpoint is written in the layout its manifest accepts (tiny_models ``layout="vllm-neuron"``) and the tests
relax exactly its size pins, where the fork binds them (``_glue_families._glm5_relax``), nothing else. The same
checkpoint also runs in the real fork files: tests/test_neuron_glue_realtree.py.

Gates (each with its fault twins below):
* ``REL_TOL`` (test_neuron_glue_experts): a rank's MoE output vs a float64 reference of the GLM-5 MoE: the fork's
  router on the same bf16 logits, routed experts from the checkpoint's exact values, the shared expert from the
  fork's own storage (bytes x 240/448 re-rounded, scales x 448/240; ml_dtypes).
* ``EXACT_BOUND`` (``inexact_values``): every stored routed-expert value vs ml_dtypes' decode of the checkpoint bytes
  times their scale: at most the pow2 repack's rounding of odd subnormals, 2^-9 x the block scale.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch

import _glue_families as fams
import _neuron_standin as st
from test_neuron_glue_compile import _checked_block_schedule
from test_neuron_glue_experts import OUTPUT_BLOCK_REL_TOL, REL_TOL
from vllm_moe_w8.codec import fp8

ARCH = "GlmMoeDsaForCausalLM"
# The pow2 repack's only rounding: odd-mantissa subnormals / smallest normals, to nearest even: <= 2^-9 x the block
# scale (1 + 2^-10 for the fp32 product). Anything else (a doubled tile, the fork's 240/448 re-rounding) exceeds it.
EXACT_BOUND = 2.0**-9 * (1 + 2.0**-10)
FORK_STORAGE = fams.FORK_STORAGE
T_DECODE = 6  # selective decode
T_PREFILL = 160  # above the 128-token dense bucket: the block prefill kernel


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Tiny GLM-5 in the layout the fork's manifest accepts (tiny_models layout="vllm-neuron": layers 0-2 dense,
    layer 3 MoE, 16 experts, top-8, indexers on layers 0-2)."""
    return fams.GLM5.write(tmp_path_factory.mktemp("glm5") / "glm5")


@pytest.fixture(scope="module")
def config(ckpt):
    return json.loads((ckpt / "config.json").read_text())


@pytest.fixture(scope="module")
def tensors(ckpt):
    return st.checkpoint_tensors(ckpt)


@pytest.fixture()
def glue(monkeypatch):
    yield from st.compiled_glue_fixture(monkeypatch)


MOE_LAYER = 3  # the first MoE layer (first_k_dense_replace 3)
NUM_EXPERTS, HIDDEN = 16, 256


def vllm_config(path, additional_config=None):
    """What the glue reads from vLLM: the model config with its PretrainedConfig (as vLLM hands it over)."""
    from types import SimpleNamespace

    neuron = dict(fams.GLM5.neuron_config, **((additional_config or {}).get("neuron_config") or {}))
    extra = dict(additional_config or {}, neuron_config=neuron)
    return SimpleNamespace(model_config=SimpleNamespace(quantization="neuron-w8", hf_config=fams.hf_config(path),
                                                        dtype=torch.bfloat16, model=str(path)),
                           additional_config=extra)


def build(glue, path, world, *, recorder=None, compile=True, cpu_compile=False, additional_config=None,
          relax="bind"):
    from vllm_neuron.model.glm_moe_dsa import GlmMoeDsaForCausalLM
    from vllm_neuron.vllm.worker.neuron_model_runner import load_model

    fams.GLM5.relax(path, world, relax)
    glue["config"] = vllm_config(path, additional_config)
    state = st.make_groups(world, ep=False)  # one TP group; the fork's EP spans it
    cfg = glue["config"].model_config.hf_config
    nc = fams.neuron_config(fams.GLM5, glue["config"].additional_config["neuron_config"])

    def one(rank):
        state(rank)
        return load_model(GlmMoeDsaForCausalLM, cfg, nc, str(path), backend=recorder or "eager", compile=compile,
                          cpu_compile=cpu_compile)

    return state, one


def hidden(tokens, seed):
    return (torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 2).to(torch.bfloat16)


def reference_moe(t, config, h, routed_weights=None):
    return fams.glm5_reference(t, MOE_LAYER, h, config, routed_weights)


def route(t, config, h):
    """The fork's selection (top-8 of sigmoid + correction bias) for hidden states ``h``: ids [T, 8]."""
    p = f"model.layers.{MOE_LAYER}"
    x = st.rms_norm(h, t[f"{p}.post_attention_layernorm.weight"], config["rms_norm_eps"])
    scores = torch.sigmoid(torch.nn.functional.linear(x, t[f"{p}.mlp.gate.weight"].to(x.dtype)).double())
    return torch.topk(scores + t[f"{p}.mlp.gate.e_score_correction_bias"].double(), config["num_experts_per_tok"], -1).indices


# ---- the exactness gate of the stored experts ------------------------------------------------------------------


def stored_experts(block):
    """{(global expert, proj): (stored value fp32 [N, K])} of one adopted block (kernel layout)."""
    from vllm_moe_w8.neuron_glue.loaders import from_kernel_layout

    kw = block.w8_kernel_weights()
    w13, w2 = from_kernel_layout(kw)
    i = block.w8_plan.inter_per_rank
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


def fork_bytes_differ(model, t, rank, world) -> bool:
    """The gate on the fork's own FP8 tensors: the shared expert's gate shard holds exactly the fork's storage of the
    checkpoint bytes (its 240/448 loader on the raw bytes, computed here by torch's float8 cast)."""
    shared = model.model.layers[MOE_LAYER].mlp.shared_experts.gate_proj
    name = f"model.layers.{MOE_LAYER}.mlp.shared_experts.gate_proj.weight"
    rows = t[name].shape[0] // world
    want = (t[name][rank * rows: (rank + 1) * rows].float() * FORK_STORAGE).to(torch.float8_e4m3fn)
    return shared.weight.dtype != torch.float8_e4m3fn or not torch.equal(shared.weight.view(torch.uint8), want.view(torch.uint8))


# ---- tests (the build / threaded load / float64 / fullgraph path at TP 1 and 2, in the stand-in and the real tree:
# tests/test_neuron_glue_realtree.py) ---------------------------------------------------------------------------


def test_the_fork_pins_refuse_a_tiny_model_unrelaxed(glue, ckpt):
    """The stand-in keeps the fork's frozen contract (the tests relax its size pins explicitly): TP 2 and the tiny
    shape refused."""
    from vllm_neuron.model.glm_moe_dsa import GlmMoeDsaForCausalLM
    from vllm_neuron.model.neuron_config import NeuronConfig

    cfg, nc = fams.hf_config(ckpt), NeuronConfig.from_dict(fams.GLM5.neuron_config)
    with pytest.raises(ValueError, match="tensor_parallel_size=64"):
        GlmMoeDsaForCausalLM.from_configs(cfg, nc, 2)
    with pytest.raises(ValueError, match="Unsupported GLM-5.2 architecture values"):
        GlmMoeDsaForCausalLM.from_configs(cfg, nc, 64)


def test_start_up_accepts_glm5_and_the_fork_registry_lists_it(glue, ckpt):
    """--quantization neuron-w8 with GLM-5 (greedy on-device sampling) passes the platform's pre-checks; the stand-in
    registry lists it as the fork's @3a1e231 does, with the factory neuron-w8 wrapped."""
    from vllm_neuron.model.glm_moe_dsa import GlmMoeDsaForCausalLM
    from vllm_neuron.vllm.platform import NeuronPlatform

    from vllm_moe_w8.neuron_glue import interfaces, registration

    fams.GLM5.relax(ckpt, 1)  # the tiny model: size pins relaxed as the fork binds them (the layout ones stay)
    config = vllm_config(ckpt)
    NeuronPlatform.check_and_update_config(config)
    assert config in NeuronPlatform.checked_configs
    assert ARCH not in interfaces.NOT_REPLACED
    assert getattr(GlmMoeDsaForCausalLM.from_configs, registration.WRAPPED, False)


def test_start_up_names_every_launch_requirement_of_the_fork(glue, ckpt):
    """A launch the fork would refuse while building GLM-5 is refused at start-up with every reason and its remedy:
    sampling not greedy (the runner's default), TP other than the factory's SUPPORTED_TENSOR_PARALLEL_SIZE, a config
    off the fork's architecture pins; then the launch line that starts. Each pin is read from the installed fork
    (relaxing the stand-in's pins relaxes the check)."""
    from types import SimpleNamespace

    from vllm_neuron.vllm.platform import NeuronPlatform

    from vllm_moe_w8.neuron_glue.interfaces import NeuronGlueError

    config = vllm_config(ckpt, {"neuron_config": {"on_device_sampling_config": {}}})
    config.parallel_config = SimpleNamespace(tensor_parallel_size=2)
    with pytest.raises(NeuronGlueError) as info:
        NeuronPlatform.check_and_update_config(config)
    text = str(info.value)
    for needed in ("on-device sampling must be greedy", '"all_greedy": true', "--tensor-parallel-size is 2",
                   "SUPPORTED_TENSOR_PARALLEL_SIZE = 64", "hidden_size = 256 (the fork pins 6144)",
                   "n_routed_experts = 16 (the fork pins 256)", "vllm serve zai-org/GLM-5-FP8 --quantization neuron-w8 "
                   "--tensor-parallel-size 64 --additional-config '{\"neuron_config\": {\"on_device_sampling_config\": "
                   "{\"all_greedy\": true}}}'"):
        assert needed in text, (needed, text)
    config.additional_config["neuron_config"] = {"on_device_sampling_config": None}  # host sampling: accepted
    with pytest.raises(NeuronGlueError) as info:
        NeuronPlatform.check_and_update_config(config)
    assert "on-device sampling" not in str(info.value) and "--tensor-parallel-size is 2" in str(info.value)
    fams.GLM5.relax(ckpt, 2)  # the size pins relaxed to this tiny model at TP 2: nothing left to refuse
    NeuronPlatform.check_and_update_config(config)


def test_output_block_mode(glue, ckpt, tensors, config):
    """output-block (opt-in, lossy): one scale per 128 output rows, within its stated bound of the reference."""
    world = 2
    state, one = build(glue, ckpt, world, compile=False, additional_config={"neuron_w8": {"mode": "output-block"}})
    models = st.run_ranks(world, one)
    x = hidden(T_DECODE, 14)
    want = reference_moe(tensors, config, x)

    def step(rank):
        state(rank)
        block = models[rank].model.layers[MOE_LAYER].mlp.experts
        assert block.w8_kernel_weights().mode == "output-block" and block.w8_w13_scales.shape[-1] == 1
        return models[rank](x, None, True)[0]

    for rank, out in enumerate(st.run_ranks(world, step)):
        assert st.rel_err(out, want) <= OUTPUT_BLOCK_REL_TOL, f"rank {rank}"


def test_routing_really_differs_between_the_two_calls(tensors, config):
    """The realtree test's no-recompile check is only meaningful if its second routing differs (seeds 1 and 101)."""
    ids = [route(tensors, config, hidden(T_DECODE, s)) for s in (1, 101)]
    assert not torch.equal(ids[0], ids[1])


def test_fault_twin_a_forward_reading_routing_values_does_not_compile(glue, monkeypatch, ckpt):
    """The compile gate refuses a host check of the routing values in the block kernels' metadata."""
    from vllm_moe_w8.kernels import routing

    monkeypatch.setattr(routing, "block_schedule", _checked_block_schedule(routing.block_schedule))
    state, one = build(glue, ckpt, 2, recorder=st.Recorder())
    models = st.run_ranks(2, one)

    def step(rank):
        state(rank)
        return models[rank](hidden(T_DECODE, 1), torch.arange(T_DECODE), True)

    with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)) as info:
        st.run_ranks(2, step)
    assert "check_routing" in str(info.value), str(info.value)[:2000]


def test_threaded_load_keeps_no_fork_fp8_expert_and_the_forks_own_fp8(glue, ckpt, tensors):
    """No float8_e4m3fn expert tensor is left in an adopted bank; the fork's own FP8 tensors (shared expert) come from
    its own loaders on the loader threads, untouched by ours."""
    from vllm_neuron.utils import checkpoints

    checkpoints.worker_threads.clear()
    world = 2
    _, one = build(glue, ckpt, world, compile=False)
    models = st.run_ranks(world, one)
    assert len(checkpoints.worker_threads) > 1, "the fork's parameters were read on the loader's worker threads"
    for rank, model in enumerate(models):
        block = model.model.layers[MOE_LAYER].mlp.experts
        assert block.w8_plan.first_expert == rank * NUM_EXPERTS // world
        assert not any(t.dtype == torch.float8_e4m3fn for t in list(block.parameters()) + list(block.buffers()))
        assert not fork_bytes_differ(model, tensors, rank, world), rank


def test_fault_twin_the_dequantising_hook_would_corrupt_the_forks_own_fp8(glue, monkeypatch, ckpt, tensors):
    """Why GLM-5 loads without neuron-w8's dequantising slice hook: with it active, the fork's FP8 loader gets
    already-dequantised values and stores other bytes (the gate above refuses them)."""
    from vllm_moe_w8.neuron_glue import model_load

    real = model_load.wrap
    monkeypatch.setattr(model_load, "wrap", lambda *a, dequantise_non_experts=True, **k: real(*a, **k, dequantise_non_experts=True))
    _, one = build(glue, ckpt, 1, compile=False)
    (model,) = st.run_ranks(1, one)
    assert fork_bytes_differ(model, tensors, 0, 1)


def test_exactness_gate_fault_twins(glue, ckpt, tensors):
    """EXACT_BOUND refuses the smallest realistic faults of the stored experts: the fork's 240/448 re-rounding in
    place of pow2, and one 128x128 scale tile doubled."""
    _, one = build(glue, ckpt, 1, compile=False)
    (model,) = st.run_ranks(1, one)
    stored = stored_experts(model.model.layers[MOE_LAYER].mlp.experts)
    name = f"model.layers.{MOE_LAYER}.mlp.experts.3.down_proj.weight"
    assert inexact_values(stored[(3, "down_proj")], tensors, name) == 0
    fork = fams.fork_storage_dequant(tensors, name).float()
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
    _, one = build(glue, ckpt, 1, compile=False)
    with pytest.raises(NumericsSelfCheckError, match=rf"layer {MOE_LAYER}, expert 0 \(local 0\)"):
        st.run_ranks(1, one)


def test_rel_tol_fault_twins(glue, ckpt, tensors, config):
    """REL_TOL refuses: experts placed on the wrong rank (two ranks' stored experts swapped), one scale tile of a
    routed expert doubled, and the fork's 240/448 re-rounded routed experts in the reference."""
    world = 2
    state, one = build(glue, ckpt, world, compile=False)
    models = st.run_ranks(world, one)
    x = hidden(T_DECODE, 13)
    want = reference_moe(tensors, config, x)
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
    busiest = int(torch.bincount(route(tensors, config, x).flatten(), minlength=NUM_EXPERTS).argmax())
    rank, local = divmod(busiest, NUM_EXPERTS // world)  # the expert most used by this batch: one gate tile doubled
    scales = kw[rank].w13_scales.clone()
    scales[local, 0, 0] *= 2
    blocks[rank].w8_set_weights(type(kw[rank])(kw[rank].w13, scales, kw[rank].w2, kw[rank].w2_scales, kw[rank].mode))
    assert all(st.rel_err(o, want) > REL_TOL for o in outputs()), "one scale tile doubled"
    p = f"model.layers.{MOE_LAYER}"
    fork = reference_moe(tensors, config, x, routed_weights=lambda e, proj: fams.fork_storage_dequant(
        tensors, f"{p}.mlp.experts.{e}.{proj}.weight"))
    assert st.rel_err(fork, want) > REL_TOL, "the fork's 240/448 routed experts"


def test_cpu_compile_traces_on_meta(glue, ckpt):
    """VLLM_NEURON_CPU_COMPILE: load_weights_lite, model on meta; decode and prefill buckets trace with the experts'
    meta buffers."""
    rec = st.Recorder()
    state, one = build(glue, ckpt, 2, recorder=rec, cpu_compile=True)
    state(0)
    model = one(0)
    block = model.model.layers[MOE_LAYER].mlp.experts
    assert block.w8_w13.device.type == "meta" and block.w8_w13.dtype == torch.uint8
    for n, decode in ((1, True), (16, True), (128, True), (256, False)):
        x = torch.empty(n, HIDDEN, dtype=torch.bfloat16, device="meta")
        out = model(x, torch.empty(n, dtype=torch.long, device="meta"), decode)
        assert out.device.type == "meta" and out.shape == (1, n, HIDDEN)
    assert len(rec.graphs) == 4


def test_without_the_accounting_hook_the_fork_refuses_the_load(glue, monkeypatch, ckpt):
    """Why account_routed_experts exists (its fault twin): the fork's load_weights refuses a mapping that leaves this
    rank's routed-expert keys unaccounted, and names them."""
    import dataclasses

    from vllm_moe_w8.neuron_glue import glm_experts

    bank = glm_experts.BANKS["glm_moe_dsa"]
    monkeypatch.setitem(glm_experts.BANKS, "glm_moe_dsa", dataclasses.replace(bank, prepare_model=None))
    _, one = build(glue, ckpt, 2, compile=False)
    with pytest.raises(ValueError, match=rf"does not exactly account .*missing=\['model\.layers\.{MOE_LAYER}\.mlp\.experts\."):
        st.run_ranks(2, one)


def test_a_bank_placed_otherwise_is_refused_naming_the_fork(glue, monkeypatch, ckpt):
    """The loader reads experts [r*L, (r+1)*L); a bank whose global_expert_ids differ (a fork that moved its
    placement) is refused at adoption, naming the fork commit read."""
    from vllm_neuron.model.glm_moe_dsa import moe

    from vllm_moe_w8.neuron_glue.interfaces import NeuronGlueError

    monkeypatch.setattr(moe.GlmMoeDsaRoutedExperts, "global_expert_ids",
                        property(lambda self: tuple(range(self.num_local_experts))[::-1]))
    _, one = build(glue, ckpt, 1, compile=False)
    with pytest.raises(NeuronGlueError, match=r"not the linear placement .*@02ef711"):
        st.run_ranks(1, one)
