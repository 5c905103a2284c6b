"""The neuron-w8 MoE method on real vLLM ``RoutedExperts`` layers, in-process: loading through vLLM's
TP/EP-aware weight loader, repack modes, the numerics self-check, TP and EP rank loops, logging.

Independent truth: a float64 MoE over the checkpoint's exactly dequantised weights (torch's own FP8
conversion, ``_plugin_fixtures.dense_moe``), and the reassembled per-rank shards vs the checkpoint.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

pytest.importorskip("vllm")

from _plugin_fixtures import PREFIX, dense_moe, load_layer, make_checkpoint, make_layer, plugin_log, quant_config_for, rel_err, routing  # noqa: E402

from vllm_moe_w8.codec import fp8  # noqa: E402
from vllm_moe_w8.op import reference as moe_reference  # noqa: E402
from vllm_moe_w8.vllm_glue.self_check import POW2_BOUND_SLACK  # noqa: E402

# fp32 accumulation over H=256 / I<=384 products vs a float64 reference, plus pow2's counted
# round-to-nearest-even values (each <= 2**-9 x its block scale): measured ~1e-6 of max|out|.
EXACT_MODE_RTOL = 1e-5
# Same op, same stored weights, different fp32 summation order (per-rank partial sums).
SUMMATION_RTOL = 1e-5
# output-block requantises every weight to e4m3 with one scale per 128 rows: each weight moves by
# up to half an e4m3 step (2**-4 relative), so the layer output moves by a few percent at most.
OUTPUT_BLOCK_RTOL = 0.1


@pytest.fixture(scope="module")
def ckpt():
    return make_checkpoint(num_experts=4, hidden=256, inter=384)


@pytest.fixture(scope="module")
def tokens(ckpt):
    return routing(9, ckpt.num_experts, 2, ckpt.hidden)


def _layer(fmt, ckpt, **kw):
    layer = make_layer(quant_config_for(fmt), ckpt, **kw)
    load_layer(layer, ckpt)
    return layer


@pytest.mark.parametrize("mode", ["pow2", "lut", "output-block"])
def test_block_fp8_layer_matches_float64_reference(ckpt, tokens, mode):
    layer = _layer("block", ckpt, additional_config={"neuron_w8": {"mode": mode}})
    method = layer.quant_method
    assert method.mode == mode and layer.w13_weight.dtype == torch.uint8 and layer.w2_weight.dtype == torch.uint8
    assert method.code_format == fp8.CODE_FORMAT[mode]
    x, w, ids = tokens
    out = method.apply(layer, x, w, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    on_storage = moe_reference.reference_moe(x, w, ids, layer.w13_weight, layer.w13_weight_scale_inv, layer.w2_weight,
                                             layer.w2_weight_scale_inv, *method.block, method.code_format)
    assert rel_err(out, on_storage) < SUMMATION_RTOL
    tol = OUTPUT_BLOCK_RTOL if mode == "output-block" else EXACT_MODE_RTOL
    assert rel_err(out, dense_moe(ckpt, x, w, ids)) < tol


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_stored_weights_dequantise_to_the_checkpoint(scale_dtype):
    """lut keeps every value; pow2 changes exactly the counted RNE values, each by <= 2**-9 x scale
    (+ fp32 rounding of the two products when the scales are arbitrary fp32, as GLM's are)."""
    ckpt = make_checkpoint(num_experts=4, hidden=256, inter=384, scale_dtype=scale_dtype, seed=11)
    lut = _layer("block", ckpt, additional_config={"neuron_w8": {"mode": "lut"}})
    pow2 = _layer("block", ckpt)
    inter = ckpt.inter
    changed = 0
    for e in range(ckpt.num_experts):
        for layer, exact in ((lut, True), (pow2, False)):
            m = layer.quant_method
            gate, up = moe_reference.dequantize_w13(layer.w13_weight, layer.w13_weight_scale_inv, e, m.block, m.code_format)
            down = moe_reference.dequantize_expert(layer.w2_weight[e], layer.w2_weight_scale_inv[e], m.block, m.code_format)
            for got, shard in ((gate, "w1"), (up, "w3"), (down, "w2")):
                want = ckpt.dense[e, shard]
                if exact:
                    assert torch.equal(got, want), (e, shard)
                else:
                    scale = fp8.expand_scales(ckpt.scales[e, shard].float(), tuple(want.shape), (128, 128))
                    assert bool(((got - want).abs() <= 2.0**-9 * POW2_BOUND_SLACK * scale).all())
                    changed += int((got != want).sum())
    assert changed == int(pow2.quant_method.load_summary.totals["values_rounded"])
    assert gate.shape == (inter, ckpt.hidden)


def test_per_channel_compressed_tensors_layer(tokens):
    ckpt = make_checkpoint(num_experts=4, hidden=256, inter=384, fmt="channel", seed=3)
    layer = _layer("channel", ckpt)
    assert layer.quant_method.block == (1, 0)
    assert tuple(layer.w13_weight_scale.shape) == (4, 2 * 384, 1) and tuple(layer.w2_weight_scale.shape) == (4, 256, 1)
    x, w, ids = tokens
    assert rel_err(layer.quant_method.apply(layer, x, w, ids), dense_moe(ckpt, x, w, ids)) < EXACT_MODE_RTOL


def rank_sum_gate(total, ref, dense) -> None:
    """TP/EP rank loops: the all-reduced per-rank outputs equal the TP1 layer's up to fp32 summation order,
    and the checkpoint's float64 MoE up to the exact modes' accumulation error."""
    assert rel_err(total, ref) < SUMMATION_RTOL, f"rank sum vs TP1: rel err {rel_err(total, ref):.3g}"
    assert rel_err(total, dense) < EXACT_MODE_RTOL, f"rank sum vs float64: rel err {rel_err(total, dense):.3g}"


def tp_rank_sum(ckpt, tokens, tp_size, loads_rank=lambda rank: rank):
    """Sum of the pow2 layer outputs of every TP rank; rank r loads the shard of ``loads_rank(r)``."""
    x, w, ids = tokens
    total = torch.zeros(x.shape[0], ckpt.hidden, dtype=torch.float64)
    for rank in range(tp_size):
        pow2 = _layer("block", ckpt, tp=(tp_size, loads_rank(rank)))
        total += pow2.quant_method.apply(pow2, x, w, ids).double()
    return total


def ep_rank_sum(ckpt, tokens, loads_rank=lambda rank: rank):
    """Sum of the layer outputs of two EP ranks (each holding half the experts); rank r loads ``loads_rank(r)``'s."""
    x, w, ids = tokens
    total = torch.zeros(x.shape[0], ckpt.hidden, dtype=torch.float64)
    for rank in range(2):
        layer = make_layer(quant_config_for("block"), ckpt, ep=(2, loads_rank(rank)))
        loaded = load_layer(layer, ckpt)
        assert loaded == ckpt.num_experts // 2 * 6  # 3 weights + 3 scales per local expert
        assert layer.w13_weight.shape[0] == ckpt.num_experts // 2
        stats = layer.quant_method.load_summary.totals
        assert stats["blocks"] == ckpt.num_experts // 2 * (3 * 2 + 3 * 2 + 2 * 3)  # local experts only
        total += layer.quant_method.apply(layer, x, w, ids).double()
    return total


@pytest.mark.parametrize("tp_size,inter", [(2, 384), (4, 384), (2, 320)])
def test_tp_rank_loop_reassembles_and_sums_exactly(tokens, tp_size, inter):
    """Per-rank intermediate 192 / 96 / 160 is not a multiple of 128: the scale grid is refined to
    gcd(size, 128) and the shards reassemble the checkpoint bit for bit (lut)."""
    ckpt = make_checkpoint(num_experts=4, hidden=256, inter=inter, seed=5)
    x, w, ids = tokens
    ref_layer = _layer("block", ckpt)
    ref = ref_layer.quant_method.apply(ref_layer, x, w, ids)
    per_rank = inter // tp_size
    gates = {e: [] for e in range(ckpt.num_experts)}
    downs = {e: [] for e in range(ckpt.num_experts)}
    for rank in range(tp_size):
        lut = _layer("block", ckpt, tp=(tp_size, rank), additional_config={"neuron_w8": {"mode": "lut"}})
        m = lut.quant_method
        assert m.block == (math.gcd(per_rank, 128),) * 2
        assert tuple(lut.w13_weight.shape) == (ckpt.num_experts, 2 * per_rank, ckpt.hidden)
        for e in range(ckpt.num_experts):
            gate, _ = moe_reference.dequantize_w13(lut.w13_weight, lut.w13_weight_scale_inv, e, m.block, m.code_format)
            gates[e].append(gate)
            downs[e].append(moe_reference.dequantize_expert(lut.w2_weight[e], lut.w2_weight_scale_inv[e], m.block, m.code_format))
    for e in range(ckpt.num_experts):
        assert torch.equal(torch.cat(gates[e], 0), ckpt.dense[e, "w1"])
        assert torch.equal(torch.cat(downs[e], 1), ckpt.dense[e, "w2"])
    rank_sum_gate(tp_rank_sum(ckpt, tokens, tp_size), ref, dense_moe(ckpt, x, w, ids))


def test_ep_rank_loop_holds_and_repacks_only_local_experts(ckpt, tokens):
    x, w, ids = tokens
    ref = _layer("block", ckpt)
    ref_out = ref.quant_method.apply(ref, x, w, ids)
    rank_sum_gate(ep_rank_sum(ckpt, tokens), ref_out, dense_moe(ckpt, x, w, ids))


def test_rank_sum_gate_catches_a_wrong_rank_slice(ckpt, tokens):
    """The gate's twin: the last rank loading rank 0's shard (TP: a wrong slice of every expert; EP: the
    wrong half of the experts) must fail it."""
    x, w, ids = tokens
    ref = _layer("block", ckpt)
    ref_out, dense = ref.quant_method.apply(ref, x, w, ids), dense_moe(ckpt, x, w, ids)
    for tp_size in (2, 4):
        with pytest.raises(AssertionError, match="rank sum vs TP1"):
            rank_sum_gate(tp_rank_sum(ckpt, tokens, tp_size, loads_rank=lambda r: 0 if r == tp_size - 1 else r), ref_out, dense)
    with pytest.raises(AssertionError, match="rank sum vs TP1"):
        rank_sum_gate(ep_rank_sum(ckpt, tokens, loads_rank=lambda r: 0), ref_out, dense)


def test_swiglu_limit_is_applied(ckpt, tokens):
    x, w, ids = tokens
    layer = _layer("block", ckpt, swiglu_limit=0.05)
    out = layer.quant_method.apply(layer, x, w, ids)
    assert rel_err(out, dense_moe(ckpt, x, w, ids, swiglu_limit=0.05)) < EXACT_MODE_RTOL
    assert rel_err(out, dense_moe(ckpt, x, w, ids)) > 10 * EXACT_MODE_RTOL  # the clamp did bite


def _flip_mantissa_lsb(out):
    mag = out.codes & 0x7F
    normal = torch.where(mag < 0x70, mag, 0)  # a large normal value that stays finite when flipped in either format
    i, j = (int(v) for v in divmod(int(torch.argmax(normal)), out.codes.shape[1]))
    out.codes[i, j] ^= 0x01  # one e4m3 step
    return re.escape(f"[{i}, {j}]")


def _double_first_scale(out):
    out.scales.view(-1)[0] *= 2  # the first scale tile (pow2 / lut) or row block (output-block)
    return r"\[0, \d+\]"


@pytest.mark.parametrize("mode", ["pow2", "lut", "output-block"])
@pytest.mark.parametrize("fault", [_flip_mantissa_lsb, _double_first_scale], ids=lambda f: f.__name__[1:])
def test_self_check_stops_a_bad_repack_and_can_be_disabled(ckpt, monkeypatch, mode, fault):
    """The load-time self-check against the smallest realistic repack faults, in every mode."""
    real = fp8.repack
    where = []

    def corrupt(weight, scale, mode="pow2", block=fp8.DEFAULT_BLOCK, name=None):
        out = real(weight, scale, mode, block, name)
        if name and ".3.down_proj" in name:
            where.append(fault(out))
        return out

    monkeypatch.setattr(fp8, "repack", corrupt)
    from vllm_moe_w8.vllm_glue.self_check import NumericsSelfCheckError

    config = {"neuron_w8": {"mode": mode}}
    layer = make_layer(quant_config_for("block"), ckpt, additional_config=config)
    with pytest.raises(NumericsSelfCheckError, match=rf"layer {PREFIX}, expert 3 .*down_proj") as err:
        load_layer(layer, ckpt)
    assert where and re.search(where[0], str(err.value)), (where, str(err.value))
    layer = make_layer(quant_config_for("block"), ckpt, additional_config={"neuron_w8": {"mode": mode, "self_check": False}})
    load_layer(layer, ckpt)  # no check: loads (and would serve the corrupted value)


def test_load_errors_name_the_tensor(ckpt):
    layer = make_layer(quant_config_for("block"), ckpt)
    p = layer.w13_weight
    with pytest.raises(ValueError, match=rf"{PREFIX}\.2\.up_proj\.weight is torch.bfloat16"):
        p.weight_loader(param=p, loaded_weight=torch.zeros(384, 256, dtype=torch.bfloat16), weight_name="w13_weight", shard_id="w3", expert_id=2)
    s = layer.w2_weight_scale_inv
    with pytest.raises(ValueError, match=rf"{PREFIX}\.1\.down_proj\.weight_scale_inv has shape \(3, 3\).*needs \(2, 3\)"):
        s.weight_loader(param=s, loaded_weight=torch.ones(3, 3), weight_name="w2_weight_scale_inv", shard_id="w2", expert_id=1)


def test_load_logs_start_and_summary(ckpt):
    with plugin_log() as text:
        qc = quant_config_for("block")
        layers = [make_layer(qc, ckpt) for _ in range(2)]
        for layer in layers:
            load_layer(layer, ckpt)
    start = [t for t in text if "loading routed experts" in t]
    summary = [t for t in text if "processed 2 MoE layers" in t]
    assert len(start) == 1 and "mode pow2" in start[0] and "compute path" in start[0] and "TP rank 0/1" in start[0] and "local experts 4 of 4" in start[0]
    assert len(summary) == 1
    for piece in ("expert bytes", "blocks shifted", "values rounded", "self-check passed"):
        assert piece in summary[0]


def _start_lines(make):
    with plugin_log() as text:
        made = make()
    return made, [t for t in text if "loading routed experts" in t]


@pytest.mark.parametrize("kernel, amx, mode", [("auto", True, "pow2"), ("auto", False, "pow2"), ("native", True, "pow2"),
                                               ("auto", True, "output-block")])
def test_load_start_line_names_the_kernel_that_really_runs(ckpt, tokens, monkeypatch, kernel, amx, mode):
    """The first load line names the routed experts' kernel as decided for the layer (on an AMX host with a fitting
    layout: vLLM's FP8 kernel, which is then the one apply calls), not the op by default. AMX is faked: the choice
    reads ``amx_host()``, vLLM's kernel itself runs here (unless this vLLM build lacks it)."""
    from vllm_moe_w8.vllm_glue import cpu_vllm_fp8 as vf

    monkeypatch.setenv(vf.ENV, kernel)
    monkeypatch.setattr(vf, "amx_host", lambda: amx)
    calls = []
    real_forward = vf.forward
    monkeypatch.setattr(vf, "forward", lambda *a: calls.append(1) or real_forward(*a))
    layer, start = _start_lines(lambda: _layer("block", ckpt, additional_config={"neuron_w8": {"mode": mode}},
                                               dtype=torch.bfloat16))
    runs_vllm = kernel == "auto" and amx and mode == "pow2" and vf.unavailable_reason() is None
    assert len(start) == 1, start
    assert (vf.KERNEL_NAME in start[0]) == runs_vllm and ("op.cpu.fused_moe_cpu" in start[0]) == (not runs_vllm), start[0]
    assert layer.quant_method.cpu_kernel == ("vllm-fp8" if runs_vllm else "op")
    x, w, ids = tokens
    layer.quant_method.apply(layer, x.to(torch.bfloat16), w, ids)
    assert bool(calls) == runs_vllm


def test_forced_vllm_kernel_on_an_unfit_layer_stops_before_any_weight_is_read(ckpt, monkeypatch):
    """``VLLM_MOE_W8_CPU_KERNEL=vllm-fp8`` with output-block scales (one scale per 128 rows: not vLLM's 128x128 tiles)
    is refused when the layer is created, naming the setting, the reason and the remedy."""
    from vllm_moe_w8.vllm_glue import cpu_vllm_fp8 as vf

    monkeypatch.setenv(vf.ENV, "vllm-fp8")
    with pytest.raises(ValueError, match=r"VLLM_MOE_W8_CPU_KERNEL=vllm-fp8, but vLLM's FP8 MoE kernel cannot run this layer"
                                         r".*Unset VLLM_MOE_W8_CPU_KERNEL"):
        make_layer(quant_config_for("block"), ckpt, additional_config={"neuron_w8": {"mode": "output-block"}},
                   dtype=torch.bfloat16)


@pytest.mark.parametrize("mode", ["pow2", "output-block"])
def test_converted_checkpoint_loads_without_repack(ckpt, tokens, mode):
    """uint8 codes + fp32 scales as `vllm-moe-w8 convert` writes them: loaded as they are (no second repack),
    at TP1 and in a TP2 rank loop (tiles refined to 64 rows on 192-row ranks); same output as converting at load."""
    from vllm_moe_w8.vllm_glue.quant_config import NeuronW8Config

    block = (128, 0) if mode == "output-block" else (128, 128)
    converted = {}
    for key, codes in ckpt.weights.items():
        rep = fp8.repack(codes, ckpt.scales[key], mode, (128, 128))
        converted[key] = (rep.codes, rep.scale_grid)
    conv_ckpt = type(ckpt)("block", {k: v[0] for k, v in converted.items()}, {k: v[1] for k, v in converted.items()},
                           ckpt.dense, ckpt.num_experts, ckpt.hidden, ckpt.inter)
    cfg = {"quant_method": "neuron-w8", "mode": mode, "code_format": fp8.CODE_FORMAT[mode], "weight_block_size": [128, 128],
           "expert_block_size": list(block), "source": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}
    x, w, ids = tokens
    at_load = _layer("block", ckpt, additional_config={"neuron_w8": {"mode": mode}})
    want = at_load.quant_method.apply(at_load, x, w, ids)
    layer = make_layer(NeuronW8Config.from_config(cfg), conv_ckpt)
    load_layer(layer, conv_ckpt)
    assert layer.quant_method.block == block
    assert torch.equal(layer.quant_method.apply(layer, x, w, ids), want)
    total = torch.zeros_like(want, dtype=torch.float64)
    for rank in range(2):
        layer = make_layer(NeuronW8Config.from_config(cfg), conv_ckpt, tp=(2, rank))
        load_layer(layer, conv_ckpt)
        assert layer.quant_method.block == (64, 0 if mode == "output-block" else 64)
        total += layer.quant_method.apply(layer, x, w, ids).double()
    assert rel_err(total, want) < SUMMATION_RTOL
