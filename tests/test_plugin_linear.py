"""``NeuronW8LinearMethod`` on real vLLM linear layers (QKV, merged gate/up, row-parallel, replicated):
FP8 block / per-channel weights loaded through the layers' own loaders — ragged shards and TP ranks
whose slice is not a multiple of 128 included — must dequantise to exactly the checkpoint's values
(torch's own float8 conversion x scale, rounded once to the model dtype)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from _plugin_fixtures import quant_config_for, vllm_context  # noqa: E402

from vllm_moe_w8 import tiny_models  # noqa: E402
from vllm_moe_w8.vllm_glue.linear_method import NeuronW8LinearMethod  # noqa: E402

DTYPE = torch.bfloat16


def _quant(n, k, fmt="block", seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    if fmt == "block":
        codes, scale = tiny_models.quantize_block(w, torch.float32)
        return codes, scale, tiny_models.dequantize_exact(codes, scale, (128, 128))
    codes, scale = tiny_models.quantize_channel(w, torch.bfloat16)
    return codes, scale, tiny_models.dequantize_exact(codes, scale, None)


@pytest.fixture
def tp(monkeypatch):
    import vllm.model_executor.layers.linear as linear

    def set_tp(size, rank):
        monkeypatch.setattr(linear, "get_tensor_model_parallel_world_size", lambda: size)
        monkeypatch.setattr(linear, "get_tensor_model_parallel_rank", lambda: rank)

    return set_tp


def _load(layer, suffix, tensors, shard=None):
    codes, scale, _ = tensors
    args = () if shard is None else (shard,)
    layer.weight.weight_loader(layer.weight, codes, *args)
    s = getattr(layer, suffix)
    s.weight_loader(s, scale, *args)


def _build(cls, fmt="block", hand_over=False, **kwargs):
    with vllm_context():
        layer = cls(quant_config=quant_config_for(fmt), params_dtype=DTYPE, **kwargs)
    if hasattr(layer.quant_method, "hand_over"):
        layer.quant_method.hand_over = hand_over  # keep layer.weight inspectable
    return layer


@pytest.mark.parametrize("tp_size", [1, 2])
def test_qkv_ragged_kv_shards(tp, tp_size):
    """q 256 rows, k/v 64 rows (half a 128-block each), hidden 200 (ragged columns)."""
    from vllm.model_executor.layers.linear import QKVParallelLinear

    q, k, v = _quant(256, 200, seed=1), _quant(128, 200, seed=2), _quant(128, 200, seed=3)
    for rank in range(tp_size):
        tp(tp_size, rank)
        layer = _build(QKVParallelLinear, hidden_size=200, head_size=64, total_num_heads=4, total_num_kv_heads=2, bias=False,
                       prefix="model.layers.0.self_attn.qkv_proj")
        assert isinstance(layer.quant_method, NeuronW8LinearMethod)
        for shard, t in (("q", q), ("k", k), ("v", v)):
            _load(layer, "weight_scale_inv", t, shard)
        layer.quant_method.process_weights_after_loading(layer)
        assert layer.weight.dtype == DTYPE and not hasattr(layer, "weight_scale_inv")
        qs, ks = 256 // tp_size, 128 // tp_size
        want = torch.cat([q[2][rank * qs:(rank + 1) * qs], k[2][rank * ks:(rank + 1) * ks], v[2][rank * ks:(rank + 1) * ks]])
        assert torch.equal(layer.weight.data, want.to(DTYPE))
        x = torch.randn(3, 200, dtype=DTYPE)
        out, _ = layer(x)
        assert torch.equal(out, torch.nn.functional.linear(x, want.to(DTYPE)))


def test_dequantised_layer_is_handed_over_to_vllms_unquantized_method(tp):
    from vllm.model_executor.layers.linear import QKVParallelLinear, UnquantizedLinearMethod

    tp(1, 0)
    q, k, v = _quant(256, 200, seed=1), _quant(128, 200, seed=2), _quant(128, 200, seed=3)
    layer = _build(QKVParallelLinear, hand_over=True, hidden_size=200, head_size=64, total_num_heads=4, total_num_kv_heads=2,
                   bias=False, prefix="model.layers.0.self_attn.qkv_proj")
    for shard, t in (("q", q), ("k", k), ("v", v)):
        _load(layer, "weight_scale_inv", t, shard)
    with vllm_context():
        layer.quant_method.process_weights_after_loading(layer)
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    x = torch.randn(5, 200, dtype=DTYPE)
    with vllm_context():
        out, _ = layer(x)
    want = torch.nn.functional.linear(x.float(), torch.cat([q[2], k[2], v[2]]).to(DTYPE).float())
    # vLLM's CPU GEMM (oneDNN) vs an fp32 product of the same bf16 operands: bf16 output rounding.
    assert float((out.float() - want).abs().max() / want.abs().max()) < 2**-7


def test_merged_gate_up_and_row_parallel_tp2_ragged_ranks(tp):
    """384 / TP2 = 192 per rank: merged rows and row-parallel columns cut through 128-blocks."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    gate, up, down = _quant(384, 256, seed=4), _quant(384, 256, seed=5), _quant(256, 384, seed=6)
    rows, cols = [], []
    for rank in range(2):
        tp(2, rank)
        merged = _build(MergedColumnParallelLinear, input_size=256, output_sizes=[384, 384], bias=False, prefix="model.layers.0.mlp.gate_up_proj")
        _load(merged, "weight_scale_inv", gate, 0)
        _load(merged, "weight_scale_inv", up, 1)
        merged.quant_method.process_weights_after_loading(merged)
        half = merged.weight.data.shape[0] // 2
        rows.append((merged.weight.data[:half], merged.weight.data[half:]))
        row = _build(RowParallelLinear, input_size=384, output_size=256, bias=False, prefix="model.layers.0.mlp.down_proj")
        assert row.quant_method.col_tile == 64
        _load(row, "weight_scale_inv", down)
        row.quant_method.process_weights_after_loading(row)
        cols.append(row.weight.data)
    assert torch.equal(torch.cat([r[0] for r in rows]), gate[2].to(DTYPE))
    assert torch.equal(torch.cat([r[1] for r in rows]), up[2].to(DTYPE))
    assert torch.equal(torch.cat(cols, dim=1), down[2].to(DTYPE))


def test_per_channel_row_parallel_and_fused_on_disk(tp):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    down = _quant(256, 384, fmt="channel", seed=7)
    parts = []
    for rank in range(2):
        tp(2, rank)
        row = _build(RowParallelLinear, fmt="channel", input_size=384, output_size=256, bias=False, prefix="model.layers.1.mlp.down_proj")
        _load(row, "weight_scale", down)
        row.quant_method.process_weights_after_loading(row)
        parts.append(row.weight.data)
    assert torch.equal(torch.cat(parts, dim=1), down[2].to(DTYPE))
    tp(1, 0)
    fused = _quant(2 * 192, 256, seed=8)  # gate_up stored fused on disk (shard id None)
    merged = _build(MergedColumnParallelLinear, input_size=256, output_sizes=[192, 192], bias=False, prefix="model.layers.1.mlp.gate_up_proj")
    _load(merged, "weight_scale_inv", fused)
    merged.quant_method.process_weights_after_loading(merged)
    assert torch.equal(merged.weight.data, fused[2].to(DTYPE))


def test_high_precision_layer_not_listed_is_kept(tp):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    tp(1, 0)
    layer = _build(ReplicatedLinear, input_size=256, output_size=8, bias=False, prefix="model.layers.0.mlp.gate")
    w = torch.randn(8, 256).to(DTYPE)
    layer.weight.weight_loader(layer.weight, w)
    assert not hasattr(layer, "weight_scale_inv")  # nothing left to load for it
    layer.quant_method.process_weights_after_loading(layer)
    assert torch.equal(layer.weight.data, w)
    ragged = _quant(100, 200, seed=9)  # replicated, ragged in both dimensions
    layer = _build(ReplicatedLinear, input_size=200, output_size=100, bias=False, prefix="model.layers.0.linear_attn.in_proj_z")
    _load(layer, "weight_scale_inv", ragged)
    layer.quant_method.process_weights_after_loading(layer)
    assert torch.equal(layer.weight.data, ragged[2].to(DTYPE))


def test_mixed_precision_shards_are_refused(tp):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    tp(1, 0)
    layer = _build(MergedColumnParallelLinear, input_size=256, output_sizes=[128, 128], bias=False, prefix="model.layers.0.mlp.gate_up_proj")
    _load(layer, "weight_scale_inv", _quant(128, 256), 0)
    with pytest.raises(ValueError, match=r"gate_up_proj \(shard 1\)\.weight is torch.bfloat16 but another shard"):
        layer.weight.weight_loader(layer.weight, torch.zeros(128, 256, dtype=DTYPE), 1)
