"""The interpreter's runtime-dependent features (kernels/nki_cpu/dynamic.py): registers, nl.dynamic_range,
scalar- and vector-offset DMA access patterns and DMA read-modify-write. Each feature: a legal use that
computes exactly (against numpy), and its misuses refused (index out of range, a dynamic trip count past the
static capacity, a register read before it holds a value, ...). Plus: the cost model charges them."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_moe_w8.kernels.nki_cpu import NkiValidationError, calibration, cost, cost_dynamic, jit, run
from vllm_moe_w8.kernels.nki_cpu import isa as nisa
from vllm_moe_w8.kernels.nki_cpu import language as nl

ROWS, COLS = 8, 16
TABLE = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) / 7


@jit
def gather_rows_kernel(table, index):
    """out[p] = table[index[p]]: one vector-offset DMA (index [P, 1] int32)."""
    p = index.shape[0]
    idx = nl.ndarray((p, 1), dtype=index.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=index)
    rows = nl.ndarray((p, table.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=rows, src=table.ap(pattern=[[table.shape[1], p], [1, table.shape[1]]], offset=0, vector_offset=idx,
                                         indirect_dim=0))
    out = nl.ndarray((p, table.shape[1]), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=rows)
    return out


@jit
def row_sum_loop_kernel(table, order, count):
    """out = sum over i < count of table[order[i]]: a dynamic loop of count[0, 0] trips (a register), the
    iteration's position in an SBUF tile, the row fetched by a scalar-offset DMA of order's entry."""
    n = table.shape[1]
    acc = nl.ndarray((1, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=acc, value=0.0)
    pos = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.memset(dst=pos, value=0)
    c = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=c, src=count)
    reg = nisa.register_alloc()
    nisa.register_load(reg, c)
    for _ in nl.dynamic_range(reg):
        row_id = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=row_id, src=order.ap(pattern=[[1, 1], [1, 1]], offset=0, scalar_offset=pos, indirect_dim=0))
        row = nl.ndarray((1, n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=row, src=table.ap(pattern=[[n, 1], [1, n]], offset=0, scalar_offset=row_id, indirect_dim=0))
        nisa.tensor_tensor(dst=acc, data1=acc, data2=row, op=nl.add)
        nisa.tensor_scalar(dst=pos, data=pos, op0=nl.add, operand0=1)
    out = nl.ndarray((1, n), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=acc)
    return out


def _scatter_operands(base, index, values):
    """Inside a kernel: out (HBM) = base, the values in SBUF, and out's rows at index[p] as a vector-offset
    access pattern (the destination of both scatter kernels)."""
    p, n = values.shape
    out = nl.ndarray(base.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    b = nl.ndarray(base.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=b, src=base)
    nisa.dma_copy(dst=out, src=b)
    idx = nl.ndarray((p, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=index)
    v = nl.ndarray((p, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=v, src=values)
    dst = out.ap(pattern=[[n, p], [1, n]], offset=0, vector_offset=idx, indirect_dim=0)
    return out, dst, v


@jit
def scatter_add_kernel(base, index, values, skip=False):
    """out = base; out[index[p]] += values[p] by DMA read-modify-write (dma_compute); ``skip``: with
    oob_mode.skip (rows whose index is outside ``base`` are left out)."""
    out, dst, v = _scatter_operands(base, index, values)
    if skip:
        nisa.dma_compute(dst=dst, srcs=[dst, v], reduce_op=nl.add, oob_mode=nisa.oob_mode.skip)
    else:
        nisa.dma_compute(dst=dst, srcs=[dst, v], reduce_op=nl.add)
    return out


def col(values, dtype=np.int32):
    return np.asarray(values, dtype=dtype).reshape(-1, 1)


def test_vector_offset_gather_is_exact_and_refuses_out_of_range_rows():
    idx = [5, 0, 7, 5]
    out, stats = run(gather_rows_kernel, TABLE, col(idx))
    assert np.array_equal(out, TABLE[idx])
    assert stats.indirect_dmas[("vector", 4)] == 1
    for bad in ([5, 0, 8, 1], [5, -1, 2, 1]):
        with pytest.raises(NkiValidationError, match=r"vector_offset -?\d+ out of range .*\(size 8\)"):
            run(gather_rows_kernel, TABLE, col(bad))
    with pytest.raises(NkiValidationError, match="offsets are integer tiles"):
        run(gather_rows_kernel, TABLE, col(idx, np.float32))


def test_dynamic_loop_with_register_and_scalar_offsets_is_exact():
    order = col([3, 3, 6, 1, 0])
    for count in (0, 1, 5):
        out, stats = run(row_sum_loop_kernel, TABLE, order, np.array([[count]], np.int32))
        want = TABLE[order[:count, 0]].sum(axis=0, keepdims=True) if count else np.zeros((1, COLS), np.float32)
        assert np.allclose(out, want, rtol=0, atol=1e-6)
        assert (stats.dynamic_loops, stats.dynamic_iterations, stats.register_loads) == (1, count, 1)
        assert stats.indirect_dmas[("scalar", 1)] == 2 * count


def test_a_dynamic_trip_count_past_the_static_capacity_is_refused():
    """order holds 5 entries (the static capacity); a loaded count of 6 makes the 6th trip's scalar offset
    leave the tensor: refused, never read past the end."""
    with pytest.raises(NkiValidationError, match=r"scalar_offset 5 out of range .*\(size 5\)"):
        run(row_sum_loop_kernel, TABLE, col([3, 3, 6, 1, 0]), np.array([[6]], np.int32))


def test_a_scalar_offset_out_of_range_is_refused():
    with pytest.raises(NkiValidationError, match=r"scalar_offset 8 out of range .*\(size 8\)"):
        run(row_sum_loop_kernel, TABLE, col([3, 8]), np.array([[2]], np.int32))


def _register_kernel(setup):
    @jit
    def kernel(count):
        c = nl.ndarray((1, 1), dtype=count.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=c, src=count)
        reg = setup(c)
        acc = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=acc, value=0.0)
        for _ in nl.dynamic_range(1, reg):
            nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)
        out = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=acc)
        return out

    return kernel


def _loaded(c):
    reg = nisa.register_alloc()
    nisa.register_load(reg, c)
    return reg


def _never_loaded(c):
    return nisa.register_alloc()


def _moved(c):
    reg = nisa.register_alloc()
    nisa.register_move(reg, 4)
    return reg


def test_registers_hold_values_only_once_given_one():
    assert run(_register_kernel(_loaded), np.array([[4]], np.int32))[0][0, 0] == 3  # trips 1..3
    assert run(_register_kernel(_moved), np.array([[9]], np.int32))[0][0, 0] == 3
    with pytest.raises(NkiValidationError, match="before it holds a value"):
        run(_register_kernel(_never_loaded), np.array([[4]], np.int32))
    with pytest.raises(NkiValidationError, match="registers hold 32-bit integers"):
        run(_register_kernel(_loaded), np.array([[4.0]], np.float32))


def _loop_kernel(body, step=1):
    @jit
    def kernel(x):
        t = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        for i in nl.dynamic_range(0, 2, step):
            body(i, t)
        out = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    return kernel


def _double(i, t):
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)


def _index_with_loop_variable(i, t):
    nisa.tensor_scalar(dst=t[:, i:i + 1], data=t[:, i:i + 1], op0=nl.multiply, operand0=2.0)


def test_the_dynamic_loop_variable_is_a_runtime_value():
    x = np.ones((1, 4), np.float32)
    assert np.array_equal(run(_loop_kernel(_double), x)[0], 4 * x)
    with pytest.raises(NkiValidationError, match="iteration variable .* runtime value"):
        run(_loop_kernel(_index_with_loop_variable), x)
    with pytest.raises(NkiValidationError, match="step=0.5"):
        run(_loop_kernel(_double, step=0.5), x)


def test_dma_read_modify_write_adds_exactly_and_refuses_repeated_rows():
    base = np.arange(6 * 4, dtype=np.float32).reshape(6, 4)
    values = np.full((3, 4), 0.25, np.float32) * np.arange(1, 4, dtype=np.float32)[:, None]
    out, stats = run(scatter_add_kernel, base, col([4, 0, 2]), values)
    want = base.copy()
    want[[4, 0, 2]] += values
    assert np.array_equal(out, want)
    assert stats.indirect_dmas[("vector", 3)] == 1
    with pytest.raises(NkiValidationError, match="twice in one DMA"):
        run(scatter_add_kernel, base, col([4, 0, 4]), values)
    with pytest.raises(NkiValidationError, match="out of range"):
        run(scatter_add_kernel, base, col([4, 0, 6]), values)


def test_dma_read_modify_write_with_oob_skip_leaves_out_of_range_rows_and_their_bytes():
    """oob_mode.skip (aws-neuron-sdk @81ce03ae nisa.dma_compute): rows whose index lies outside the indexed
    dimension are skipped - no element touched, no byte moved - while every in-range row is added exactly and
    still checked (a repeated in-range row is refused); the default mode still refuses them; any other mode is
    refused."""
    base = np.arange(6 * 4, dtype=np.float32).reshape(6, 4)
    values = np.full((4, 4), 0.25, np.float32) * np.arange(1, 5, dtype=np.float32)[:, None]
    out, stats = run(scatter_add_kernel, base, col([4, 6, 0, 9]), values, skip=True)
    want = base.copy()
    want[[4, 0]] += values[[0, 2]]
    assert np.array_equal(out, want)
    _, full = run(scatter_add_kernel, base, col([4, 5, 0, 1]), values, skip=True)
    assert full.hbm_read_bytes - stats.hbm_read_bytes == 2 * 4 * 4  # two skipped rows of 4 fp32: never read
    assert full.hbm_write_bytes - stats.hbm_write_bytes == 2 * 4 * 4  # ... nor written
    assert stats.indirect_dmas[("vector", 4)] == 1  # descriptors are still generated for every row
    with pytest.raises(NkiValidationError, match="twice in one DMA"):
        run(scatter_add_kernel, base, col([4, 9, 4, 7]), values, skip=True)
    with pytest.raises(NkiValidationError, match="out of range"):
        run(scatter_add_kernel, base, col([4, 6, 0, 1]), values)

    @jit
    def bad_mode(base, index, values):
        out = nl.ndarray(base.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        b = nl.ndarray(base.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=b, src=base)
        nisa.dma_copy(dst=out, src=b)
        idx = nl.ndarray(index.shape, dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx, src=index)
        v = nl.ndarray(values.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=v, src=values)
        dst = out.ap(pattern=[[4, 4], [1, 4]], offset=0, vector_offset=idx, indirect_dim=0)
        nisa.dma_compute(dst=dst, srcs=[dst, v], reduce_op=nl.add, oob_mode="wrap")
        return out

    with pytest.raises(NkiValidationError, match="oob_mode='wrap'"):
        run(bad_mode, base, col([4, 6, 0, 1]), values)


@jit
def scatter_write_kernel(base, index, values, skip=True):
    """out = base; out[index[p]] = values[p] by one plain vector-offset DMA write (dma_copy), with oob_mode.skip
    when ``skip``."""
    out, dst, v = _scatter_operands(base, index, values)
    if skip:
        nisa.dma_copy(dst=dst, src=v, oob_mode=nisa.oob_mode.skip)
    else:
        nisa.dma_copy(dst=dst, src=v)
    return out


@jit
def scalar_skip_kernel(table, first, second):
    """row := table[first]; then a second scalar-offset DMA of table[second] into the same row with oob_mode.skip
    (an out-of-range ``second`` moves nothing: the row keeps table[first])."""
    n = table.shape[1]
    row = nl.ndarray((1, n), dtype=nl.float32, buffer=nl.sbuf)
    for which in (first, second):
        i = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=i, src=which)
        nisa.dma_copy(dst=row, src=table.ap(pattern=[[n, 1], [1, n]], offset=0, scalar_offset=i, indirect_dim=0),
                      oob_mode=nisa.oob_mode.skip)
    out = nl.ndarray((1, n), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=row)
    return out


def test_dma_copy_with_oob_skip_moves_only_in_range_rows():
    """dma_copy(oob_mode=oob_mode.skip) (aws-neuron-sdk @81ce03ae nisa.dma_copy: "skip the DMA transfer for a given
    dynamic address or index when it is out of bound"): a vector-offset scatter writes exactly its in-range rows and
    moves no byte for the others; a scalar-offset load out of range leaves its destination as it was; the default
    mode still refuses an out-of-range index, and skip on a DMA without a dynamic address is refused."""
    base = np.arange(6 * 4, dtype=np.float32).reshape(6, 4)
    values = np.arange(16, dtype=np.float32).reshape(4, 4) + 100
    out, stats = run(scatter_write_kernel, base, col([4, 6, 0, 9]), values)
    want = base.copy()
    want[[4, 0]] = values[[0, 2]]
    assert np.array_equal(out, want)
    _, full = run(scatter_write_kernel, base, col([4, 5, 0, 1]), values)
    assert full.hbm_write_bytes - stats.hbm_write_bytes == 2 * 4 * 4  # two skipped rows: never written
    assert stats.indirect_dmas[("vector", 4)] == 1
    with pytest.raises(NkiValidationError, match="out of range"):
        run(scatter_write_kernel, base, col([4, 6, 0, 1]), values, skip=False)
    # two rows scattered to one row: the docs forbid repeated indices only for dma_compute (nki-library's moe_cte scatters
    # every padding row of a block to the dummy row T); the interpreter lets the highest partition win
    dup, _ = run(scatter_write_kernel, base, col([4, 9, 4, 7]), values)
    want = base.copy()
    want[4] = values[2]
    assert np.array_equal(dup, want)
    kept, st_kept = run(scalar_skip_kernel, TABLE, np.array([[2]], np.int32), np.array([[8]], np.int32))
    assert np.array_equal(kept, TABLE[2:3])
    moved, st_moved = run(scalar_skip_kernel, TABLE, np.array([[2]], np.int32), np.array([[5]], np.int32))
    assert np.array_equal(moved, TABLE[5:6])
    assert st_moved.hbm_read_bytes - st_kept.hbm_read_bytes == COLS * 4  # the skipped load read nothing
    assert st_moved.dma_count == st_kept.dma_count  # ... but was still issued

    @jit
    def static_skip(x):
        t = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x, oob_mode=nisa.oob_mode.skip)
        return x

    with pytest.raises(NkiValidationError, match="without a dynamic address"):
        run(static_skip, TABLE)


def test_a_never_written_skip_destination_stays_garbage():
    """A gather whose rows are skipped writes nothing there: a DMA moves those never-written bytes as they are (garbage
    on the device) and the kernel output returns them as 0xFF bytes (NaN)."""
    @jit
    def kernel(table, index):
        idx = nl.ndarray((2, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx, src=index)
        rows = nl.ndarray((2, table.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows, src=table.ap(pattern=[[table.shape[1], 2], [1, table.shape[1]]], offset=0,
                                             vector_offset=idx, indirect_dim=0), oob_mode=nisa.oob_mode.skip)
        out = nl.ndarray((2, table.shape[1]), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=rows)
        return out

    assert np.array_equal(run(kernel, TABLE, col([3, 1]))[0], TABLE[[3, 1]])
    out, _ = run(kernel, TABLE, col([8, 1]))
    assert np.isnan(out[0]).all() and np.array_equal(out[1], TABLE[1])


@pytest.mark.parametrize("scenario", sorted(calibration.SCENARIOS))
def test_the_cost_model_charges_descriptors_register_loads_and_loop_trips(scenario):
    sc = calibration.SCENARIOS[scenario]
    c = sc.constants
    order = col([3, 3, 6, 1, 0])
    _, none = run(row_sum_loop_kernel, TABLE, order, np.array([[0]], np.int32))
    _, five = run(row_sum_loop_kernel, TABLE, order, np.array([[5]], np.int32))
    e0, e5 = cost.estimate(none, sc), cost.estimate(five, sc)
    assert e5.control_s - e0.control_s == pytest.approx(5 * c.dynamic_iteration_s)
    assert e0.control_s == pytest.approx(c.register_load_s)
    assert e5.time_s > e0.time_s + 5 * c.dynamic_iteration_s * 0.99
    _, gathered = run(gather_rows_kernel, TABLE, col([5, 0, 7, 5]))
    assert cost_dynamic.descriptor_seconds(gathered, c) == pytest.approx(3 * c.indirect_descriptor_s)
    assert cost.estimate(gathered, sc).dge_s == pytest.approx(gathered.dma_count * c.dge_per_dma_s + 3 * c.indirect_descriptor_s)
    for name in cost_dynamic.CONSTANT_NAMES:
        assert getattr(c, name) > 0 and sc.sources[name].startswith("assumed"), (scenario, name)
