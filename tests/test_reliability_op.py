"""Wrong inputs to the compute paths are refused, never computed: the torch op ``moe_w8::fused_moe``, the CPU
implementation ``cpu_moe.fused_moe_cpu`` and the NKI output-block / pow2 kernels (run by the interpreter), each
given scales in the other mode's layout; and the numerics self-check stops a load whose repack is wrong.

Layouts (DEVELOPING.md): pow2 keeps the checkpoint's 128x128 grid, ``[E, 2*ceil(I/128), ceil(H/128)]``;
output-block has one scale per 128 output rows, ``[E, 2*ceil(I/128), 1]``. With H = I = 256 the two differ
(2 columns vs 1), so a scale tensor of the wrong mode is detectable from its shape alone.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from vllm_moe_w8.op import cpu as cpu_moe
from vllm_moe_w8.codec import fp8
from vllm_moe_w8.op import custom_op as moe_op  # noqa: F401  (defines torch.ops.moe_w8.fused_moe)

E, H, I, T, K = 4, 256, 256, 5, 2  # noqa: E741


def _experts(mode: str, seed: int = 0):
    """(w13, s13, w2, s2, block) of E random experts repacked in ``mode`` (op storage)."""
    gen = torch.Generator().manual_seed(seed)
    w13, s13, w2, s2 = [], [], [], []
    for _ in range(E):
        parts = []
        for shape in ((I, H), (I, H), (H, I)):
            w = torch.randn(shape, generator=gen) * 0.05
            grid = fp8.grid_shape(shape, (128, 128))
            scale = (w.abs().reshape(grid[0], 128, grid[1], 128).amax(dim=(1, 3)) / 448.0)
            codes = (w / fp8.expand_scales(scale, shape, (128, 128))).to(torch.float8_e4m3fn)
            parts.append(fp8.repack(codes, scale, mode=mode))
        gate, up, down = parts
        w13.append(torch.cat([gate.codes, up.codes]))
        s13.append(torch.cat([gate.scale_grid, up.scale_grid]))
        w2.append(down.codes)
        s2.append(down.scale_grid)
    return torch.stack(w13), torch.stack(s13), torch.stack(w2), torch.stack(s2), gate.block


@pytest.fixture(scope="module")
def pow2():
    return _experts("pow2")


@pytest.fixture(scope="module")
def output_block():
    return _experts("output-block")


@pytest.fixture(scope="module")
def routing():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    w, ids = torch.randn(T, E, generator=gen).softmax(-1).topk(K, dim=-1)
    return x, w.float(), ids.to(torch.int32)


def test_layouts_differ_as_documented(pow2, output_block):
    assert pow2[4] == (128, 128) and output_block[4] == (128, 0)
    assert tuple(pow2[1].shape) == (E, 2 * math.ceil(I / 128), math.ceil(H / 128)) == (E, 4, 2)
    assert tuple(output_block[1].shape) == (E, 4, 1)


OPS = {
    "torch.ops.moe_w8.fused_moe": lambda *a: torch.ops.moe_w8.fused_moe(*a),
    "cpu_moe.fused_moe_cpu": cpu_moe.fused_moe_cpu,
    "cpu_moe.fused_moe_torch": cpu_moe.fused_moe_torch,
}


@pytest.mark.parametrize("op", list(OPS))
def test_output_block_op_refuses_pow2_scales(op, pow2, output_block, routing):
    x, w, ids = routing
    w13, s13, w2, s2, _ = output_block
    _, p13, _, p2, _ = pow2
    good = OPS[op](x, w, ids, w13, s13, w2, s2, 128, 0, "e4m3")  # the right layout runs
    assert good.shape == (T, H) and bool(torch.isfinite(good.float()).all())
    with pytest.raises(ValueError, match=r"w13_scales has shape \(4, 4, 2\); expected \(4, 4, 1\)"):
        OPS[op](x, w, ids, w13, p13, w2, s2, 128, 0, "e4m3")
    with pytest.raises(ValueError, match=r"w2_scales has shape \(4, 2, 2\); expected \(4, 2, 1\)"):
        OPS[op](x, w, ids, w13, s13, w2, p2, 128, 0, "e4m3")


@pytest.mark.parametrize("op", list(OPS))
def test_pow2_op_refuses_output_block_scales(op, pow2, output_block, routing):
    x, w, ids = routing
    w13, s13, w2, s2, _ = pow2
    with pytest.raises(ValueError, match=r"w13_scales has shape \(4, 4, 1\); expected \(4, 4, 2\)"):
        OPS[op](x, w, ids, w13, output_block[1], w2, s2, 128, 128, "e4m3")


@pytest.mark.parametrize("op", list(OPS))
def test_op_refuses_other_bad_arguments(op, pow2, routing):
    x, w, ids = routing
    w13, s13, w2, s2, _ = pow2
    cases = [
        ((x, w, ids, w13.view(torch.float8_e4m3fn).to(torch.bfloat16), s13, w2, s2, 128, 128, "e4m3"), r"uint8"),
        ((x, w, ids, w13, s13, w2, s2, 128, 128, "e5m2"), r"e5m2"),
        ((x, w, ids.clamp(max=0) + E, w13, s13, w2, s2, 128, 128, "e4m3"), r"expert id 4"),
        ((x[:, :128], w, ids, w13, s13, w2, s2, 128, 128, "e4m3"), r"shape|expert shapes"),
        ((x, w, ids, w13, s13, w2, s2, 0, 128, "e4m3"), r"block"),
    ]
    for args, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            OPS[op](*args)


# ---- NKI kernels (through the CPU interpreter, or AWS's simulator where real NKI is installed) ----------------

def _kernel_call(experts, routing, kernel_name):
    from vllm_moe_w8.kernels import host, launch
    from vllm_moe_w8.kernels.moe_w8 import moe_w8_output_block, moe_w8_pow2

    w13, s13, w2, s2, block = experts
    x, w, ids = routing
    kw = host.to_kernel_layout(w13, s13, w2, s2, block[0], block[1], "e4m3")
    kernel = {"output-block": moe_w8_output_block, "pow2": moe_w8_pow2}[kernel_name]
    return launch.simulate_moe(x, w, ids, kw, kernel=kernel)


def test_output_block_kernel_refuses_block_scales(pow2, routing):
    with pytest.raises(ValueError, match=r"w13_scales .*128x128 block-scale grid.*output-block kernel"):
        _kernel_call(pow2, routing, "output-block")


def test_pow2_kernel_refuses_output_block_scales(output_block, routing):
    with pytest.raises(ValueError, match=r"w13_scales has shape \(4, 4, 1\); pow2 expects"):
        _kernel_call(output_block, routing, "pow2")


@pytest.mark.parametrize("block, code_format, pattern", [
    ((64, 128), "e4m3", r"no NKI kernel for scale tiles \(64, 128\)"),
    ((1, 0), "e4m3", r"no NKI kernel for scale tiles \(1, 0\)"),
    ((128, 128), "e4m3fn", r"code_format 'e4m3fn'"),
])
def test_kernel_layout_refuses_tiles_without_a_kernel(pow2, block, code_format, pattern):
    from vllm_moe_w8.kernels import host

    w13, s13, w2, s2, _ = pow2
    with pytest.raises(ValueError, match=pattern):
        host.to_kernel_layout(w13, s13, w2, s2, block[0], block[1], code_format)


# ---- the numerics self-check (method level, in-process: no vLLM start-up) -------------------------------------

# Tests from here on build vLLM layers or NeuronW8Config: they need vLLM importable (the tests above do not).
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vLLM (pip install -e .[cpu]): builds vLLM MoE layers / NeuronW8Config")


@pytest.fixture(scope="module")
def ckpt():
    from _plugin_fixtures import make_checkpoint

    return make_checkpoint(num_experts=4, hidden=256, inter=384)


@needs_vllm
def test_self_check_is_on_by_default(ckpt, monkeypatch):
    from _plugin_fixtures import make_layer, quant_config_for

    from vllm_moe_w8.vllm_glue.settings import SELF_CHECK_ENV

    monkeypatch.delenv(SELF_CHECK_ENV, raising=False)
    layer = make_layer(quant_config_for("block"), ckpt)
    assert layer.quant_method.settings.self_check is True
    assert layer.quant_method.settings.self_check_experts >= 1


def _corrupting_repack(monkeypatch, expert: int, what: str):
    """Wrap fp8.repack so that expert ``expert``'s down_proj comes out wrong in one way."""
    real = fp8.repack

    def bad(weight, scale, mode="pow2", block=fp8.DEFAULT_BLOCK, name=None):
        out = real(weight, scale, mode, block, name)
        if name and f".{expert}.down_proj" in name:
            if what == "scale":  # e.g. a tile's scale doubled without its codes halved
                out.scales.view(-1)[0] *= 2.0
            elif what == "code":
                out.codes[3, 9] ^= 0x01  # one mantissa bit
            elif what == "nonfinite":
                out.scales.view(-1)[0] = float("inf")
        return out

    monkeypatch.setattr(fp8, "repack", bad)


@needs_vllm
@pytest.mark.parametrize("mode, what", [
    ("pow2", "scale"), ("lut", "code"), ("output-block", "scale"), ("output-block", "nonfinite"),
])
def test_self_check_stops_a_wrong_repack(ckpt, monkeypatch, mode, what):
    from _plugin_fixtures import PREFIX, load_layer, make_layer, quant_config_for

    from vllm_moe_w8.vllm_glue.self_check import NumericsSelfCheckError

    monkeypatch.delenv("VLLM_MOE_W8_SELF_CHECK", raising=False)
    _corrupting_repack(monkeypatch, expert=3, what=what)  # experts 0 and 3 (first and last) are always sampled
    layer = make_layer(quant_config_for("block"), ckpt, additional_config={"neuron_w8": {"mode": mode}})
    with pytest.raises(NumericsSelfCheckError, match=rf"{PREFIX}, expert 3 "):
        load_layer(layer, ckpt)


@needs_vllm
def test_self_check_off_switches(ckpt, monkeypatch):
    """Both documented switches turn it off (then the corrupted value would be served: debugging only)."""
    from _plugin_fixtures import load_layer, make_layer, quant_config_for

    _corrupting_repack(monkeypatch, expert=3, what="scale")
    layer = make_layer(quant_config_for("block"), ckpt, additional_config={"neuron_w8": {"self_check": False}})
    load_layer(layer, ckpt)
    monkeypatch.setenv("VLLM_MOE_W8_SELF_CHECK", "0")
    layer = make_layer(quant_config_for("block"), ckpt)
    assert layer.quant_method.settings.self_check is False
    load_layer(layer, ckpt)


def _feed_all_but(layer, ckpt, skipped):
    """Feed every expert tensor through the layer's loaders except ``skipped`` = (global expert, shard, 'weight'|'scale')."""
    from _plugin_fixtures import PREFIX

    for (e, shard), w in ckpt.weights.items():
        stem = "w2" if shard == "w2" else "w13"
        for kind, suffix, tensor in (("weight", "weight", w), ("scale", ckpt.scale_suffix, ckpt.scales[e, shard])):
            if (e, shard, kind) == skipped:
                continue
            param = getattr(layer, f"{stem}_{suffix}")
            param.weight_loader(param=param, loaded_weight=tensor, weight_name=f"{PREFIX}.{stem}_{suffix}", shard_id=shard,
                                expert_id=e, return_success=True)


@pytest.fixture(scope="module")
def ckpt_channel():
    from _plugin_fixtures import make_checkpoint

    return make_checkpoint(num_experts=4, hidden=256, inter=384, fmt="channel")


# (tp, ep) of the layer under test: single rank, TP rank 1 of 2 (a slice of every expert), EP rank 1 of 2 (experts 2, 3).
PARALLEL = {"single": dict(), "tp2_rank1": dict(tp=(2, 1)), "ep2_rank1": dict(ep=(2, 1))}


@needs_vllm
@pytest.mark.parametrize("parallel", list(PARALLEL))
@pytest.mark.parametrize("fmt", ["block", "channel"])
@pytest.mark.parametrize("skip", ["weight", "scale"])
def test_layer_refuses_an_expert_tensor_that_was_never_loaded(ckpt, ckpt_channel, skip, fmt, parallel):
    """Every expert tensor but one (expert 2's up_proj weight or scale) reaches the layer: the load is refused, naming it."""
    from _plugin_fixtures import PREFIX, make_layer, quant_config_for

    data = ckpt if fmt == "block" else ckpt_channel
    layer = make_layer(quant_config_for(fmt), data, **PARALLEL[parallel])
    _feed_all_but(layer, data, (2, "w3", skip))
    name = "weight" if skip == "weight" else data.scale_suffix
    with pytest.raises(ValueError, match=rf"{PREFIX}\.2\.up_proj\.{name}\b.*re-download"):
        layer.quant_method.process_weights_after_loading(layer)


@needs_vllm
def test_layer_accepts_a_complete_load_and_ignores_other_ranks_experts(ckpt):
    """EP rank 0 of 2 holds experts 0, 1: a checkpoint tensor of expert 2 is another rank's business."""
    from _plugin_fixtures import make_layer, quant_config_for

    layer = make_layer(quant_config_for("block"), ckpt, ep=(2, 0))
    _feed_all_but(layer, ckpt, (2, "w3", "weight"))
    layer.quant_method.process_weights_after_loading(layer)
    assert bool(layer.quant_method.expert_loads.loaded.all()) and layer.quant_method.expert_loads.loaded.shape[0] == 2


# ---- the up-front, header-only checkpoint check (NeuronW8Config.maybe_update_config; no vLLM start-up) -----------

@needs_vllm
@pytest.mark.parametrize("fmt", ["block", "channel", "converted"])
@pytest.mark.parametrize("case", ["weight_not_in_shard", "scale_not_in_checkpoint"])
def test_checkpoint_check_names_a_missing_expert_tensor(tiny_checkpoint, tmp_path, fmt, case):
    import json

    import corrupt as C

    from vllm_moe_w8.codec.model_config import quantization_config
    from vllm_moe_w8.tools.convert import convert_checkpoint
    from vllm_moe_w8.vllm_glue.quant_config import NeuronW8Config

    base = tiny_checkpoint("qwen3-moe", fmt="channel" if fmt == "channel" else "block")
    if fmt == "converted":
        summary = convert_checkpoint(base, tmp_path / "converted", mode="pow2", progress=False)
        assert summary["ok"], summary
        base = tmp_path / "converted"
    path = C.copy_checkpoint(base, tmp_path / "broken")

    def config():
        return NeuronW8Config.from_config(quantization_config(json.loads((path / "config.json").read_text())))

    config().maybe_update_config(str(path))  # intact: accepted
    suffix = "weight" if case == "weight_not_in_shard" else C.scale_suffix(path)
    name = C.expert_name(path, suffix)
    shard = C.drop_tensor(path, name, keep_in_index=case == "weight_not_in_shard")
    with pytest.raises(ValueError) as info:
        config().maybe_update_config(str(path))
    text = str(info.value)
    assert name in text and shard in text and "re-download" in text.lower(), text


@needs_vllm
def test_checkpoint_check_skips_a_hub_id():
    from _plugin_fixtures import quant_config_for

    quant_config_for("block").maybe_update_config("Qwen/Qwen3-30B-A3B-FP8")  # not a local folder: left to the loaders
