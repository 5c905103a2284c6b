"""The avx512bf16 kernel's BF16-h path (``h_mode="bf16"``) is exactly "h rounded to nearest BF16, then the exact
down projection" -- a sharp gate, not only the rounding *bound* that tests/test_cpu_moe.py applies.

The reference is float64 over the exactly dequantised experts with h = SiLU(gate) * up rounded to nearest BF16
(ties to even, torch's float32 -> bfloat16 cast). Float32 activations keep the op's output in float32, so nothing
hides a wrong rounding. The kernel computes gate and up in float32, so an h within float32 error of a BF16
rounding midpoint may round the other way: such h_i (flagged from an estimate of that float32 error) may move
their output by one BF16 ulp of h_i times |W2[n, i]|; every other h_i must round as the reference does. The
shapes are the tiny Qwen3.5-MoE's (H 256, I 384, E 16, top-4) and a ragged I, at token counts that take the
register path (<= 3 pairs per expert) and the panel path, with one and two threads.

Why this exists: served in a tiny bf16 Qwen3.5-MoE the BF16 h missed the model accuracy gate (max |dlogprob| 0.347 vs
0.030 exact). This gate shows the kernel does what it says on every path the model uses; the gap came from one
last-layer routing flip at a near-tie (docs/cpu-path.md, "Performance of the torch path (CPU)").
"""

from __future__ import annotations

import pytest
import torch

from test_cpu_moe import HOST_ISAS, make_experts, make_routing
from vllm_moe_w8.op import cpu as cpu_moe
from vllm_moe_w8.op import reference as ref_mod

pytestmark = pytest.mark.skipif("avx512bf16" not in HOST_ISAS, reason="needs an avx512bf16 host")

# float32 dot products of n terms, summed in blocks and vector lanes: error well below 2^-20 * sum |terms|
# (the worst case n * 2^-24 is never approached by these sums). An h_i whose float64 value lies within that error
# (propagated through SiLU and the product) of a BF16 rounding midpoint may round either way.
F32_DOT_REL = 2.0**-20


def round_bf16(h: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "nearest":
        return h.float().bfloat16().double()
    bits = h.float().view(torch.int32) & ~0xFFFF  # toward zero: the fault the gate must refuse
    return bits.view(torch.float32).double()


def reference_parts(x, wts, ids, w13, w13_s, w2, w2_s, block, fmt, mode="nearest"):
    """(float64 output with h rounded per ``mode``, per-output allowance for h_i near a rounding midpoint)."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    allow = torch.zeros_like(out)
    xd = x.double()
    for e in sorted(set(int(i) for i in ids.flatten().tolist() if i >= 0)):
        gate, up = (m.double() for m in ref_mod.dequantize_w13(w13, w13_s, e, block, fmt))
        down = ref_mod.dequantize_expert(w2[e], w2_s[e], block, fmt).double()
        rows, slots = (ids == e).nonzero(as_tuple=True)
        xe = xd[rows]
        g, u = xe @ gate.T, xe @ up.T
        h = torch.nn.functional.silu(g) * u
        dg, du = F32_DOT_REL * (xe.abs() @ gate.abs().T), F32_DOT_REL * (xe.abs() @ up.abs().T)
        dh = 1.1 * dg * u.abs() + torch.nn.functional.silu(g).abs() * du + 2.0**-22 * h.abs()  # |silu'| <= 1.1
        lo = round_bf16(h, "zero")  # the BF16 next to h toward zero, its ulp, and the midpoint to the next one out
        ulp = torch.where(lo == 0, torch.zeros_like(lo), 2.0 ** (torch.floor(torch.log2(lo.abs().clamp(min=1e-300))) - 7))
        mid = lo + torch.sign(h) * ulp / 2
        near = ((h - mid).abs() <= dh).double()
        w = wts[rows, slots].double().abs()[:, None]
        out.index_add_(0, rows, (round_bf16(h, mode) @ down.T) * wts[rows, slots].double()[:, None])
        allow.index_add_(0, rows, ((near * ulp.abs()) @ down.abs().T) * w)
    return out, allow


# besides the flagged h_i: float32 sums of exactly rounded h against exact weights (measured ~1e-7 of the output's
# magnitude on these shapes; FP32_REL_TOL, 2e-5, would hide a one-ulp error of a few h_i)
SHARP_REL_TOL = 1e-6


def assert_is_h_rounded_to_nearest(out, x, wts, ids, experts, block, fmt):
    exp, allow = reference_parts(x, wts, ids, *experts, block, fmt)
    scale = float(exp.abs().max())
    err = (out.double() - exp).abs()
    worst = float((err - SHARP_REL_TOL * scale - allow).max())
    assert worst <= 0, f"BF16-h output differs from h rounded to nearest: max error {float(err.max()):.3g} (scale {scale:.3g})"


def run_bf16h(x, wts, ids, experts, block, fmt, threads=1):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return cpu_moe.fused_moe_native(x, wts, ids, *experts, *block, fmt, isa="avx512bf16", h_mode="bf16")
    finally:
        torch.set_num_threads(before)


CASES = [(inter, fmt, block, t) for inter, fmt, block in ((384, "e4m3", (128, 128)), (192, "e4m3fn", (128, 128)),
                                                          (384, "e4m3", (128, 0)))
         for t in (1, 2, 3, 5, 16, 67)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("inter,fmt,block,t", CASES)
def test_bf16_h_is_h_rounded_to_nearest(inter, fmt, block, t, threads):
    experts = make_experts(16, 256, inter, block, fmt, seed=t)
    gen = torch.Generator().manual_seed(200 + t)
    ids, wts = make_routing(t, 4, 16, gen, duplicates=True)
    x = torch.randn((t, 256), generator=gen) * 0.05  # gate values of order 1: SiLU neither linear nor saturated
    out = run_bf16h(x, wts, ids, experts, block, fmt, threads)
    assert_is_h_rounded_to_nearest(out, x, wts, ids, experts, block, fmt)


class _named:
    """Names the twin that was not refused."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is None:
            raise AssertionError(f"the sharp gate accepted the {self.name}")
        return False


@pytest.mark.parametrize("t", [3, 67])
def test_sharp_gate_refuses_other_roundings_and_a_flipped_code(t):
    """The gate's twins: h truncated instead of rounded, h not rounded at all (the exact path), and one flipped
    code (the kernel on a broken expert) are refused, at a register-path and a panel-path token count."""
    block, fmt = (128, 128), "e4m3"
    experts = make_experts(16, 256, 384, block, fmt, seed=t)
    gen = torch.Generator().manual_seed(200 + t)
    ids, wts = make_routing(t, 4, 16, gen, duplicates=True)
    x = torch.randn((t, 256), generator=gen) * 0.05  # gate values of order 1: SiLU neither linear nor saturated
    truncated, _ = reference_parts(x, wts, ids, *experts, block, fmt, mode="zero")
    exact = cpu_moe.fused_moe_native(x, wts, ids, *experts, *block, fmt, isa="avx512bf16", h_mode="exact")
    broken = [e.clone() for e in experts]
    expert = int(ids[0, 0])
    flat = int(torch.argmax(broken[2][expert] & 0x7F))
    broken[2][expert].view(-1)[flat] ^= 0x80  # the routed expert's largest down weight changes sign
    flipped = run_bf16h(x, wts, ids, broken, block, fmt)
    for name, out in (("truncated h", truncated), ("exact h", exact), ("flipped code", flipped)):
        with pytest.raises(AssertionError, match="differs from h rounded to nearest"), _named(name):
            assert_is_h_rounded_to_nearest(out.float(), x, wts, ids, experts, block, fmt)
