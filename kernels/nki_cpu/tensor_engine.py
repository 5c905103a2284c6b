"""TensorE: ``nc_matmul`` and ``nc_transpose`` (aws-neuron-sdk @81ce03ae ``nki/api/nki/isa/__init__.py``; NeuronCore-v3
facts from ``nki/guides/architecture/trainium2_arch.rst``), rules ``TE-*``.

``dst = stationary.T @ moving`` in float32 (torch's single-threaded fp32 GEMM; bf16 / fp16 / fp8 products are exact in
fp32, tfloat32 / float32 operands are multiplied as float32 here: the hardware's passes for them are not modelled).
"""

from __future__ import annotations

import numpy as np
import torch

from . import dtypes as dt
from .dynamic import AccessPattern
from .enums import engine_name
from .machine import PSUM_BANK_BYTES, current
from .rules import ISA, TRN2, NkiValidationError, rule
from .tensor import Tensor, free_size, read, read_raw, write, write_raw

STATIONARY_FMAX = 128
MOVING_FMAX = 512

ACCUMULATE = rule("TE-ACCUMULATE", ISA, "``accumulate=None`` (default): The compiler automatically infers the correct flag — "
                  "first write overwrites, subsequent writes accumulate",
                  "accumulate=None overwrites a PSUM location no matmul has written since the tile was allocated and "
                  "accumulates onto one a matmul has; False overwrites; True accumulates")
ACC_INIT = rule("TE-ACCUMULATE-INIT", ISA, "Only valid after the PSUM location has been initialized by a matmul with "
                "``accumulate=False``", "accumulating (True, or None inferred) onto PSUM bytes not last written by a matmul "
                "is refused (a memset / copy-initialised location is undefined behaviour on NeuronCore-v3)")
MEMORY = rule("TE-MEMORY", ISA, "the ``stationary`` and ``moving`` must be SBUF tiles, and ``dst`` tile must be a PSUM tile",
              "nc_matmul operands in SBUF, result in PSUM")
DTYPES = rule("TE-DTYPES", ISA, "if one of the input tiles is ``tfloat32/float32``, the other tile must also be ``tfloat32/float32``",
              "operands float8_e4m3 / float8_e5m2 / bfloat16 / float16 / tfloat32 / float32 (float8_e4m3fn is NeuronCore-v4); "
              "float32 and tfloat32 pair with each other, not with 8/16-bit types")
DST = rule("TE-DST", ISA, "The ``dst`` tile must be a float32 tile in NeuronCore-v2 and NeuronCore-v3",
           "nc_matmul writes a float32 PSUM tile, inside one 2 KiB bank per partition")
SIZES = rule("TE-SIZES", ISA, "On NeuronCore-v2 and -v3, the free dimension size of ``moving`` tile must not exceed 512",
             "contraction (partitions) <= 128 (or the tiling row size), stationary free <= 128 (or the column size), moving "
             "free <= 512; dst is [stationary free, moving free]")
TILING = rule("TE-TILING", ISA, "``tile_position`` and ``tile_size`` must both be set to enable tiling mode",
              "tile_size (row, column) each 32, 64 or 128, tile_position multiples of them inside the 128x128 array; "
              "values unchanged (tiling only shares the array)")
DOUBLE_ROW = rule("TE-DOUBLE-ROW", ISA, "when performance mode is ``double_row``, ``stationary`` and ``moving`` tiles must be "
                  "one of ``float8_e4m3`` or ``float8_e5m2``", "double_row: both operands FP8 with layout [K, 2, F]; "
                  "contracts over K x 2; not with column tiling")
ONEZERO = rule("TE-ONEZERO", ISA, "hints to the compiler whether the ``stationary`` operand is a tile with ones/zeros only",
               "is_stationary_onezero / is_moving_onezero: the operand must hold only ones and zeros")
TRANSPOSE = rule("TE-TRANSPOSE", ISA, "Tensor Engine ``nc_transpose`` can handle an input tile of shape [128, 128] or smaller, "
                 "while Vector Engine can handle shape [32, 32] or smaller",
                 "nc_transpose: TensorE SBUF -> PSUM up to [128, 128]; VectorE SBUF/PSUM up to [32, 32]; dst dtype = data "
                 "dtype, shape = [free, partitions] (free dims flattened)")
FP8_TRANSPOSE = rule("TE-TRANSPOSE-FP8", TRN2, "NeuronCore-v3 TensorE transpose mode for FP8 input data produces 16-bit output "
                     "elements in PSUM, with the upper 8 bits filled with zeros",
                     "a TensorE transpose of FP8 data is refused: its 16-bit PSUM elements do not fit the FP8 dst tile "
                     "that nc_transpose requires (transpose on VectorE, or DMA-transpose a 2-byte view)")


def _tile(t, what: str, buffers) -> Tensor:
    if isinstance(t, AccessPattern):
        t = t.static(what)
    if not isinstance(t, Tensor):
        raise NkiValidationError(f"{what} must be an NKI tensor, got {type(t).__name__}")
    MEMORY.check(t.buffer in buffers, f"{what} {t.name!r} is in {t.buffer}; it must be in {' or '.join(buffers)}")
    return t


def _bank_check(dst: Tensor, what: str) -> None:
    row_bytes = free_size(dst) * dst.dtype.itemsize
    offset = dst.storage.free_base + dst.boffset % dst.storage.row_bytes
    DST.check(row_bytes <= PSUM_BANK_BYTES and offset // PSUM_BANK_BYTES == (offset + row_bytes - 1) // PSUM_BANK_BYTES,
              f"{what} dst {dst.name!r} ({row_bytes} B/partition at offset {offset}) must lie within one 2 KiB PSUM bank")


def _matmul_tn(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a.T @ b in float32 (torch's GEMM; the runtime runs it single-threaded: small tiles, shared cores)."""
    return (torch.from_numpy(np.ascontiguousarray(a)).T @ torch.from_numpy(np.ascontiguousarray(b))).numpy()


def _dtypes(stationary: Tensor, moving: Tensor, double_row: bool) -> None:
    for t, what in ((stationary, "stationary"), (moving, "moving")):
        DTYPES.check(t.dtype is not dt.float8_e4m3fn, f"nc_matmul {what} {t.name!r} is float8_e4m3fn, which TensorE accepts "
                                                      "only on Trn3; on Trn2 store the bytes as float8_e4m3 codes (repack) and "
                                                      ".view(nl.float8_e4m3)")
        DTYPES.check(t.dtype in dt.MATMUL_DTYPES_TRN2, f"nc_matmul {what} {t.name!r} has dtype {t.dtype}; Trn2 multiplies "
                                                       f"{', '.join(d.name for d in dt.MATMUL_DTYPES_TRN2)}")
        if double_row:
            DOUBLE_ROW.check(t.dtype in (dt.float8_e4m3, dt.float8_e5m2), f"double_row {what} {t.name!r} is {t.dtype}")
    fp32 = (dt.float32, dt.tfloat32)
    DTYPES.check((stationary.dtype in fp32) == (moving.dtype in fp32),
                 f"nc_matmul operand dtypes {stationary.dtype} x {moving.dtype}: float32/tfloat32 pair only with float32/tfloat32")


def _tiling(tile_position, tile_size, k: int, m: int, double_row: bool) -> None:
    if not tile_position and not tile_size:
        SIZES.check(k <= 128, f"nc_matmul contraction (partition) size {k} > 128")
        SIZES.check(m <= STATIONARY_FMAX, f"nc_matmul stationary free size {m} > {STATIONARY_FMAX}")
        return
    TILING.check(bool(tile_position) and bool(tile_size) and len(tile_position) == 2 and len(tile_size) == 2,
                 f"nc_matmul tile_position={tile_position!r}, tile_size={tile_size!r}: both (row, column) pairs or neither")
    (r0, c0), (rs, cs) = (int(v) for v in tile_position), (int(v) for v in tile_size)
    TILING.check(rs in (32, 64, 128) and cs in (32, 64, 128), f"nc_matmul tile_size {tile_size}: 32, 64 or 128 rows / columns")
    TILING.check(r0 % rs == 0 and c0 % cs == 0 and r0 + rs <= 128 and c0 + cs <= 128,
                 f"nc_matmul tile_position {tile_position} with tile_size {tile_size}: multiples of the size inside 128x128")
    TILING.check(not (double_row and cs != 128), "double_row cannot be combined with column tiling")
    SIZES.check(k <= rs and m <= cs, f"nc_matmul contraction {k} / stationary free {m} exceed the tile {tile_size}")


def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              accumulate=None, tile_position=(), tile_size=(), perf_mode=None, name=None) -> None:
    """dst[M, N] (+)= stationary[K, M].T @ moving[K, N] on TensorE (free dims flattened)."""
    stationary = _tile(stationary, "nc_matmul stationary", ("sbuf",))
    moving = _tile(moving, "nc_matmul moving", ("sbuf",))
    dst = _tile(dst, "nc_matmul dst", ("psum",))
    mode = getattr(perf_mode, "value", perf_mode)  # matmul_perf_mode member or its string
    DOUBLE_ROW.check(mode in (None, "none", "double_row"), f"nc_matmul perf_mode={perf_mode!r}: none or double_row on Trn2")
    double_row = mode == "double_row"
    _dtypes(stationary, moving, double_row)
    if is_transpose:
        return _transpose_mode(dst, stationary, moving)
    a, b = read(stationary, "nc_matmul stationary"), read(moving, "nc_matmul moving")
    if double_row:
        DOUBLE_ROW.check(stationary.ndim == 3 and moving.ndim == 3 and stationary.shape[1] == 2 and moving.shape[1] == 2,
                         f"double_row layout [K, 2, F]: stationary {stationary.shape}, moving {moving.shape}")
        a, b = a.transpose(1, 0, 2).reshape(-1, a.shape[2]), b.transpose(1, 0, 2).reshape(-1, b.shape[2])
    k, m = stationary.shape[0], int(np.prod(a.shape[1:]))
    n = int(np.prod(b.shape[1:]))
    a, b = a.reshape(a.shape[0], m), b.reshape(b.shape[0], n)
    SIZES.check(stationary.shape[0] == moving.shape[0], f"nc_matmul contraction (partition) sizes differ: stationary "
                                                        f"{stationary.shape} vs moving {moving.shape}")
    _tiling(tile_position, tile_size, k, m, double_row)
    SIZES.check(n <= MOVING_FMAX, f"nc_matmul moving free size {n} > {MOVING_FMAX} (moving {moving.name!r} {moving.shape})")
    DST.check(dst.dtype is dt.float32, f"nc_matmul dst {dst.name!r} is {dst.dtype}; matmul results in PSUM are float32 on "
                                       "NeuronCore-v3")
    _bank_check(dst, "nc_matmul")
    SIZES.check(dst.shape[0] == m and free_size(dst) == n, f"nc_matmul dst {dst.name!r} shape {dst.shape} != stationary.T @ "
                                                           f"moving [{m}, {n}]")
    for flag, arr, what in ((is_stationary_onezero, a, "stationary"), (is_moving_onezero, b, "moving")):
        ONEZERO.check(not flag or np.isin(arr, (0.0, 1.0)).all(), f"is_{what}_onezero=True but the {what} operand holds "
                                                                  "values other than 0 and 1")
    result = _matmul_tn(a, b).reshape(dst.shape)
    if _accumulates(dst, accumulate):
        result = read(dst, "nc_matmul dst (accumulate)") + result
    write(dst, result, by_matmul=True)
    current().stats.matmuls[(k * (2 if double_row else 1), m, n, stationary.dtype.name, moving.dtype.name)] += 1


def _accumulates(dst: Tensor, accumulate) -> bool:
    """Whether this matmul accumulates (:data:`ACCUMULATE`, :data:`ACC_INIT`). PSUM bytes carry their state since the
    tile was allocated: 0 never written, 1 written by another instruction, 2 written by a matmul."""
    state = dst.mm_bytes()
    if accumulate is None:
        if not state.any():
            return False
        ACC_INIT.check((state == 2).all(), f"nc_matmul accumulate=None into {dst.name!r}: part of it was "
                       + ("written by something other than a matmul" if (state == 1).any() else "never written")
                       + " since it was allocated, so no flag fits the whole tile; start the group with accumulate=False")
        return True
    if accumulate:
        ACC_INIT.check((state == 2).all(), f"nc_matmul accumulate=True into {dst.name!r} where no initialising matmul "
                                           "(accumulate=False) has written; start each PSUM accumulation group with "
                                           "accumulate=False")
        return True
    return False


def _transpose_mode(dst: Tensor, stationary: Tensor, moving: Tensor) -> None:
    """is_transpose=True: bit-accurate transpose of the stationary operand through the identity moving operand."""
    ident = read(moving, "nc_matmul moving")
    k = stationary.shape[0]
    TRANSPOSE.check(ident.shape == (k, k) and np.array_equal(ident, np.eye(k, dtype=np.float32)),
                    "nc_matmul(is_transpose=True): the moving operand must be the identity (the interpreter models the "
                    "transpose, not a general product, in this mode)")
    _transpose_into(dst, stationary, "nc_matmul(is_transpose=True)")


def _transpose_into(dst: Tensor, data: Tensor, what: str) -> None:
    TRANSPOSE.check(dst.dtype is data.dtype, f"{what} dst {dst.name!r} is {dst.dtype}; it must have the input's data type {data.dtype}")
    p, f = data.shape[0], free_size(data)
    TRANSPOSE.check(dst.shape[0] == f and free_size(dst) == p, f"{what} dst {dst.name!r} shape {dst.shape} != [{f}, {p}]")
    raw = read_raw(data, f"{what} data").reshape(p, f)
    write_raw(dst, raw.T.reshape(dst.shape))  # bit-accurate on NeuronCore-v3 (TRN2 guide)


def nc_transpose(dst, data, engine=None, name=None) -> None:  # noqa: A002
    """dst[F, P] = data[P, F].T: TensorE (SBUF -> PSUM, up to 128 x 128) or VectorE (SBUF/PSUM, up to 32 x 32)."""
    eng = engine_name(engine)
    data = _tile(data, "nc_transpose data", ("sbuf", "psum"))
    dst = _tile(dst, "nc_transpose dst", ("sbuf", "psum"))
    p, f = data.shape[0], free_size(data)
    if eng == "unknown":
        eng = "tensor" if (p > 32 or f > 32 or data.buffer == "sbuf" and dst.buffer == "psum") else "vector"
    TRANSPOSE.check(eng in ("tensor", "vector"), f"nc_transpose engine {engine!r}: the Tensor or Vector Engine")
    if eng == "tensor":
        TRANSPOSE.check(data.buffer == "sbuf" and dst.buffer == "psum", "TensorE nc_transpose reads SBUF and writes PSUM")
        TRANSPOSE.check(p <= 128 and f <= 128, f"TensorE nc_transpose of {data.shape}: at most [128, 128]")
        FP8_TRANSPOSE.check(data.dtype not in dt.FP8, f"TensorE nc_transpose of {data.dtype} {data.name!r} into an FP8 PSUM tile")
        _bank_check(dst, "nc_transpose")
        _transpose_into(dst, data, "nc_transpose")
        current().stats.transposes[(int(p), int(f), data.dtype.name)] += 1
    else:
        TRANSPOSE.check(p <= 32 and f <= 32, f"VectorE nc_transpose of {data.shape}: at most [32, 32]")
        _transpose_into(dst, data, "nc_transpose")
        current().stats.engine_ops[("vector", "transpose", int(p), int(f))] += 1
