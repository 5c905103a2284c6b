"""GLM-5.3-Flash's routed-expert bank (fork jinhuang12/vllm-neuron ``Glm5NextRoutedExperts``) adopted by neuron-w8,
inside the labelled stand-in of vllm-neuron (tests/neuron_standin: NOT vllm-neuron; the fork's router, shared
expert and load order are reproduced there, its FP8 kernel is not). The kernels run in the NKI interpreter.

Each rank of a TP=2 or EP=2 group builds the model the runner's way (meta build, ``load_weights`` on the 4-thread
loader, ``.to``, ``torch.compile(fullgraph=True, dynamic=False)``). Gates, each with its fault twins:
* numerics (``within_gate``): every rank's all-reduced layer output, and the sum over ranks of the bank's own
  partial outputs, against a float64 reference of the GLM MoE (noaux_tc routing, SwiGLU clamped at
  ``swiglu_limit``, shared expert) from the checkpoint's own values; REL_TOL as the Qwen blocks';
* compile: one graph per rank (fullgraph), one launch per layer, no recompile over new routings; no
  float8_e4m3fn tensor reaches a launch;
* loading: the fork's non-expert FP8 tensors reach it as the checkpoint's bytes (on the loader threads), the stored
  experts decode to the checkpoint's values within pow2's bound.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import _glm5next as g
import _neuron_standin as st
from test_neuron_glue_experts import OUTPUT_BLOCK_REL_TOL, REL_TOL

WORLD = 2
T_DECODE, T_DENSE, T_PREFILL = 6, 64, 160  # selective block kernel, dense kernel, block prefill (host_routed.schedule_for)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return g.write_checkpoint(tmp_path_factory.mktemp("glm") / "glm5next")


@pytest.fixture(scope="module")
def tensors(ckpt):
    return st.checkpoint_tensors(ckpt)


@pytest.fixture()
def glue(monkeypatch):
    yield from st.compiled_glue_fixture(monkeypatch)


def load_ranks(ckpt, holder, ep, world=WORLD, additional_config=None, **kw):
    from vllm_neuron.vllm.worker.neuron_model_runner import load_model

    from vllm_moe_w8.neuron_glue import interfaces

    holder["config"] = st.vllm_config(ckpt, additional_config=additional_config)
    cls, cfg = interfaces.import_attr(*g.FACTORY), holder["config"].model_config.hf_config
    state = st.make_groups(world, ep)

    def one(rank):
        state(rank)
        return load_model(cls, cfg, None, str(ckpt), **kw)

    return state, st.run_ranks(world, one)


def ep_rank(rank, ep):
    return torch.tensor([rank if ep else 0], dtype=torch.int64)  # the fork's form: an int64 device tensor


def run(models, state, x, ep, rank_of=ep_rank):
    def step(rank):
        state(rank)
        return models[rank](x, expert_parallel_rank=rank_of(rank, ep))

    return st.run_ranks(len(models), step)


def within_gate(outs, tensors, x, limit=g.SWIGLU_LIMIT) -> bool:
    """THE numerics gate: every rank's [layers, T, H] output within REL_TOL of the float64 reference."""
    return all(st.rel_err(out[layer], g.reference_layer(tensors, layer, x, limit)) <= REL_TOL
               for out in outs for layer in range(g.SIZES["num_hidden_layers"]))


def banks(models, layer=0):
    return [m.model.layers[layer].mlp.experts for m in models]


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "ep2"])
def test_rank_loop_matches_reference(glue, ckpt, tensors, ep):
    from vllm_moe_w8.neuron_glue import glm_experts

    state, models = load_ranks(ckpt, glue, ep, compile=False)
    assert all(isinstance(b, glm_experts.W8Glm5NextRoutedExperts) for layer in (0, 1) for b in banks(models, layer))
    for tokens in (T_DECODE, T_DENSE, T_PREFILL):
        x = g.hidden(tokens, tokens)
        assert within_gate(run(models, state, x, ep), tensors, x), (ep, tokens)
    # the sum over ranks of the bank's own partial sums == the routed part of the reference
    x = g.hidden(T_DECODE, 3)
    normed, aff = g.normed(tensors, 0, x), g.route(tensors, 0, x)

    def partial(rank):
        state(rank)
        return banks(models)[rank](normed, aff, None, expert_parallel_rank=ep_rank(rank, ep)).float()

    parts = st.run_ranks(WORLD, partial)
    want = g.reference_layer(tensors, 0, x, shared=False)
    assert st.rel_err(sum(parts), want) <= REL_TOL
    if ep:  # each EP rank alone holds its own experts' share
        for rank, part in enumerate(parts):
            n = g.SIZES["n_routed_experts"] // WORLD
            mine = range(rank * n, rank * n + n)
            assert st.rel_err(part, g.reference_layer(tensors, 0, x, shared=False, experts=mine)) <= REL_TOL


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "ep2"])
def test_fault_twins_fail_the_same_gate(glue, ckpt, tensors, ep):
    from vllm_moe_w8.neuron_glue import glm_experts

    state, models = load_ranks(ckpt, glue, ep, compile=False)
    x = g.hidden(T_DECODE, 3)
    aff = g.route(tensors, 0, x)
    unfaulted = run(models, state, x, ep)
    assert within_gate(unfaulted, tensors, x)
    assert g.clamped_fraction(tensors, 0, x) > 0.1, "precondition: the SwiGLU bound changes many pre-activations"
    assert not within_gate(unfaulted, tensors, x, limit=None), "precondition: an unclamped reference differs"
    saved = [b.w8_settings for b in banks(models)]
    for b in banks(models):  # swiglu_limit ignored by the adopted experts
        b.w8_settings = dataclasses.replace(b.w8_settings, swiglu_limit=0.0)
    assert not within_gate(run(models, state, x, ep), tensors, x)
    for b, s in zip(banks(models), saved):
        b.w8_settings = s
    if ep:  # wrong EP placement: each rank selects the other rank's affinity columns
        assert not within_gate(run(models, state, x, ep, rank_of=lambda r, _: torch.tensor([1 - r])), tensors, x)
    a, b = banks(models)  # a loader off by one rank: rank 0 holds rank 1's shard (TP: its half of I; EP: its experts)
    kw_a = a.w8_kernel_weights()
    a.w8_set_weights(b.w8_kernel_weights())
    assert not within_gate(run(models, state, x, ep), tensors, x)
    a.w8_set_weights(kw_a)
    assert within_gate(run(models, state, x, ep), tensors, x), "restored"
    local = glm_experts.local_affinities(aff, a.w8_plan, 0)  # one scale tile of rank 0's most-used expert doubled
    hot = int(local.sum(0).argmax())
    a.w8_w13_scales[hot, 0, 0] *= 2
    assert not within_gate(run(models, state, x, ep), tensors, x)
    a.w8_w13_scales[hot, 0, 0] /= 2


def test_an_int_rank_other_than_the_loaded_one_is_refused(glue, ckpt, tensors):
    from vllm_moe_w8.neuron_glue.interfaces import NeuronGlueError

    state, models = load_ranks(ckpt, glue, ep=True, compile=False)
    x = g.hidden(T_DECODE, 5)
    state(1)  # the bank alone (no collective) on rank 1, called for rank 0
    with pytest.raises(NeuronGlueError, match=r"expert_parallel_rank 0 but its experts were loaded for EP rank 1"):
        banks(models)[1](g.normed(tensors, 0, x), g.route(tensors, 0, x), None, expert_parallel_rank=0)
    assert within_gate(run(models, state, x, True, rank_of=lambda r, _: r), tensors, x), "a Python-int rank works too"


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "ep2"])
def test_compiled_whole_no_recompile_over_routings(glue, ckpt, tensors, ep):
    rec = st.Recorder()
    state, models = load_ranks(ckpt, glue, ep, backend=rec)
    seeds = (11, 12, 13)
    routings = [g.route(tensors, 0, g.hidden(T_DECODE, s)).nonzero().tolist() for s in seeds]
    assert len({str(r) for r in routings}) == len(seeds), "precondition: the routings differ"
    for i, seed in enumerate(seeds):
        x = g.hidden(T_DECODE, seed)

        def step(rank):
            state(rank)
            with torch._dynamo.config.patch(error_on_recompile=i > 0):  # per thread: set on the rank's own thread
                return models[rank](x, expert_parallel_rank=ep_rank(rank, ep))

        assert within_gate(st.run_ranks(WORLD, step), tensors, x), (ep, seed)
    assert len(rec.graphs) == WORLD, "one graph per rank: no graph break (fullgraph), no recompile per routing"
    for gm in rec.graphs:
        nodes = st.Recorder.launch_nodes(gm)
        assert [n.args[0] for n in nodes] == ["moe_w8_blocks_pow2"] * g.SIZES["num_hidden_layers"]
        dtypes = {a.meta["example_value"].dtype for n in nodes for a in n.all_input_nodes if "example_value" in a.meta}
        assert torch.float8_e4m3fn not in dtypes and torch.uint8 in dtypes, dtypes  # no unsafe-fp8 flag needed


def _value_reading_topk(local, top_k):
    """FAULT: the bank's top-k checking the routing on the host (a tensor value read in Python)."""
    if bool((local < 0).any()):
        raise ValueError("negative affinity")
    w, ids = torch.topk(local, top_k, dim=-1)
    return w, ids


def test_fault_twin_a_bank_reading_routing_values_does_not_compile(glue, ckpt, monkeypatch):
    from vllm_moe_w8.neuron_glue import glm_experts

    monkeypatch.setattr(glm_experts, "topk_of_affinities", _value_reading_topk)
    state, models = load_ranks(ckpt, glue, ep=False, backend=st.Recorder())
    with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)) as info:
        run(models, state, g.hidden(T_DECODE, 1), False)
    assert "_value_reading_topk" in str(info.value) or "data-dependent" in str(info.value).lower(), str(info.value)[:2000]


def exact_non_expert(models, tensors) -> bool:
    """THE loading gate for the fork's own FP8 tensors: each rank's shared-expert parameters are the checkpoint's
    E4M3FN bytes (its TP shard), bit for bit, as the fork's loader expects them."""
    for rank, m in enumerate(models):
        shared = m.model.layers[1].mlp.shared_experts
        for proj, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
            got = getattr(shared, f"{proj}_weight")
            full = tensors[f"{g.PREFIX}.1.mlp.shared_experts.{proj}.weight"]
            want = full.narrow(dim, rank * shared.shard_size, shared.shard_size)
            if got.dtype != torch.float8_e4m3fn or not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                return False
    return True


def experts_within_pow2(models, tensors, ep) -> bool:
    """THE loading gate for our experts: stored Trn2 codes (ml_dtypes float8_e4m3) x stored scales == the checkpoint's
    ml_dtypes E4M3FN decode x its scales, this rank's slice, within pow2's bound (2^-9 x block scale, odd subnormals)."""
    import ml_dtypes

    from vllm_moe_w8.codec import fp8
    from vllm_moe_w8.neuron_glue.loaders import from_kernel_layout

    e_total, inter = g.SIZES["n_routed_experts"], g.SIZES["moe_intermediate_size"]
    for rank, m in enumerate(models):
        kw = m.model.layers[1].mlp.experts.w8_kernel_weights()
        w13, w2 = from_kernel_layout(kw)
        local, i_r = (e_total // WORLD, inter) if ep else (e_total, inter // WORLD)
        first, lo = (rank * local, 0) if ep else (0, rank * i_r)
        for e in range(local):
            for proj, codes, scales in (("gate_proj", w13[e, :i_r], kw.w13_scales[e, : i_r // 128]),
                                        ("up_proj", w13[e, i_r:], kw.w13_scales[e, i_r // 128:]),
                                        ("down_proj", w2[e], kw.w2_scales[e])):
                name = f"{g.PREFIX}.1.mlp.experts.{first + e}.{proj}.weight"
                want = st.ml_dtypes_dequant(tensors[name], tensors[name + "_scale_inv"])
                scale_el = fp8.expand_scales(tensors[name + "_scale_inv"].float(), tuple(want.shape), (128, 128))
                cut = (slice(lo, lo + i_r), slice(None)) if proj != "down_proj" else (slice(None), slice(lo, lo + i_r))
                got = torch.from_numpy(codes.numpy().view(ml_dtypes.float8_e4m3).astype("float32"))
                got = got * fp8.expand_scales(scales, tuple(codes.shape), (128, 128))
                if not bool(((got - want[cut]).abs() <= 2.0**-9 * scale_el[cut] * (1 + 2.0**-10)).all()):
                    return False
    return True


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "ep2"])
def test_threaded_load_fork_tensors_exact_and_experts_within_pow2(glue, ckpt, tensors, ep, monkeypatch):
    import threading

    from vllm_neuron.utils import checkpoints

    checkpoints.worker_threads.clear()
    _, models = load_ranks(ckpt, glue, ep, compile=False)
    assert checkpoints.worker_threads and threading.current_thread().name not in checkpoints.worker_threads
    assert exact_non_expert(models, tensors)
    assert experts_within_pow2(models, tensors, ep)
    for b in banks(models):  # the fork loaded none of its FP8 bank; the grids it read out of band were released
        assert b.gate_proj_weight is None and not hasattr(b, "gate_proj_weight_scale_inv")
        assert {"w8_w13", "w8_w2"} <= {n for n, _ in b.named_buffers()} and b.w8_w13.dtype == torch.uint8
    # fault twins: one stored scale tile doubled; the Qwen path's dequantising hook left on for the fork's tensors
    bank = models[0].model.layers[1].mlp.experts
    bank.w8_w2_scales[1, 0, 0] *= 2
    assert not experts_within_pow2(models, tensors, ep)
    from vllm_moe_w8.neuron_glue import model_load

    real_wrap = model_load.wrap
    monkeypatch.setattr(model_load, "wrap", lambda *a, **k: real_wrap(*a, **{**k, "dequantise_non_experts": True}))
    _, hooked = load_ranks(ckpt, glue, ep, compile=False)
    assert not exact_non_expert(hooked, tensors)


def test_output_block_opt_in(glue, ckpt, tensors):
    state, models = load_ranks(ckpt, glue, ep=False, world=1, compile=False,
                               additional_config={"neuron_w8": {"mode": "output-block"}})
    bank = banks(models)[0]
    assert bank.w8_kernel_weights().mode == "output-block" and bank.w8_w13_scales.shape[-1] == 1
    x = g.hidden(T_DECODE, 9)
    state(0)
    out = models[0](x)
    assert st.rel_err(out[0], g.reference_layer(tensors, 0, x)) <= OUTPUT_BLOCK_REL_TOL


class _Group:
    def __init__(self, rank, size):
        self.rank_in_group, self.world_size = rank, size


def _state(rank, world, ep):
    shards = world // ep
    return type("PS", (), {"get_tp_group": staticmethod(lambda: _Group(rank, world)),
                           "get_neuron_ep_rank": staticmethod(lambda: rank // shards),
                           "get_neuron_ep_tp_group": staticmethod(lambda: _Group(rank % shards, shards))})


def test_the_seed_and_the_forks_registered_layouts():
    """configs/glm-5.3-flash.json layouts (seed TP=32/EP=32, the fork's TP=64/ep_degree 16) at the real sizes."""
    from vllm_moe_w8.neuron_glue import glm_experts
    from vllm_moe_w8.neuron_glue.interfaces import NeuronGlueError

    cfg = json.loads((Path(__file__).parents[1] / "configs" / "glm-5.3-flash.json").read_text())
    text = cfg["config"]["text_config"]
    sizes = glm_experts.Sizes(text["hidden_size"], text["moe_intermediate_size"])
    for layout in cfg["layouts"]:
        world, ep = layout["tp"], layout["ep_size"]
        bank = type("Bank", (), dict(num_routed_experts=text["n_routed_experts"], tp_degree=world, ep_degree=ep,
                                     num_local_experts=text["n_routed_experts"] // ep))
        for rank in (0, 5, world - 1):
            plan = glm_experts.glm5_next_plan(bank, sizes, _state(rank, world, ep))
            plan.validate(layout["name"])
            assert (plan.num_local, plan.inter_per_rank) == (layout["experts_per_rank"], layout["moe_intermediate_per_rank"])
            assert plan.first_expert == (rank // (world // ep)) * plan.num_local and plan.tp_rank == rank % (world // ep)
    bank = type("Bank", (), dict(num_routed_experts=288, tp_degree=64, ep_degree=16, num_local_experts=18))
    bad = _state(5, 64, 16)
    bad.get_neuron_ep_tp_group = staticmethod(lambda: _Group(2, 4))  # 5 % 4 == 1: the column disagrees
    with pytest.raises(NeuronGlueError, match="the fork's column"):
        glm_experts.glm5_next_plan(bank, sizes, bad)
    bank.ep_degree, bank.tp_degree = 24, 64  # 64 % 24 != 0
    with pytest.raises(NeuronGlueError, match="ep_degree must divide"):
        glm_experts.glm5_next_plan(bank, sizes, _state(0, 64, 16))


def test_top_k_of_scattered_affinities():
    from vllm_moe_w8.neuron_glue import glm_experts

    local = torch.tensor([[0.0, 0.7, 0.0, 0.2], [0.0, 0.0, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
    w, ids = glm_experts.topk_of_affinities(local, 2)
    assert ids.tolist() == [[1, 3], [-1, -1], [0, -1]] and torch.allclose(w, torch.tensor([[0.7, 0.2], [0, 0], [0.5, 0]]))


def test_registration_resolves_glm5next_and_refuses_an_unlisting_registry(glue, ckpt, monkeypatch):
    """No longer in NOT_REPLACED: the architecture resolves to the fork's bank; a registry without it is refused
    naming the fork registries read."""
    from vllm_neuron.model import registry

    from vllm_moe_w8.neuron_glue import interfaces, registration
    from vllm_moe_w8.neuron_glue.interfaces import NeuronGlueError

    assert g.ARCH not in interfaces.NOT_REPLACED
    target, _, block = interfaces.resolve_target(g.ARCH)
    assert target is interfaces.GLM5_NEXT and block.__name__ == "Glm5NextRoutedExperts"
    config = st.vllm_config(ckpt)
    registration._precheck_config(config)  # the stand-in's registry lists it
    real = registry.get_models
    monkeypatch.setattr(registry, "get_models", lambda: [(a, c) for a, c in real() if a != g.ARCH])
    with pytest.raises(NeuronGlueError, match=r"Glm5NextForConditionalGeneration: .*does not list it.*@83b3499 and @3a1e231"):
        registration._precheck_config(config)


# ---- the fork's contracts the stand-in reproduces, and the glue's answers to them --------------------------------


def test_the_forks_config_reader_and_router_refuse_what_a_looser_stand_in_took(glue, ckpt, tmp_path):
    """As the fork's glm5_next/config.py and functional/moe/router.py: a PretrainedConfig / dict / path only, a
    vision_config required (a dict or path without one is a KeyError; a PretrainedConfig has transformers' default
    one); the router takes the expert count off dim 1 of router_weight [H, E] and refuses any top-k but 8. neuron-w8's
    start-up check names a top-k other than 8 before the fork's build would fail."""
    from types import SimpleNamespace

    from vllm_neuron.functional.moe.router import NoauxTcRouterError, noaux_tc_rmsnorm_router_topk
    from vllm_neuron.model.glm5_next.config import Glm5NextConfig

    from vllm_moe_w8.neuron_glue import registration
    from vllm_moe_w8.neuron_glue.interfaces import NeuronGlueError

    raw = json.loads((ckpt / "config.json").read_text())
    assert Glm5NextConfig.from_configs(raw).text_config.num_experts_per_tok == 8
    with pytest.raises(TypeError, match="Unsupported hf_config type"):
        Glm5NextConfig.from_configs(st.as_namespace(raw))
    text_only = {k: v for k, v in raw.items() if k != "vision_config"}
    with pytest.raises(KeyError, match="vision_config"):
        Glm5NextConfig.from_configs(text_only)
    h, e = g.SIZES["hidden_size"], g.SIZES["n_routed_experts"]
    x, gamma, w, bias = torch.randn(1, 3, h), torch.ones(h), torch.randn(h, e), torch.zeros(e)
    _, idx, aff, _ = noaux_tc_rmsnorm_router_topk(x, gamma, w, bias, top_k=8)
    assert aff.shape == (3, e) and idx.shape == (3, 8)
    with pytest.raises(NoauxTcRouterError, match="top_k must be exactly 8, got 2"):
        noaux_tc_rmsnorm_router_topk(x, gamma, w, bias, top_k=2)
    with pytest.raises(NoauxTcRouterError, match=f"correction_bias must be .* with E={h}"):
        noaux_tc_rmsnorm_router_topk(x, gamma, w.T.contiguous(), bias, top_k=8)  # [E, H]: the expert count read as H
    (tmp_path / "config.json").write_text(json.dumps(dict(text_only, text_config=dict(raw["text_config"],
                                                                                      num_experts_per_tok=2))))
    with pytest.raises(NeuronGlueError) as info:
        registration._precheck_config(st.vllm_config(tmp_path))
    assert "selects exactly 8 experts per token" in str(info.value)
    assert "has no vision_config" not in str(info.value), "vLLM's PretrainedConfig carries transformers' default one"
    assert st.hf_config(tmp_path).to_dict()["vision_config"] is not None
    from vllm_moe_w8.neuron_glue import launch_checks

    dict_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=text_only))  # a dict-shaped config: refused
    with pytest.raises(NeuronGlueError, match="has no vision_config"):
        launch_checks.check(g.ARCH, dict_config)


def test_transformers_renaming_the_dsa_layer_type_is_named_at_start_up(glue, tmp_path):
    """transformers 5.19 (huggingface/transformers#48974) renames a config's 'deepseek_sparse_attention' layers to
    'indexed_attention'; the fork's config reader refuses that while building. neuron-w8 names it at start-up."""
    import transformers
    from vllm_neuron.model.glm5_next.config import Glm5NextConfig

    from vllm_moe_w8.neuron_glue import registration
    from vllm_moe_w8.neuron_glue.interfaces import NeuronGlueError
    from vllm_moe_w8.tiny_models.neuron_layouts import glm5_next_config

    text = dict(g.text_config(), num_hidden_layers=4)  # the fork's schedule: layer 3 is DSA
    (tmp_path / "config.json").write_text(json.dumps(glm5_next_config(text)))
    hf = st.hf_config(tmp_path)
    if "indexed_attention" not in hf.to_dict()["text_config"]["layer_types"]:
        pytest.skip(f"transformers {transformers.__version__} keeps 'deepseek_sparse_attention'")
    with pytest.raises(ValueError, match=r"unrecognised attention families \['indexed_attention'\]"):
        Glm5NextConfig.from_configs(hf)
    with pytest.raises(NeuronGlueError, match=r"huggingface/transformers#48974"):
        registration._precheck_config(st.vllm_config(tmp_path))


def test_the_adopted_bank_keeps_the_class_name_the_forks_shard_table_is_keyed_by(glue, ckpt):
    """The fork looks a module's shard layout up by class name (_SHARD_GEOMETRY.get(type(module).__name__)): the
    adopted bank is neuron-w8's (its qualname says so) under the fork's name, so the lookup still finds its row.
    Fault twin: a class renamed W8... falls out of the table."""
    from vllm_neuron.model.glm5_next import model_fp8

    from vllm_moe_w8.neuron_glue import glm_experts

    _, models = load_ranks(ckpt, glue, ep=False, compile=False)
    for bank in banks(models):
        assert isinstance(bank, glm_experts.W8Glm5NextRoutedExperts)
        assert type(bank).__name__ == "Glm5NextRoutedExperts" and type(bank).__qualname__ == "W8Glm5NextRoutedExperts"
        assert model_fp8._shard_geometry_for(bank, "gate_proj_weight", WORLD) == (0, WORLD)
        renamed = type("W8Glm5NextRoutedExperts", (type(bank),), {})
        bank.__class__ = renamed
        assert model_fp8._shard_geometry_for(bank, "gate_proj_weight", WORLD) is None
        bank.__class__ = renamed.__mro__[1]


def test_weights_free_load_takes_the_forks_reader_and_reads_no_expert(glue, ckpt, monkeypatch):
    """VLLM_NEURON_CPU_COMPILE: the fork's load_weights_lite is self.load_weights(path, meta, cache_dir,
    reader=...); neuron-w8's wrapper takes the keyword, reads no expert (the experts get meta buffers of the kernel
    layout), the fork's rehearsal runs on meta, and the model traces on meta. Fault twin: a wrapper without the keyword
    fails there (TypeError)."""
    from vllm_neuron.utils import checkpoints

    from vllm_moe_w8.neuron_glue import loaders

    calls = []
    real = loaders.load_layer_experts
    monkeypatch.setattr(loaders, "load_layer_experts", lambda *a, **k: calls.append(a) or real(*a, **k))
    checkpoints.worker_threads.clear()
    rec = st.Recorder()
    state, models = load_ranks(ckpt, glue, ep=False, cpu_compile=True, backend=rec)
    assert not calls and not checkpoints.worker_threads, "no expert read, no data load"
    for m in models:
        inner = m._orig_mod
        assert inner.last_load == "rehearsal"
        for layer in inner.model.layers:
            assert layer.mlp.experts.w8_w13.device.type == "meta" and layer.mlp.experts.w8_w13.dtype == torch.uint8
    x = torch.empty(T_DECODE, g.SIZES["hidden_size"], dtype=torch.bfloat16, device="meta")
    outs = run(models, state, x, False, rank_of=lambda r, _: torch.tensor([0], device="meta"))
    assert all(o.device.type == "meta" for o in outs) and len(rec.graphs) == WORLD
    from vllm_neuron.model.glm5_next.factory import Glm5NextForConditionalGeneration
    from vllm_neuron.model.neuron_config import NeuronConfig

    with torch.device("meta"):
        model = Glm5NextForConditionalGeneration.from_configs(st.hf_config(ckpt), NeuronConfig.from_dict({}))
    model.load_weights = lambda checkpoint_path, device, cache_dir=None: None  # FAULT: the old wrapper's signature
    with pytest.raises(TypeError, match="reader"):
        model.load_weights_lite(str(ckpt), torch.device("cpu"), None)


def test_the_ep_degree_is_the_parallel_states_at_call_time(glue, monkeypatch):
    """The fork's _resolve_ep_degree(None) asks neuron_parallel_state.get_neuron_ep_degree() through the module, at
    call time (1 when expert parallelism was never initialised); the stand-in reads no field of its own."""
    from vllm_neuron.model.glm5_next.factory import _resolve_ep_degree
    from vllm_neuron.parallel import neuron_parallel_state as ps

    st.make_groups(1, ep=False)(0)
    assert _resolve_ep_degree(None) == 1 and _resolve_ep_degree(4) == 4
    monkeypatch.setattr(ps, "get_neuron_ep_degree", lambda: 16)
    assert _resolve_ep_degree(None) == 16
