"""The on-chip dequantise-to-BF16 kernel (kernels/moe_w8_dequant.py) in the interpreter: equal to a BF16 model
dequantised from the same checkpoint (bf16(w * s) weights, fp32 reference) within the dense kernels' bound, its
fault twin, and its accuracy against the exact fp32 reference beside output-block requantisation's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_moe_w8.kernels import host, launch
from vllm_moe_w8.kernels.moe_w8_dequant import moe_w8_dequant_bf16
from vllm_moe_w8.kernels.nki_api import BACKEND
from vllm_moe_w8.neuron_glue.kernel_check import ACT_BF16_ROUNDOFF, checkpoint_experts, error_bound, repacked, routing
from vllm_moe_w8.op.reference import activate, dequantize_expert, dequantize_w13, reference_moe

pytestmark = pytest.mark.skipif(BACKEND != "interpreter", reason="runs in the project's NKI interpreter")


@pytest.fixture(scope="module")
def ckpt():
    return checkpoint_experts(4, 512, 256, seed=4)


def _run(kw, x, aff, swiglu_limit=0.0):
    def one_call(hidden, aff_chunk):
        from vllm_moe_w8.kernels.nki_cpu import run

        args = launch.kernel_args(hidden, aff_chunk, kw)
        host.check_kernel_args(*args, mode="pow2", swiglu_limit=swiglu_limit)
        out, _stats = run(moe_w8_dequant_bf16, *args, float(swiglu_limit))
        return torch.from_numpy(np.asarray(out, dtype=np.float32)).sum(dim=0)

    return host.run_chunked(one_call, x, aff)


def bf16_model_reference(x, topk_weights, topk_ids, w13, s13, w2, s2, block, swiglu_limit=0.0):
    """fp32 MoE on bf16(dequantised) weights: what a BF16 model converted from the checkpoint computes."""
    aff = host.dense_affinities(topk_weights, topk_ids, w13.shape[0])
    out = torch.zeros(x.shape[0], w2.shape[1])
    xf = x.float()
    for e in range(w13.shape[0]):
        gate, up = (w.to(torch.bfloat16).float() for w in dequantize_w13(w13, s13, e, block, "e4m3"))
        down = dequantize_expert(w2[e], s2[e], block, "e4m3").to(torch.bfloat16).float()
        out += (activate(xf @ gate.T, xf @ up.T, swiglu_limit=swiglu_limit) * aff[:, e:e + 1]) @ down.T
    return out


def _case(ckpt, tokens, seed, fault=None, swiglu_limit=0.0):
    w13, s13, w2, s2, block = repacked(ckpt, "pow2")
    x = torch.randn(tokens, w2.shape[1], generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    topk_weights, topk_ids = routing(tokens, w13.shape[0], 2, seed)
    kw = host.to_kernel_layout(w13, s13, w2, s2, block[0], block[1], "e4m3")
    if fault is not None:
        kw = host.KernelWeights(kw.w13.clone(), kw.w13_scales.clone(), kw.w2.clone(), kw.w2_scales.clone(), kw.mode)
        fault(kw)
    out = _run(kw, x, host.dense_affinities(topk_weights, topk_ids, kw.num_experts), swiglu_limit)
    ref = bf16_model_reference(x, topk_weights, topk_ids, w13, s13, w2, s2, block, swiglu_limit)
    bound = error_bound(x, topk_weights, topk_ids, w13, s13, w2, s2, block, swiglu_limit)
    return out, ref, bound, (x, topk_weights, topk_ids)


def gate(out, ref, bound):
    err = (out - ref).abs()
    assert bool((err <= bound).all()), f"max err/bound {float((err / bound).max()):.3f}"


@pytest.mark.parametrize("tokens,limit", [(8, 0.0), (130, 0.5)])  # 130: two token tiles; 0.5: the clamp bites
def test_dequant_kernel_equals_the_dequantised_bf16_model(ckpt, tokens, limit):
    out, ref, bound, _ = _case(ckpt, tokens, seed=tokens, swiglu_limit=limit)
    gate(out, ref, bound)


def _double_one_scale_tile(kw):
    kw.w13_scales[0, 0, kw.w13_scales.shape[2] - 1] *= 2


def test_fault_a_doubled_scale_tile_fails_the_gate(ckpt):
    out, ref, bound, _ = _case(ckpt, 8, seed=8, fault=_double_one_scale_tile)
    with pytest.raises(AssertionError, match="max err/bound"):
        gate(out, ref, bound)


def test_dequant_is_more_accurate_than_output_block_requantisation(ckpt):
    """Against the exact fp32 reference of the checkpoint: bf16(w*s) (relative 2**-9 per weight) vs requantising
    to one scale per 128 output rows (an FP8 rounding of every weight whose block scale changed)."""
    out, _ref, _bound, (x, topk_weights, topk_ids) = _case(ckpt, 8, seed=8)
    w13, s13, w2, s2, block = repacked(ckpt, "pow2")
    exact = reference_moe(x, topk_weights, topk_ids, w13, s13, w2, s2, block[0], block[1], "e4m3")
    ob = repacked(ckpt, "output-block")
    ob_ref = reference_moe(x, topk_weights, topk_ids, ob[0], ob[1], ob[2], ob[3], ob[4][0], ob[4][1], "e4m3")
    rel = {name: float((y - exact).norm() / exact.norm()) for name, y in (("dequant", out), ("output-block", ob_ref))}
    assert rel["dequant"] < 4 * ACT_BF16_ROUNDOFF, rel
    assert rel["dequant"] < rel["output-block"], rel
