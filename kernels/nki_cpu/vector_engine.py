"""Elementwise instructions of VectorE (and the ScalarE / GpSimdE variants their docs allow): ``tensor_tensor``,
``tensor_scalar``, ``scalar_tensor_tensor``, ``tensor_copy``, ``memset``, ``tensor_copy_predicated``
(aws-neuron-sdk @81ce03ae ``nki/api/nki/isa/__init__.py``), rules ``VE-*``.

Arithmetic operators compute in float32 and cast to the destination ("The engine casts input data types to float32
and performs the element-wise operation in float32 math"); bitvec operators act on integer bit patterns; int32 /
uint32 ``tensor_tensor`` on GpSimdE is exact integer arithmetic ("uses native integer arithmetic").
"""

from __future__ import annotations

import numpy as np

from . import dtypes as dt
from . import operators as ops
from .engines import count, pick, per_partition, same_layout, tile
from .rules import ISA, rule
from .tensor import read, read_raw, write, write_raw

TT_PSUM = rule("VE-TT-PSUM", ISA, "the two input tiles, ``data1`` and ``data2`` cannot both reside in PSUM",
               "tensor_tensor / scalar_tensor_tensor / tensor_tensor_scan / tensor_copy_predicated: the two inputs are "
               "not both in PSUM")
TT_INT = rule("VE-TT-INT", ISA, "When all input/output tiles are int32 or uint32, the operation defaults to GpSimd Engine, "
              "which uses native integer arithmetic", "all-int32/uint32 tensor_tensor defaults to GpSimdE with exact integer "
              "arithmetic (VectorE when an operand is in PSUM, or when asked for: float32 math)")
POWER = rule("VE-POWER", ISA, "``nl.power``. (Which runs on the GpSimd engine.)", "tensor_tensor(op=nl.power) runs on GpSimdE")
BITVEC = rule("VE-BITVEC", ISA, "If bitvec operators are used, the ``tensor_scalar`` instruction must run on Vector Engine",
              "bitvec operators run on VectorE, on integer dtypes, and are not mixed with arithmetic ones in one instruction")
TS_GPSIMD = rule("VE-TS-GPSIMD", ISA, "`nki.isa.engine.gpsimd` (only allowed for rsqrt)",
                 "tensor_scalar on GpSimdE only as op0=nl.rsqrt (operand0 0 or None, no op1)")
TS_SCALAR = rule("VE-TS-SCALARE", ISA, "The Scalar Engine on trn2 only supports some operator combinations",
                 "tensor_scalar on ScalarE: op0=multiply with op1=add or None, or op0=add with op1=None")
TS_F32 = rule("VE-TS-FLOAT32", ISA, "the operand0 and operand1 (if used) must be float32",
              "tensor_scalar's operand tiles are float32 (compile-time scalars are float32 immediates)")
TS_PAIR = rule("VE-TS-OP1", ISA, "``op1`` and ``operand1`` are optional, but must be ``None`` (default values) when unused",
               "op1 and operand1 come together; a unary op0 takes operand0 None or 0")
STT = rule("VE-STT", ISA, "Both ``op0`` and ``op1`` must be arithmetic operators",
           "scalar_tensor_tensor runs on VectorE with arithmetic operators; operand1 has data's shape")
MEMSET = rule("VE-MEMSET", ISA, "For x4 packed types (``float8_e4m3fn_x4``, ``float8_e5m2_x4``, ``float4_e2m1fn_x4``), only "
              "``value=0`` is supported", "memset on VectorE or GpSimdE fills a compile-time constant cast to the dtype")
PREDICATED = rule("VE-PREDICATED", ISA, "``predicate`` must be of type ``uint8``, ``uint16``, or ``uint32``",
                  "tensor_copy_predicated: uint predicate, src and dst of one dtype, same layout")


def _compute(op, a, b):
    with np.errstate(all="ignore"):
        return op.fn(a, b)


def _bitvec(op, a: np.ndarray, b) -> np.ndarray:
    return op.fn(a, np.asarray(b).astype(a.dtype))


def tensor_tensor(dst, data1, data2, op, engine=None, name=None) -> None:  # noqa: A002
    """dst = data1 op data2, elementwise (VectorE or GpSimdE)."""
    op = ops.need(op, ("arith", "bitvec"), "tensor_tensor op")
    data1, data2, dst = tile(data1, "tensor_tensor data1"), tile(data2, "tensor_tensor data2"), tile(dst, "tensor_tensor dst")
    same_layout(data1, data2, "tensor_tensor")
    same_layout(dst, data1, "tensor_tensor")
    TT_PSUM.check(not (data1.buffer == "psum" and data2.buffer == "psum"), "tensor_tensor: data1 and data2 are both in PSUM")
    ints = all(t.dtype in dt.INT32 for t in (dst, data1, data2))
    default = "gpsimd" if op.name == "power" or (ints and "psum" not in (t.buffer for t in (dst, data1, data2))) else "vector"
    eng = pick(engine, default, ("vector", "gpsimd"), (dst, data1, data2))
    POWER.check(op.name != "power" or eng == "gpsimd", "tensor_tensor(op=nl.power) runs on GpSimdE")
    shape = dst.shape
    if op.kind == "bitvec":
        BITVEC.check(eng == "vector" and all(t.dtype.is_int for t in (dst, data1, data2)),
                     f"tensor_tensor bitvec {op!r} on {eng} with {data1.dtype}/{data2.dtype}: VectorE, integer dtypes")
        write_raw(dst, _bitvec(op, read_raw(data1).reshape(shape), read_raw(data2).reshape(shape)).astype(dst.dtype.np))
    elif ints and eng == "gpsimd":
        a, b = read_raw(data1).reshape(shape).astype(np.int64), read_raw(data2).reshape(shape).astype(np.int64)
        r = _compute(op, a, b)
        TT_INT.check(op.name not in ("divide", "power"), f"integer tensor_tensor {op!r}: not native integer arithmetic here")
        write_raw(dst, np.asarray(r).astype(dst.dtype.np))
    else:
        write(dst, _compute(op, read(data1, "tensor_tensor data1").reshape(shape), read(data2, "tensor_tensor data2").reshape(shape)))
    count(eng, "tensor_tensor", data1)


def _unary_operand(op, operand, what):
    TS_PAIR.check(operand is None or (isinstance(operand, (int, float)) and operand == 0),
                  f"{what}: the unary operator {op!r} takes operand None or 0")


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False, engine=None,
                  name=None) -> None:  # noqa: A002
    """dst = (data op0 operand0) op1 operand1; operands compile-time scalars or [P, 1] tiles."""
    data, dst = tile(data, "tensor_scalar data"), tile(dst, "tensor_scalar dst")
    same_layout(dst, data, "tensor_scalar")
    eng = pick(engine, "vector", ("vector", "scalar", "gpsimd"), (dst, data, operand0, operand1))
    op0 = ops.need(op0, ("arith", "bitvec", "unary"), "tensor_scalar op0")
    TS_PAIR.check((op1 is None) == (operand1 is None) or (op1 is not None and op1.kind == "unary"),
                  "tensor_scalar: op1 and operand1 must be given together (both None when unused)")
    if op1 is not None:
        op1 = ops.need(op1, ("arith", "bitvec", "unary"), "tensor_scalar op1")
    if eng == "gpsimd":
        TS_GPSIMD.check(op0.name == "rsqrt" and op1 is None, f"tensor_scalar(engine=gpsimd) with op0={op0!r}: NKI allows "
                                                              "GpSimdE for tensor_scalar only for rsqrt")
    if eng == "scalar":
        combo = (op0.name, None if op1 is None else op1.name)
        TS_SCALAR.check(combo in (("multiply", "add"), ("multiply", None), ("add", None)),
                        f"tensor_scalar on ScalarE with op0={op0!r}, op1={op1!r}: trn2's Scalar Engine takes multiply+add, "
                        "multiply or add; run it on the vector engine")
    kinds = {op0.kind == "bitvec"} | ({op1.kind == "bitvec"} if op1 is not None else set())
    BITVEC.check(len(kinds) == 1, "tensor_scalar: op0 and op1 must both be bitvec or both arithmetic")
    shape = dst.shape
    if op0.kind == "bitvec":
        BITVEC.check(eng == "vector" and dst.dtype.is_int and data.dtype.is_int, f"bitvec tensor_scalar on {eng} with "
                                                                                   f"{data.dtype}: VectorE, integer dtypes")
        x = read_raw(data).reshape(shape)
        for op, operand, rev, what in ((op0, operand0, reverse0, "operand0"), (op1, operand1, reverse1, "operand1")):
            if op is None:
                continue
            b = np.asarray(operand if not hasattr(operand, "shape") else read_raw(tile(operand, what)).reshape(
                (shape[0],) + (1,) * (len(shape) - 1)))
            x = _bitvec(op, b.astype(x.dtype) * np.ones_like(x), x) if rev else _bitvec(op, x, b)
        write_raw(dst, x.astype(dst.dtype.np))
    else:
        x = read(data, "tensor_scalar data").reshape(shape)
        for op, operand, rev, what in ((op0, operand0, reverse0, "operand0"), (op1, operand1, reverse1, "operand1")):
            if op is None:
                continue
            if op.kind == "unary":
                _unary_operand(op, operand, f"tensor_scalar {what}")
                with np.errstate(all="ignore"):
                    x = op.fn(x)
                continue
            b = per_partition(operand, dst, f"tensor_scalar {what}", float32_only=True, rule_=TS_F32)
            x = _compute(op, b, x) if rev else _compute(op, x, b)
        write(dst, x)
    count(eng, "tensor_scalar", data)


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None) -> None:
    """dst = (data op0 operand0) op1 operand1 on VectorE; operand0 scalar or [P, 1]; operand1 like data."""
    op0, op1 = ops.need(op0, ("arith",), "scalar_tensor_tensor op0"), ops.need(op1, ("arith",), "scalar_tensor_tensor op1")
    data, dst = tile(data, "scalar_tensor_tensor data"), tile(dst, "scalar_tensor_tensor dst")
    operand1 = tile(operand1, "scalar_tensor_tensor operand1")
    same_layout(data, operand1, "scalar_tensor_tensor")
    same_layout(dst, data, "scalar_tensor_tensor")
    TT_PSUM.check(not (data.buffer == "psum" and operand1.buffer == "psum"), "scalar_tensor_tensor: data and operand1 are both in PSUM")
    shape = dst.shape
    x = read(data, "scalar_tensor_tensor data").reshape(shape)
    a = per_partition(operand0, dst, "scalar_tensor_tensor operand0")
    x = _compute(op0, a, x) if reverse0 else _compute(op0, x, a)
    y = read(operand1, "scalar_tensor_tensor operand1").reshape(shape)
    write(dst, _compute(op1, y, x) if reverse1 else _compute(op1, x, y))
    count("vector", "scalar_tensor_tensor", data)


def tensor_copy(dst, src, engine=None, name=None) -> None:  # noqa: A002
    """dst = src: bit-accurate when the dtypes agree, else through float32 (VectorE, ScalarE or GpSimdE)."""
    src, dst = tile(src, "tensor_copy src"), tile(dst, "tensor_copy dst")
    same_layout(dst, src, "tensor_copy")
    eng = pick(engine, "vector", ("vector", "scalar", "gpsimd"), (dst, src))
    if dst.dtype is src.dtype and not src.dtype.packed:
        write_raw(dst, read_raw(src, "tensor_copy src").reshape(dst.shape))
    else:
        write(dst, read(src, "tensor_copy src").reshape(dst.shape))
    count(eng, "tensor_copy", src)


def memset(dst, value, engine=None, name=None) -> None:  # noqa: A002
    """Fill ``dst`` with a compile-time constant."""
    dst = tile(dst, "memset dst")
    eng = pick(engine, "vector", ("vector", "gpsimd"), (dst,))
    if dst.dtype.packed:
        MEMSET.check(value == 0, f"memset of packed {dst.dtype} {dst.name!r} with {value!r}: only 0")
        write_raw(dst, np.zeros(dst.shape, dtype=dst.dtype.np))
    elif dst.dtype.is_int:
        write_raw(dst, np.full(dst.shape, int(value), dtype=np.int64).astype(dst.dtype.np))
    else:
        write(dst, np.full(dst.shape, float(value), dtype=np.float32))
    count(eng, "memset", dst)


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None) -> None:
    """dst = src where predicate (or its reverse) is nonzero; elsewhere dst keeps its values (VectorE)."""
    dst, predicate = tile(dst, "tensor_copy_predicated dst"), tile(predicate, "tensor_copy_predicated predicate")
    PREDICATED.check(predicate.dtype in (dt.uint8, dt.uint16, dt.uint32, dt.bool_),
                     f"tensor_copy_predicated predicate {predicate.name!r} is {predicate.dtype}")
    same_layout(dst, predicate, "tensor_copy_predicated")
    mask = read_raw(predicate).reshape(dst.shape) != 0
    mask = ~mask if reverse_pred else mask
    if hasattr(src, "shape") or hasattr(src, "pairs"):
        src = tile(src, "tensor_copy_predicated src")
        same_layout(dst, src, "tensor_copy_predicated")
        PREDICATED.check(src.dtype is dst.dtype, f"tensor_copy_predicated src {src.dtype} and dst {dst.dtype} differ")
        TT_PSUM.check(not (src.buffer == "psum" and predicate.buffer == "psum"), "src and predicate are both in PSUM")
        values = read_raw(src).reshape(dst.shape)
    else:
        values = dt.from_float32(np.full(dst.shape, float(src), np.float32), dst.dtype)
    dst.data[mask] = values[mask]  # where the predicate is off, dst is unmodified
    dst.written_bytes()[mask] = True
    mm = dst.mm_bytes()
    if mm is not None:
        mm[mask] = 1
    count("vector", "tensor_copy_predicated", dst)
