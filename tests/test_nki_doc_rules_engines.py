"""Rule tests (see tests/test_nki_doc_rules.py) of the compute engines: TensorE, VectorE, ScalarE, GpSimdE, the
operator tables, registers and the traced Python subset."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from vllm_moe_w8.kernels.nki_cpu import NkiValidationError, jit, run
from vllm_moe_w8.kernels.nki_cpu import isa as nisa
from vllm_moe_w8.kernels.nki_cpu import language as nl
from tests.test_nki_doc_rules import NONE, out_of, refused, sb

RNG = np.random.default_rng(1)
TESTED: set = set()


def rules(*ids):
    TESTED.update(ids)
    return pytest.mark.parametrize("_rule", [",".join(ids)])


def bf16(shape):
    return RNG.standard_normal(shape).astype(ml_dtypes.bfloat16)


def loaded(x, dtype=None):
    t = sb(x.shape, dtype or x.dtype)
    nisa.dma_copy(dst=t, src=x)
    return t


# --- TensorE -------------------------------------------------------------------------------------------------------

def _tiled(accumulate_first, accumulate_rest):
    @jit
    def kernel(a, b):
        ps = sb((64, 128), buffer=nl.psum)
        for k in range(2):
            kw = {} if (accumulate_first if k == 0 else accumulate_rest) == "default" else \
                {"accumulate": accumulate_first if k == 0 else accumulate_rest}
            nisa.nc_matmul(dst=ps, stationary=loaded(a[k * 128:(k + 1) * 128]), moving=loaded(b[k * 128:(k + 1) * 128]), **kw)
        res = sb((64, 128))
        nisa.tensor_copy(dst=res, src=ps)
        return out_of(res)

    return kernel


@rules("TE-ACCUMULATE", "TE-ACCUMULATE-INIT")
def test_matmul_accumulate_default_infers_overwrite_then_accumulate(_rule):
    a, b = bf16((256, 64)), bf16((256, 128))
    want = a.astype(np.float64).T @ b.astype(np.float64)
    mag = np.abs(a.astype(np.float64)).T @ np.abs(b.astype(np.float64))
    for first, rest in (("default", "default"), (False, True), (False, "default")):
        out, _ = run(_tiled(first, rest), a, b)
        assert (np.abs(out - want) <= 256 * 2.0 ** -24 * mag).all()  # products exact in fp32, fp32 sums

    @jit
    def onto_memset(a, b):
        ps = sb((64, 128), value=0.0, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=loaded(a[0:128]), moving=loaded(b[0:128]))

    refused("TE-ACCUMULATE-INIT", _tiled(True, True), a, b, match="no initialising matmul")
    refused("TE-ACCUMULATE-INIT", onto_memset, a, b, match="other than a matmul")


def _matmul(st=nl.bfloat16, mv=nl.bfloat16, k=128, m=64, n=128, dst=nl.float32, dst_buf=nl.psum, **kw):
    @jit
    def kernel(x):
        ps = sb((min(m, 128), n), dst, buffer=dst_buf)  # an over-wide stationary must be caught by nc_matmul
        nisa.nc_matmul(dst=ps, stationary=sb((k, m), st, value=1.0), moving=sb((k, n), mv, value=1.0), **kw)
        res = sb((min(m, 128), n))
        nisa.tensor_copy(dst=res, src=ps)
        return out_of(res)

    return kernel


@rules("TE-MEMORY", "TE-DTYPES", "TE-DST", "TE-SIZES")
def test_matmul_operands(_rule):
    assert (run(_matmul(nl.float32, nl.tfloat32), NONE)[0] == 128.0).all()  # fp32 x tf32 pairs
    assert (run(_matmul(nl.float8_e4m3, nl.bfloat16), NONE)[0] == 128.0).all()
    refused("TE-DTYPES", _matmul(nl.float32, nl.bfloat16), NONE)
    refused("TE-DTYPES", _matmul(nl.float8_e4m3fn), NONE, match="Trn3")
    refused("TE-DST", _matmul(dst=nl.bfloat16), NONE)
    refused("TE-MEMORY", _matmul(dst_buf=nl.sbuf), NONE)
    refused("TE-SIZES", _matmul(n=513), NONE, match="moving free size 513")
    refused("TE-SIZES", _matmul(m=129), NONE, match="stationary free size 129")


@rules("TE-TILING", "TE-DOUBLE-ROW", "TE-ONEZERO")
def test_matmul_modes(_rule):
    assert (run(_matmul(k=64, m=64, tile_position=(64, 0), tile_size=(64, 64)), NONE)[0] == 64.0).all()
    refused("TE-TILING", _matmul(tile_position=(0, 0)), NONE, match="both")
    refused("TE-TILING", _matmul(k=64, m=64, tile_position=(32, 0), tile_size=(64, 64)), NONE)
    assert (run(_matmul(is_moving_onezero=True), NONE)[0] == 128.0).all()
    a = RNG.integers(-3, 4, (128, 2, 4)).astype(ml_dtypes.float8_e4m3)
    b = RNG.integers(-3, 4, (128, 2, 8)).astype(ml_dtypes.float8_e4m3)

    @jit
    def double_row(a, b):
        ps = sb((4, 8), buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=loaded(a), moving=loaded(b), perf_mode="double_row")
        res = sb((4, 8))
        nisa.tensor_copy(dst=res, src=ps)
        return out_of(res)

    want = np.einsum("kli,klj->ij", a.astype(np.float64), b.astype(np.float64))
    assert np.array_equal(run(double_row, a, b)[0], want)  # small integers: exact
    refused("TE-DOUBLE-ROW", _matmul(perf_mode="double_row"), NONE)

    @jit
    def not_onezero(x):
        ps = sb((64, 128), buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=sb((128, 64), value=2.0), moving=sb((128, 128), value=1.0), is_stationary_onezero=True)

    refused("TE-ONEZERO", not_onezero, NONE)


@rules("TE-TRANSPOSE", "TE-TRANSPOSE-FP8")
def test_transposes(_rule):
    x = bf16((32, 100))

    def make(dtype, shape, buf=nl.psum, engine=None):
        @jit
        def kernel(x):
            t = loaded(x, dtype)
            d = sb(shape, dtype, buffer=buf)
            nisa.nc_transpose(dst=d, data=t, engine=engine)
            r = sb(shape, dtype)
            nisa.tensor_copy(dst=r, src=d)
            return out_of(r)

        return kernel

    assert np.array_equal(run(make(nl.bfloat16, (100, 32)), x)[0], x.T)
    small = x[:, 0:16].copy()
    assert np.array_equal(run(make(nl.bfloat16, (16, 32), nl.sbuf, nisa.engine.vector), small)[0], small.T)
    refused("TE-TRANSPOSE", make(nl.bfloat16, (100, 32), nl.sbuf, nisa.engine.vector), x, match="at most \\[32, 32\\]")
    refused("TE-TRANSPOSE-FP8", make(nl.float8_e4m3, (100, 32)), x.astype(ml_dtypes.float8_e4m3))


# --- VectorE / ScalarE / GpSimdE elementwise -----------------------------------------------------------------------

@rules("VE-TS-SCALARE", "VE-TS-FLOAT32", "VE-TS-OP1", "VE-TS-GPSIMD", "ENG-SCALAR-OPERAND")
def test_tensor_scalar(_rule):
    x = RNG.standard_normal((4, 6)).astype(np.float32)

    def make(op0, op1=None, engine=None, operand_dtype=nl.float32, operand1=None, operand0=None):
        @jit
        def kernel(x):
            t, col = loaded(x), sb((4, 1), operand_dtype, value=0.5)
            o = sb((4, 6))
            nisa.tensor_scalar(dst=o, data=t, op0=op0, operand0=col if operand0 is None else operand0(), op1=op1,
                               operand1=operand1, engine=engine)
            return out_of(o)

        return kernel

    assert np.array_equal(run(make(nl.multiply, nl.add, nisa.engine.scalar, operand1=2.0), x)[0], x * 0.5 + 2.0)
    assert np.array_equal(run(make(nl.maximum, nl.subtract, operand1=1.0), x)[0], np.maximum(x, 0.5) - 1.0)
    refused("VE-TS-SCALARE", make(nl.maximum, engine=nisa.engine.scalar), x)
    refused("VE-TS-SCALARE", make(nl.add, nl.multiply, nisa.engine.scalar, operand1=2.0), x)
    refused("VE-TS-FLOAT32", make(nl.multiply, operand_dtype=nl.bfloat16), x)
    refused("VE-TS-OP1", make(nl.multiply, op1=nl.add), x)
    refused("VE-TS-GPSIMD", make(nl.multiply, engine=nisa.engine.gpsimd), x)
    refused("ENG-SCALAR-OPERAND", make(nl.multiply, operand0=lambda: sb((2, 1), value=1.0)), x)


@rules("VE-TT-PSUM", "VE-TT-INT", "VE-POWER", "VE-BITVEC", "ENG-GPSIMD-PSUM", "ENG-CHOICE", "ENG-SHAPES")
def test_tensor_tensor(_rule):
    big = np.array([[2 ** 24 + 1, 7], [-(2 ** 30), 3]], np.int32)

    @jit
    def int_add(x):
        t = loaded(x)
        o = sb((2, 2), nl.int32)
        nisa.tensor_tensor(dst=o, data1=t, data2=t, op=nl.add)  # int32 on GpSimdE: native integer arithmetic
        a = sb((2, 2), nl.int32)
        nisa.tensor_tensor(dst=a, data1=o, data2=t, op=nl.bitwise_and, engine=nisa.engine.vector)
        return out_of(o), out_of(a)

    (o, a), _ = run(int_add, big)
    assert np.array_equal(o, big * 2) and np.array_equal(a, (big * 2) & big)

    def two(buf1, buf2, op=nl.add, engine=None, dtype=nl.float32, shape2=(4, 4)):
        @jit
        def kernel(x):
            p1, p2 = sb((4, 4), dtype, 1.0, buf1), sb(shape2, dtype, 2.0, buf2)
            nisa.tensor_tensor(dst=sb((4, 4), dtype), data1=p1, data2=p2, op=op, engine=engine)

        return kernel

    run(two(nl.psum, nl.sbuf), NONE)
    refused("VE-TT-PSUM", two(nl.psum, nl.psum), NONE)
    refused("VE-POWER", two(nl.sbuf, nl.sbuf, nl.power, nisa.engine.vector), NONE)
    refused("VE-BITVEC", two(nl.sbuf, nl.sbuf, nl.bitwise_and), NONE)
    refused("ENG-GPSIMD-PSUM", two(nl.psum, nl.sbuf, engine=nisa.engine.gpsimd), NONE)
    refused("ENG-CHOICE", two(nl.sbuf, nl.sbuf, engine=nisa.engine.scalar), NONE)
    refused("ENG-SHAPES", two(nl.sbuf, nl.sbuf, shape2=(4, 5)), NONE)


@rules("VE-STT", "VE-MEMSET", "VE-PREDICATED")
def test_scalar_tensor_tensor_memset_predicated_copy(_rule):
    x = RNG.standard_normal((4, 6)).astype(np.float32)

    @jit
    def fine(x):
        t = loaded(x)
        o = sb((4, 6))
        nisa.scalar_tensor_tensor(dst=o, data=t, op0=nl.multiply, operand0=3.0, op1=nl.subtract, operand1=t)
        keep = sb((4, 6), value=-1.0)
        pred = sb((4, 6), nl.uint8)
        nisa.memset(dst=pred, value=0)
        nisa.memset(dst=pred[:, 0:2], value=1)
        nisa.tensor_copy_predicated(dst=keep, src=o, predicate=pred)
        return out_of(keep)

    want = np.full((4, 6), -1.0, np.float32)
    want[:, :2] = (x * 3.0 - x)[:, :2]
    assert np.array_equal(run(fine, x)[0], want)

    @jit
    def stt_bitvec(x):
        t = sb((4, 6), nl.int32, value=1)
        nisa.scalar_tensor_tensor(dst=t, data=t, op0=nl.bitwise_and, operand0=1, op1=nl.add, operand1=t)

    @jit
    def packed(x):
        nisa.memset(dst=sb((4, 2), nl.float8_e4m3fn_x4), value=1.0)

    @jit
    def float_predicate(x):
        nisa.tensor_copy_predicated(dst=sb((4, 2), value=0.0), src=sb((4, 2), value=1.0), predicate=sb((4, 2), value=1.0))

    refused("OP-TABLE", stt_bitvec, NONE)
    refused("VE-MEMSET", packed, NONE)
    refused("VE-PREDICATED", float_predicate, NONE)


@rules("VR-REDUCE", "VR-SCAN", "VR-SHUFFLE")
def test_reductions_scans_and_shuffles(_rule):
    x = RNG.standard_normal((32, 3, 5)).astype(np.float32)

    @jit
    def fine(x):
        t = loaded(x)
        r = sb((32, 3))
        nisa.tensor_reduce(dst=r, op=nl.maximum, data=t, axis=2, negate=True)
        s = sb((32, 15))
        nisa.tensor_tensor_scan(dst=s, data0=t.reshape((32, 15)), data1=t.reshape((32, 15)), initial=1.0, op0=nl.multiply,
                                op1=nl.add)
        sh = sb((32, 3))
        nisa.nc_stream_shuffle(dst=sh, src=r, shuffle_mask=list(range(31, -1, -1)))
        return out_of(r), out_of(s), out_of(sh)

    (r, s, sh), _ = run(fine, x)
    assert np.array_equal(r, -x.max(axis=2)) and np.array_equal(sh, r[::-1])
    flat, prev, want = x.reshape(32, 15), np.ones(32, np.float32), np.empty((32, 15), np.float32)
    for i in range(15):
        prev = (flat[:, i] * prev + flat[:, i]).astype(np.float32)
        want[:, i] = prev
    assert np.array_equal(s, want)

    @jit
    def partition_axis(x):
        nisa.tensor_reduce(dst=sb((1, 5)), op=nl.add, data=loaded(x), axis=0)

    @jit
    def bitvec_scan(x):
        t = sb((4, 4), nl.int32, value=1)
        nisa.tensor_tensor_scan(dst=t, data0=t, data1=t, initial=0, op0=nl.bitwise_or, op1=nl.add)

    @jit
    def short_mask(x):
        t = sb((32, 4), value=1.0)
        nisa.nc_stream_shuffle(dst=t, src=t, shuffle_mask=[0] * 16)

    refused("VR-REDUCE", partition_axis, x[:, :, 0].copy())
    refused("OP-TABLE", bitvec_scan, NONE)
    refused("VR-SHUFFLE", short_mask, NONE)


# --- ScalarE -------------------------------------------------------------------------------------------------------

@rules("SE-SCALE", "SE-BIAS-SCALAR", "SE-REDUCE", "OP-TABLE", "ACT-RANGE", "SE-ACTIVATE2", "SE-APPROX")
def test_activation(_rule):
    x = RNG.standard_normal((4, 6)).astype(np.float32)

    @jit
    def fine(x):
        t, scale = loaded(x), sb((4, 1), value=2.0)
        o, total = sb((4, 6)), sb((4, 1))
        nisa.activation(dst=o, op=nl.exp, data=t, scale=scale, bias=0.5, reduce_op=nl.add, reduce_res=total,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        lg = sb((4, 6))
        nisa.activation(dst=lg, op=nl.log, data=t)  # negative inputs are outside log's valid range: NaN
        return out_of(o), out_of(total), out_of(lg)

    (o, total, lg), _ = run(fine, x)
    want = np.exp(x * 2.0 + 0.5)
    assert np.allclose(o, want, rtol=2 ** -22) and np.allclose(total[:, 0], want.sum(axis=1), rtol=2 ** -20)
    assert np.array_equal(np.isnan(lg), x < 2.0 ** -64)

    def act(scale=1.0, op=nl.silu, bias=None, **kw):  # scale / bias: a number or a function making the tile
        @jit
        def kernel(x):
            nisa.activation(dst=sb((4, 6)), op=op, data=loaded(x), scale=scale() if callable(scale) else scale,
                            bias=bias() if callable(bias) else bias, **kw)

        return kernel

    refused("SE-SCALE", act(scale=lambda: sb((4, 1), nl.bfloat16, 1.0)), x)
    refused("SE-SCALE", act(bias=lambda: sb((4, 1), nl.tfloat32, 1.0)), x)
    refused("OP-TABLE", act(op=nl.add), x)
    refused("SE-REDUCE", act(reduce_op=nl.maximum, reduce_cmd=nisa.reduce_cmd.reset_reduce), x)
    refused("ENG-SCALAR-OPERAND", act(bias=lambda: sb((2, 1), value=1.0)), x)  # a [P, 1] bias of the wrong P (a scalar is fine)

    @jit
    def trn3_only(x):
        t = loaded(x)
        nisa.activate2(dst=sb((4, 6)), op=nl.gelu, data=t, imm0=2.0, imm1=0.5, op0=nl.multiply, op1=nl.add)

    refused("SE-ACTIVATE2", trn3_only, x)


# --- GpSimdE ------------------------------------------------------------------------------------------------------

@rules("GP-IOTA", "GP-NONZERO", "GP-LOCAL-GATHER")
def test_gpsimd(_rule):
    src = (RNG.random((32, 8)) < 0.5).astype(np.float32)
    values = RNG.standard_normal((32, 10)).astype(np.float32)
    index = RNG.integers(0, 10, (32, 2)).astype(np.uint16)

    @jit
    def fine(src, values, index):
        io = sb((4, 6), nl.int32)
        nisa.iota(dst=io, pattern=[[2, 2], [1, 3]], offset=5, channel_multiplier=100)
        nz = sb((32, 9), nl.int32, value=0)
        nisa.nonzero_with_count(dst=nz, src=loaded(src))
        g = sb((32, 32))
        nisa.local_gather(dst=g, src_buffer=loaded(values), index=loaded(index))
        return out_of(io), out_of(nz), out_of(g)

    (io, nz, g), _ = run(fine, src, values, index)
    assert np.array_equal(io, 5 + 100 * np.arange(4)[:, None] + (2 * np.arange(2)[:, None] + np.arange(3)).reshape(1, 6))
    for p in (0, 16):
        idx = np.flatnonzero(src[p])
        assert list(nz[p, :idx.size]) == list(idx) and nz[p, 8] == idx.size and (nz[p, idx.size:8] == -1).all()
    assert (nz[1] == 0).all()  # partitions other than 0, 16, ... are untouched
    for c in range(2):
        flat = index[16 * c:16 * c + 16].flatten(order="F")
        assert np.array_equal(g[16 * c:16 * c + 16], values[16 * c:16 * c + 16][:, flat])

    @jit
    def iota_size(x):
        nisa.iota(dst=sb((4, 5), nl.int32), pattern=[[1, 6]])

    @jit
    def nonzero_dst(x):
        nisa.nonzero_with_count(dst=sb((16, 8), nl.int32), src=sb((16, 8), value=1.0))

    @jit
    def gather_int32_index(x):
        nisa.local_gather(dst=sb((16, 2)), src_buffer=sb((16, 4), value=1.0), index=sb((16, 2), nl.int32, value=0))

    refused("GP-IOTA", iota_size, NONE)
    refused("GP-NONZERO", nonzero_dst, NONE)
    refused("GP-LOCAL-GATHER", gather_int32_index, NONE)


# --- registers and the Python subset -------------------------------------------------------------------------------

@rules("REG-LOAD")
def test_register_load_from_a_one_element_tile(_rule):
    @jit
    def fine(x):
        bound = nl.ones([1], dtype=nl.int32, buffer=nl.sbuf)  # the doc's own example: a 1-D [1] SBUF tile
        reg = nisa.register_alloc()
        nisa.register_load(reg, bound)
        acc = sb((1, 1), value=0.0)
        for _ in nl.dynamic_range(reg):
            nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)
        stored = sb((1, 1), nl.int32)
        nisa.register_store(stored, reg)
        return out_of(acc), out_of(stored)

    (acc, stored), _ = run(fine, NONE)
    assert acc[0, 0] == 1.0 and stored[0, 0] == 1

    @jit
    def two_elements(x):
        nisa.register_load(nisa.register_alloc(), sb((1, 2), nl.int32, value=1))

    @jit
    def float_source(x):
        nisa.register_load(nisa.register_alloc(), sb((1, 1), value=1.0))

    refused("REG-LOAD", two_elements, NONE)
    refused("REG-LOAD", float_source, NONE)


def _with_int_key_dict(x):
    sizes = {1: 4}
    return sizes


@rules("PY-SUBSET")
def test_the_traced_subset_takes_string_keyed_dicts_only(_rule):
    @jit
    def string_keys(x):
        sizes = {"T": 4}
        more = dict(H=8)
        assert sizes["T"] * 2 == more["H"]

    run(string_keys, NONE)
    refused("PY-SUBSET", jit(_with_int_key_dict), NONE, match="not a string")
