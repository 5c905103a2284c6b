"""The CPU MoE op (vllm_moe_w8.op.cpu) against the float64 reference MoE over exactly dequantised weights.

Every implementation (the portable torch path and every native variant this CPU can run -- on an AVX-512 BF16
host both ``avx512bf16`` and ``avx2``) must give the reference's numbers up to float32 rounding, for every scale
layout the op accepts; the avx512bf16 variant's BF16-h path (``native-avx512bf16-bf16h``: h rounded to BF16
before the down projection, opt-in with VLLM_MOE_W8_CPU_H=bf16; exactly that rounding: tests/test_cpu_moe_bf16h.py) additionally up to that rounding's bound
(:data:`H_BF16_REL`). A native variant the host's flags allow is always parametrised: if its build breaks,
these tests fail rather than skip.
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm_moe_w8.codec import fp8
from vllm_moe_w8.op import cpu as cpu_moe
from vllm_moe_w8.op import native as cpu_moe_native
from vllm_moe_w8.op import reference as ref_mod
from vllm_moe_w8.op.reference import reference_moe

# float32 compute (products of exactly dequantised weights, sums of <= a few thousand terms, two
# matmuls deep) vs a float64 reference: a few hundred float32 ulps of the output's magnitude.
FP32_REL_TOL = 2e-5
# bf16/fp16 outputs additionally carry one rounding of each element to the output dtype.
HALF_ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}

# The BF16-h path rounds each h_i = silu(gate_i) * up_i to nearest BF16 (8 significant bits): |error| <= 2^-9 |h_i|,
# so an output moves by at most 2^-9 * sum_i |W2[n, i]| |h_i| (times |routing weight|, summed over the slots),
# on top of the float32 terms above. The bound is computed per element from the float64 reference's |W2| |h|.
H_BF16_REL = 2.0**-9

HOST_ISAS = cpu_moe_native.host_isas()
# native-avx512bf16 runs with the exact h (two planes), native-avx512bf16-bf16h with the BF16 h (one plane).
IMPLEMENTATIONS = ["torch"] + [f"native-{isa}" for isa in HOST_ISAS] + (
    ["native-avx512bf16-bf16h"] if "avx512bf16" in HOST_ISAS else [])


def _run(impl, *args, **kwargs):
    if impl == "torch":
        return cpu_moe.fused_moe_torch(*args, **kwargs)
    if impl.endswith("-bf16h"):
        return cpu_moe.fused_moe_native(*args, isa=impl.removeprefix("native-").removesuffix("-bf16h"), h_mode="bf16", **kwargs)
    return cpu_moe.fused_moe_native(*args, isa=impl.removeprefix("native-"), h_mode="exact", **kwargs)


def h_bf16(impl: str) -> bool:
    return impl.endswith("-bf16h")


def random_codes(shape, code_format, gen):
    """Random FP8 bytes that are finite in ``code_format`` (e4m3: magnitude < 0x78; e4m3fn: not 0x7F)."""
    codes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    mag = codes & 0x7F
    if code_format == "e4m3":
        codes = torch.where(mag >= 0x78, codes - 0x40, codes)
    else:
        codes = torch.where(mag == 0x7F, codes - 1, codes)
    return codes


def make_experts(e, h, inter, block, code_format, seed=0):
    """Op storage for E experts with random codes and random positive scales on the block grid."""
    gen = torch.Generator().manual_seed(seed)
    bn, bk = block
    g = lambda n, k: (math.ceil(n / bn), 1 if bk == 0 else math.ceil(k / bk))  # noqa: E731
    w13 = random_codes((e, 2 * inter, h), code_format, gen)
    w2 = random_codes((e, h, inter), code_format, gen)
    gi, gh = g(inter, h)
    w13_s = torch.rand((e, 2 * gi, gh), generator=gen) * 0.02 + 1e-3
    gh2, gi2 = g(h, inter)
    w2_s = torch.rand((e, gh2, gi2), generator=gen) * 0.02 + 1e-3
    return w13, w13_s, w2, w2_s


def make_routing(t, k, e, gen, *, duplicates=False, unrouted=()):
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    if duplicates and t > 1 and k > 1:
        ids[1, 1] = ids[1, 0]  # the same expert twice for one token
    for row in unrouted:
        if row < t:
            ids[row] = -1  # expert(s) not on this rank
    if t > 2:
        ids[2, 0] = -1
    weights = torch.rand((t, k), generator=gen)
    return ids, weights


def h_rounding_bound(x, ids, wts, w13, w13_s, w2, w2_s, bn, bk, fmt, limit=0.0):
    """sum over slots |w| * (|W2| @ |h|) [T, H] in float64 (the BF16-h path's extra error, over H_BF16_REL)."""
    block = (bn, bk)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for e in sorted(set(int(i) for i in ids.flatten().tolist() if i >= 0)):
        gate, up = ref_mod.dequantize_w13(w13, w13_s, e, block, fmt)
        down = ref_mod.dequantize_expert(w2[e], w2_s[e], block, fmt).double()
        rows, slots = (ids == e).nonzero(as_tuple=True)
        xe = x.double()[rows]
        h = ref_mod.activate(xe @ gate.double().T, xe @ up.double().T, swiglu_limit=limit)
        out.index_add_(0, rows, (h.abs() @ down.abs().T) * wts[rows, slots].double().abs()[:, None])
    return out


def assert_matches_reference(out, x, ids, wts, w13, w13_s, w2, w2_s, bn, bk, fmt, limit=0.0, h_rounded=False):
    """The op's accuracy gate: float32 terms (FP32_REL_TOL of the output's magnitude), the output dtype's
    rounding, and with ``h_rounded`` (the BF16-h path) H_BF16_REL of |W2| |h| per output element."""
    ref = reference_moe(x, wts, ids, w13, w13_s, w2, w2_s, bn, bk, fmt, swiglu_limit=limit, dtype=torch.float64)
    assert out.dtype == x.dtype and out.shape == ref.shape
    scale = float(ref.abs().max()) or 1.0
    err = (out.double() - ref).abs()
    bound = FP32_REL_TOL * scale + HALF_ULP.get(x.dtype, 0.0) * ref.abs()
    if h_rounded:
        bound = bound + H_BF16_REL * h_rounding_bound(x, ids, wts, w13, w13_s, w2, w2_s, bn, bk, fmt, limit)
    worst = float((err - bound).max())
    assert worst <= 0, f"max error {float(err.max()):.3g} exceeds tolerance (scale {scale:.3g})"


MODES = [
    # (code_format, block): block FP8 (pow2 repack), per-channel, output-block, OCP bytes (lut)
    ("e4m3", (128, 128)),
    ("e4m3", (1, 0)),
    ("e4m3", (128, 0)),
    ("e4m3fn", (128, 128)),
]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("fmt,block", MODES)
@pytest.mark.parametrize("t", [1, 7, 64])
def test_matches_reference_modes(impl, fmt, block, t):
    e, h, inter, k = 8, 256, 192, 4  # I = 192: the last 128-row block is ragged
    w13, w13_s, w2, w2_s = make_experts(e, h, inter, block, fmt, seed=t)
    gen = torch.Generator().manual_seed(100 + t)
    ids, wts = make_routing(t, k, e, gen, duplicates=True, unrouted=(3,))
    x = torch.randn((t, h), generator=gen).to(torch.bfloat16)
    out = _run(impl, x, wts, ids, w13, w13_s, w2, w2_s, *block, fmt)
    assert_matches_reference(out, x, ids, wts, w13, w13_s, w2, w2_s, *block, fmt, h_rounded=h_bf16(impl))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_refined_grid_ragged_and_dtypes(impl, dtype):
    """Tensor-parallel refined grid: I = 192 per rank with 64-row/column tiles; every input dtype."""
    e, h, inter, k, t = 6, 320, 192, 3, 9
    block = (64, 64)
    w13, w13_s, w2, w2_s = make_experts(e, h, inter, block, "e4m3", seed=7)
    gen = torch.Generator().manual_seed(8)
    ids, wts = make_routing(t, k, e, gen, duplicates=True, unrouted=(0,))
    x = torch.randn((t, h), generator=gen).to(dtype)
    out = _run(impl, x, wts, ids, w13, w13_s, w2, w2_s, *block, "e4m3")
    assert_matches_reference(out, x, ids, wts, w13, w13_s, w2, w2_s, *block, "e4m3", h_rounded=h_bf16(impl))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_repacked_checkpoint_and_swiglu_limit(impl):
    """Experts repacked from OCP bytes by fp8.repack (pow2), with a SwiGLU clamp that bites."""
    e, h, inter, k, t = 4, 256, 128, 2, 16
    gen = torch.Generator().manual_seed(3)
    w13_r, w2_r = [], []
    for _ in range(e):
        gate_up = (torch.randn((2 * inter, h), generator=gen) * 300).clamp(-448, 448).to(torch.float8_e4m3fn)
        down = (torch.randn((h, inter), generator=gen) * 300).clamp(-448, 448).to(torch.float8_e4m3fn)
        s13 = torch.rand((2 * inter // 128, h // 128), generator=gen) * 1e-2 + 1e-4
        s2 = torch.rand((h // 128, inter // 128), generator=gen) * 1e-2 + 1e-4
        w13_r.append(fp8.repack(gate_up, s13))
        w2_r.append(fp8.repack(down, s2))
    assert sum(r.stats.blocks_shifted for r in w13_r) > 0  # the repack really moved blocks to e4m3's range
    w13 = torch.stack([r.codes for r in w13_r])
    w13_s = torch.stack([r.scales for r in w13_r])
    w2 = torch.stack([r.codes for r in w2_r])
    w2_s = torch.stack([r.scales for r in w2_r])
    ids, wts = make_routing(t, k, e, gen, duplicates=True)
    x = torch.randn((t, h), generator=gen).to(torch.bfloat16) * 4
    ref_free = reference_moe(x, wts, ids, w13, w13_s, w2, w2_s, 128, 128, "e4m3", dtype=torch.float64)
    out = _run(impl, x, wts, ids, w13, w13_s, w2, w2_s, 128, 128, "e4m3", swiglu_limit=0.5)
    assert_matches_reference(out, x, ids, wts, w13, w13_s, w2, w2_s, 128, 128, "e4m3", limit=0.5, h_rounded=h_bf16(impl))
    assert not torch.allclose(out.double(), ref_free, rtol=1e-2)  # the clamp changed the result


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_no_routes_gives_zeros(impl):
    e, h, inter = 3, 128, 64
    w13, w13_s, w2, w2_s = make_experts(e, h, inter, (64, 64), "e4m3")
    x = torch.randn(5, h).to(torch.bfloat16)
    ids = torch.full((5, 2), -1, dtype=torch.int64)
    out = _run(impl, x, torch.ones(5, 2), ids, w13, w13_s, w2, w2_s, 64, 64, "e4m3")
    assert out.dtype == torch.bfloat16 and torch.equal(out, torch.zeros_like(out))
    empty = _run(impl, x[:0], torch.ones(0, 2), ids[:0], w13, w13_s, w2, w2_s, 64, 64, "e4m3")
    assert empty.shape == (0, h)


def test_dispatch_matches_torch_path():
    """fused_moe_cpu (whatever implementation it picks) gives the torch path's numbers."""
    e, h, inter, k, t = 8, 256, 192, 4, 7
    w13, w13_s, w2, w2_s = make_experts(e, h, inter, (128, 128), "e4m3", seed=11)
    gen = torch.Generator().manual_seed(12)
    ids, wts = make_routing(t, k, e, gen)
    x = torch.randn((t, h), generator=gen).to(torch.bfloat16)
    out = cpu_moe.fused_moe_cpu(x, wts, ids, w13, w13_s, w2, w2_s, 128, 128, "e4m3")
    impl = cpu_moe.implementation(h, inter, 128)
    rounded = cpu_moe.h_precision(x.dtype, impl.removeprefix("native-")) == "bf16"
    assert not rounded  # the exact h by default, on every variant (the BF16 h is opt-in: VLLM_MOE_W8_CPU_H=bf16)
    assert_matches_reference(out, x, ids, wts, w13, w13_s, w2, w2_s, 128, 128, "e4m3", h_rounded=rounded)


def test_bad_arguments_are_named():
    w13, w13_s, w2, w2_s = make_experts(2, 128, 64, (64, 64), "e4m3")
    x = torch.randn(2, 128)
    ids = torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="w13_scales"):
        cpu_moe.fused_moe_cpu(x, torch.ones(2, 1), ids, w13, w13_s[:, :1], w2, w2_s, 64, 64, "e4m3")
    with pytest.raises(ValueError, match="code_format"):
        cpu_moe.fused_moe_cpu(x, torch.ones(2, 1), ids, w13, w13_s, w2, w2_s, 64, 64, "e5m2")
    with pytest.raises(ValueError, match="local experts"):
        cpu_moe.fused_moe_cpu(x, torch.ones(2, 1), ids + 5, w13, w13_s, w2, w2_s, 64, 64, "e4m3")
    with pytest.raises(ValueError, match="uint8"):
        cpu_moe.fused_moe_cpu(x, torch.ones(2, 1), ids, w13.float(), w13_s, w2, w2_s, 64, 64, "e4m3")


@pytest.fixture
def fresh_native(monkeypatch):
    """cpu_moe_native with its load state reset (and reset again afterwards)."""
    cpu_moe_native.reset()
    monkeypatch.setattr(cpu_moe, "_LOGGED", set())
    monkeypatch.delenv(cpu_moe_native.ENV_ISA, raising=False)
    monkeypatch.delenv("VLLM_MOE_W8_NATIVE", raising=False)
    yield cpu_moe_native
    cpu_moe_native.reset()


@pytest.mark.parametrize("how", ["disabled", "forced torch", "compiler fails"])
def test_falls_back_to_torch_and_says_why(fresh_native, monkeypatch, caplog, how):
    if how == "disabled":
        monkeypatch.setenv("VLLM_MOE_W8_NATIVE", "0")
    elif how == "forced torch":
        monkeypatch.setenv(cpu_moe_native.ENV_ISA, "torch")
    else:
        monkeypatch.setenv("CXX", "/bin/false")  # part of the cache key: no cached build matches, the build fails
    assert cpu_moe.implementation(128, 64, 64) == "torch"
    expected = {"disabled": "VLLM_MOE_W8_NATIVE=0", "forced torch": "VLLM_MOE_W8_CPU_ISA=torch", "compiler fails": "failed"}[how]
    e, h, inter = 4, 128, 64
    w13, w13_s, w2, w2_s = make_experts(e, h, inter, (64, 64), "e4m3")
    gen = torch.Generator().manual_seed(5)
    ids, wts = make_routing(3, 2, e, gen)
    x = torch.randn(3, h).to(torch.bfloat16)
    with caplog.at_level("INFO", logger="vllm.vllm_moe_w8.op.cpu"):
        out = cpu_moe.fused_moe_cpu(x, wts, ids, w13, w13_s, w2, w2_s, 64, 64, "e4m3")
    assert_matches_reference(out, x, ids, wts, w13, w13_s, w2, w2_s, 64, 64, "e4m3")
    messages = [r.getMessage() for r in caplog.records]
    assert any("torch implementation" in m and "unavailable" in m and (expected in m or how == "compiler fails" and not HOST_ISAS)
               for m in messages), messages


@pytest.mark.skipif(not HOST_ISAS, reason="no native variant fits this CPU (the torch path is the implementation here)")
def test_no_silent_fallback_on_a_supported_host(fresh_native, monkeypatch, caplog):
    """On a host whose flags a native variant supports, the op must run that variant: a broken build or
    dispatch fails here instead of quietly serving the (slower) torch path."""
    best = HOST_ISAS[0]
    assert cpu_moe_native.selected_isa() == best
    assert cpu_moe.implementation(2048, 512, 128) == f"native-{best}", cpu_moe_native.unavailable_reason(best)

    def torch_path_called(*args, **kwargs):
        raise AssertionError("fused_moe_cpu fell back to the torch path on a host the native kernel supports")

    monkeypatch.setattr(cpu_moe, "fused_moe_torch", torch_path_called)
    w13, w13_s, w2, w2_s = make_experts(4, 256, 128, (128, 128), "e4m3", seed=2)
    gen = torch.Generator().manual_seed(9)
    ids, wts = make_routing(5, 2, 4, gen)
    x = torch.randn(5, 256, generator=gen).to(torch.bfloat16)
    with caplog.at_level("INFO", logger="vllm.vllm_moe_w8.op.cpu"):
        out = cpu_moe.fused_moe_cpu(x, wts, ids, w13, w13_s, w2, w2_s, 128, 128, "e4m3")
    assert_matches_reference(out, x, ids, wts, w13, w13_s, w2, w2_s, 128, 128, "e4m3", h_rounded=False)  # the exact h is the default
    assert any("native kernel" in r.getMessage() and f"instruction set {best}" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("isa", HOST_ISAS)
def test_forced_isa_is_used_built_once_and_logged(fresh_native, monkeypatch, caplog, isa):
    monkeypatch.setenv(cpu_moe_native.ENV_ISA, isa)
    first = fresh_native.build(isa)
    assert first.exists() and fresh_native.build(isa) == first  # second call: the cached file, no rebuild
    assert isa in first.name  # cached per instruction set
    assert cpu_moe.implementation(128, 64, 64) == f"native-{isa}"
    w13, w13_s, w2, w2_s = make_experts(2, 128, 64, (64, 64), "e4m3")
    with caplog.at_level("INFO", logger="vllm.vllm_moe_w8.op.cpu"):
        cpu_moe.fused_moe_cpu(torch.randn(1, 128), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int64), w13, w13_s, w2, w2_s, 64, 64, "e4m3")
    assert any(f"instruction set {isa}" in r.getMessage() for r in caplog.records)


def test_forcing_an_isa_the_cpu_lacks_is_an_error(fresh_native, monkeypatch):
    monkeypatch.setenv(cpu_moe_native.ENV_ISA, "avx512bf16")
    monkeypatch.setattr(cpu_moe_native, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    with pytest.raises(RuntimeError, match="lacks avx512f"):
        cpu_moe_native.selected_isa()
    monkeypatch.setenv(cpu_moe_native.ENV_ISA, "sse9")
    with pytest.raises(ValueError, match="VLLM_MOE_W8_CPU_ISA"):
        cpu_moe_native.selected_isa()


def test_avx2_only_host_picks_avx2(fresh_native, monkeypatch):
    """The automatic choice follows the CPU's flags: an AVX2-only machine of this kind gets the AVX2 variant."""
    monkeypatch.setattr(cpu_moe_native, "is_x86_64_linux", lambda: True)
    monkeypatch.setattr(cpu_moe_native, "cpu_flags", lambda: {"avx2", "fma", "f16c", "sse4_2"})
    assert cpu_moe_native.selected_isa() == "avx2"
    monkeypatch.setattr(cpu_moe_native, "cpu_flags", lambda: {"sse4_2"})
    assert cpu_moe_native.selected_isa() == "torch"
    assert "CPU lacks" in cpu_moe_native.unavailable_reason("torch")


@pytest.mark.parametrize("fault", ["scale tile doubled", "one code flipped", "fp32 inputs rounded to bf16"])
def test_reference_gate_catches_realistic_faults(fault):
    """The tolerance above is tight enough to fail on the smallest realistic fault: one expert's scale tile
    doubled, one FP8 code's lowest mantissa bit flipped, or float32 activations rounded to one bf16 plane
    (what the avx512bf16 variant would compute if it dropped the residual planes)."""
    e, h, inter, k, t = 4, 256, 128, 2, 5
    w13, w13_s, w2, w2_s = make_experts(e, h, inter, (128, 128), "e4m3", seed=21)
    gen = torch.Generator().manual_seed(22)
    ids, wts = make_routing(t, k, e, gen)
    x = torch.randn((t, h), generator=gen)
    expert = int(ids[0, 0])
    bad13, bad13_s, x_run = w13.clone(), w13_s.clone(), x
    if fault == "scale tile doubled":
        bad13_s[expert, 0, 0] *= 2
    elif fault == "one code flipped":  # the lowest mantissa bit of the gate code that weighs most in token 0's output
        gate = cpu_moe.dequantize_rows(w13[expert, :inter], w13_s[expert, :1], 128, 128, "e4m3")
        row = int((x[0] @ gate.T).abs().argmax())
        col = int((gate[row] * x[0]).abs().argmax())
        bad13[expert, row, col] ^= 1
    else:
        x_run = x.bfloat16().float()
    out = cpu_moe.fused_moe_cpu(x_run, wts, ids, bad13, bad13_s, w2, w2_s, 128, 128, "e4m3")
    with pytest.raises(AssertionError, match="exceeds tolerance"):
        assert_matches_reference(out, x, ids, wts, w13, w13_s, w2, w2_s, 128, 128, "e4m3")


@pytest.mark.skipif(HOST_ISAS[:2] != ["avx512bf16", "avx2"], reason="needs a host that runs both native variants")
def test_tile_width_outside_avx512_groups_uses_avx2_and_says_so(fresh_native, caplog):
    """block_k = 32 cannot be served by 64-code decode groups: the AVX2 variant runs, the log says why."""
    assert cpu_moe.implementation(256, 128, 32) == "native-avx2"
    w13, w13_s, w2, w2_s = make_experts(3, 256, 128, (32, 32), "e4m3", seed=4)
    gen = torch.Generator().manual_seed(6)
    ids, wts = make_routing(4, 2, 3, gen)
    x = torch.randn(4, 256, generator=gen).to(torch.bfloat16)
    with caplog.at_level("INFO", logger="vllm.vllm_moe_w8.op.cpu"):
        out = cpu_moe.fused_moe_cpu(x, wts, ids, w13, w13_s, w2, w2_s, 32, 32, "e4m3")
    assert_matches_reference(out, x, ids, wts, w13, w13_s, w2, w2_s, 32, 32, "e4m3")
    messages = [r.getMessage() for r in caplog.records]
    assert any("avx512bf16 kernel is not used" in m and "not covered" in m for m in messages), messages


@pytest.mark.parametrize("impl", [i for i in IMPLEMENTATIONS if i != "torch"])
def test_thread_count_and_scheduling_do_not_change_a_bit(impl):
    """Work items own disjoint outputs and each sums in a fixed order, so the caller-plus-helpers scheduling gives
    the same bits with 1 thread and with more threads than cores (helpers that start late or never)."""
    e, h, inter, k, t = 16, 512, 256, 4, 40  # ~6 MB of routed codes: above the single-thread threshold
    w13, w13_s, w2, w2_s = make_experts(e, h, inter, (128, 128), "e4m3", seed=31)
    gen = torch.Generator().manual_seed(32)
    ids, wts = make_routing(t, k, e, gen)
    x = torch.randn((t, h), generator=gen).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 7):
            torch.set_num_threads(threads)
            outs.append(_run(impl, x, wts, ids, w13, w13_s, w2, w2_s, 128, 128, "e4m3"))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert_matches_reference(outs[0], x, ids, wts, w13, w13_s, w2, w2_s, 128, 128, "e4m3", h_rounded=h_bf16(impl))


@pytest.mark.skipif("avx512bf16" not in HOST_ISAS, reason="needs an avx512bf16 host")
def test_h_precision_is_chosen_logged_and_selectable(fresh_native, monkeypatch, caplog):
    """The exact h by default; VLLM_MOE_W8_CPU_H=bf16 gives BF16 activations the BF16 h (and the log says so and
    why); other dtypes stay exact; a bad value is named."""
    w13, w13_s, w2, w2_s = make_experts(4, 256, 128, (128, 128), "e4m3", seed=41)
    gen = torch.Generator().manual_seed(42)
    ids, wts = make_routing(6, 2, 4, gen)
    x = torch.randn((6, 256), generator=gen)
    assert cpu_moe.h_precision(torch.bfloat16, "avx512bf16") == "exact" and "h exact" in cpu_moe.describe_path()
    xb = x.bfloat16()
    args = (wts, ids, w13, w13_s, w2, w2_s, 128, 128, "e4m3")
    rounded = cpu_moe.fused_moe_native(xb, *args, isa="avx512bf16", h_mode="bf16")
    exact = cpu_moe.fused_moe_native(xb, *args, isa="avx512bf16", h_mode="exact")
    assert torch.equal(cpu_moe.fused_moe_cpu(xb, *args), exact) and not torch.equal(rounded, exact)
    monkeypatch.setenv(cpu_moe_native.ENV_H, "bf16")
    assert cpu_moe.h_precision(torch.bfloat16, "avx512bf16") == "bf16"
    assert cpu_moe.h_precision(torch.float32, "avx512bf16") == cpu_moe.h_precision(torch.bfloat16, "avx2") == "exact"
    assert "rounded to BF16" in cpu_moe.describe_path()
    with caplog.at_level("INFO", logger="vllm.vllm_moe_w8.op.cpu"):
        opted = cpu_moe.fused_moe_cpu(xb, *args)
    assert any("rounded to BF16" in r.getMessage() and "bfloat16 activations" in r.getMessage() for r in caplog.records)
    assert torch.equal(opted, rounded)
    monkeypatch.setenv(cpu_moe_native.ENV_H, "fast")
    with pytest.raises(ValueError, match="VLLM_MOE_W8_CPU_H"):
        cpu_moe.fused_moe_cpu(x.bfloat16(), wts, ids, w13, w13_s, w2, w2_s, 128, 128, "e4m3")
