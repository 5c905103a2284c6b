"""Every documented rule of the interpreter (``nki_cpu.RULES``: AWS's NKI docs @81ce03ae, file and sentence) with a
rule test written here: the legal use computes exactly what numpy says, and the documented misuse is refused naming
the rule. This file: memory and views, DMA, SPMD, the language face; tests/test_nki_doc_rules_engines.py: the compute
engines. ``test_every_rule_has_a_rule_test`` keeps the two in step with the registry."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from vllm_moe_w8.kernels.nki_cpu import RULES, NkiValidationError, jit, launch, run
from vllm_moe_w8.kernels.nki_cpu import isa as nisa
from vllm_moe_w8.kernels.nki_cpu import language as nl

RNG = np.random.default_rng(0)
NONE = np.zeros(1, np.float32)
TESTED: set = set()  # rule ids this module's tests exercise (collected by test_every_rule_has_a_rule_test)


def rules(*ids):
    TESTED.update(ids)
    return pytest.mark.parametrize("_rule", [",".join(ids)])


def refused(rule_id: str, fn, *args, grid=None, match=""):
    with pytest.raises(NkiValidationError, match=rf"{match}.*\[{rule_id};"):
        if grid:
            launch(fn, (grid,), *args)
        else:
            run(fn, *args)


def sb(shape, dtype=nl.float32, value=None, buffer=nl.sbuf, **kw):
    t = nl.ndarray(shape, dtype=dtype, buffer=buffer, **kw)
    if value is not None:
        nisa.memset(dst=t, value=value)
    return t


def out_of(t):
    out = nl.ndarray(t.shape, dtype=t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


# --- memory --------------------------------------------------------------------------------------------------------

@rules("MEM-PRIVATE-HBM")
def test_private_hbm_belongs_to_its_program(_rule):
    @jit
    def each_own(x):
        scratch = nl.ndarray((2, 4), dtype=nl.float32, buffer=nl.private_hbm)
        t = sb((2, 4), value=float(nl.program_id(0) + 1))
        nisa.dma_copy(dst=scratch, src=t)
        back = sb((2, 4))
        nisa.dma_copy(dst=back, src=scratch)
        out = nl.ndarray((2, 2, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[nl.program_id(0)], src=back)
        return out

    out, _ = launch(each_own, (2,), NONE)
    assert (out[0] == 1).all() and (out[1] == 2).all()  # program 1's write did not reach program 0's scratch

    @jit
    def returns_private(x):
        scratch = nl.ndarray((2, 4), dtype=nl.float32, buffer=nl.hbm)
        nisa.dma_copy(dst=scratch, src=sb((2, 4), value=1.0))
        return scratch

    assert (run(returns_private, NONE)[0] == 1).all()  # one program: its private HBM is the output
    refused("MEM-PRIVATE-HBM", returns_private, NONE, grid=2)


@rules("MEM-ADDRESS")
def test_tiles_placed_by_address_alias_and_psum_starts_a_bank(_rule):
    @jit
    def alias(x):
        a = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf, address=(0, 1024))
        nisa.memset(dst=a, value=3.0)
        b = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf, address=(0, 1024))  # the same bytes
        ps = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.psum, address=(0, 2048))
        nisa.tensor_copy(dst=ps, src=b)
        return out_of(b)

    assert (run(alias, NONE)[0] == 3.0).all()

    @jit
    def off_bank(x):
        return nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.psum, address=(0, 1024))

    refused("MEM-ADDRESS", off_bank, NONE, match="start a 2 KiB bank")


@rules("MEM-SBUF-CAPACITY", "MEM-PSUM-CAPACITY")
def test_capacity_counts_tiles_over_their_live_ranges(_rule):
    def make(sbuf_kib, banks, reuse=False):
        @jit
        def kernel(x):
            big = sb((128, sbuf_kib * 1024), nl.uint8, value=0)
            tiles = [sb((128, 512), buffer=nl.psum) for _ in range(banks)]
            for t in tiles:
                nisa.memset(dst=t, value=0.0)  # every bank in use before big's last use: all live together
            if not reuse:
                nisa.memset(dst=big, value=1)
            more = sb((128, 32 * 1024), nl.uint8, value=0)  # after big's last use (reuse) or beside it
            nisa.memset(dst=big if not reuse else more, value=2)

        return kernel

    _, stats = run(make(192, 8), NONE)
    assert stats.peak_sbuf_bytes == 224 * 1024 and stats.peak_psum_banks == 8
    _, reused = run(make(200, 8, reuse=True), NONE)  # 200 + 32 KiB fit one after the other, not together
    assert reused.peak_sbuf_bytes == 200 * 1024
    refused("MEM-SBUF-CAPACITY", make(200, 8), NONE, match="SBUF overflow")
    refused("MEM-PSUM-CAPACITY", make(8, 9), NONE, match="PSUM overflow")


@rules("MEM-UNWRITTEN")
def test_never_written_elements_read_as_sentinels(_rule):
    @jit
    def half(x):
        t = sb((4, 8))
        nisa.memset(dst=t[:, 0:4], value=2.0)
        u = sb((4, 8))
        nisa.tensor_scalar(dst=u, data=t, op0=nl.add, operand0=1.0)
        return out_of(u)

    out, stats = run(half, NONE)
    assert (out[:, :4] == 3.0).all() and np.isnan(out[:, 4:]).all() and stats.unwritten_reads == 16


# --- views ---------------------------------------------------------------------------------------------------------

@rules("VIEW-PARTITION", "VIEW-INDEX")
def test_views_stay_in_their_partitions(_rule):
    x = np.arange(4 * 6, dtype=np.float32).reshape(4, 6)

    @jit
    def fine(x):
        t = sb((4, 6))
        nisa.dma_copy(dst=t, src=x)
        assert t[1].shape == (1, 6) and x[1].shape == (6,)  # an int keeps the partition dim on-chip, drops it in HBM
        return out_of(t[1:3, ::2].permute((0, 1)))

    assert np.array_equal(run(fine, x)[0], x[1:3, ::2])

    @jit
    def crosses(x):
        t = sb((4, 6), value=0.0)
        return t.ap(pattern=[[6, 2], [1, 12]])

    @jit
    def outside(x):
        return sb((4, 6))[:, 4:8]

    refused("VIEW-PARTITION", crosses, NONE, match="may not cross")
    refused("VIEW-INDEX", outside, NONE, match="out of bounds")


@rules("VIEW-RESHAPE")
def test_reshape_of_on_chip_tiles_keeps_the_partition_dim(_rule):
    x = np.arange(4 * 12, dtype=np.float32).reshape(4, 12)

    @jit
    def fine(x):
        t = sb((4, 12))
        nisa.dma_copy(dst=t, src=x)
        r = t.reshape((4, 3, 4))
        o = sb((4, 4, 3))
        nisa.tensor_copy(dst=o, src=r.permute((0, 2, 1)))
        return out_of(o)

    assert np.array_equal(run(fine, x)[0], x.reshape(4, 3, 4).transpose(0, 2, 1))

    @jit
    def moves_partitions(x):
        return sb((4, 12)).reshape((8, 6))

    refused("VIEW-RESHAPE", moves_partitions, NONE, match="partition dimension must stay")


@rules("VIEW-DTYPE")
def test_view_reinterprets_bytes_and_rescales_the_last_dim(_rule):
    x = RNG.standard_normal((4, 8)).astype(np.float32)

    @jit
    def fine(x):
        t = sb((4, 8))
        nisa.dma_copy(dst=t, src=x)
        b = sb((4, 32), nl.uint8)
        nisa.tensor_copy(dst=b, src=t.view(nl.uint8))
        return out_of(b)

    assert np.array_equal(run(fine, x)[0], x.view(np.uint8))

    @jit
    def strided(x):
        return sb((4, 8))[:, ::2].view(nl.uint8)

    refused("VIEW-DTYPE", strided, NONE, match="not contiguous")


@rules("VIEW-AP-PARTITION")
def test_ap_on_sbuf(_rule):
    x = np.arange(4 * 8, dtype=np.float32).reshape(4, 8)

    @jit
    def fine(x):
        t = sb((4, 8))
        nisa.dma_copy(dst=t, src=x)
        o = sb((4, 4))
        nisa.tensor_copy(dst=o, src=t.ap(pattern=[[8, 4], [2, 4]], offset=1))
        return out_of(o)

    assert np.array_equal(run(fine, x)[0], x[:, 1::2])

    @jit
    def bad_stride(x):
        return sb((4, 8)).ap(pattern=[[4, 4], [1, 4]])

    refused("VIEW-AP-PARTITION", bad_stride, NONE)


# --- DMA -----------------------------------------------------------------------------------------------------------

@rules("DMA-MEMORY", "DMA-CONVERT", "DMA-COUNT")
def test_dma_converts_and_pairs_elements_by_count(_rule):
    x = RNG.standard_normal((4, 6)).astype(np.float32)

    @jit
    def fine(x):
        t = sb((2, 12), nl.bfloat16)
        nisa.dma_copy(dst=t, src=x)  # [4, 6] fp32 -> [2, 12] bf16: same element count, converted through float32
        out = nl.ndarray((4, 6), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(run(fine, x)[0], want)

    @jit
    def from_psum(x):
        p = sb((2, 4), value=0.0, buffer=nl.psum)
        return out_of(p)

    @jit
    def counts_differ(x):
        t = sb((4, 5))
        nisa.dma_copy(dst=t, src=x)

    refused("DMA-MEMORY", from_psum, NONE)
    refused("DMA-COUNT", counts_differ, x)


def _gather(mode=None, engine=None, priority=None):
    @jit
    def kernel(data, idx_hbm):
        idx = sb((4, 1), nl.int32)
        nisa.dma_copy(dst=idx, src=idx_hbm)
        rows = sb((4, data.shape[1]))
        kw = {} if mode is None else {"dge_mode": mode}
        if engine is not None:
            kw["engine"] = engine
        nisa.dma_copy(dst=rows, src=data.ap(pattern=[[data.shape[1], 4], [1, data.shape[1]]], vector_offset=idx),
                      priority=priority, **kw)
        return out_of(rows)

    return kernel


@rules("DMA-INDIRECT", "DMA-DGE", "DMA-PRIORITY")
def test_gathers_run_on_software_dge(_rule):
    data, idx = RNG.standard_normal((9, 5)).astype(np.float32), np.array([[3], [0], [8], [3]], np.int32)
    for mode in (None, nisa.dge_mode.unknown, nisa.dge_mode.swdge, 1):  # 1: the member's value, as nki-library passes it
        assert np.array_equal(run(_gather(mode), data, idx)[0], data[idx[:, 0]])
    refused("DMA-DGE", _gather(nisa.dge_mode.hwdge), data, idx, match="software DGE")
    refused("DMA-DGE", _gather(None, engine=nisa.engine.sync), data, idx, match="only valid with dge_mode=hwdge")
    refused("DMA-PRIORITY", _gather(priority=0), data, idx)
    refused("DMA-INDIRECT", _gather(), data, np.array([[3], [0], [9], [3]], np.int32), match="vector_offset 9 out of range")

    @jit
    def sbuf_indexed(x):
        t, i = sb((4, 4), value=0.0), sb((4, 1), nl.int32, value=0)
        return t.ap(pattern=[[4, 4], [1, 4]], vector_offset=i)

    refused("DMA-INDIRECT", sbuf_indexed, NONE, match="must be in HBM")


@rules("DMA-OOB")
def test_oob_skip_needs_a_dynamic_address(_rule):
    @jit
    def static_skip(x):
        t = sb((1, 1))
        nisa.dma_copy(dst=t, src=x.reshape((1, 1)), oob_mode=nisa.oob_mode.skip)

    refused("DMA-OOB", static_skip, NONE, match="without a dynamic address")


@rules("DMA-TRANSPOSE", "DMA-TRANSPOSE-SHAPE")
def test_dma_transpose(_rule):
    x = RNG.standard_normal((6, 16)).astype(ml_dtypes.bfloat16)

    def make(dtype, shape):
        @jit
        def kernel(x):
            t = sb(shape, dtype)
            nisa.dma_transpose(dst=t, src=x)
            return out_of(t)

        return kernel

    assert np.array_equal(run(make(nl.bfloat16, (16, 6)), x)[0], x.T)
    refused("DMA-TRANSPOSE-SHAPE", make(nl.bfloat16, (6, 16)), x)
    refused("DMA-TRANSPOSE", make(nl.float8_e4m3, (16, 6)), x.astype(ml_dtypes.float8_e4m3), match="2-byte")


@rules("DMA-COMPUTE")
def test_dma_compute_adds_and_takes_only_add(_rule):
    a, b = RNG.standard_normal((4, 6)).astype(np.float32), RNG.standard_normal((4, 6)).astype(np.float32)

    def make(op, scales=None):
        @jit
        def kernel(a, b):
            out = nl.ndarray((4, 6), dtype=nl.float32, buffer=nl.shared_hbm)
            nisa.dma_compute(dst=out, srcs=[a, b], reduce_op=op, scales=scales)
            return out

        return kernel

    assert np.array_equal(run(make(nl.add), a, b)[0], a + b)
    refused("DMA-COMPUTE", make(nl.multiply), a, b)
    refused("DMA-COMPUTE", make(nl.add, scales=[1.0, 2.0]), a, b)


# --- SPMD ------------------------------------------------------------------------------------------------------------

@rules("SPMD-SENDRECV", "SPMD-BARRIER")
def test_sendrecv_exchanges_and_core_barrier_needs_two_cores(_rule):
    @jit
    def swap(x):
        mine = sb((4, 4), value=float(nl.program_id(0) + 1))
        theirs = sb((4, 4))
        nisa.sendrecv(src=mine, dst=theirs, send_to_rank=1 - nl.program_id(0), recv_from_rank=1 - nl.program_id(0), pipe_id=0)
        out = nl.ndarray((2, 4, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[nl.program_id(0)], src=theirs)
        nisa.core_barrier(out, (0, 1))
        return out

    out, _ = launch(swap, (2,), NONE)
    assert (out[0] == 2).all() and (out[1] == 1).all()

    @jit
    def to_hbm(x):
        nisa.sendrecv(src=sb((4, 4), value=1.0), dst=nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm),
                      send_to_rank=0, recv_from_rank=0, pipe_id=0)

    @jit
    def one_core_barrier(x):
        out = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.core_barrier(out, (0, 1))

    refused("SPMD-SENDRECV", to_hbm, NONE)
    refused("SPMD-BARRIER", one_core_barrier, NONE)


def test_a_program_waiting_for_a_peer_that_never_comes_is_a_deadlock():
    @jit
    def lonely(x):
        if nl.program_id(0) == 0:
            out = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
            nisa.core_barrier(out, (0, 1))

    with pytest.raises(NkiValidationError, match="deadlock"):
        launch(lonely, (2,), NONE)


# --- the language face -------------------------------------------------------------------------------------------

@rules("LANG-BROADCAST", "LANG-GRID")
def test_broadcast_to_and_the_grid(_rule):
    x = RNG.standard_normal((1, 5)).astype(np.float32)

    @jit
    def fine(x):
        t = sb((1, 5))
        nisa.dma_copy(dst=t, src=x)
        assert nl.program_ndim() == 1 and nl.num_programs(0) == 1
        return out_of(nl.broadcast_to(t, (4, 5)))

    assert np.array_equal(launch(fine, (1,), x)[0], np.broadcast_to(x, (4, 5)))

    @jit
    def bad(x):
        return nl.broadcast_to(sb((2, 5), value=0.0), (4, 5))

    @jit
    def axis1(x):
        return nl.program_id(1)

    refused("LANG-BROADCAST", bad, NONE)
    refused("LANG-GRID", axis1, NONE)


@rules("LANG-CLASS")
def test_nki_objects_default_missing_fields_to_none(_rule):
    from dataclasses import dataclass

    @dataclass
    class Dims(nl.NKIObject):
        T: int
        H: int
        spare: int

    d = Dims(T=4, H=8)  # the compiler's initializer: fields without a default are None
    assert (d.T, d.H, d.spare) == (4, 8, None)


@rules("JIT-OPTIONS", "JIT-LNC")
def test_jit_options_and_the_lnc_grid(_rule):
    def body(x):
        return None

    assert jit(mode="trace")(body) is not None
    with pytest.raises(NkiValidationError, match=r"\[JIT-OPTIONS;"):
        jit(platform_target="trn2")
    with pytest.raises(NkiValidationError, match=r"\[JIT-LNC;"):
        launch(jit(body), (1,), NONE, lnc=2)


def test_every_rule_has_a_rule_test():
    from tests import test_nki_doc_rules_engines as engines

    missing = sorted(set(RULES) - TESTED - engines.TESTED)
    assert not missing, f"rules without a rule test: {missing}"
