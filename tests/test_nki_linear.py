"""The block-scaled 1-byte linear kernels (kernels/linear_w8.py) through the served launch
(``kernel_launch.run_linear_w8``, the NKI interpreter) against float64 references of the same stored weights, with the
gate ``host_linear.gate`` (exact pow2 path: fp32 accumulation bound; dequant path: the bf16-weight reference and its
accumulation bound) and its fault-injection twins; the loader's pow2 repack, fusion and refusals; the HBM bytes a
launch reads (``host_linear.read_bytes``, the planner's formula) against the interpreter's counter."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from benchmarks.linear_shapes import checkpoint_linear as checkpoint
from benchmarks.linear_shapes import seed_linears
from vllm_moe_w8.codec import fp8
from vllm_moe_w8.kernels import host_linear as hl
from vllm_moe_w8.kernels import linear_w8
from vllm_moe_w8.kernels.nki_api import BACKEND
from vllm_moe_w8.neuron_glue import kernel_launch

interpreter_only = pytest.mark.skipif(BACKEND != "interpreter", reason="counts the interpreter's Stats")


def tokens_x(t: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(t, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def run(x, lw, lnc, stats=None):
    return kernel_launch.run_linear_w8(x, lw, lnc=lnc, stats=stats)


@pytest.fixture(scope="module")
def small():
    return hl.linear_weights(*checkpoint(512, 384, seed=3), name="small.weight")


@pytest.mark.parametrize("tokens,lnc", [(1, 1), (5, 2), (16, 2), (77, 2), (128, 1), (130, 2), (300, 1), (520, 2)])
def test_the_served_linear_matches_the_reference(small, tokens, lnc):
    """T <= 128: the exact pow2 kernel within the fp32-accumulation bound; longer T: the dequant kernel within its
    bound of the bf16-weight reference (host_linear.gate picks the path by T, as run_linear_w8 does)."""
    x = tokens_x(tokens, small.k, tokens)
    out = run(x, small, lnc)
    assert out.shape == (tokens, small.n) and out.dtype == torch.float32
    ok, ratio = hl.gate(out, x, small)
    assert ok, f"T={tokens} ({hl.path_for(tokens)}): err/bound {ratio:.4f}"


def test_the_dequant_kernel_computes_the_bf16_models_weights(small):
    """The dequant path's weights are bf16(code x scale) - bit for bit what the checkpoint dequantised to bf16 gives
    (the BF16 path's weights), except the pow2 repack's rounded odd subnormals - and its error against the exact
    weights stays within one bf16 rounding per weight (BF16_ROUNDOFF x sum |x| |W|) plus accumulation."""
    codes, scale = checkpoint(512, 384, seed=3)
    bf16_model = fp8.dequantize_checkpoint(codes, scale).to(torch.bfloat16)
    ours = hl.dense_weight(small).to(torch.bfloat16)
    assert int((ours != bf16_model).sum()) <= small.stats.values_changed
    x = tokens_x(256, small.k, 11)
    out = run(x, small, 2)
    ref = hl.reference(x, small)
    bound = hl.error_bound(x, small) + hl.BF16_ROUNDOFF * hl.magnitude(x, small)
    ok, ratio = hl.within_bound(out, ref, bound)
    assert ok, f"err / (bf16 + accumulation bound) {ratio:.4f}"
    assert not hl.within_bound(out, ref, hl.error_bound(x, small))[0], "the bf16 rounding is visible at fp32 level"


def _faulty(lw: hl.LinearWeights, fault) -> hl.LinearWeights:
    bad = hl.LinearWeights(lw.codes.clone(), lw.scales.clone(), lw.name, lw.splits, lw.parts, lw.stats)
    fault(bad)
    return bad


def _double_a_scale_tile(lw):
    lw.scales[1, 2] *= 2


def _flip_a_code(lw):
    """One byte's sign bit: the largest code of block (row block 1, column block 0) - a realistic corrupted byte."""
    blk = lw.codes[:, 0, 128:256]
    mag = (blk & 0x7F).to(torch.int32)
    p, n = divmod(int(mag.argmax()), 128)
    lw.codes[p, 0, 128 + n] ^= 0x80


FAULTS = {"a scale tile doubled": _double_a_scale_tile, "a code flipped": _flip_a_code}


@pytest.mark.parametrize("tokens", [16, 256])
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_the_gate_refuses_a_corrupted_weight(small, fault, tokens):
    """Fault twins of the gate the kernels pass: the kernel is fed a corrupted copy, the reference is the loaded one."""
    x = tokens_x(tokens, small.k, 5)
    ok, ratio = hl.gate(run(x, _faulty(small, FAULTS[fault]), 2), x, small)
    assert not ok and ratio > 1, f"{fault} at T={tokens} ({hl.path_for(tokens)}) passed: err/bound {ratio:.3f}"


@pytest.mark.parametrize("tokens", [16, 256])
def test_the_gate_refuses_the_wrong_shards_scales(tokens):
    """Fault twin: rank 0's shard of a TP-split weight loaded with rank 1's scale rows."""
    codes, scale = checkpoint(1024, 256, seed=9)
    right = hl.linear_weights(codes[:512], scale[:4], name="w.rank0")
    wrong = hl.linear_weights(codes[:512], scale[4:], name="w.rank0")
    x = tokens_x(tokens, 256, 6)
    assert hl.gate(run(x, right, 2), x, right)[0]
    ok, ratio = hl.gate(run(x, wrong, 2), x, right)
    assert not ok and ratio > 1


def _seed_case(name: str, seed: int):
    spec = seed_linears(tp=4)[name]
    parts = [hl.linear_weights(*checkpoint(n, spec["k"], seed=seed + i), name=part)
             for i, (part, n) in enumerate(spec["parts"])]
    return parts, (hl.fuse(parts, name=name) if len(parts) > 1 else parts[0])


@pytest.mark.parametrize("name", sorted(seed_linears(tp=4)))
def test_qwen35_tp4_projections_one_launch_each(name):
    """The seed model's per-rank shapes at TP=4 (q+k+v: 2048 + 256 + 256 rows; in_proj_qkv+z: 2048 + 1024; o_proj /
    out_proj: K 1024), decode T=1 at LNC 2: one launch per fused linear, its output cut by ``splits`` matches every
    part's own reference."""
    parts, lw = _seed_case(name, seed=len(name))
    x = tokens_x(1, lw.k, 1)
    out = run(x, lw, 2)
    assert lw.splits == tuple(p.n for p in parts) and lw.parts == tuple(p.name for p in parts)
    for part, y in zip(parts, out.split(lw.splits, dim=1)):
        ok, ratio = hl.gate(y, x, part)
        assert ok, f"{name} / {part.name}: err/bound {ratio:.4f}"


@pytest.mark.parametrize("name", ["attention q+k+v", "DeltaNet in_proj_qkv+z"])
def test_qwen35_tp4_fused_projections_at_prefill(name):
    """The same fused shapes at a prefill length (384 tokens: the dequant kernel, token tiles split over LNC 2)."""
    parts, lw = _seed_case(name, seed=2)
    x = tokens_x(384, lw.k, 2)
    out = run(x, lw, 2)
    for part, y in zip(parts, out.split(lw.splits, dim=1)):
        assert hl.gate(y, x, part)[0]


@pytest.mark.parametrize("tokens", [16, 256])
def test_several_resident_chunks(monkeypatch, tokens):
    """A program whose weights exceed RESIDENT_BYTES runs in column chunks (x loaded once per chunk): still within
    the gate, and the bytes formula follows."""
    monkeypatch.setattr(linear_w8, "RESIDENT_BYTES", 1024)
    lw = hl.linear_weights(*checkpoint(2048, 256, seed=4), name="wide")
    assert linear_w8.chunk_columns(2, 1024, hl.path_for(tokens) == "pow2") < 1024
    x = tokens_x(tokens, 256, 4)
    stats = []
    assert hl.gate(run(x, lw, 2, stats), x, lw)[0]
    if BACKEND == "interpreter":
        assert sum(s.hbm_read_bytes for s in stats[0]) == hl.read_bytes(2048, 256, tokens, 2)


@interpreter_only
@pytest.mark.parametrize("tokens,lnc", [(1, 2), (32, 1), (200, 2), (256, 1)])
def test_read_bytes_is_what_a_launch_reads(small, tokens, lnc):
    """host_linear.read_bytes (the formula the planner prints per decoded token) equals the interpreter's HBM read
    counter over the programs."""
    stats = []
    run(tokens_x(tokens, small.k, 1), small, lnc, stats)
    assert sum(s.hbm_read_bytes for s in stats[0]) == hl.read_bytes(small.n, small.k, tokens, lnc)


@pytest.mark.parametrize("vector_blocks", [0, 5, 16])
def test_every_pow2_engine_schedule_passes(small, vector_blocks):
    """The exact kernel under each engine split of kernels/schedule.py (block_scale.contract_pow2)."""
    from vllm_moe_w8.kernels.nki_cpu import launch as nki_launch
    from vllm_moe_w8.neuron_glue.interpreter_hop import numpy_of

    x = tokens_x(32, small.k, 8)
    out, _ = nki_launch(linear_w8.linear_w8_pow2, (2,), numpy_of(x), small.codes.numpy(), small.scales.numpy(), lnc=2,
                        split_tokens=0, vector_blocks=vector_blocks)
    assert hl.within_bound(torch.from_numpy(out), hl.reference(x, small), hl.error_bound(x, small))[0]


def test_the_repack_is_pow2_and_the_layout_is_the_kernels():
    """Blocks without E4M3FN-only codes keep bytes and scale; the others are halved with the scale doubled (the
    routed experts' rule, fp8.repack); codes[p, g, n] is W[n, g*128 + p]."""
    codes, scale = checkpoint(256, 384, seed=1)
    lw = hl.linear_weights(codes, scale, name="w")
    ref = fp8.repack(codes, scale, mode="pow2")
    assert torch.equal(lw.codes.permute(2, 1, 0).reshape(256, 384), ref.codes)
    kept = scale.view(-1)[::3]
    assert torch.equal(lw.scales.view(-1)[::3], kept) and torch.equal(lw.scales.view(-1)[1::3], scale.view(-1)[1::3] * 2)
    assert lw.stats.blocks == 6 and lw.stats.blocks_shifted == 4
    assert torch.equal(hl.dense_weight(lw), fp8.dequantize(ref))


def test_fuse_concatenates_along_n_and_keeps_the_parts():
    a = hl.linear_weights(*checkpoint(256, 256, 1), name="q")
    b = hl.linear_weights(*checkpoint(128, 256, 2), name="k")
    f = hl.fuse([a, b], name="qk")
    assert (f.n, f.k, f.splits, f.parts) == (384, 256, (256, 128), ("q", "k"))
    assert torch.equal(f.codes[:, :, 256:], b.codes) and torch.equal(f.scales[2:], b.scales)
    assert f.stats.blocks == a.stats.blocks + b.stats.blocks
    with pytest.raises(hl.LinearShapeError, match="different K"):
        hl.fuse([a, hl.linear_weights(*checkpoint(128, 384, 3), name="v")], name="bad")


@pytest.mark.parametrize("shape,scale_shape,match", [
    ((200, 256), (2, 2), "N and K must be non-zero multiples of 128"),
    ((256, 320), (2, 3), "N and K must be non-zero multiples of 128"),
    ((256, 256), (2, 1), r"scale grid \(2, 1\) does not match"),
    ((128, 16384), (1, 128), "K=16384 > 8192"),
])
def test_shapes_the_kernel_cannot_take_are_refused_naming_the_tensor(shape, scale_shape, match):
    w = torch.zeros(shape, dtype=torch.uint8)
    with pytest.raises(hl.LinearShapeError, match=match) as err:
        hl.linear_weights(w, torch.ones(scale_shape), name="model.layers.3.self_attn.q_proj.weight")
    assert "model.layers.3.self_attn.q_proj.weight" in str(err.value)


def test_bad_bytes_and_lnc_are_refused():
    w = torch.zeros(128, 128, dtype=torch.uint8)
    w[5, 7] = 0x7F
    with pytest.raises(ValueError, match="'layer.w' holds 1 FP8 NaN"):
        hl.linear_weights(w, torch.ones(1, 1), name="layer.w")
    with pytest.raises(hl.LinearShapeError, match="2-D"):
        hl.linear_weights(torch.zeros(128, dtype=torch.uint8), torch.ones(1, 1), name="v")
    lw = hl.linear_weights(torch.zeros(384, 128, dtype=torch.uint8), torch.ones(3, 1), name="three.blocks")
    with pytest.raises(hl.LinearShapeError, match="3 blocks of 128, which LNC 2 cannot split"):
        run(tokens_x(2, 128, 0), lw, 2)
    assert hl.gate(run(tokens_x(2, 128, 0), lw, 1), tokens_x(2, 128, 0), lw)[0]
    with pytest.raises(ValueError, match=r"x \(2, 256\) must be \[T, 128\]"):
        run(tokens_x(2, 256, 0), lw, 1)


def test_the_benchmark_prices_the_served_launch():
    """benchmarks/bench_linear.ours runs the launch run_linear_w8 makes (bucket, kernel, split) under both scenarios and
    its bytes agree with host_linear.read_bytes (the bench asserts it); the exact alternative at prefill is pow2."""
    from benchmarks import bench_linear

    spec = {"parts": (("a", 256), ("b", 256)), "k": 256, "layers": 1}
    decode, prefill = bench_linear.ours(spec, 3), bench_linear.ours(spec, 300, exact=True)
    assert (decode["kernel"], decode["bucket"], prefill["kernel"], prefill["bucket"]) == ("pow2", 16, "pow2", 512)
    assert all(decode[f"{sc}_us"] > 0 for sc in bench_linear.SCENARIOS)


AWS_SOURCES = os.environ.get("VLLM_MOE_W8_AWS_SOURCES")  # the harness's local folder; unset: skipped (no AWS code here)


def _bf16_baseline(role: str, tokens: int, swap_rows: bool = False) -> tuple[str, bool]:
    """(kernel, within 2^-8 x sum |x| |W| of x @ W) for nki-library's kernel run as bench_linear runs it; ``swap_rows``
    feeds it W with two contraction rows swapped (a layout error) while the reference keeps W."""
    import ml_dtypes
    import numpy as np

    from benchmarks import aws_dense
    from benchmarks.aws_differential import loader
    from vllm_moe_w8.kernels.nki_cpu import launch as nki_launch

    rng = np.random.default_rng(tokens)
    x = rng.standard_normal((tokens, 256)).astype(ml_dtypes.bfloat16)
    w = (rng.standard_normal((256, 512)) / 16).astype(ml_dtypes.bfloat16)
    fed = w[[128] + list(range(1, 128)) + [0] + list(range(129, 256))] if swap_rows else w
    with loader.nki_mapped():
        kernels = aws_dense.load(Path(AWS_SOURCES))
        name, args, kw = aws_dense.call(kernels, role, x, np.ascontiguousarray(fed))
        out, _ = nki_launch(kernels[name], (2,), *args, lnc=2, **kw)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    err = np.abs(np.asarray(out, np.float64).reshape(tokens, 512) - x64 @ w64)
    return name, bool((err <= 2.0**-8 * (np.abs(x64) @ np.abs(w64))).all())


@pytest.mark.skipif(not AWS_SOURCES, reason="set VLLM_MOE_W8_AWS_SOURCES to the harness's local folder of AWS sources")
@pytest.mark.parametrize("role,tokens", [("fused", 8), ("fused", 256), ("out", 8), ("out", 256)])
def test_the_bf16_baseline_kernels_compute_the_product(role, tokens):
    """The BF16 side of bench_linear is a working kernel: nki-library's QKV / output projection kernels, executed as the
    bench executes them, give x @ W within their bf16 output's rounding; fed a W with two rows swapped they do not."""
    name, ok = _bf16_baseline(role, tokens)
    assert name == {("fused", 8): "qkv_tkg", ("fused", 256): "qkv_cte", ("out", 8): "out_tkg",
                    ("out", 256): "out_cte"}[(role, tokens)]
    assert ok
    assert not _bf16_baseline(role, tokens, swap_rows=True)[1]
