"""The Neuron experts module on CPU, inside a stand-in of vllm-neuron (tests/neuron_standin, NOT vllm-neuron).

Each rank of a TP=2 or EP=2 group builds the tiny Qwen3-MoE model the way vllm-neuron's runner does
(from_configs on the meta device, load_weights from a real-layout FP8 checkpoint), with neuron-w8's
factory wrapping; its MoE block's NKI kernel runs in the project's interpreter, its collectives go
through the stand-in's process group. Every rank's output must match an independent float64 reference
computed from the checkpoint's own values (torch's float8 conversion), the router and the norm.
"""

from __future__ import annotations

import pytest
import torch

import _neuron_standin as st
from vllm_moe_w8.codec import fp8
from vllm_moe_w8.neuron_glue import kernel_launch

# Relative Frobenius error of a rank's MoE output against the float64 reference. The kernel rounds the
# activation SiLU(g)*u*affinity to bf16 before the down projection (unit roundoff 2**-9), the module
# returns bf16 (another 2**-9), and the pow2 repack rounds odd subnormal codes (<= 2**-9 x block scale,
# a few values). Independent roundings of 2**-9 add in quadrature to well under 2**-8; 2**-7 leaves 2x
# headroom for fp32 accumulation and the RMSNorm's bf16 input. Measured (TP=2 and EP=2, decode and prefill): <= 3.1e-3.
REL_TOL = 2.0**-7
SIZES = dict(hidden_size=256, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2)
# output-block requantises every weight to e4m3 (3 mantissa bits) per 128 output rows: each weight is off by
# at most half a step, 2**-4 relative, in each of the two chained projections, so the output's relative
# error stays below 2 x 2**-4 = 2**-3. Measured (TP=2 and EP=2): <= 6.2e-2.
OUTPUT_BLOCK_REL_TOL = 2.0**-3
T_DECODE = 6
T_PREFILL = 12  # divisible by the world size (sequence parallel); the last PAD tokens are padding
PAD = 2


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from vllm_moe_w8 import tiny_models

    return tiny_models.write_checkpoint(tmp_path_factory.mktemp("ng") / "qwen3moe", "Qwen3MoeForCausalLM", **SIZES)


@pytest.fixture(scope="module")
def tensors(ckpt):
    return st.checkpoint_tensors(ckpt)


@pytest.fixture()
def glue(monkeypatch):
    """The stand-in on sys.path, neuron-w8's Neuron registration installed, the vLLM config a test sets."""
    yield from st.glue_fixture(monkeypatch)


def load_rank_models(ckpt, holder, world, ep, additional_config=None):
    from vllm_neuron.model.qwen3_moe import Qwen3MoeForCausalLM
    from vllm_neuron.vllm.worker.neuron_model_runner import load_model

    holder["config"] = st.vllm_config(ckpt, additional_config=additional_config)
    state = st.make_groups(world, ep)
    cfg = holder["config"].model_config.hf_config

    def build(rank):
        state(rank)
        return load_model(Qwen3MoeForCausalLM, cfg, None, str(ckpt))

    return state, st.run_ranks(world, build)


def hidden_states(tokens, seed):
    return (torch.randn(tokens, SIZES["hidden_size"], generator=torch.Generator().manual_seed(seed)) * 2).to(torch.bfloat16)


def reference(tensors, layer, hidden, real=None):
    prefix = f"model.layers.{layer}"
    x = st.rms_norm(hidden, tensors[f"{prefix}.post_attention_layernorm.weight"], 1e-6)
    return st.reference_routed(x, tensors, prefix, SIZES["num_experts"], SIZES["num_experts_per_tok"], real=real)


def run_layer(models, state, layer, world, decode_hidden, prefill_hidden, positions):
    def step(rank):
        state(rank)
        block = models[rank].model.layers[layer].mlp.experts
        dec = block(decode_hidden, positions=None, is_decode=True, rank=None)
        chunk = prefill_hidden.chunk(world)[rank]
        pre = block(chunk, positions=positions, is_decode=False, rank=None)
        return dec, pre

    return st.run_ranks(world, step)


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "ep2"])
def test_rank_loop_matches_reference(glue, ckpt, tensors, ep):
    world = 2
    state, models = load_rank_models(ckpt, glue, world, ep)
    decode_hidden, prefill_hidden = hidden_states(T_DECODE, 1), hidden_states(T_PREFILL, 2)
    positions = torch.cat([torch.arange(T_PREFILL - PAD), torch.zeros(PAD, dtype=torch.long)])
    real = torch.arange(T_PREFILL) < T_PREFILL - PAD
    for layer in range(SIZES["num_hidden_layers"]):
        want_dec = reference(tensors, layer, decode_hidden)
        want_pre = reference(tensors, layer, prefill_hidden, real)
        outs = run_layer(models, state, layer, world, decode_hidden, prefill_hidden, positions)
        for rank, (dec, pre) in enumerate(outs):
            assert dec.dtype == torch.bfloat16 and dec.shape == decode_hidden.shape
            assert st.rel_err(dec, want_dec) <= REL_TOL, f"decode, layer {layer}, rank {rank}"
            assert st.rel_err(pre, want_pre.chunk(world)[rank]) <= REL_TOL, f"prefill, layer {layer}, rank {rank}"
            assert bool((pre.chunk(1)[0][real.chunk(world)[rank].logical_not()] == 0).all()), "padding tokens add nothing"


T_LONG_PREFILL = 2 * (kernel_launch.DENSE_MAX_TOKENS + 2)  # above one 128-token dense chunk


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "ep2"])
def test_long_prefill_runs_the_block_kernel_and_matches_reference(glue, ckpt, tensors, monkeypatch, ep):
    """The experts module's kernel call is kernel_launch.run_routed_experts: a prefill above DENSE_MAX_TOKENS rows
    runs the block prefill kernel in one launch (T + 128 hidden rows, metadata on device) at the configured LNC,
    and the layer still matches the reference."""
    world = 2
    state, models = load_rank_models(ckpt, glue, world, ep)
    hidden_rows = []
    real_launch = kernel_launch.launch
    monkeypatch.setattr(kernel_launch, "launch", lambda kernel, lnc, tensors, *a: hidden_rows.append(
        (kernel.__name__, lnc, tensors[0].shape[0])) or real_launch(kernel, lnc, tensors, *a))
    hidden = hidden_states(T_LONG_PREFILL, 4)
    positions = torch.arange(T_LONG_PREFILL)
    want = reference(tensors, 0, hidden, torch.ones(T_LONG_PREFILL, dtype=torch.bool))

    def step(rank):
        state(rank)
        block = models[rank].model.layers[0].mlp.experts
        # sequence-parallel input, all-gathered inside the block: T_LONG_PREFILL rows reach the kernel call
        return block(hidden.chunk(world)[rank], positions=positions, is_decode=False, rank=None)

    outs = st.run_ranks(world, step)
    assert sorted(hidden_rows) == [("moe_w8_blocks_pow2", 2, T_LONG_PREFILL + 128)] * world, hidden_rows
    for rank, out in enumerate(outs):
        assert st.rel_err(out, want.chunk(world)[rank]) <= REL_TOL, f"rank {rank}"


def test_tolerance_catches_realistic_errors(glue, ckpt, tensors):
    """Fault twins of REL_TOL: each is a plausible bug in this glue, and each must fail the gate."""
    world = 2
    state, models = load_rank_models(ckpt, glue, world, ep=False)
    hidden = hidden_states(T_DECODE, 3)
    want = reference(tensors, 0, hidden)
    prefix = "model.layers.0"
    x = st.rms_norm(hidden, tensors[f"{prefix}.post_attention_layernorm.weight"], 1e-6)
    # routing without renormalising the top-k weights (vllm-neuron's decode kernel call passes no norm_topk_prob)
    unnormalised = st.reference_routed(x, tensors, prefix, SIZES["num_experts"], SIZES["num_experts_per_tok"], renormalize=False)
    assert st.rel_err(unnormalised, want) > REL_TOL

    def partial(rank):  # one TP rank's partial sum, as if the all-reduce were missing
        state(rank)
        block = models[rank].model.layers[0].mlp.experts
        block.moe_group = type("NoReduce", (), {"world_size": 1})()
        return block(hidden, positions=None, is_decode=True, rank=None)

    outs = st.run_ranks(world, partial)
    assert all(st.rel_err(o, want) > REL_TOL for o in outs)

    # the other rank's intermediate shard (a loader off by one rank): swap the two ranks' stored experts
    a, b = (models[r].model.layers[0].mlp.experts for r in range(world))
    kw_a, kw_b = a.w8_kernel_weights(), b.w8_kernel_weights()
    a.w8_set_weights(kw_b)
    b.w8_set_weights(kw_a)

    def swapped(rank):
        state(rank)
        return models[rank].model.layers[0].mlp.experts(hidden, positions=None, is_decode=True, rank=None)

    outs = st.run_ranks(world, swapped)
    assert st.rel_err(outs[0], want) > REL_TOL


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "ep2"])
def test_loaders_cut_experts_like_vllm_neuron(glue, ckpt, tensors, ep):
    """Stored codes x scales per rank == the checkpoint's slice in vllm-neuron's convention (pow2 bound)."""
    from vllm_moe_w8.neuron_glue.loaders import from_kernel_layout

    world = 2
    _, models = load_rank_models(ckpt, glue, world, ep)
    e_total, inter = SIZES["num_experts"], SIZES["moe_intermediate_size"]
    for rank, model in enumerate(models):
        block = model.model.layers[1].mlp.experts
        kw = block.w8_kernel_weights()
        w13, w2 = from_kernel_layout(kw)
        local, i_r = (e_total // world, inter) if ep else (e_total, inter // world)
        first, lo = (rank * local, 0) if ep else (0, rank * i_r)
        assert w13.shape == (local, 2 * i_r, SIZES["hidden_size"]) and kw.w13.dtype == torch.uint8
        assert not any(isinstance(p, torch.nn.Parameter) and p.dim() == 3 for p in block.parameters()), "no BF16 experts kept"
        for e in range(local):
            g = first + e
            for proj, codes, scales in (
                ("gate_proj", w13[e, :i_r], kw.w13_scales[e, : i_r // 128]),
                ("up_proj", w13[e, i_r:], kw.w13_scales[e, i_r // 128:]),
                ("down_proj", w2[e], kw.w2_scales[e]),
            ):
                name = f"model.layers.1.mlp.experts.{g}.{proj}.weight"
                full = st.dequant(tensors, name)
                want = full[lo: lo + i_r] if proj != "down_proj" else full[:, lo: lo + i_r]
                got = torch.from_numpy(codes.numpy().view(__import__("ml_dtypes").float8_e4m3).astype("float32"))
                got = got * fp8.expand_scales(scales, tuple(codes.shape), (128, 128))
                scale_el = fp8.expand_scales(tensors[name + "_scale_inv"].float(), tuple(full.shape), (128, 128))
                scale_el = scale_el[lo: lo + i_r] if proj != "down_proj" else scale_el[:, lo: lo + i_r]
                assert bool(((got - want).abs() <= 2.0**-9 * scale_el * (1 + 2.0**-10)).all()), (rank, g, proj)


def test_output_block_mode(glue, ckpt, tensors):
    """output-block (opt-in, lossy): stored per 128 output rows; within its stated error of the checkpoint reference."""
    state, models = load_rank_models(ckpt, glue, 1, ep=False, additional_config={"neuron_w8": {"mode": "output-block"}})
    block = models[0].model.layers[0].mlp.experts
    assert block.w8_kernel_weights().mode == "output-block" and block.w8_w13_scales.shape[-1] == 1
    hidden = hidden_states(T_DECODE, 4)
    state(0)
    out = block(hidden, positions=None, is_decode=True, rank=None)
    assert st.rel_err(out, reference(tensors, 0, hidden)) <= OUTPUT_BLOCK_REL_TOL


def test_self_check_stops_a_corrupt_repack(glue, ckpt, monkeypatch):
    """The load-time self-check's bound (fault twin): one flipped code in a sampled expert stops the load."""
    from vllm_moe_w8.neuron_glue import loaders
    from vllm_moe_w8.vllm_glue.self_check import NumericsSelfCheckError

    real_repack = fp8.repack

    def corrupt(weight, scale, mode="pow2", block=None, name=None):
        rep = real_repack(weight, scale, mode, block, name=name)
        if name == "model.layers.0.mlp.experts.0.down_proj.weight":
            rep.codes[5, 7] ^= 0x08  # one exponent bit of one weight
        return rep

    monkeypatch.setattr(loaders.fp8, "repack", corrupt)
    with pytest.raises(NumericsSelfCheckError, match=r"layer 0, expert 0 \(local 0\), down_proj\[5, 7\]"):
        load_rank_models(ckpt, glue, 1, ep=False)


def test_converted_checkpoint_loads_without_repack(glue, ckpt, tensors, tmp_path):
    """A `vllm-moe-w8 convert` checkpoint (pow2 codes already final) gives the bytes load-time conversion gives."""
    from vllm_moe_w8.tools.convert import convert_checkpoint

    world = 2
    summary = convert_checkpoint(ckpt, tmp_path / "converted", mode="pow2", tp=world, progress=False)
    assert summary["ok"], summary
    state, converted = load_rank_models(tmp_path / "converted", glue, world, ep=False)
    _, original = load_rank_models(ckpt, glue, world, ep=False)
    for rank in range(world):
        a = converted[rank].model.layers[1].mlp.experts.w8_kernel_weights()
        b = original[rank].model.layers[1].mlp.experts.w8_kernel_weights()
        assert torch.equal(a.w13, b.w13) and torch.equal(a.w2, b.w2)
        assert torch.equal(a.w13_scales, b.w13_scales) and torch.equal(a.w2_scales, b.w2_scales)
    hidden = hidden_states(T_DECODE, 7)
    outs = run_layer(converted, state, 0, world, hidden, hidden_states(T_PREFILL, 8), None)
    assert all(st.rel_err(dec, reference(tensors, 0, hidden)) <= REL_TOL for dec, _ in outs)
