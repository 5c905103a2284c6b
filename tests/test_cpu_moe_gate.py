"""The CPU op's accuracy gate (``assert_matches_reference`` in test_cpu_moe.py) fails on the smallest realistic
weight faults: the op runs on corrupted experts, the float64 reference on the checkpoint's, and the very gate
the op's tests use must refuse the result (while the clean weights pass it). The BF16-h path
(``native-avx512bf16-bf16h``, BF16 activations) is judged by its own, wider gate (``h_rounded``), which must
refuse the same faults; and the BF16 h must fail the exact gate (the exact path is not silently the BF16 one)."""

from __future__ import annotations

import pytest
import torch

from test_cpu_moe import IMPLEMENTATIONS, _run, assert_matches_reference, h_bf16, make_experts, make_routing

E, H, INTER, TOP_K, TOKENS = 4, 256, 256, 2, 8


def double_one_scale_tile(w13, w13_s, w2, w2_s):
    w13_s[1, 0, w13_s.shape[2] - 1] *= 2  # expert 1, gate rows 0-127, last tile


def swap_gate_up(w13, w13_s, w2, w2_s):
    gate, up = w13[2].chunk(2, dim=0)
    w13[2] = torch.cat([up, gate]).clone()  # expert 2's gate and up halves exchanged, scales with them
    sg, su = w13_s[2].chunk(2, dim=0)
    w13_s[2] = torch.cat([su, sg]).clone()


def flip_one_code(w13, w13_s, w2, w2_s):
    flat = int(torch.argmax(w2[0] & 0x7F))  # expert 0's largest down-projection weight changes sign
    w2[0].view(-1)[flat] ^= 0x80


def wrong_rank_slice(w13, w13_s, w2, w2_s):
    w2[3] = torch.roll(w2[3], shifts=64, dims=1).clone()  # expert 3's down columns taken from the wrong offset


# Scale and code faults in every storage the op reads (pow2 / lut / output-block); the layout faults once.
CASES = [(fault, fmt, block) for fmt, block in (("e4m3", (128, 128)), ("e4m3fn", (128, 128)), ("e4m3", (128, 0)))
         for fault in (double_one_scale_tile, flip_one_code)]
CASES += [(swap_gate_up, "e4m3", (128, 128)), (wrong_rank_slice, "e4m3", (128, 128))]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("fault,fmt,block", CASES, ids=[f"{f.__name__}-{fmt}-{b[1]}" for f, fmt, b in CASES])
def test_cpu_op_gate_catches_one_weight_fault(impl, fmt, block, fault):
    clean = make_experts(E, H, INTER, block, fmt, seed=11)
    gen = torch.Generator().manual_seed(12)
    ids, wts = make_routing(TOKENS, TOP_K, E, gen)
    ids[0] = torch.tensor([0, 1], dtype=ids.dtype)  # experts 0 and 1 are routed
    ids[1] = torch.tensor([2, 3], dtype=ids.dtype)  # and so are 2 and 3
    x = torch.randn((TOKENS, H), generator=gen)
    rounded = h_bf16(impl)
    if rounded:
        x = x.bfloat16()  # the BF16-h path's default use: BF16 activations

    out = _run(impl, x, wts, ids, *clean, *block, fmt)
    assert_matches_reference(out, x, ids, wts, *clean, *block, fmt, h_rounded=rounded)

    broken = [t.clone() for t in clean]
    fault(*broken)
    assert any(not torch.equal(a, b) for a, b in zip(clean, broken)), "the fault changed nothing"
    out = _run(impl, x, wts, ids, *broken, *block, fmt)
    with pytest.raises(AssertionError, match="exceeds tolerance"):
        assert_matches_reference(out, x, ids, wts, *clean, *block, fmt, h_rounded=rounded)


@pytest.mark.skipif("native-avx512bf16-bf16h" not in IMPLEMENTATIONS, reason="needs an avx512bf16 host")
def test_bf16_h_fails_the_exact_gate():
    """The exact path's gate tells the BF16 h apart: run with h rounded to BF16 it refuses, with h exact it passes
    (float32 activations, so the output carries no BF16 rounding of its own to hide h's)."""
    clean = make_experts(E, H, INTER, (128, 128), "e4m3", seed=11)
    gen = torch.Generator().manual_seed(12)
    ids, wts = make_routing(TOKENS, TOP_K, E, gen)
    x = torch.randn((TOKENS, H), generator=gen)
    exact = _run("native-avx512bf16", x, wts, ids, *clean, 128, 128, "e4m3")
    assert_matches_reference(exact, x, ids, wts, *clean, 128, 128, "e4m3")
    rounded = _run("native-avx512bf16-bf16h", x, wts, ids, *clean, 128, 128, "e4m3")
    assert_matches_reference(rounded, x, ids, wts, *clean, 128, 128, "e4m3", h_rounded=True)
    with pytest.raises(AssertionError, match="exceeds tolerance"):
        assert_matches_reference(rounded, x, ids, wts, *clean, 128, 128, "e4m3")
