"""FP8 codecs and repack, checked against ml_dtypes (an independent implementation of both formats).

Exactness is bit-level where the maths is exact: pow2 keeps every value except the documented
round-to-nearest-even of odd codes below 0x10 in shifted tiles, and lut keeps every byte. Every test runs on
both pow2 paths: the native single-pass body (codec/csrc/repack_pow2.cpp) and the numpy fallback.
"""

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from vllm_moe_w8.codec import fp8, repack_native

ALL_CODES = np.arange(256, dtype=np.uint8)
FINITE_FN = ALL_CODES[(ALL_CODES & 0x7F) != 0x7F]
SCALE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# A half step of e4m3 (3 mantissa bits) relative to the value, for round-to-nearest requantisation.
E4M3_HALF_ULP_REL = 2.0**-4
# Below the smallest normal (2**-6) e4m3's step is 2**-9: half of it, in units of the block scale.
E4M3_HALF_SUBNORMAL_STEP = 2.0**-10
# One float32 rounding, relative (output-block divides the exact weight by its new scale in float32).
FP32_ULP_REL = 2.0**-23


@pytest.fixture(autouse=True, params=["native", "numpy"])
def repack_path(request, monkeypatch):
    """Each test once per pow2 path; the native one must really run (a broken build fails, not falls back)."""
    monkeypatch.setenv(repack_native.ENV, "numpy" if request.param == "numpy" else "auto")
    if request.param == "native":
        assert repack_native.available(), repack_native.unavailable_reason()
    return request.param


def test_the_chosen_path_runs(repack_path, monkeypatch):
    calls = []
    real = repack_native.pow2
    monkeypatch.setattr(repack_native, "pow2", lambda *a: calls.append(1) or real(*a))
    codes = (torch.randn(256, 256) * 200).clamp(-448, 448).to(torch.float8_e4m3fn)
    r = fp8.repack(codes, torch.ones(2, 2))
    assert calls and r.stats.blocks_shifted == 4
    assert (real(codes.view(torch.uint8).numpy(), 128, 128) is None) == (repack_path == "numpy")


def test_an_unknown_repack_path_is_named(monkeypatch):
    monkeypatch.setenv(repack_native.ENV, "simd")
    with pytest.raises(ValueError, match="VLLM_MOE_W8_REPACK"):
        fp8.repack(torch.zeros(128, 128, dtype=torch.uint8), torch.ones(1, 1))


def ml_decode(codes: np.ndarray, dtype) -> np.ndarray:
    # float64: an fp8 value times an fp32 scale is exact in float64 (4 + 24 significant bits < 53)
    return np.asarray(codes, dtype=np.uint8).view(dtype).astype(np.float64)


def ml_dequant(codes: np.ndarray, scale: np.ndarray, block) -> np.ndarray:
    """Independent dequantisation: ml_dtypes decode times np.repeat-expanded scales."""
    n, k = codes.shape
    bn, bk = block
    s = np.repeat(scale.astype(np.float64), bn, axis=0)[:n]
    s = np.repeat(s, k if bk == 0 else bk, axis=1)[:, :k]
    return ml_decode(codes, ml_dtypes.float8_e4m3fn) * s


def test_every_code_decodes_like_ml_dtypes():
    for fmt, dtype in (("e4m3fn", ml_dtypes.float8_e4m3fn), ("e4m3", ml_dtypes.float8_e4m3)):
        ours = fp8.decode(torch.from_numpy(ALL_CODES), fmt).numpy()
        theirs = ml_decode(ALL_CODES, dtype)
        np.testing.assert_array_equal(ours, theirs)  # NaN positions must agree too


def test_formats_agree_below_0x78_and_only_there():
    fn = ml_decode(ALL_CODES, ml_dtypes.float8_e4m3fn)
    e = ml_decode(ALL_CODES, ml_dtypes.float8_e4m3)
    same = (ALL_CODES & 0x7F) < fp8.FN_ONLY_MIN_MAG
    np.testing.assert_array_equal(fn[same], e[same])
    assert not np.any(fn[~same] == e[~same])


def test_halving_every_finite_code_matches_ml_dtypes_rounding():
    halved = fp8.halve_codes(torch.from_numpy(FINITE_FN)).numpy()
    want = (ml_decode(FINITE_FN, ml_dtypes.float8_e4m3fn) / 2).astype(ml_dtypes.float8_e4m3).view(np.uint8)
    np.testing.assert_array_equal(halved, want)
    assert np.all((halved & 0x7F) < fp8.FN_ONLY_MIN_MAG)
    # exactly the 16 odd codes with magnitude < 0x10 (8 magnitudes, two signs) round
    inexact = ml_decode(halved, ml_dtypes.float8_e4m3) != ml_decode(FINITE_FN, ml_dtypes.float8_e4m3fn) / 2
    assert sorted(FINITE_FN[inexact] & 0x7F) == sorted([m for m in range(1, 16, 2)] * 2)


def random_fp8(n, k, rng, fn_only_tiles=True):
    """Random finite e4m3fn bytes [n, k] (NaN codes excluded); magnitudes below 0x78 only if asked."""
    mag = rng.integers(0, 0x7F if fn_only_tiles else 0x78, size=(n, k), dtype=np.uint8)
    sign = (rng.integers(0, 2, size=(n, k), dtype=np.uint8) << 7).astype(np.uint8)
    return mag | sign


def random_scale(grid, dtype, rng):
    s = torch.from_numpy(rng.uniform(1e-3, 2.0, size=grid).astype(np.float32)).to(dtype)
    return s


shapes = st.tuples(st.integers(1, 300), st.integers(1, 300))


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), dtype_i=st.integers(0, 2), sparse=st.booleans())
def test_pow2_is_exact_but_for_counted_rounding(shape, seed, dtype_i, sparse):
    rng = np.random.default_rng(seed)
    n, k = shape
    codes = random_fp8(n, k, rng)
    if sparse:  # some tiles without any e4m3fn-only code: they must be kept bit for bit
        codes[: n // 2] &= 0xBF  # clears the top exponent bit: magnitude < 0x40
    scale = random_scale((math.ceil(n / 128), math.ceil(k / 128)), SCALE_DTYPES[dtype_i], rng)
    r = fp8.repack(torch.from_numpy(codes), scale, "pow2")
    out = r.codes.numpy()
    assert r.codes.dtype == torch.uint8 and r.scales.dtype == torch.float32
    assert np.all((out & 0x7F) < 0x78), "pow2 must never emit a code outside Trn2 float8_e4m3"

    want = ml_dequant(codes, scale.float().numpy(), (128, 128))
    got = ml_decode(out, ml_dtypes.float8_e4m3) * np.repeat(np.repeat(r.scales.numpy(), 128, 0)[:n], 128, 1)[:, :k]
    diff = got != want
    assert diff.sum() == r.stats.values_changed
    # each rounded value moves by exactly 2**-9 x the checkpoint's scale
    s_full = np.repeat(np.repeat(scale.float().numpy(), 128, 0)[:n], 128, 1)[:, :k]
    np.testing.assert_array_equal(np.abs(got - want)[diff], (s_full * 2.0**-9)[diff])
    if r.stats.values_changed:
        assert r.stats.max_abs_error == pytest.approx(float(np.abs(got - want).max()), rel=1e-6)

    # tiles without e4m3fn-only codes: bytes and scale bit for bit; others: scale exactly doubled
    for bi in range(scale.shape[0]):
        for bj in range(scale.shape[1]):
            tile = (slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128))
            shifted = np.any((codes[tile] & 0x7F) >= 0x78)
            factor = 2.0 if shifted else 1.0
            assert r.scales[bi, bj].item() == scale[bi, bj].float().item() * factor
            if not shifted:
                np.testing.assert_array_equal(out[tile], codes[tile])
    assert r.stats.blocks_shifted == int((r.scales != scale.float()).sum())


def output_block_within_bound(codes, scale, out_codes, out_scales) -> np.ndarray:
    """The output-block gate, per element: |requantised - exact| <= half an e4m3 step (or half the subnormal
    step of the row block's scale), plus the float32 rounding of the requantiser's w / s (an exact tie can
    land either side). ``codes``/``scale``: the checkpoint's; ``out_codes``/``out_scales``: the repack's."""
    n = codes.shape[0]
    exact = ml_dequant(codes, scale.float().numpy(), (128, 128))
    s_rows = np.repeat(out_scales.numpy(), 128)[:n, None]
    got = ml_decode(out_codes.numpy(), ml_dtypes.float8_e4m3) * s_rows
    bound = np.maximum(np.abs(exact) * E4M3_HALF_ULP_REL, s_rows * E4M3_HALF_SUBNORMAL_STEP) * (1 + 1e-6) + np.abs(exact) * FP32_ULP_REL
    return np.abs(got - exact) <= bound


def test_output_block_gate_catches_one_wrong_code_or_scale():
    """The bound above is tight enough to see the smallest realistic repack faults."""
    rng = np.random.default_rng(7)
    codes = random_fp8(300, 200, rng)
    scale = random_scale((3, 2), torch.float32, rng)
    r = fp8.repack(torch.from_numpy(codes), scale, "output-block")
    assert output_block_within_bound(codes, scale, r.codes, r.scales).all()
    # one code off by one e4m3 step (its mantissa's last bit flipped), at a normal value of row block 1
    i, j = 130, int(np.argmax((r.codes[130].numpy() & 0x7F)))
    flipped = r.codes.clone()
    flipped[i, j] ^= 1
    ok = output_block_within_bound(codes, scale, flipped, r.scales)
    assert not ok[i, j] and ok.sum() == ok.size - 1
    # one row block's scale doubled: every normal weight of that block is caught (the smallest subnormals, whose
    # bound is half the doubled block's subnormal step, may hide)
    doubled = r.scales.clone()
    doubled[2] *= 2
    ok = output_block_within_bound(codes, scale, r.codes, doubled)
    assert not ok[256:][r.codes[256:].numpy() & 0x7F >= 0x08].any() and ok[:256].all()


@settings(max_examples=25, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), dtype_i=st.integers(0, 2))
@example(shape=(281, 12), seed=766, dtype_i=0)  # a float32 w/s landing on an exact subnormal tie
@example(shape=(1, 1), seed=163, dtype_i=0)  # a row block whose only weight is 0 (found by hypothesis, 12-01)
def test_output_block_requantises_within_half_a_step(shape, seed, dtype_i):
    rng = np.random.default_rng(seed)
    n, k = shape
    codes = random_fp8(n, k, rng)
    scale = random_scale((math.ceil(n / 128), math.ceil(k / 128)), SCALE_DTYPES[dtype_i], rng)
    r = fp8.repack(torch.from_numpy(codes), scale, "output-block")
    assert r.scales.shape == (math.ceil(n / 128),) and r.block == (128, 0)
    out = r.codes.numpy()
    assert np.all((out & 0x7F) < 0x78)
    exact = ml_dequant(codes, scale.float().numpy(), (128, 128))
    s_rows = np.repeat(r.scales.numpy(), 128)[:n, None]
    got = ml_decode(out, ml_dtypes.float8_e4m3) * s_rows
    # each row block's largest magnitude maps to (about) 240; a row block of zeros keeps scale 1 (any scale is exact
    # for zeros; 1 is finite, positive and never divides by zero) and all-zero codes
    amax = np.maximum.reduceat(np.abs(exact).reshape(-1, k).max(1), np.arange(0, n, 128))
    zero = amax == 0
    np.testing.assert_allclose(r.scales.numpy()[~zero] * fp8.E4M3_MAX, amax[~zero], rtol=1e-6)
    assert np.all(r.scales.numpy()[zero] == 1.0)
    assert np.all((out & 0x7F)[np.repeat(zero, 128)[:n]] == 0)
    assert output_block_within_bound(codes, scale, r.codes, r.scales).all()
    got32 = fp8.dequantize(r).numpy()
    np.testing.assert_array_equal(got32, got.astype(np.float32))  # an fp32 product is the rounded exact one
    assert r.stats.max_abs_error == float(np.abs(got32 - exact.astype(np.float32)).max())


@pytest.mark.parametrize("dtype", SCALE_DTYPES)
def test_lut_keeps_bytes_and_is_exact(dtype):
    rng = np.random.default_rng(1)
    codes = random_fp8(200, 130, rng)
    scale = random_scale((2, 2), dtype, rng)
    r = fp8.repack(torch.from_numpy(codes).view(torch.float8_e4m3fn), scale, "lut")
    np.testing.assert_array_equal(r.codes.numpy(), codes)
    np.testing.assert_array_equal(fp8.dequantize(r).numpy(), ml_dequant(codes, scale.float().numpy(), (128, 128)).astype(np.float32))


@pytest.mark.parametrize("mode", fp8.MODES)
@pytest.mark.parametrize("dtype", SCALE_DTYPES)
def test_per_channel_scales(mode, dtype):
    rng = np.random.default_rng(2)
    codes = random_fp8(150, 300, rng)
    scale = random_scale((150, 1), dtype, rng)
    r = fp8.repack(torch.from_numpy(codes), scale, mode)
    exact = ml_dequant(codes, scale.float().numpy(), (1, 0)).astype(np.float32)
    got = fp8.dequantize(r).numpy()
    if mode == "lut":
        np.testing.assert_array_equal(got, exact)
    elif mode == "pow2":
        assert r.block == (1, 0) and r.scales.shape == (150, 1)
        assert int((got != exact).sum()) == r.stats.values_changed
        # each rounded value moves by 2**-9 x its row's scale (slack: the fp32 rounding of the products)
        np.testing.assert_allclose(got, exact, rtol=0, atol=float(scale.float().max()) * 2.0**-9 * (1 + 1e-6))
    else:
        assert np.all(np.abs(got - exact) <= np.abs(exact) * E4M3_HALF_ULP_REL + float(r.scales.max()) * E4M3_HALF_SUBNORMAL_STEP)


def test_blocks_without_fn_only_codes_are_untouched():
    rng = np.random.default_rng(3)
    codes = random_fp8(256, 256, rng, fn_only_tiles=False)
    assert np.all((codes & 0x7F) < 0x78)
    scale = random_scale((2, 2), torch.bfloat16, rng)
    r = fp8.repack(torch.from_numpy(codes), scale)
    np.testing.assert_array_equal(r.codes.numpy(), codes)
    assert torch.equal(r.scales, scale.float()) and r.stats.blocks_shifted == 0


@pytest.mark.parametrize("block", [(128, 128), (16, 16), (64, 0), (1, 0)])
def test_pow2_edges_match_ml_dtypes_halving(block):
    """Ragged last tile row and column, tiles that do not shift beside ones that do, whole-row tiles (bk == k),
    and magnitudes below 0x10 of both signs everywhere (ragged last 32-row group and unshifted tiles included):
    each tile's bytes are ml_dtypes' halving (round half to even) or untouched, and the counts agree."""
    rng = np.random.default_rng(11)
    n, k = 300, 260
    mag = rng.integers(0x10, 0x7F, size=(n, k), dtype=np.uint8)
    small = rng.random((n, k)) < 0.02
    small[n - 5:, :40] = True  # the ragged last group of 32 rows and the ragged last tile row
    mag[small] = rng.integers(0, 0x10, size=int(small.sum()), dtype=np.uint8)
    grid = fp8.grid_shape((n, k), block)
    bn, bk = block[0], block[1] or k
    keep = np.zeros(grid, dtype=bool)
    keep.ravel()[::3] = True  # every third tile holds no e4m3fn-only code: it must not shift
    for gi, gj in zip(*np.nonzero(keep)):
        tile = mag[gi * bn:(gi + 1) * bn, gj * bk:(gj + 1) * bk]
        np.minimum(tile, 0x77, out=tile)
    codes = mag | (rng.integers(0, 2, size=(n, k), dtype=np.uint8) << 7).astype(np.uint8)
    r = fp8.repack(torch.from_numpy(codes), random_scale(grid, torch.float32, rng), "pow2", block=block)

    halved = (ml_decode(FINITE_FN, ml_dtypes.float8_e4m3fn) / 2).astype(ml_dtypes.float8_e4m3).view(np.uint8)
    table = np.zeros(256, dtype=np.uint8)
    table[FINITE_FN] = halved
    shifted_el = np.repeat(np.repeat(~keep, bn, 0)[:n], bk, 1)[:, :k]
    np.testing.assert_array_equal(r.codes.numpy(), np.where(shifted_el, table[codes], codes))
    assert r.stats.blocks_shifted == int((~keep).sum())
    rounded = shifted_el & (mag < 0x10) & (mag % 2 == 1)
    assert rounded.any() and (small & ~shifted_el).any()  # both kinds of small magnitudes are present
    assert r.stats.values_changed == int(rounded.sum())


def test_refined_grid_is_exact():
    """A 64-row tile grid (TP shards of 192 rows) gives the same values as the 128 grid it refines."""
    rng = np.random.default_rng(4)
    codes = random_fp8(384, 256, rng)
    scale = random_scale((3, 2), torch.float32, rng)
    fine = scale.repeat_interleave(2, dim=0)[:6]
    a = fp8.dequantize(fp8.repack(torch.from_numpy(codes), scale, "lut"))
    b = fp8.dequantize(fp8.repack(torch.from_numpy(codes), fine, "lut", block=(64, 128)))
    assert torch.equal(a, b)


# --- errors: each names the problem, and the tensor when given ---------------------------------------

NAME = "model.layers.0.mlp.experts.3.up_proj.weight"


def test_nan_codes_are_refused_with_tensor_name():
    codes = torch.zeros(4, 4, dtype=torch.uint8)
    codes[1, 2] = 0xFF
    with pytest.raises(ValueError, match=r"NaN.*\(1, 2\)") as e:
        fp8.repack(codes, torch.ones(1, 1), name=NAME)
    assert NAME in str(e.value)
    assert fp8.count_nan_codes(codes) == 1


@pytest.mark.parametrize("grid", [(2, 1), (1, 2), (3,), (1, 1, 1)])
def test_scale_grid_mismatch(grid):
    with pytest.raises(ValueError, match="does not match weight") as e:
        fp8.repack(torch.zeros(100, 100, dtype=torch.uint8), torch.ones(grid), name=NAME)
    assert NAME in str(e.value) and "expected (1, 1)" in str(e.value)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_scale_values(bad):
    s = torch.ones(2, 2)
    s[1, 0] = bad
    with pytest.raises(ValueError, match=r"non-finite or non-positive.*\(1, 0\)") as e:
        fp8.repack(torch.zeros(256, 256, dtype=torch.uint8), s, name=NAME)
    assert NAME in str(e.value)


def test_scale_whose_weights_overflow_is_refused():
    """A scale with 448 x scale = inf cannot be a real checkpoint's; doubling it (pow2) could not be exact either."""
    codes = torch.full((8, 8), 0x7E, dtype=torch.uint8)  # 448: the block must shift
    with pytest.raises(ValueError, match="overflow float32") as e:
        fp8.repack(codes, torch.full((1, 1), 3e38), name=NAME)
    assert NAME in str(e.value)


def test_other_bad_arguments():
    with pytest.raises(ValueError, match="unknown repack mode"):
        fp8.repack(torch.zeros(2, 2, dtype=torch.uint8), torch.ones(1, 1), "int4")
    with pytest.raises(ValueError, match="2-D"):
        fp8.repack(torch.zeros(2, dtype=torch.uint8), torch.ones(1, 1), name=NAME)
    with pytest.raises(ValueError, match="float8_e4m3fn or torch.uint8"):
        fp8.repack(torch.zeros(2, 2, dtype=torch.bfloat16), torch.ones(1, 1))
    with pytest.raises(ValueError, match="dtype torch.int32"):
        fp8.repack(torch.zeros(2, 2, dtype=torch.uint8), torch.ones(1, 1, dtype=torch.int32))



@pytest.mark.parametrize("where", ["first", "chunk_edge", "last"])
def test_nan_codes_are_found_in_every_step_of_the_scan(where):
    """The lut/output-block NaN check scans the bytes in fp8.NAN_SCAN_CHUNK steps: a NaN code in the first step,
    the first byte after a step boundary, or the ragged last step is refused (ml_dtypes says the byte is NaN); the
    same tensor without it repacks."""
    n, k = 512, 257  # 131,584 bytes: two full steps and a ragged third
    codes = torch.zeros(n, k, dtype=torch.uint8)
    assert codes.numel() > 2 * fp8.NAN_SCAN_CHUNK and codes.numel() % fp8.NAN_SCAN_CHUNK
    scales = torch.ones(4, 3)  # 128x128 blocks
    fp8.repack(codes, scales, mode="lut", name=NAME)
    flat = {"first": 5, "chunk_edge": fp8.NAN_SCAN_CHUNK, "last": n * k - 1}[where]
    codes.view(-1)[flat] = 0x7F
    assert np.isnan(codes.view(-1)[flat: flat + 1].numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)[0])
    with pytest.raises(ValueError, match="NaN") as e:
        fp8.repack(codes, scales, mode="lut", name=NAME)
    assert NAME in str(e.value)
