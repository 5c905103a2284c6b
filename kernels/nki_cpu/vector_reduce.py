"""VectorE instructions that combine elements along or across partitions: ``tensor_reduce``, ``tensor_tensor_scan``,
``nc_stream_shuffle``, ``reciprocal`` (aws-neuron-sdk @81ce03ae ``nki/api/nki/isa/__init__.py``), rules ``VR-*``."""

from __future__ import annotations

import numpy as np

from . import operators as ops
from .engines import count, per_partition, same_layout, tile
from .rules import ISA, rule
from .tensor import free_size, read, read_raw, write, write_raw
from .vector_engine import TT_PSUM

REDUCE = rule("VR-REDUCE", ISA, "The reduction axes must be the last contiguous free dimension(s) of the tile, ending at the "
              "final dimension. Axis 0 (partition axis) cannot be reduced",
              "tensor_reduce: a reducible operator, the last free axes, dst holding what is left (keepdims or not); "
              "negate only with arithmetic operators")
SCAN = rule("VR-SCAN", ISA, "The two input tiles (``data0`` and ``data1``) must have the same partition axis size and the same "
            "number of elements per partition", "tensor_tensor_scan: result[:, i] = op1(op0(data0[:, i], prev), data1[:, i]) "
            "over the flattened free axis, initial a scalar or [P, 1] tile; arithmetic operators")
SHUFFLE = rule("VR-SHUFFLE", ISA, "``shuffle_mask[i]`` indicates which input partition the output partition [i] copies from "
               "within each 32-partition quadrant", "nc_stream_shuffle: a 32-entry mask applied per quadrant (255 keeps the "
               "output partition), same dtype and elements per partition, quadrant start rules")


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None) -> None:
    """dst = op-reduction of ``data`` over its last free ``axis`` (VectorE)."""
    op = ops.need(op, ("arith", "bitvec"), "tensor_reduce op")
    REDUCE.check(op.reducible, f"tensor_reduce op {op!r} is not a legal reduction operator")
    data, dst = tile(data, "tensor_reduce data"), tile(dst, "tensor_reduce dst")
    axes = sorted({int(a) for a in (axis if isinstance(axis, (list, tuple)) else (axis,))})
    axes = [a + data.ndim if a < 0 else a for a in axes]
    REDUCE.check(axes and axes[0] > 0 and axes == list(range(axes[0], data.ndim)),
                 f"tensor_reduce axis={axis} of a {data.ndim}-d tile: the last contiguous free dims, not the partition dim")
    kept = data.shape[:axes[0]]
    REDUCE.check(dst.shape[0] == data.shape[0] and free_size(dst) == int(np.prod(kept[1:], dtype=np.int64)),
                 f"tensor_reduce dst {dst.shape} does not hold data {data.shape} reduced over {tuple(axes)}")
    if op.kind == "bitvec":
        REDUCE.check(not negate, "tensor_reduce negate with a bitvec operator")
        x = read_raw(data)
        r = op.fn.reduce(x, axis=tuple(axes))
        write_raw(dst, r.reshape(dst.shape).astype(dst.dtype.np))
    else:
        x = read(data, "tensor_reduce data")
        with np.errstate(all="ignore"):
            r = op.fn.reduce(x, axis=tuple(axes)) if hasattr(op.fn, "reduce") else _fold(op, x, axes)
        write(dst, (-r if negate else r).reshape(dst.shape))
    count("vector", "tensor_reduce", data)


def _fold(op, x, axes):
    flat = x.reshape(x.shape[:axes[0]] + (-1,))
    acc = flat[..., 0]
    for i in range(1, flat.shape[-1]):
        acc = op.fn(acc, flat[..., i])
    return acc


def tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False, name=None) -> None:
    """result[:, i] = op1(op0(data0[:, i], result[:, i-1]), data1[:, i]), result[:, -1] = initial (VectorE)."""
    op0, op1 = ops.need(op0, ("arith",), "tensor_tensor_scan op0"), ops.need(op1, ("arith",), "tensor_tensor_scan op1")
    data0, data1, dst = (tile(t, f"tensor_tensor_scan {w}") for t, w in ((data0, "data0"), (data1, "data1"), (dst, "dst")))
    same_layout(data0, data1, "tensor_tensor_scan")
    same_layout(dst, data0, "tensor_tensor_scan")
    TT_PSUM.check(not (data0.buffer == "psum" and data1.buffer == "psum"), "tensor_tensor_scan: data0 and data1 both in PSUM")
    p = data0.shape[0]
    a = read(data0, "tensor_tensor_scan data0").reshape(p, -1)
    b = read(data1, "tensor_tensor_scan data1").reshape(p, -1)
    prev = np.broadcast_to(per_partition(initial, data0, "tensor_tensor_scan initial"), (p,) + (1,) * (data0.ndim - 1))
    prev = np.asarray(prev, np.float32).reshape(p)
    out = np.empty_like(a)
    with np.errstate(all="ignore"):
        for i in range(a.shape[1]):
            t = op0.fn(prev, a[:, i]) if reverse0 else op0.fn(a[:, i], prev)
            prev = (op1.fn(b[:, i], t) if reverse1 else op1.fn(t, b[:, i])).astype(np.float32)
            out[:, i] = prev
    write(dst, out.reshape(dst.shape))
    count("vector", "tensor_tensor_scan", data0)


def nc_stream_shuffle(dst, src, shuffle_mask, name=None) -> None:
    """Cross-partition moves within each 32-partition quadrant (VectorE)."""
    src, dst = tile(src, "nc_stream_shuffle src"), tile(dst, "nc_stream_shuffle dst")
    mask = [int(m) for m in shuffle_mask]
    SHUFFLE.check(len(mask) == 32 and all(0 <= m < 32 or m == 255 for m in mask), f"shuffle_mask {mask}: 32 entries in 0..31 or 255")
    SHUFFLE.check(dst.dtype is src.dtype and free_size(dst) == free_size(src),
                  f"nc_stream_shuffle: dst {dst.dtype} {dst.shape} vs src {src.dtype} {src.shape}")
    active = -(-max(src.shape[0], dst.shape[0]) // 32) * 32
    starts = {96: (0,), 128: (0,), 64: (0, 64), 32: (0, 32, 64, 96)}[active]
    for t in (src, dst):
        start = t.storage.base // t.storage.pitch + t.boffset // t.storage.row_bytes
        SHUFFLE.check(start in starts, f"nc_stream_shuffle: {t.name!r} starts at partition {start}; with {active} active "
                                       f"partitions it must start at {starts}")
    values = read_raw(src, "nc_stream_shuffle src").reshape(src.shape[0], -1)
    out = read_raw(dst).reshape(dst.shape[0], -1).copy() if 255 in mask else np.empty((dst.shape[0], values.shape[1]), values.dtype)
    for q in range(0, dst.shape[0], 32):
        for i, m in enumerate(mask):
            if m != 255 and q + i < dst.shape[0]:
                SHUFFLE.check(q + m < src.shape[0], f"nc_stream_shuffle: output partition {q + i} copies missing source partition {q + m}")
                out[q + i] = values[q + m]
    write_raw(dst, out.reshape(dst.shape))
    count("vector", "nc_stream_shuffle", dst)


def reciprocal(dst, data, name=None) -> None:
    """dst = 1 / data on VectorE (higher precision than ScalarE's, shared.rst)."""
    data, dst = tile(data, "reciprocal data"), tile(dst, "reciprocal dst")
    same_layout(dst, data, "reciprocal")
    with np.errstate(all="ignore"):
        write(dst, 1.0 / read(data, "reciprocal data").reshape(dst.shape))
    count("vector", "reciprocal", data, factor=8)
