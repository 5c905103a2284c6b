"""Qwen3.5-MoE's attention and Gated-DeltaNet mixers with 1-byte projections (neuron_glue/mixers.py), in both trees:
the stand-in (CI) and the real vllm-neuron files (``--vllm-neuron-tree``: whn09's ``model/qwen3_5/model.py``
@3de9ea3 and ``deltanet.py`` @7ea9927, their real forward, KV pages, recurrent state and delta rule).

Each rank builds and loads the tiny Qwen3.5-MoE the runner's way (tests/_glue_ranks.py: the threaded loader fills
what vllm-neuron still owns; neuron-w8's loader the released projections). Per mixer, vllm-neuron's own forward runs
prefill (64 tokens, the rank's sequence-parallel share) then decode (4 requests reading the pages the prefill wrote),
compiled with ``fullgraph=True``; a second decode with other inputs must not recompile. The reference is the same
vllm-neuron class, unadopted, built in float64 with every parameter filled by its own weight loader from the
checkpoint's exact values (its BF16 twin - today's path: weights rounded to bf16, vllm-neuron's own matmuls - is
measured beside it: ours may not be worse).
"""

from __future__ import annotations

import pytest
import torch

import _glue_ranks as gr
import _neuron_standin as st
from test_neuron_glue_realtree import assembled, checkpoints, real_folder, run, tree  # noqa: F401

FAMILY = "qwen3_5_moe"
# A mixer's output against its float64 twin. Both ours and today's BF16 path carry vllm-neuron's bf16 activations
# through the mixer (the input, each projection's output cast to bf16 as its `@` returns it, attention probabilities,
# DeltaNet's conv window and gated norm); ours keeps the weights exact (pow2 codes, fp32 accumulation) where today's
# rounds every weight to bf16. Those activations dominate: measured, today's path is 6.4e-3 (attention) and 1.4e-2
# (the real DeltaNet's decode step from its prefilled state) away from float64. The gate is the error users already
# accept, rounded up to a power of two, 2**-6; a loading fault is 0.19 or more. And ours must not be worse than today's
# path: within NOT_WORSE of its error (its weights are closer to the checkpoint's; the activations are the same).
MIXER_REL_TOL = 2.0**-6
NOT_WORSE = 1.1
# A fused product [T, N] fp32 against float64 x @ W of the twin's exact parameters: bf16 inputs are exact, the weights
# exact, fp32 accumulation over K <= 2**11 terms errs by at most K x 2**-24 ~ 1.2e-4 relative in the worst case.
LINEAR_REL_TOL = 2.0**-12
FAULTS = ("scale_tile_doubled", "last_two_parts_swapped", "other_ranks_shard")
# Real Qwen3.5 head dims (256 attention, 128 DeltaNet) keep every rank's slice in whole 128x128 blocks at the TP sizes
# served; the family's default tiny model (64) does not at TP 2, so the 1-byte tests use a tiny model with 128.
ALIGNED = dict(head_dim=128, linear_head_dim=128)


def _write_aligned(tmp_path_factory, **extra):
    from vllm_moe_w8 import tiny_models

    f = st.FAMILIES[FAMILY]
    return tiny_models.write_checkpoint(tmp_path_factory.mktemp("mixers") / "aligned", f["arch"],
                                        **dict(f["sizes"], num_hidden_layers=2, **ALIGNED, **extra))


@pytest.fixture(scope="module")
def aligned(tmp_path_factory):
    return _write_aligned(tmp_path_factory)


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory):
    """One KV head for the four query heads: at TP 2 both ranks hold the same (replicated) KV head, as Qwen3.5-35B-A3B's
    2 KV heads at TP 4 - the loaders' ``rank // num_kv_replicas`` rule decides which."""
    return _write_aligned(tmp_path_factory, num_key_value_heads=1)


@pytest.mark.parametrize("world,kv", [(1, "kv2"), (2, "kv2"), (2, "kv1_replicated")])
def test_mixers_run_vllm_neurons_forward_with_1_byte_projections(run, aligned, one_kv_head, world, kv):
    ckpt = aligned if kv == "kv2" else one_kv_head
    results = run(gr.Job(FAMILY, world, False, str(ckpt), extra="_glue_extras:mixer_checks"))
    worst, bf16_worst, closest_fault, products = {}, {}, {}, {}
    for res in results:
        kinds = sorted(m["kind"] for m in res["extra"])
        assert kinds == ["attention", "deltanet"], kinds  # the tiny model's two layers: one of each mixer
        for m in res["extra"]:
            where = f"world {world} rank {res['rank']} {m['kind']} layer {m['layer']}"
            assert m["qualname"] in ("W8Qwen3_5Attention", "W8Qwen3_5GatedDeltaNet"), m["qualname"]
            assert m["released"] == [], f"{where}: vllm-neuron still holds {m['released']}"
            if m["kind"] == "attention":  # the KV head shared by both ranks under TP 2 with one KV head
                assert m["kv_replicas"] == (2 if kv == "kv1_replicated" else 1), (where, m["kv_replicas"])
            assert m["graphs"] == 2, f"{where}: {m['graphs']} graphs for prefill + two decodes (fullgraph, no recompile)"
            for phase in ("prefill", "decode"):
                want = m["float64"][phase]
                err, base = st.rel_err(m["ours"][phase], want), st.rel_err(m["bf16"][phase], want)
                worst[m["kind"]] = max(worst.get(m["kind"], 0.0), err)
                bf16_worst[m["kind"]] = max(bf16_worst.get(m["kind"], 0.0), base)
                assert m["ours"][phase].dtype == torch.bfloat16 and err <= MIXER_REL_TOL, f"{where} {phase}: {err:.2e}"
                assert err <= NOT_WORSE * base, f"{where} {phase}: {err:.2e}, today's BF16 path {base:.2e}"
            assert st.rel_err(m["ours_second"], m["float64_second"]) <= MIXER_REL_TOL, f"{where}: second decode"
            for group, (got, want) in m["products"].items():
                products[group] = max(products.get(group, 0.0), st.rel_err(got, want))
                assert got.dtype == torch.float32 and products[group] <= LINEAR_REL_TOL, (where, group, products[group])
            for fault in FAULTS:
                if fault in m["faults"]:
                    err = st.rel_err(m["faults"][fault]["prefill"], m["float64"]["prefill"])
                    closest_fault[fault] = min(closest_fault.get(fault, float("inf")), err)
                    assert err > MIXER_REL_TOL, f"{where}: fault {fault} passed the gate ({err:.2e})"
            assert ("other_ranks_shard" in m["faults"]) == (world > 1)
    print(f"mixers world {world} {kv}: worst rel err vs float64 {worst} (today's BF16 {bf16_worst}); closest faults "
          f"{closest_fault}; gate {MIXER_REL_TOL:.2e}; fused products vs float64 x @ W {products} (gate {LINEAR_REL_TOL:.2e})")


def test_weights_free_build_traces_the_mixers_on_meta(run, aligned):
    """VLLM_NEURON_CPU_COMPILE (the runner's load_weights_lite, then .to("meta")): the mixers' packed 1-byte
    projections are meta buffers of the real layout (packed from zero codes of the config's shapes: nothing read) and
    vllm-neuron's forward traces on meta for prefill and decode."""
    ckpt = aligned
    for res in run(gr.Job(FAMILY, 2, False, str(ckpt), lite=True, extra="_glue_extras:mixer_meta_checks")):
        assert sorted(m["kind"] for m in res["extra"]) == ["attention", "deltanet"]
        for m in res["extra"]:
            assert m["buffers"] == ["meta"] and m["outputs"] == ["meta", "meta"] and m["graphs"] == 2, m
            assert not m["has_fp8_params"]


def test_a_slice_cutting_scale_blocks_keeps_vllm_neurons_bf16_path(run, checkpoints, aligned):
    """The family's tiny model (head dims 64): at TP 1 every slice is whole 128x128 blocks and both mixers are adopted;
    at TP 2 a rank's KV head (64 rows) and DeltaNet q / k segments cut a block, so those mixers keep vllm-neuron's BF16
    parameters (loaded, dequantised, as today) - the layer still runs; with the opt-out every mixer keeps them."""
    small = checkpoints(FAMILY)
    job = lambda ckpt, world, extra=None: gr.Job(FAMILY, world, False, str(ckpt), extra="_glue_extras:mixer_adoption",  # noqa: E731
                                                 additional_config=extra or {})
    one = run(job(small, 1))[0]["extra"]
    assert all(q.startswith("W8") and not bf16 for _, _, q, bf16, _ in one), one
    for res in run(job(small, 2)):
        assert all(not q.startswith("W8") and len(bf16) in (3, 4) and set(d) == {"torch.bfloat16"}
                   for _, _, q, bf16, d in res["extra"]), res["extra"]
    for res in run(job(aligned, 2, {"neuron_w8": {"non_expert_layers": "bf16"}})):
        assert all(not q.startswith("W8") and bf16 for _, _, q, bf16, _ in res["extra"]), res["extra"]


# The layouts `plan` says neuron-w8 serves at 1 byte (tools/decode_bytes.SERVED): issue #34's table (TP 4, LNC 2) and
# the packaged recommendation (TP 8, LNC 1). Each rank's mixers, built as vllm-neuron builds them at that TP, must be
# adopted by mixers.plan_cuts, their rank cuts the loaders' own: q whole [query | gate] heads partitioning the
# checkpoint's rows, k / v the KV head of rank // (TP / KV heads), o_proj / out_proj this rank's input columns.
SERVED_LAYOUTS = [("qwen3.5-35b-a3b", 4, 2), ("qwen3.5-35b-a3b", 8, 1)]


@pytest.mark.parametrize("model,tp,lnc", SERVED_LAYOUTS)
def test_the_served_qwen35_layouts_are_adopted_with_the_loaders_cuts(model, tp, lnc):
    import dataclasses
    import importlib

    import json

    from vllm_moe_w8.neuron_glue import mixers
    from vllm_moe_w8.tools import plan

    st.put_standin_on_path()
    try:
        ps = importlib.import_module("vllm_neuron.parallel.neuron_parallel_state")
        cfg_mod = importlib.import_module("vllm_neuron.model.qwen3_5.config")
        get_loader = importlib.import_module("vllm_neuron.utils.weight_loader").get_weight_loader
        tc = json.loads(plan.packaged_configs()[model].read_text())["config"]["text_config"]
        mixer_fields = ("num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
                        "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
        text = cfg_mod.Qwen3_5TextConfig(tc["hidden_size"], tc["num_hidden_layers"], tuple(tc["layer_types"]),
                                         tc.get("rms_norm_eps", 1e-6), torch.bfloat16,
                                         **{k: tc[k] for k in mixer_fields})
        shapes = mixers.checkpoint_shapes(text)
        group = ps.ThreadGroup(tp)
        q_rows = []
        for rank in range(tp):
            ps.set_rank_state(ps.GroupCoordinator(group, rank))
            for target in mixers.TARGETS:
                cls = getattr(importlib.import_module(target.module[0]), target.module[1])
                with torch.device("meta"):
                    module = cls(text, 3 if target.kind == "attention" else 0)
                mixers.check_module(module, target, target.kind)
                loaders = {p: get_loader(getattr(module, p)) for g in target.groups for p in g.params}
                cuts, why = mixers.plan_cuts(target, loaders, rank, shapes, lnc, f"rank {rank} {target.kind}")
                assert cuts is not None, f"{model} TP {tp} rank {rank}: {target.kind} kept BF16: {why}"
                if target.kind == "attention":
                    kv_head = rank // (tp // text.num_key_value_heads)
                    for p in ("k_proj_weight", "v_proj_weight"):
                        assert cuts[p].rows.tolist() == list(range(kv_head * text.head_dim, (kv_head + 1) * text.head_dim))
                    q_rows += cuts["q_proj_weight"].rows.tolist()
                    per = 2 * text.num_attention_heads * text.head_dim // tp
                    assert cuts["q_proj_weight"].rows.tolist() == list(range(rank * per, (rank + 1) * per))
                    assert cuts["o_proj_weight"].cols.tolist() == list(range(rank * per // 2, (rank + 1) * per // 2))
                else:
                    gk = text.linear_num_key_heads * text.linear_key_head_dim
                    vd, kd = text.linear_num_value_heads * text.linear_value_head_dim // tp, gk // tp
                    segments = [range(o + rank * n, o + (rank + 1) * n) for o, n in ((0, kd), (gk, kd), (2 * gk, vd))]
                    assert cuts["in_proj_qkv_weight"].rows.tolist() == [r for seg in segments for r in seg]
                    assert cuts["in_proj_z_weight"].rows.tolist() == list(range(rank * vd, (rank + 1) * vd))
                    assert cuts["out_proj_weight"].cols.tolist() == list(range(rank * vd, (rank + 1) * vd))
        assert sorted(q_rows) == list(range(shapes["self_attn.q_proj"][0]))
    finally:
        st.drop_standin()


def _fp8_part(rows: int, cols: int, seed: int, top: bool = False):
    """E4M3FN bytes [rows, cols] (no NaN codes) and positive block scales; ``top``: every block uses codes above 240,
    so the pow2 repack halves it (odd subnormals round: the count the self-check must match)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 0x7F, (rows, cols), generator=g, dtype=torch.uint8)  # positive codes, 0x7F (NaN) excluded
    codes |= (torch.randint(0, 2, (rows, cols), generator=g, dtype=torch.uint8) << 7)  # random signs
    if top:
        codes[::128, ::128] = 0x7E  # 448: every block halved
    scales = torch.rand(rows // 128, cols // 128, generator=g) + 0.5
    return codes, scales


def test_the_packed_projections_self_check_against_the_checkpoint():
    """mixers.check_packed (run at load on the first mixer of each kind, as the experts' sampled self-check): the
    packed q+k+v passes against the checkpoint's codes x scales, exactly (pow2: only the counted roundings differ);
    realistic loading faults stop it, naming the part - a code flipped in the packed copy, one part's scales taken from
    another part (a mis-cut), the parts fused in another order than the checkpoint's."""
    from vllm_moe_w8.neuron_glue import mixers
    from vllm_moe_w8.kernels import host_linear as hl
    from vllm_moe_w8.vllm_glue.self_check import NumericsSelfCheckError

    parts = [(*_fp8_part(256, 256, 1, top=True), "q_proj.weight"), (*_fp8_part(128, 256, 2), "k_proj.weight"),
             (*_fp8_part(128, 256, 3, top=True), "v_proj.weight")]
    lw = mixers.pack(parts, "layers.3.qkv")
    assert lw.stats.blocks_shifted > 0 and lw.stats.values_changed > 0  # the rounding the count must match happened
    mixers.check_packed(parts, lw, "layers.3.qkv")

    flipped = hl.LinearWeights(lw.codes.clone(), lw.scales, lw.name, lw.splits, lw.parts, lw.stats)
    flipped.codes[5, 1, 300] ^= 0x01  # one stored code one step off, in row 300: the k_proj part (rows 256..383)
    with pytest.raises(NumericsSelfCheckError, match="k_proj.weight"):
        mixers.check_packed(parts, flipped, "layers.3.qkv")
    wrong_scales = [parts[0], (parts[1][0], parts[2][1], "k_proj.weight"), parts[2]]
    with pytest.raises(NumericsSelfCheckError, match="k_proj.weight"):
        mixers.check_packed(parts, mixers.pack(wrong_scales, "layers.3.qkv"), "layers.3.qkv")
    with pytest.raises(NumericsSelfCheckError):
        mixers.check_packed(parts, mixers.pack([parts[0], parts[2], parts[1]], "layers.3.qkv"), "layers.3.qkv")
