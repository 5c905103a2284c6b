"""Fuzz the FP8 codecs (vllm_moe_w8/codec/fp8.py) with hypothesis: random shapes, dtypes, bytes, scales and tiles.

Contract under test: for any input, ``repack`` / ``dequantize_checkpoint`` / ``decode`` / ``resolve_block``
either return a well-formed result or raise ``ValueError`` with a message; nothing else escapes (no
IndexError, RuntimeError, silent NaN). When ``repack`` succeeds, the result dequantises to the
checkpoint's values exactly (lut), within 2**-9 x scale on the counted rounded values (pow2), or finite
(output-block) -- the independent truth is ml_dtypes' float8_e4m3fn decoding of the input bytes; pow2's
native body and its numpy fallback give the same bytes, scales and counts.
Example counts are bounded so the module runs in well under a minute.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import os
from contextlib import contextmanager

from vllm_moe_w8.codec import fp8, repack_native

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
POW2_RNE = 2.0**-9  # pow2: a rounded (odd subnormal / smallest-normal) value moves by 2**-9 x its tile's scale

SCALE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.uint8]
WEIGHT_DTYPES = [torch.uint8, torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.int8]


def _bytes_tensor(data: bytes, shape) -> torch.Tensor:
    n = math.prod(shape)
    if n == 0:
        return torch.zeros(shape, dtype=torch.uint8)
    buf = (data * (n // max(len(data), 1) + 1))[:n] if data else bytes(n)
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8).reshape(shape).clone()


@st.composite
def weights_and_scales(draw):
    n = draw(st.integers(1, 300))
    k = draw(st.integers(1, 300))
    raw = draw(st.binary(min_size=0, max_size=512))
    codes = _bytes_tensor(raw, (n, k))
    if draw(st.booleans()):  # mostly avoid NaN codes so the success path is exercised too
        codes = torch.where((codes & 0x7F) == 0x7F, codes & 0xF0, codes)
    wdtype = draw(st.sampled_from(WEIGHT_DTYPES))
    weight = codes if wdtype == torch.uint8 else (codes.view(torch.float8_e4m3fn) if wdtype == torch.float8_e4m3fn else codes.to(wdtype))
    block = draw(st.sampled_from([(128, 128), (64, 32), (1, 0), (128, 0), (16, 16), (0, 128), (-1, 4), "channel", None]))
    grid_kind = draw(st.sampled_from(["right", "right", "right", "channel", "random"]))
    if grid_kind == "right" and isinstance(block, tuple) and block[0] > 0 and block[1] >= 0:
        shape = fp8.grid_shape((n, k), block)
    elif grid_kind == "channel":
        shape = (n, 1)
    else:
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
    values = st.one_of(
        st.floats(1e-6, 10.0), st.sampled_from([0.0, -1.0, float("nan"), float("inf"), -float("inf"), 3e38, 1e-40]),
    )
    fill = draw(values)
    scale = torch.full(shape, fill, dtype=torch.float64)
    if scale.numel() and draw(st.booleans()):
        scale = scale * torch.rand(shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 99)))) + 1e-3
    sdtype = draw(st.sampled_from(SCALE_DTYPES))
    scale = scale.to(sdtype) if sdtype.is_floating_point else scale.clamp(-5, 5).nan_to_num(0).to(sdtype)
    mode = draw(st.sampled_from(list(fp8.MODES) + ["bogus"]))
    return weight, scale, mode, block


def _truth(codes: torch.Tensor, scale_el: torch.Tensor) -> torch.Tensor:
    """The checkpoint's values by ml_dtypes (independent of fp8.py's tables): value x scale rounded once to float32."""
    vals = codes.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return (torch.from_numpy(vals) * scale_el.float()).double()


@contextmanager
def numpy_repack():
    old = os.environ.get(repack_native.ENV)
    os.environ[repack_native.ENV] = "numpy"
    try:
        yield
    finally:
        os.environ.pop(repack_native.ENV) if old is None else os.environ.__setitem__(repack_native.ENV, old)


@FUZZ
@given(weights_and_scales())
def test_pow2_native_and_numpy_paths_agree(case):
    weight, scale, _, block = case
    assert repack_native.available(), repack_native.unavailable_reason()
    outcome = []
    for ctx in (contextmanager(lambda: (yield))(), numpy_repack()):
        with ctx:
            try:
                rep = fp8.repack(weight, scale, mode="pow2", block=block, name="fuzz.weight")
                outcome.append((rep.codes, rep.scales, rep.stats))
            except ValueError as e:
                outcome.append(str(e))
    (a, b) = outcome
    if isinstance(a, str) or isinstance(b, str):
        assert a == b
    else:
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]


@FUZZ
@given(weights_and_scales())
def test_repack_returns_a_faithful_result_or_a_value_error(case):
    weight, scale, mode, block = case
    try:
        rep = fp8.repack(weight, scale, mode=mode, block=block, name="fuzz.weight")
    except ValueError as e:
        assert str(e), "a ValueError must say what is wrong"
        return
    codes = weight.view(torch.uint8) if weight.dtype != torch.uint8 else weight
    assert rep.codes.dtype == torch.uint8 and tuple(rep.codes.shape) == tuple(codes.shape)
    assert rep.scales.dtype == torch.float32 and bool(torch.isfinite(rep.scales).all()) and bool((rep.scales > 0).all())
    src_block = fp8.resolve_block(tuple(codes.shape), tuple(scale.shape), block)
    truth = _truth(codes, fp8.expand_scales(scale.float(), tuple(codes.shape), src_block))
    got = fp8.dequantize(rep).double()
    assert bool(torch.isfinite(got).all())
    err = (got - truth).abs()
    if mode == "lut":
        assert bool((err == 0).all())
    elif mode == "pow2":
        bound = POW2_RNE * fp8.expand_scales(scale.float(), tuple(codes.shape), src_block).double()
        assert bool((err <= bound * (1 + 1e-12)).all())
        assert int((err > 0).sum()) <= rep.stats.values_changed
    else:  # output-block: requantised to e4m3 per 128 rows, half a step at most (2**-4 relative to the row's range)
        row_max = truth.abs().reshape(-1, truth.shape[1]).amax(dim=1, keepdim=True)
        assert bool((err <= row_max * 2.0**-4 + 1e-30).all())


@FUZZ
@given(weights_and_scales())
def test_dequantize_checkpoint_returns_finite_values_or_a_value_error(case):
    weight, scale, _, block = case
    try:
        out = fp8.dequantize_checkpoint(weight, scale, block=block, name="fuzz.weight")
    except ValueError as e:
        assert str(e)
        return
    assert out.dtype == torch.float32 and bool(torch.isfinite(out).all())


@FUZZ
@given(st.binary(min_size=1, max_size=64), st.text(max_size=8), st.lists(st.integers(0, 9), min_size=0, max_size=4))
def test_decode_any_bytes_any_format(data, fmt, shape):
    n = math.prod(shape) if shape else 1
    codes = _bytes_tensor(data, (n,)).reshape(shape) if shape else _bytes_tensor(data, (1,)).reshape(())
    for f in (fmt, "e4m3", "e4m3fn"):
        try:
            out = fp8.decode(codes, f)
        except ValueError as e:
            assert f not in ("e4m3", "e4m3fn") and str(e)
            continue
        ref = codes.numpy().view(ml_dtypes.float8_e4m3fn if f == "e4m3fn" else ml_dtypes.float8_e4m3).astype(np.float32)
        np.testing.assert_array_equal(out.numpy(), ref)  # NaN == NaN here


@FUZZ
@given(st.integers(1, 400), st.integers(1, 400),
       st.lists(st.integers(-3, 300), min_size=0, max_size=3), st.lists(st.integers(0, 9), min_size=0, max_size=3))
def test_resolve_block_and_expand_scales(n, k, block, scale_shape):
    try:
        b = fp8.resolve_block((n, k), tuple(scale_shape), tuple(block))
    except ValueError as e:
        assert str(e)
        return
    assert len(b) == 2 and b[0] >= 1 and b[1] >= 0
    grid = fp8.grid_shape((n, k), b)
    full = fp8.expand_scales(torch.arange(1, grid[0] * grid[1] + 1, dtype=torch.float32).reshape(grid), (n, k), b)
    assert tuple(full.shape) == (n, k)
    # every element carries its own tile's scale
    i, j = n - 1, k - 1
    tile = (i // b[0]) * grid[1] + (0 if b[1] == 0 else j // b[1])
    assert float(full[i, j]) == tile + 1


@pytest.mark.parametrize("shape", [(), (7,), (2, 3, 4)])
def test_repack_refuses_non_matrix_weights(shape):
    with pytest.raises(ValueError, match="2-D"):
        fp8.repack(torch.zeros(shape, dtype=torch.uint8), torch.ones(1, 1), name="x.weight")
