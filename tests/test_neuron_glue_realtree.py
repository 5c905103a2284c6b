"""The Neuron glue inside vllm-neuron, the same tests in two trees: the stand-in (tests/neuron_standin, CI) and a
local folder of real, unmodified vllm-neuron files (``--vllm-neuron-tree=<folder>``, tests/_realtree.py; skipped,
naming the option, without it). Only Neuron-only pieces are stubbed there (tests/neuron_realtree/stubs, each saying
what it replaces).

Each run builds every rank the way vllm-neuron's runner does (tests/_glue_ranks.py): the family's factory on meta,
its own ``load_weights`` (the real threaded ``SafetensorsCheckpoint`` loader in the real tree), ``.to(cpu)``, and
``torch.compile(fullgraph=True, dynamic=False)`` of the decoder layers' MoE halves. In the real tree ranks are
processes with torch.distributed (gloo) and the process groups the real ``neuron_parallel_state`` makes; in the
stand-in, threads. Gates: ``REL_TOL`` against a float64 reference (test_neuron_glue_experts, with its fault twins),
``EXACT_BOUND`` for the stored experts (test_neuron_glue_glm5), one graph per shape and no recompile over a second
routing, the loader's worker threads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import _glue_families as fams
import _glue_ranks as gr
import _neuron_standin as st
import _realtree as rt
from test_neuron_glue_experts import REL_TOL
from test_neuron_glue_glm5 import EXACT_BOUND, inexact_values

CASES = [("decode", 6, True, 1), ("prefill", 160, False, 2)]  # selective decode; block prefill (> 128 tokens)
SECOND = 100  # the second routing's seed offset


@pytest.fixture(scope="session")
def real_folder(request):
    folder = rt.folder_from(request.config)
    if folder is None:
        pytest.skip(rt.SKIP_REASON)
    problems = rt.verify(folder)
    if problems:
        pytest.fail("the real-tree folder does not match tests/neuron_realtree/MANIFEST.toml:\n" + "\n".join(problems))
    return folder


@pytest.fixture(scope="session")
def assembled(tmp_path_factory):
    return tmp_path_factory.mktemp("realtree")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root, cache = tmp_path_factory.mktemp("rt_ckpt"), {}

    def make(family: str) -> Path:
        if family not in cache:
            cache[family] = fams.FAMILIES[family].write(root / family)
        return cache[family]

    return make


@pytest.fixture(params=["standin", "real"])
def tree(request):
    if request.param == "real":
        request.getfixturevalue("real_folder")
    return request.param


@pytest.fixture()
def run(request, tree, assembled, tmp_path, monkeypatch):
    """``run(job) -> [per-rank results]`` in this test's tree."""

    def go(job: gr.Job):
        if tree == "real":
            root = rt.assemble(request.getfixturevalue("real_folder"), job.family, assembled)
            return gr.run_real(job, root, tmp_path / f"{job.family}-{job.world}")
        from vllm_moe_w8.neuron_glue import registration

        monkeypatch.setattr(registration, "current_vllm_config", registration.current_vllm_config)  # restored after
        st.put_standin_on_path()
        torch._dynamo.reset()
        try:
            return gr.run_standin(job)
        finally:
            torch._dynamo.reset()
            st.drop_standin()

    return go


def reference(family: str, ckpt: Path):
    config = json.loads((ckpt / "config.json").read_text())
    tensors = st.checkpoint_tensors(ckpt)
    if family == "glm_moe_dsa":
        layers = [i for i in range(config["num_hidden_layers"]) if i >= config["first_k_dense_replace"]]
        return tensors, layers, lambda layer, h: fams.glm5_reference(tensors, layer, h, config)
    if family in st.FAMILIES:  # the Qwen families (_neuron_standin's float64 references)
        return tensors, list(range(config.get("num_hidden_layers") or config["text_config"]["num_hidden_layers"])), \
            lambda layer, h: st.reference_layer(family, tensors, layer, h)
    raise NotImplementedError(family)


def layouts():
    """(family, world, ep) for every adopted family: TP/EP 1, and 2 with each of the family's layouts."""
    return [pytest.param(f, w, ep, id=f"{f}-{'ep' if ep else 'tp'}{w}")
            for f, fam in fams.FAMILIES.items() for w in (1, 2) for ep in fam.ep_layouts if w > 1 or not ep]


def split_shared(kw: dict, plan: dict, shared):
    """(routed bank buffers, [(shared expert buffers, its plan)]) of one adopted block: the shared expert in the routed
    bank's last slot, in its own bank, or not adopted (vllm-neuron's BF16 one)."""
    if shared is None:
        return kw, []
    layout, splan, own = shared
    if layout == "bank":
        return kw, [({k.replace("w8_shared_", "w8_"): v for k, v in own.items()}, splan)]
    local = plan["num_experts"] // plan["ep_degree"]
    return {k: v[:local] for k, v in kw.items()}, [({k: v[local:] for k, v in kw.items()}, splan)]


def stored_values(kw: dict, plan: dict):
    """{(global expert, proj): stored value fp32} from one bank's kernel-layout buffers (test_neuron_glue_glm5)."""
    import ml_dtypes
    import numpy as np

    from vllm_moe_w8.codec import fp8
    from vllm_moe_w8.kernels.host import KernelWeights
    from vllm_moe_w8.neuron_glue.loaders import from_kernel_layout

    weights = KernelWeights(kw["w8_w13"], kw["w8_w13_scales"], kw["w8_w2"], kw["w8_w2_scales"], "pow2")
    w13, w2 = from_kernel_layout(weights)
    i_r = plan["intermediate_size"] // plan["tp_degree"]
    first = plan["ep_rank"] * (plan["num_experts"] // plan["ep_degree"])
    out = {}
    for e in range(w13.shape[0]):
        for proj, codes, scales in (("gate_proj", w13[e, :i_r], weights.w13_scales[e, : i_r // 128]),
                                    ("up_proj", w13[e, i_r:], weights.w13_scales[e, i_r // 128:]),
                                    ("down_proj", w2[e], weights.w2_scales[e])):
            values = torch.from_numpy(codes.numpy().view(ml_dtypes.float8_e4m3).astype(np.float32))
            out[(first + e, proj)] = values * fp8.expand_scales(scales, tuple(codes.shape), (128, 128))
    return out


def prefix(family: str) -> str:
    return st.FAMILIES[family]["prefix"] if family in st.FAMILIES else "model.layers"


def inexact_in_slice(got: torch.Tensor, tensors: dict, name: str, proj: str, plan: dict) -> int:
    """``inexact_values`` (EXACT_BOUND) on this rank's TP slice: rows of gate/up, columns of down."""
    i_r = plan["intermediate_size"] // plan["tp_degree"]
    lo = plan["tp_rank"] * i_r
    cut = (slice(lo, lo + i_r), slice(None)) if proj != "down_proj" else (slice(None), slice(lo, lo + i_r))
    sliced = {name: tensors[name][cut].contiguous(), name + "_scale_inv": None}
    scale = tensors[name + "_scale_inv"]
    sliced[name + "_scale_inv"] = scale[lo // 128:(lo + i_r) // 128] if proj != "down_proj" else scale[:, lo // 128:(lo + i_r) // 128]
    return inexact_values(got, sliced, name)


@pytest.mark.parametrize("family, world, ep", layouts())
def test_build_threaded_load_float64_and_fullgraph(run, checkpoints, family, world, ep):
    """Every rank: the bank is neuron-w8's, the load ran on the loader's worker threads, each stored expert is the
    checkpoint's value within EXACT_BOUND, one graph per shape with one kernel launch per MoE layer, no recompile
    for a second routing, and both routings' MoE halves within REL_TOL of the float64 reference."""
    ckpt = checkpoints(family)
    tensors, layers, want = reference(family, ckpt)
    sp = fams.FAMILIES[family].sequence_parallel_prefill
    results = run(gr.Job(family, world, ep, str(ckpt), cases=CASES, compile=True, second_seed=SECOND))
    assert len(results) == world
    for res in results:
        rank = res["rank"]
        # ours (qualname W8<name>) under the fork's class name, which fork code looks modules up by
        assert all(q == "W8" + n for q, n in res["bank_classes"]), res["bank_classes"]
        assert res["threads"] and res["caller"] not in res["threads"], "the load ran on the loader's worker threads"
        assert res["graphs"] == len(CASES) and res["graphs_after_second"] == len(CASES), "one graph per shape, no recompile"
        # one launch per MoE layer; Qwen3.5 under EP one more, its shared expert's own bank (shared_expert.py)
        per_layer = 2 if family == "qwen3_5_moe" and ep else 1
        assert all(k == ["moe_w8_blocks_pow2"] * (per_layer * len(layers)) for k in res["kernels"]), res["kernels"]
        shared = res.get("shared") or [None] * len(layers)
        assert (family == "qwen3_5_moe") == all(s is not None for s in shared), shared  # adopted by default
        for kw, plan, layer, sh in zip(res["kernel_weights"], res["plans"], layers, shared):
            routed, own = split_shared(kw, plan, sh)
            for (g, proj), got in stored_values(routed, plan).items():
                name = f"{prefix(family)}.{layer}.mlp.experts.{g}.{proj}.weight"
                assert inexact_in_slice(got, tensors, name, proj, plan) == 0, (rank, g, proj)
            for skw, splan in own:  # the shared expert: the rank's TP shard over the world, the same bound
                for (_, proj), got in stored_values(skw, splan).items():
                    name = f"{prefix(family)}.{layer}.mlp.shared_expert.{proj}.weight"
                    assert inexact_in_slice(got, tensors, name, proj, splan) == 0, (rank, "shared", proj)
        for key, offset in (("outputs", 0), ("outputs_second", SECOND)):
            for name, tokens, decode, seed in CASES:
                for i, layer in enumerate(layers):
                    got = res[key][name][i]
                    assert got.dtype == torch.bfloat16
                    ref = want(layer, gr.hidden(tokens, seed + offset, got.shape[-1]))
                    ref = ref.chunk(world)[rank] if sp and not decode else ref  # the rank's sequence-parallel share
                    err = st.rel_err(got, ref)
                    assert err <= REL_TOL, f"rank {rank} {key} {name} layer {layer}: {err:.2e}"


def test_the_exactness_bound_is_tight():
    assert EXACT_BOUND < 2.0**-8


@pytest.mark.parametrize("family", list(fams.FAMILIES))
def test_cpu_compile_weights_free_build_traces_on_meta(run, checkpoints, family):
    """VLLM_NEURON_CPU_COMPILE: the runner calls ``load_weights_lite`` when the model has one, then moves it to meta.
    whn09's Qwen3.5 model has none (@3de9ea3): neuron-w8 gives the model one, so every family's experts are meta
    buffers of the kernel layout (no weights read) and the MoE halves trace (fullgraph) on meta."""
    ckpt = checkpoints(family)
    results = run(gr.Job(family, 1, False, str(ckpt), cases=CASES, compile=True, lite=True))
    for res in results:
        assert all(dev == "meta" and dtype == torch.uint8 for b in res["lite_buffers"] for dev, dtype in b.values())
        assert res["graphs"] == len(CASES)
        assert all(o.device.type == "meta" for o in res["outputs"].values())
    if family == "qwen3_5_moe":
        assert not results[0]["has_own_lite"], "the fork's Qwen3.5 model has no load_weights_lite of its own"


# ---- GLM-5: what the fork binds, checks and requires, the same in both trees ------------------------------------


def failure(run, job: gr.Job) -> str:
    """The error text of a job that must fail (a rank's traceback in the real tree, the exception in the stand-in)."""
    try:
        run(job)
    except Exception as e:  # noqa: BLE001 - the text is what is judged
        return f"{type(e).__name__}: {e}"
    raise AssertionError(f"{job.family} {job.relax} {job.additional_config}: expected a failure, the job ran")


def test_glm5_pins_are_bound_at_import(run, checkpoints):
    """The fork binds its size pins as default arguments when weight_loaders is imported
    (``load_checkpoint_manifest(expected_key_count=...)``, ``local_load_plan(ep=PINNED_EP)``): assigning the module
    constants afterwards changes nothing, and keeping the index key count pinned refuses the tiny index, naming it."""
    ckpt = checkpoints("glm_moe_dsa")
    keys = fams.index_key_count(ckpt)
    for how in ("assign", "keep-key-count"):
        text = failure(run, gr.Job("glm_moe_dsa", 1, False, str(ckpt), relax=how))
        assert f"Checkpoint index has {keys} keys; expected 118629" in text, (how, text[-3000:])


def test_glm5_official_tiny_layout_is_refused_by_the_forks_contract(run, tmp_path):
    """The official tiny layout (one dense layer) is one the fork's pinned contract refuses (first_k_dense_replace 3,
    a layout pin the tests do not relax); the vllm-neuron layout (tiny_models layout="vllm-neuron") is accepted."""
    from vllm_moe_w8 import tiny_models

    ckpt = tiny_models.write_checkpoint(tmp_path / "official", "GlmMoeDsaForCausalLM", num_experts=16,
                                        num_experts_per_tok=8)
    text = failure(run, gr.Job("glm_moe_dsa", 1, False, str(ckpt)))
    assert "first_k_dense_replace=1 (expected 3)" in text, text[-3000:]


def test_glm5_default_sampling_is_named_at_start_up_not_deep_in_the_fork(run, checkpoints):
    """A launch without greedy on-device sampling: neuron-w8's start-up check refuses it naming the remedy; without
    that check the fork itself refuses while building the model."""
    ckpt = checkpoints("glm_moe_dsa")
    sampling = {"neuron_config": {"on_device_sampling_config": {}}}  # what NeuronConfig.from_dict({}) makes
    text = failure(run, gr.Job("glm_moe_dsa", 1, False, str(ckpt), additional_config=sampling, precheck=True))
    assert "on-device sampling must be greedy" in text and '"all_greedy": true' in text, text[-3000:]
    # the launch line that starts, with the TP the fork's factory supports (relaxed to this tiny world: 1)
    assert "vllm serve zai-org/GLM-5-FP8 --quantization neuron-w8 --tensor-parallel-size 1 --additional-config" in text
    text = failure(run, gr.Job("glm_moe_dsa", 1, False, str(ckpt), additional_config=sampling, glue=False))
    assert "GLM-5.2 on-device sampling supports greedy only" in text, text[-3000:]
    greedy = gr.Job("glm_moe_dsa", 1, False, str(ckpt), cases=CASES[:1], precheck=True)
    assert run(greedy)[0]["bank_classes"], "the family's launch (greedy) passes the start-up check and builds"
