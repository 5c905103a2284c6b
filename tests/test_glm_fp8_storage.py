"""The three Trn2 expert storages of ``benchmarks/bench_glm_fp8_storage.py`` against independent arithmetic.

Truths used here: ``ml_dtypes``' value sets of float8_e4m3fn / float8_e4m3 (every finite value of a format, as a set
of exact fractions), nearest-value search with ties to the even code (round to nearest even, re-derived), torch's own
``float8_e4m3fn`` cast (what the fork's loaders call), and the project's repack statistics.
"""

from __future__ import annotations

import json
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

from benchmarks import bench_glm_fp8_storage as bench
from benchmarks.common import RESULTS

FN, E4M3 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3
MAGS = np.arange(0x7F, dtype=np.uint8)  # every finite e4m3fn magnitude code, 0x00..0x7E
E4M3_VALUES = {Fraction(float(v)): c for c, v in enumerate(np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float64))
               if np.isfinite(v) and c < 0x80}  # positive float8_e4m3 values -> code


def _nearest_even(x: Fraction) -> Fraction:
    """The float8_e4m3 value nearest to x >= 0 (ties: the even code), by search over the value set."""
    best = min(E4M3_VALUES, key=lambda v: (abs(v - x), E4M3_VALUES[v] & 1))
    return best


def _value(code: int) -> Fraction:
    return Fraction(float(np.uint8(code).view(FN)))


def _stored_values(method: str, codes: np.ndarray, scales=np.ones((1, 1), np.float32), block=(1, MAGS.size)):
    stored, s = bench.storage(method, codes, scales, block)
    return stored, s, [Fraction(float(v)) for v in stored.view(E4M3).astype(np.float64).ravel()]


@pytest.mark.parametrize("method, factor", [(bench.METHODS[1], Fraction(1, 2)), (bench.METHODS[2], Fraction(15, 28))])
def test_fork_storages_round_every_code_to_nearest_even(method, factor):
    """Each magnitude's stored value is the float8_e4m3 value nearest to value x factor; exactly those whose product
    is not in the value set are re-rounded (for 1/2: the odd subnormals and odd smallest normals)."""
    _, s, got = _stored_values(method, MAGS[None, :])
    assert float(s[0, 0]) == np.float32(1 / factor)  # the scale carries the inverse factor (float32)
    rerounded = set()
    for code, v in zip(MAGS, got):
        want = _value(code) * factor
        assert v == _nearest_even(want), (hex(code), v, want)
        if want not in E4M3_VALUES:
            rerounded.add(int(code))
    if factor == Fraction(1, 2):
        assert rerounded == {m for m in range(0x10) if m & 1}  # the maths: halving is exact above the subnormal edge
    else:  # 240/448 is not a binary fraction: most magnitudes re-round
        assert len(rerounded) > 100
    row = bench.bytes_rerounded(method, MAGS[None, :], bench.storage(method, MAGS[None, :], np.ones((1, 1), np.float32), (1, MAGS.size))[0])
    assert row == len(rerounded)


@pytest.mark.parametrize("method, factor", [(bench.METHODS[1], 0.5), (bench.METHODS[2], 240 / 448)])
def test_fork_storage_equals_torch_cast(method, factor):
    """The model of the fork's loader equals torch's own ``(w.float() * factor).clamp(+-240).to(float8_e4m3fn)`` on
    every code and on quantised weights, and its bytes mean the same value read as e4m3 (the unsafe-flag view)."""
    rng = np.random.default_rng(1)
    codes, scales = bench.quantise_blocks((0.02 * rng.standard_t(3, (256, 256))).astype(np.float32))
    for c in (np.stack([MAGS, MAGS | 0x80]), codes):
        w = torch.from_numpy(c.copy()).view(torch.float8_e4m3fn)
        want = (w.float() * factor).clamp(-240.0, 240.0).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        stored, _ = bench.fork_storage(c, np.ones((1, 1), np.float32), factor, 1.0, None)
        assert np.array_equal(stored, want)
        assert int((stored & 0x7F).max()) < 0x78  # never an e4m3fn-only code: both readings agree
        assert np.array_equal(stored.view(FN).astype(np.float64), stored.view(E4M3).astype(np.float64))


def test_pow2_is_exact_except_the_subnormal_edge_and_keeps_shared_blocks():
    rows = bench.code_rows()
    for case, (codes, block) in rows.items():
        scales = np.ones((1, 1), np.float32)
        truth = bench.checkpoint_decode(codes, scales, block)
        stored, s, stats = bench.pow2_storage(codes, scales, block)
        got = bench.trn2_decode(stored, s, block)
        changed = {int(c) & 0x7F for c in codes[got != truth]}
        if int((codes & 0x7F).max()) >= 0x78:  # the block is halved: exactly the values whose half is not in e4m3
            assert changed == {int(m) for m in MAGS if _value(m) / 2 not in E4M3_VALUES}
            assert float(s[0, 0]) == 2.0 and stats.values_changed == int((got != truth).sum()) == 2 * len(changed)
        else:  # no e4m3fn-only code: bytes and scale kept bit for bit, while the fork's halve still re-rounds
            assert changed == set() and np.array_equal(stored, codes) and float(s[0, 0]) == 1.0
            fork = bench.trn2_decode(*bench.storage(bench.METHODS[1], codes, scales, block), block)
            assert {int(c) & 0x7F for c in codes[fork != truth]} == {m for m in range(0x10) if m & 1}


def _assert_within_half_subnormal(truth, got, scales_after, block):
    """Gate: every error is at most half a subnormal step (2**-10) of the stored scale -- the rounding bound of
    halving. Named tolerance: the maths of RNE at the subnormal edge, nothing looser."""
    bound = bench.expand(scales_after.astype(np.float64), truth.shape, block) * 2.0**-10
    assert (np.abs(got - truth) <= bound).all(), float((np.abs(got - truth) / bound).max())


def test_realistic_blocks_pow2_and_halve_agree_and_the_gate_has_a_twin():
    rng = np.random.default_rng(2)
    codes, scales = bench.quantise_blocks((0.02 * rng.standard_normal((512, 512))).astype(np.float32))
    tiles = (codes & 0x7F).reshape(4, 128, 4, 128).max(axis=(1, 3))
    assert (tiles == 0x7E).all()  # amax / 448 puts 448 in every block, so both storages halve every block
    truth = bench.checkpoint_decode(codes, scales)
    p_stored, p_s, stats = bench.pow2_storage(codes, scales, (128, 128))
    h_stored, h_s = bench.storage(bench.METHODS[1], codes, scales)
    assert np.array_equal(p_stored, h_stored) and np.array_equal(p_s, h_s)  # no block near the MINVAL floor here
    got = bench.trn2_decode(p_stored, p_s)
    assert bench.compare(truth, got)["values_changed"] == stats.values_changed > 0
    _assert_within_half_subnormal(truth, got, p_s, (128, 128))
    faulty = p_s.copy()
    faulty[1, 2] *= 2  # fault: one scale tile doubled
    with pytest.raises(AssertionError):
        _assert_within_half_subnormal(truth, bench.trn2_decode(p_stored, faulty), p_s, (128, 128))


def test_glm5_rescale_error_is_the_rounding_of_its_product():
    """240/448: every value moves by at most half an e4m3 step of its product (relative 2**-4), never to zero."""
    rng = np.random.default_rng(3)
    codes, scales = bench.quantise_blocks((0.02 * rng.standard_normal((256, 256))).astype(np.float32))
    truth = bench.checkpoint_decode(codes, scales)
    got = bench.trn2_decode(*bench.storage(bench.METHODS[2], codes, scales))
    r = bench.compare(truth, got)
    assert r["fraction_changed"] > 0.9 and r["nonzero_to_zero"] == 0
    normal = np.abs(codes.view(FN).astype(np.float64)) * 15 / 28 >= 2.0**-6  # products in the normal range
    _assert_within_half_step(truth, got, normal)
    stored, s = bench.storage(bench.METHODS[2], codes, scales)
    s[0, 1] *= 2  # fault twin: one scale tile doubled
    with pytest.raises(AssertionError):
        _assert_within_half_step(truth, bench.trn2_decode(stored, s), normal)


def _assert_within_half_step(truth, got, where):
    """Gate: relative error <= 2**-4 (3 mantissa bits: half a step is 2**-4 of the binade), widened by 1e-6 for the
    float32 rounding of the 448/240 scale (2**-24 relative, with room)."""
    rel = np.abs(got - truth)[where] / np.abs(truth)[where]
    assert rel.max() <= 2.0**-4 * (1 + 1e-6), float(rel.max())


def test_minval_floor_inflates_small_blocks_as_the_fork_states():
    """A block whose doubled scale is below MINVAL = 1e-5 dequantises MINVAL / (2 s) times too large."""
    rng = np.random.default_rng(4)
    w = (0.02 * rng.standard_normal((256, 256))).astype(np.float32)
    w[:128, 128:] *= 0.02  # one block with amax ~ 1.6e-3 < 448 * 1e-5 / 2
    codes, scales = bench.quantise_blocks(w)
    truth = bench.checkpoint_decode(codes, scales)
    stored, s = bench.storage(bench.METHODS[1], codes, scales)
    floored = scales * np.float32(2) < np.float32(bench.GLM5NEXT_MINVAL)
    assert floored.tolist() == [[False, True], [False, False]]
    got = bench.trn2_decode(stored, s)
    blk = (slice(0, 128), slice(128, 256))
    nz = (truth[blk] != 0) & (got[blk] != 0)
    ratio = got[blk][nz] / truth[blk][nz]
    exact = np.abs(stored[blk].view(E4M3).astype(np.float64) * 2 - codes[blk].view(FN).astype(np.float64))[nz] == 0
    inflation = bench.GLM5NEXT_MINVAL / (2 * float(scales[0, 1]))
    _assert_ratio(ratio[exact], inflation)
    with pytest.raises(AssertionError):  # fault twin: a floor of 2e-5 instead of 1e-5 is told apart
        _assert_ratio(ratio[exact], 2e-5 / (2 * float(scales[0, 1])))
    assert bench.compare(truth[:128, :128], got[:128, :128])["max_error_per_block_amax"] < 1e-5  # others unaffected


def _assert_ratio(ratio, want):
    """Gate: every exact byte's value scaled by ``want``, within 1e-6 relative (the float32 rounding of 1e-5)."""
    assert np.allclose(ratio, want, rtol=1e-6, atol=0), (float(ratio.min()), float(ratio.max()), want)


def test_recorded_json_is_what_the_script_computes():
    data = json.loads((RESULTS / "glm_fp8_storage.json").read_text())
    res = bench.run(data["blocks_per_case"], data["seed"])
    assert res["codes"] == data["codes"] and res["blocks"] == data["blocks"] and res["layouts"] == data["layouts"]
    with pytest.raises(ValueError, match="unknown storage"):
        bench.storage("nope", MAGS[None, :], np.ones((1, 1), np.float32))
