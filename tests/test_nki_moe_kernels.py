"""The NKI MoE kernels, executed by the CPU interpreter (or AWS's nki.simulate where real NKI exists),
against the fp32 reference MoE on the same repacked uint8 experts.

Shapes are the real per-rank ones: Qwen3.5-35B-A3B (H 2048, I 512, 32 local experts) and GLM-5.3-Flash
(H 4096, I 2048). To keep the file within its CPU budget the GLM-width cases use 4 local experts (pow2)
and 2 (output-block), and the output-block Qwen cases use 8: output-block repacking of random weights
is the slow part, not the kernels.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_moe_w8.kernels import host, launch, schedule
from vllm_moe_w8.kernels.moe_w8 import T_MAX, moe_w8_output_block, moe_w8_pow2
from vllm_moe_w8.kernels.nki_api import BACKEND
from vllm_moe_w8.neuron_glue.kernel_check import ACT_BF16_ROUNDOFF, checkpoint_experts, error_bound, repacked, routing
from vllm_moe_w8.op.reference import reference_moe

# The gate and its harness are the ones `vllm-moe-w8 neuron-check` runs (vllm_moe_w8/neuron_glue/kernel_check.py):
# the kernel's only rounding beyond fp32 accumulation is the bf16 activation (unit roundoff 2**-9), so
# |kernel - reference| <= ABS_FLOOR + BOUND_SLACK * 2**-9 * sum_j |W2[h, j]| |act_j| (error_bound).

QWEN = dict(H=2048, I=512)
GLM = dict(H=4096, I=2048)


@pytest.fixture(scope="module")
def qwen_ckpt():
    return checkpoint_experts(32, QWEN["H"], QWEN["I"], seed=1)


@pytest.fixture(scope="module")
def small_ckpt():
    return checkpoint_experts(4, 256, 256, seed=3)


@pytest.fixture(scope="module")
def glm_ckpt():
    return checkpoint_experts(4, GLM["H"], GLM["I"], seed=2)


def _slice_experts(ckpt, n):
    (c13, s13), (c2, s2) = ckpt
    return (c13[:n], s13[:n]), (c2[:n], s2[:n])


def kernel_gate(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    """Kernel vs reference: elementwise within the bf16-activation bound, and a small relative norm."""
    err = (out - ref).abs()
    assert bool((err <= bound).all()), f"max err/bound {float((err / bound).max()):.3f}"
    assert float((out - ref).norm() / ref.norm()) < 4 * ACT_BF16_ROUNDOFF


# The pow2 kernel's engine schedules (kernels/schedule.py): every block's scale-add on ScalarE + GpSimd (fitted),
# or 9 of every 32 on VectorE (documented). Same fp32 operations, different engines: both must pass the same gate.
SCHEDULES = sorted(schedule.SCHEDULES.items())


def _simulate(x, topk_weights, topk_ids, kw, stats, swiglu_limit, vector_blocks):
    """launch.simulate_moe with the pow2 kernel's schedule given explicitly (a trace-time constant)."""
    if vector_blocks is None:
        return launch.simulate_moe(x, topk_weights, topk_ids, kw, stats, swiglu_limit=swiglu_limit)
    from vllm_moe_w8.kernels.nki_cpu import run

    aff = host.dense_affinities(topk_weights, topk_ids, kw.num_experts)

    def one_call(hidden, aff_chunk):
        args = launch.kernel_args(hidden, aff_chunk, kw)
        host.check_kernel_args(*args, mode="pow2", swiglu_limit=swiglu_limit)
        out, st = run(moe_w8_pow2, *args, float(swiglu_limit), vector_blocks=vector_blocks)
        stats.append(st)
        return torch.from_numpy(np.asarray(out, dtype=np.float32)).sum(dim=0)

    return host.run_chunked(one_call, x, aff)


def check_kernel(ckpt, mode, tokens, top_k, seed, swiglu_limit=0.0, fault=None, vector_blocks=None):
    """Run the kernel for ``mode`` and gate it against the reference; ``fault(kw)`` corrupts the kernel's
    weights only (the reference keeps the checkpoint's), for the gate's fault-injection twin. ``vector_blocks``:
    the pow2 kernel's engine schedule (None: the one loaded at import)."""
    w13, s13, w2, s2, block = repacked(ckpt, mode)
    num_experts, hidden = w13.shape[0], w2.shape[1]
    x = (torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed))).to(torch.bfloat16)
    topk_weights, topk_ids = routing(tokens, num_experts, top_k, seed)
    kw = host.to_kernel_layout(w13, s13, w2, s2, block[0], block[1], "e4m3")
    assert kw.mode == mode
    if fault is not None:  # on copies: the layout shares fp32 scale tensors with the reference's inputs
        kw = host.KernelWeights(kw.w13.clone(), kw.w13_scales.clone(), kw.w2.clone(), kw.w2_scales.clone(), kw.mode)
        fault(kw)
    stats = []
    out = _simulate(x, topk_weights, topk_ids, kw, stats, swiglu_limit, vector_blocks)
    ref = reference_moe(x, topk_weights, topk_ids, w13, s13, w2, s2, block[0], block[1], "e4m3", swiglu_limit=swiglu_limit)
    if swiglu_limit > 0:  # the clamp must bite, or this case tests nothing
        assert not torch.equal(ref, reference_moe(x, topk_weights, topk_ids, w13, s13, w2, s2, block[0], block[1], "e4m3"))
    bound = error_bound(x, topk_weights, topk_ids, w13, s13, w2, s2, block, swiglu_limit)
    assert out.shape == (tokens, hidden) and out.dtype == torch.float32
    kernel_gate(out, ref, bound)
    unrouted = (topk_ids < 0).all(dim=1)
    assert bool((out[unrouted] == 0).all()), "a token routed to no local expert must get exactly 0"
    if BACKEND == "interpreter":
        # every weight byte crosses HBM exactly once per kernel call (dense over local experts)
        weight_bytes = kw.w13.numel() + kw.w2.numel() + 4 * (kw.w13_scales.numel() + kw.w2_scales.numel())
        for (start, stop, bucket), st in zip(host.chunks(tokens), stats):
            io = bucket * hidden * 2 + bucket * num_experts * 4
            assert st.hbm_read_bytes == weight_bytes + io
            assert st.hbm_write_bytes == bucket * hidden * 4
            assert st.peak_psum_banks <= 8 and st.peak_sbuf_bytes <= 224 * 1024
    return stats


@pytest.mark.parametrize("tokens", [1, 200])  # 200: two token tiles of the 256 bucket, 56 padded rows
def test_pow2_qwen35_shape(qwen_ckpt, tokens):
    check_kernel(qwen_ckpt, "pow2", tokens, top_k=8, seed=tokens)


@pytest.mark.parametrize("scenario,vector_blocks", SCHEDULES)
def test_pow2_schedules_qwen35_width(qwen_ckpt, scenario, vector_blocks):
    stats = check_kernel(_slice_experts(qwen_ckpt, 4), "pow2", 16, top_k=4, seed=11, vector_blocks=vector_blocks)
    if BACKEND == "interpreter":  # the schedule decides the engines, nothing else
        ops = {(eng, op) for st in stats for (eng, op, _p, _f) in st.engine_ops}
        assert (("vector", "scalar_tensor_tensor") in ops) == (vector_blocks > 0)
        assert ("gpsimd", "tensor_tensor") in ops


@pytest.mark.parametrize("tokens", [7, 128])
def test_output_block_qwen35_width(qwen_ckpt, tokens):
    check_kernel(_slice_experts(qwen_ckpt, 8), "output-block", tokens, top_k=4, seed=tokens)


# GLM-5.3-Flash clamps SwiGLU at 10; these random weights give |gate|, |up| ~ 1, so a limit of 0.5 makes
# the clamp act on both sides.
GLM_TEST_SWIGLU_LIMIT = 0.5


@pytest.mark.parametrize("scenario,vector_blocks", SCHEDULES)
def test_pow2_glm_shape(glm_ckpt, scenario, vector_blocks):
    check_kernel(glm_ckpt, "pow2", 24, top_k=3, seed=5, swiglu_limit=GLM_TEST_SWIGLU_LIMIT, vector_blocks=vector_blocks)


def test_output_block_glm_shape(glm_ckpt):
    check_kernel(_slice_experts(glm_ckpt, 2), "output-block", 64, top_k=2, seed=6, swiglu_limit=GLM_TEST_SWIGLU_LIMIT)


# --- the gate's fault-injection twin: the smallest realistic weight faults must fail it ---------------------

def _double_one_scale_tile(kw):
    kw.w13_scales[0, 0, kw.w13_scales.shape[2] - 1] *= 2  # expert 0 (routed), gate rows 0-127, last tile


def _swap_gate_up(kw):
    gate, up = kw.w13[0].chunk(2, dim=-1)
    kw.w13[0] = torch.cat([up, gate], dim=-1).clone()  # expert 0's (always routed) halves swapped
    sg, su = kw.w13_scales[0].chunk(2, dim=0)
    kw.w13_scales[0] = torch.cat([su, sg], dim=0).clone()


def _flip_one_code(kw):
    codes = kw.w2[0]  # expert 0's down projection: the sign of its largest weight
    flat = int(torch.argmax(codes & 0x7F))
    codes.view(-1)[flat] ^= 0x80


@pytest.mark.parametrize("mode,vector_blocks", [("pow2", v) for _s, v in SCHEDULES] + [("output-block", None)])
@pytest.mark.parametrize("fault", [_double_one_scale_tile, _swap_gate_up, _flip_one_code], ids=lambda f: f.__name__[1:])
def test_kernel_gate_catches_one_weight_fault(small_ckpt, mode, vector_blocks, fault):
    check_kernel(small_ckpt, mode, 8, top_k=2, seed=9, vector_blocks=vector_blocks)  # the clean weights pass
    with pytest.raises(AssertionError, match="max err/bound"):
        check_kernel(small_ckpt, mode, 8, top_k=2, seed=9, fault=fault, vector_blocks=vector_blocks)


def _double_one_down_scale_tile(kw):
    kw.w2_scales[0, kw.w2_scales.shape[1] - 1, 0] *= 2  # expert 0 (routed), last hidden rows, first tile


@pytest.mark.parametrize("scenario,vector_blocks", SCHEDULES)
def test_pow2_gate_catches_a_down_scale_fault_in_every_schedule(small_ckpt, scenario, vector_blocks):
    """The down projection's blocks accumulate straight into the output: a doubled down scale tile must show."""
    with pytest.raises(AssertionError, match="max err/bound"):
        check_kernel(small_ckpt, "pow2", 8, top_k=2, seed=9, fault=_double_one_down_scale_tile, vector_blocks=vector_blocks)


# --- contract checks on the host, before every launch -------------------------------------------------------------------------------

def _small_args(mode="pow2", tokens=16, experts=2, hidden=256, inter=128):
    w13 = np.zeros((experts, 128, hidden // 128, 2 * inter), np.uint8)
    w2 = np.zeros((experts, 128, inter // 128, hidden), np.uint8)
    g13 = hidden // 128 if mode == "pow2" else 1
    g2 = inter // 128 if mode == "pow2" else 1
    s13 = np.ones((experts, 2 * inter // 128, g13), np.float32)
    s2 = np.ones((experts, hidden // 128, g2), np.float32)
    x = launch.bf16_numpy(torch.zeros(tokens, hidden, dtype=torch.bfloat16))
    aff = np.zeros((tokens, experts), np.float32)
    return [x, w13, s13, w2, s2, aff]


def _run(kernel, args):
    return launch.run_kernel(kernel, *args)


def test_output_block_kernel_refuses_block_scales():
    args = _small_args("pow2")  # 128x128 block-scale grids
    with pytest.raises(ValueError, match="block-scale grid.*moe_w8_pow2"):
        _run(moe_w8_output_block, args)
    assert np.array_equal(_run(moe_w8_output_block, _small_args("output-block")), np.zeros((1, 16, 256), np.float32))  # [programs, T, H]


def test_pow2_kernel_refuses_output_block_scales_and_bad_shapes():
    with pytest.raises(ValueError, match="w13_scales has shape"):
        _run(moe_w8_pow2, _small_args("output-block"))
    args = _small_args(tokens=T_MAX + 128)
    with pytest.raises(ValueError, match="T=384 tokens"):
        _run(moe_w8_pow2, args)
    args = _small_args()
    args[3] = args[3][:, :, :, :128]
    with pytest.raises(ValueError, match="w2 has shape"):
        _run(moe_w8_pow2, args)
    args = _small_args()
    args[0] = args[0].astype(np.float32)
    with pytest.raises(ValueError, match="hidden has dtype"):
        _run(moe_w8_pow2, args)


def test_host_layout_buckets_and_affinities():
    with pytest.raises(ValueError, match="lut"):
        host.kernel_mode(128, 128, "e4m3fn")
    with pytest.raises(ValueError, match="per-channel"):
        host.kernel_mode(1, 0, "e4m3")
    assert [host.bucket_for(t) for t in (1, 16, 17, 128, 129, 256)] == [16, 16, 32, 128, 256, 256]
    assert host.chunks(600) == [(0, 256, 256), (256, 512, 256), (512, 600, 128)]
    ids = torch.tensor([[0, 0], [-1, 1], [-1, -1]])
    w = torch.tensor([[0.25, 0.5], [0.3, 0.7], [0.1, 0.9]])
    assert torch.equal(host.dense_affinities(w, ids, 2), torch.tensor([[0.75, 0.0], [0.0, 0.7], [0.0, 0.0]]))
    w13 = torch.randint(0, 255, (2, 256, 384), dtype=torch.uint8)
    w2 = torch.randint(0, 255, (2, 384, 128), dtype=torch.uint8)
    kw = host.to_kernel_layout(w13, torch.ones(2, 2, 3), w2, torch.ones(2, 3, 1), 128, 128, "e4m3")
    e, p, k, n = 1, 5, 2, 200
    assert kw.w13[e, p, k, n] == w13[e, n, k * 128 + p]
    assert kw.w2[e, p, 0, 300] == w2[e, 300, p]
