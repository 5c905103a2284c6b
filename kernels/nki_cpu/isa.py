"""The subset of ``nki.isa`` the project's kernels use, with the checks Trn2 (NeuronCore-v3) enforces.

Every instruction computes in float32 (the engines' internal precision), casts its result to the
destination dtype, and is counted in the run's :class:`~.machine.Stats` for the cost model.
Signatures follow the current NKI API (``dst`` first, keyword-friendly).
"""

from __future__ import annotations

import numpy as np
import torch

from . import dtypes as dt
from . import language as nl
from .dynamic import (AccessPattern, count_indirect, dma_compute, gather, oob_mode, register_alloc,  # noqa: F401
                      register_load, register_move, scatter)
from .dynamic import oob_mode as dynamic_oob
from .machine import PMAX, PSUM_BANK_BYTES, NkiValidationError, Tensor, current, hbm_run_bytes, read, write


class engine:  # noqa: N801  (mirrors nisa.engine)
    unknown = "unknown"
    tensor = "tensor"
    vector = "vector"
    scalar = "scalar"
    gpsimd = "gpsimd"


STATIONARY_FMAX = 128
MOVING_FMAX = 512


def _free(t: Tensor) -> int:
    return int(np.prod(t.shape[1:], dtype=np.int64)) if t.ndim > 1 else 1


def _need(t, what: str, buffers=("sbuf", "psum")) -> Tensor:
    if not isinstance(t, Tensor):
        raise NkiValidationError(f"{what} must be an NKI tensor, got {type(t).__name__}")
    if t.buffer not in buffers:
        raise NkiValidationError(f"{what} {t.name!r} is in {t.buffer}; this instruction needs it in {' or '.join(buffers)}")
    if t.shape[0] > PMAX:
        raise NkiValidationError(f"{what} {t.name!r} spans {t.shape[0]} partitions > {PMAX}")
    return t


def _same_shape(a: Tensor, b: Tensor, what: str) -> None:
    if a.shape != b.shape:
        raise NkiValidationError(f"{what}: shapes differ, {a.name!r} {a.shape} vs {b.name!r} {b.shape}")


def _count(eng: str, op: str, t: Tensor) -> None:
    current().stats.engine_ops[(eng, op, int(t.shape[0]), _free(t))] += 1


def _scalar(operand, data: Tensor, what: str):
    """A compile-time scalar, or a [P, 1] tile broadcast along the free dims."""
    if isinstance(operand, (int, float, np.floating, np.integer)):
        return float(operand)
    t = _need(operand, what)
    if t.shape != (data.shape[0], 1):
        raise NkiValidationError(f"{what} {t.name!r} must be a scalar or a [{data.shape[0]}, 1] tile (one value per partition), got {t.shape}")
    v = read(t, what)
    return v.reshape((data.shape[0],) + (1,) * (data.ndim - 1))


def _op(op, allowed, what: str):
    if op not in allowed:
        raise NkiValidationError(f"{what} {op!r} is not supported by the interpreter (supported: {', '.join(o.name for o in allowed)})")
    return op


def _not_implemented(instruction: str, **given) -> None:
    """Refuse NKI arguments the interpreter does not model when they are set to anything but their default
    (``None``, ``False`` or an empty tuple): a kernel using them would compute something else on the device."""
    for arg, value in given.items():
        if value is not None and value is not False and value != ():
            raise NkiValidationError(
                f"{instruction}({arg}={value!r}) is not implemented by the interpreter; leave {arg} at its default "
                "or implement it in kernels/nki_cpu/isa.py (the device would honour it, the interpreter cannot check it)"
            )


# --- data movement ----------------------------------------------------------------------------------

def dma_copy(dst: Tensor, src: Tensor, dst_rmw_op=None, oob_mode=None, dge_mode=None, name=None) -> None:
    """Copy ``src`` to ``dst`` (HBM <-> SBUF, or on-chip). Shapes and dtypes must match: reinterpret
    bytes with ``.view(dtype)``; DMA does not convert. ``oob_mode`` (error, the default, or skip) applies to
    access-pattern DMAs with a dynamic address (dynamic.py); read-modify-write and DGE modes are not modelled
    (refused when set)."""
    _not_implemented("dma_copy", dst_rmw_op=dst_rmw_op, dge_mode=dge_mode)
    skip = _oob_skip(oob_mode, dst, src)
    if isinstance(src, AccessPattern) or isinstance(dst, AccessPattern):
        return _dma_pattern(dst, src, skip)
    for t, what in ((dst, "dma_copy dst"), (src, "dma_copy src")):
        if not isinstance(t, Tensor):
            raise NkiValidationError(f"{what} must be an NKI tensor")
        if t.buffer == "psum":
            raise NkiValidationError(f"{what} {t.name!r} is in PSUM: DMA moves HBM <-> SBUF; evacuate PSUM with an engine instruction")
    if dst.dtype is not src.dtype:
        raise NkiValidationError(
            f"dma_copy dtype mismatch: src {src.name!r} is {src.dtype}, dst {dst.name!r} is {dst.dtype}; "
            "DMA copies bytes: allocate the destination in the source dtype or reinterpret with .view(dtype)"
        )
    _same_shape(dst, src, "dma_copy")
    if not src.written.all():
        read(src, "dma_copy src")
    dst.data[...] = src.data
    dst.written[...] = True
    stats = current().stats
    stats.dma_count += 1
    nbytes = src.data.size * src.dtype.itemsize
    if src.buffer == "hbm":
        stats.hbm_read_bytes += nbytes
        stats.dma_runs[hbm_run_bytes(src)] += nbytes
    if dst.buffer == "hbm":
        stats.hbm_write_bytes += nbytes
        stats.dma_runs[hbm_run_bytes(dst)] += nbytes


def _oob_skip(mode, dst, src) -> bool:
    """dma_copy's ``oob_mode``: None / error (False) or skip (True), the latter only where an address is dynamic."""
    if mode is None or mode is dynamic_oob.error:
        return False
    if mode is not dynamic_oob.skip:
        raise NkiValidationError(f"dma_copy(oob_mode={mode!r}): use nisa.oob_mode.error or nisa.oob_mode.skip")
    if not any(isinstance(t, AccessPattern) and t.kind != "static" for t in (dst, src)):
        raise NkiValidationError("dma_copy(oob_mode=oob_mode.skip) on a DMA without a dynamic address (scalar_offset or "
                                 "vector_offset .ap): nothing can be out of bounds at run time; drop oob_mode")
    return True


def _dma_pattern(dst, src, skip: bool = False) -> None:
    """dma_copy with an explicit (possibly indirect) access pattern on its HBM side (dynamic.py); ``skip``
    (``oob_mode.skip``): the rows whose dynamic address is out of bounds move nothing."""
    for t, what in ((dst, "dma_copy dst"), (src, "dma_copy src")):
        if not isinstance(t, (Tensor, AccessPattern)):
            raise NkiValidationError(f"{what} must be an NKI tensor or access pattern")
        if isinstance(t, Tensor) and t.buffer != "sbuf":
            raise NkiValidationError(f"{what} {t.name!r} is in {t.buffer}: an access-pattern DMA moves between HBM (.ap) and SBUF")
    if isinstance(src, AccessPattern) == isinstance(dst, AccessPattern):
        raise NkiValidationError("dma_copy: exactly one side may be an HBM access pattern, the other an SBUF tile")
    if dst.dtype is not src.dtype:
        raise NkiValidationError(f"dma_copy dtype mismatch: src {src.name!r} is {src.dtype}, dst {dst.name!r} is {dst.dtype}")
    if tuple(dst.shape) != tuple(src.shape):
        raise NkiValidationError(f"dma_copy: shapes differ, {dst.name!r} {tuple(dst.shape)} vs {src.name!r} {tuple(src.shape)}")
    pattern = src if isinstance(src, AccessPattern) else dst
    rows = pattern.kept_rows() if skip else np.ones(pattern.shape[0], dtype=bool)
    nbytes = int(np.prod(src.shape[1:], dtype=np.int64)) * int(rows.sum()) * src.dtype.itemsize
    if isinstance(src, AccessPattern):
        values, written = gather(src, skip)
        if not written.all():
            raise NkiValidationError(f"dma_copy src reads never-written elements of {src.name!r} through its access pattern")
        dst.data[rows] = values.reshape((int(rows.sum()),) + tuple(dst.shape[1:]))
        dst.written[rows] = True
        count_indirect(src, nbytes, read_side=True)
    else:
        if not src.written[rows].all():
            raise NkiValidationError(f"dma_copy src {src.name!r} has never-written elements in the rows it scatters")
        scatter(dst, src.data[rows], skip)
        count_indirect(dst, nbytes, read_side=False)
    current().stats.dma_count += 1


# --- TensorE ----------------------------------------------------------------------------------------

def _matmul_tn(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a.T @ b in float32 (torch's single-threaded GEMM: small tiles, shared cores; see runtime.run)."""
    return (torch.from_numpy(np.ascontiguousarray(a)).T @ torch.from_numpy(np.ascontiguousarray(b))).numpy()


def _matmul_dtypes(stationary: Tensor, moving: Tensor) -> None:
    for t, what in ((stationary, "stationary"), (moving, "moving")):
        if t.dtype is dt.float8_e4m3fn:
            raise NkiValidationError(
                f"nc_matmul {what} {t.name!r} is float8_e4m3fn, which TensorE accepts only on Trn3; on Trn2 store the bytes "
                "as float8_e4m3 codes (repack) and .view(nl.float8_e4m3)"
            )
        if t.dtype not in dt.MATMUL_DTYPES_TRN2:
            raise NkiValidationError(f"nc_matmul {what} {t.name!r} has dtype {t.dtype}; Trn2 multiplies {', '.join(d.name for d in dt.MATMUL_DTYPES_TRN2)}")
    fp32 = (dt.float32, dt.tfloat32)
    if (stationary.dtype in fp32) != (moving.dtype in fp32) or (stationary.dtype in fp32 and stationary.dtype is not moving.dtype):
        raise NkiValidationError(
            f"nc_matmul operand dtypes {stationary.dtype} x {moving.dtype}: float32/tfloat32 pairs only with itself"
        )


def _psum_dst(dst: Tensor, what: str) -> None:
    _need(dst, f"{what} dst", ("psum",))
    if dst.dtype is not dt.float32:
        raise NkiValidationError(f"{what} dst {dst.name!r} is {dst.dtype}; matmul results in PSUM are float32 on NeuronCore-v3")
    row_bytes = _free(dst) * dst.dtype.itemsize
    offset = (dst.data.ctypes.data - dst.alloc.base_ptr) % dst.alloc.row_bytes
    if row_bytes > PSUM_BANK_BYTES or offset // PSUM_BANK_BYTES != (offset + row_bytes - 1) // PSUM_BANK_BYTES:
        raise NkiValidationError(f"{what} dst {dst.name!r} ({row_bytes} B/partition at offset {offset}) must lie within one 2 KiB PSUM bank")


def nc_matmul(dst: Tensor, stationary: Tensor, moving: Tensor, is_stationary_onezero=False, is_moving_onezero=False,
              is_transpose=False, accumulate=None, tile_position=(), tile_size=(), perf_mode=None, name=None) -> None:
    """dst[M, N] (+)= stationary[K, M].T @ moving[K, N] on TensorE; K <= 128, M <= 128, N <= 512.

    The one-zero hints, transposition, tile positioning and performance modes are not modelled (refused when set)."""
    _not_implemented("nc_matmul", is_stationary_onezero=is_stationary_onezero, is_moving_onezero=is_moving_onezero,
                     is_transpose=is_transpose, tile_position=tile_position, tile_size=tile_size, perf_mode=perf_mode)
    _need(stationary, "nc_matmul stationary", ("sbuf",))
    _need(moving, "nc_matmul moving", ("sbuf",))
    if stationary.ndim != 2 or moving.ndim != 2 or dst.ndim != 2:
        raise NkiValidationError(f"nc_matmul takes 2-D tiles; got stationary {stationary.shape}, moving {moving.shape}, dst {dst.shape}")
    k, m = stationary.shape
    k2, n = moving.shape
    if k != k2:
        raise NkiValidationError(f"nc_matmul contraction (partition) sizes differ: stationary {stationary.shape} vs moving {moving.shape}")
    if m > STATIONARY_FMAX:
        raise NkiValidationError(f"nc_matmul stationary free size {m} > {STATIONARY_FMAX} (stationary {stationary.name!r} {stationary.shape})")
    if n > MOVING_FMAX:
        raise NkiValidationError(f"nc_matmul moving free size {n} > {MOVING_FMAX} (moving {moving.name!r} {moving.shape})")
    _matmul_dtypes(stationary, moving)
    _psum_dst(dst, "nc_matmul")
    if dst.shape != (m, n):
        raise NkiValidationError(f"nc_matmul dst {dst.name!r} shape {dst.shape} != stationary.T @ moving shape {(m, n)}")
    result = _matmul_tn(read(stationary, "nc_matmul stationary"), read(moving, "nc_matmul moving"))
    if accumulate:
        if not dst.mm_init.all():
            raise NkiValidationError(
                f"nc_matmul accumulate=True into {dst.name!r} where no initialising matmul (accumulate=False) has written; "
                "start each PSUM accumulation group with accumulate=False"
            )
        result = dst.data.astype(np.float32) + result
    write(dst, result, by_matmul=True)
    current().stats.matmuls[(k, m, n, stationary.dtype.name, moving.dtype.name)] += 1


def nc_transpose(dst: Tensor, data: Tensor, engine=engine.unknown, name=None) -> None:  # noqa: A002
    """dst[F, P] = data[P, F].T on TensorE (a matmul against the identity, SBUF -> PSUM, bit-accurate on
    NeuronCore-v3); dst has data's dtype. The VectorE variant (32x32 blocks) is not modelled."""
    if engine not in (globals()["engine"].unknown, globals()["engine"].tensor):
        raise NkiValidationError(f"nc_transpose on engine {engine!r} is not modelled; use the Tensor Engine")
    _need(data, "nc_transpose data", ("sbuf",))
    if data.ndim != 2 or data.shape[1] > STATIONARY_FMAX:
        raise NkiValidationError(f"nc_transpose data {data.name!r} must be 2-D with free size <= 128, got {data.shape}")
    if data.dtype is dt.float8_e4m3fn:
        raise NkiValidationError("nc_transpose of float8_e4m3fn is not supported on Trn2")
    _need(dst, "nc_transpose dst", ("psum",))
    if dst.dtype is not data.dtype:
        raise NkiValidationError(f"nc_transpose dst {dst.name!r} is {dst.dtype}; it must have the input's data type {data.dtype}")
    row_bytes = _free(dst) * dst.dtype.itemsize
    offset = (dst.data.ctypes.data - dst.alloc.base_ptr) % dst.alloc.row_bytes
    if offset // PSUM_BANK_BYTES != (offset + row_bytes - 1) // PSUM_BANK_BYTES:
        raise NkiValidationError(f"nc_transpose dst {dst.name!r} must lie within one 2 KiB PSUM bank")
    if dst.shape != data.shape[::-1]:
        raise NkiValidationError(f"nc_transpose dst {dst.name!r} shape {dst.shape} != {data.shape[::-1]}")
    write(dst, read(data, "nc_transpose data").T, by_matmul=False)
    current().stats.transposes[(int(data.shape[0]), int(data.shape[1]), data.dtype.name)] += 1


# --- ScalarE / VectorE / GpSimdE -------------------------------------------------------------------------

def activation(dst: Tensor, op, data: Tensor, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=None, name=None) -> None:
    """dst = op(data * scale + bias) on ScalarE; scale: compile-time scalar or [P, 1] tile; bias: [P, 1] tile."""
    _not_implemented("activation", reduce_op=reduce_op, reduce_res=reduce_res, reduce_cmd=reduce_cmd)
    _op(op, nl.ACTIVATIONS, "activation op")
    _need(data, "activation data")
    _need(dst, "activation dst")
    _same_shape(dst, data, "activation")
    x = read(data, "activation data") * _scalar(scale, data, "activation scale")
    if bias is not None:
        if not isinstance(bias, Tensor):
            raise NkiValidationError("activation bias must be a [P, 1] tile")
        x = x + _scalar(bias, data, "activation bias")
    write(dst, op(x))
    _count("scalar", "activation", data)


def _engine(eng, default="vector", allowed=("vector", "scalar", "gpsimd"), tensors=()) -> str:
    """The engine an instruction runs on. GpSimdE cannot access PSUM (NKI API reference, ``nisa.tensor_copy`` /
    ``nisa.tensor_tensor``, aws-neuron/aws-neuron-sdk ``nki/api/nki/isa/__init__.py`` @a3247f5b): refused."""
    eng = default if eng in (None, engine.unknown) else eng
    if eng not in allowed:
        raise NkiValidationError(f"engine {eng!r} cannot run this instruction (allowed: {', '.join(allowed)})")
    if eng == "gpsimd":
        for t in tensors:
            if isinstance(t, Tensor) and t.buffer == "psum":
                raise NkiValidationError(
                    f"GpSimdE cannot access PSUM ({t.name!r} is a PSUM tile): run this instruction on the vector or "
                    "scalar engine, or evacuate PSUM to SBUF first"
                )
    return eng


def tensor_scalar(dst: Tensor, data: Tensor, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=engine.unknown, name=None) -> None:  # noqa: A002
    """dst = (data op0 operand0) op1 operand1; operands are scalars or [P, 1] tiles.

    GpSimdE runs tensor_scalar only for rsqrt (NKI API reference), which the interpreter does not model: any
    tensor_scalar on gpsimd is refused. op1 and operand1 are given together or not at all."""
    eng = _engine(engine)
    if eng == "gpsimd":
        raise NkiValidationError(
            f"tensor_scalar(engine=gpsimd) with op0={op0!r}: NKI allows GpSimdE for tensor_scalar only for rsqrt; "
            "run this operator on the vector or scalar engine"
        )
    _op(op0, nl.MATH_OPS, "tensor_scalar op0")
    if (op1 is None) != (operand1 is None):
        raise NkiValidationError("tensor_scalar: op1 and operand1 must be given together (both None when unused)")
    if op1 is not None:
        _op(op1, nl.MATH_OPS, "tensor_scalar op1")
    _need(data, "tensor_scalar data")
    _need(dst, "tensor_scalar dst")
    _same_shape(dst, data, "tensor_scalar")
    x = read(data, "tensor_scalar data")
    a = _scalar(operand0, data, "tensor_scalar operand0")
    x = op0(a, x) if reverse0 else op0(x, a)
    if op1 is not None:
        b = _scalar(operand1, data, "tensor_scalar operand1")
        x = op1(b, x) if reverse1 else op1(x, b)
    write(dst, x)
    _count(eng, "tensor_scalar", data)


def tensor_tensor(dst: Tensor, data1: Tensor, data2: Tensor, op, engine=engine.unknown, name=None) -> None:  # noqa: A002
    """dst = data1 op data2, elementwise (VectorE or GpSimdE); the inputs may not both be in PSUM."""
    eng = _engine(engine, allowed=("vector", "gpsimd"), tensors=(dst, data1, data2))
    _need(data1, "tensor_tensor data1")
    _need(data2, "tensor_tensor data2")
    _need(dst, "tensor_tensor dst")
    _same_shape(data1, data2, "tensor_tensor")
    _same_shape(dst, data1, "tensor_tensor")
    if data1.buffer == "psum" and data2.buffer == "psum":
        raise NkiValidationError("tensor_tensor: data1 and data2 cannot both be in PSUM")
    write(dst, _op(op, nl.MATH_OPS, "op")(read(data1, "tensor_tensor data1"), read(data2, "tensor_tensor data2")))
    _count(eng, "tensor_tensor", data1)


def scalar_tensor_tensor(dst: Tensor, data: Tensor, op0, operand0, op1, operand1: Tensor, reverse0=False, reverse1=False,
                         name=None) -> None:
    """dst = (data op0 operand0) op1 operand1 on VectorE; operand0 scalar or [P, 1]; operand1 like data."""
    _op(op0, nl.MATH_OPS, "scalar_tensor_tensor op0")
    _op(op1, nl.MATH_OPS, "scalar_tensor_tensor op1")
    _need(data, "scalar_tensor_tensor data")
    _need(operand1, "scalar_tensor_tensor operand1")
    _need(dst, "scalar_tensor_tensor dst")
    _same_shape(data, operand1, "scalar_tensor_tensor")
    _same_shape(dst, data, "scalar_tensor_tensor")
    if data.buffer == "psum" and operand1.buffer == "psum":
        raise NkiValidationError("scalar_tensor_tensor: data and operand1 cannot both be in PSUM")
    x = read(data, "scalar_tensor_tensor data")
    a = _scalar(operand0, data, "scalar_tensor_tensor operand0")
    x = op0(a, x) if reverse0 else op0(x, a)
    y = read(operand1, "scalar_tensor_tensor operand1")
    write(dst, op1(y, x) if reverse1 else op1(x, y))
    _count("vector", "scalar_tensor_tensor", data)


def tensor_copy(dst: Tensor, src: Tensor, engine=engine.unknown, name=None) -> None:  # noqa: A002
    """dst = src with a dtype cast (PSUM -> SBUF evacuation, or SBUF -> SBUF)."""
    eng = _engine(engine, tensors=(dst, src))
    _need(src, "tensor_copy src")
    _need(dst, "tensor_copy dst")
    _same_shape(dst, src, "tensor_copy")
    write(dst, read(src, "tensor_copy src"))
    _count(eng, "tensor_copy", src)


def memset(dst: Tensor, value, engine=engine.unknown, name=None) -> None:  # noqa: A002
    eng = _engine(engine, allowed=("vector", "gpsimd"), tensors=(dst,))
    _need(dst, "memset dst")
    write(dst, np.full(dst.shape, float(value), dtype=np.float32))
    _count(eng, "memset", dst)
