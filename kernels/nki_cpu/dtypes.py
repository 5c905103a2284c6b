"""The NKI dtypes the interpreter knows, backed by numpy / ml_dtypes storage types.

Values are computed in float32 (as Trn2's engines do) and stored in the tile's dtype. FP8 bytes decode
through a 256-entry table built from ml_dtypes, the independent truth for both FP8 formats.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np


class Dtype:
    """An NKI dtype: a name, its numpy storage type and its size in bytes."""

    __slots__ = ("name", "np", "itemsize", "is_float")

    def __init__(self, name: str, np_type):
        self.name = name
        self.np = np.dtype(np_type)
        self.itemsize = self.np.itemsize
        self.is_float = name.startswith(("float", "bfloat", "tfloat"))

    def __repr__(self) -> str:
        return f"nl.{self.name}"


float32 = Dtype("float32", np.float32)
tfloat32 = Dtype("tfloat32", np.float32)  # storage as fp32; TensorE treats it as a reduced-mantissa input
bfloat16 = Dtype("bfloat16", ml_dtypes.bfloat16)
float16 = Dtype("float16", np.float16)
float8_e4m3 = Dtype("float8_e4m3", ml_dtypes.float8_e4m3)  # Trn2 FP8 (IEEE-like, max 240)
float8_e4m3fn = Dtype("float8_e4m3fn", ml_dtypes.float8_e4m3fn)  # OCP FP8: a matmul operand on Trn3 only
float8_e5m2 = Dtype("float8_e5m2", ml_dtypes.float8_e5m2)
uint8 = Dtype("uint8", np.uint8)
int8 = Dtype("int8", np.int8)
int32 = Dtype("int32", np.int32)
uint32 = Dtype("uint32", np.uint32)

ALL = (float32, tfloat32, bfloat16, float16, float8_e4m3, float8_e4m3fn, float8_e5m2, uint8, int8, int32, uint32)
_BY_NUMPY = {d.np: d for d in (float32, bfloat16, float16, float8_e4m3, float8_e4m3fn, float8_e5m2, uint8, int8, int32, uint32)}

# Operand dtypes TensorE multiplies on Trn2 (NeuronCore-v3). float8_e4m3fn is Trn3-only.
MATMUL_DTYPES_TRN2 = (float8_e4m3, float8_e5m2, bfloat16, float16, tfloat32, float32)
FP8 = (float8_e4m3, float8_e4m3fn, float8_e5m2)

_FP8_TABLES = {
    d.name: np.arange(256, dtype=np.uint8).view(d.np).astype(np.float32) for d in FP8
}


def from_numpy(dtype: np.dtype) -> Dtype:
    try:
        return _BY_NUMPY[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"no NKI dtype for numpy dtype {dtype}; pass float32/bfloat16/float16/fp8/uint8/int8/int32 arrays") from None


def to_float32(values: np.ndarray, dtype: Dtype) -> np.ndarray:
    """Stored values -> float32 (exact for every dtype here except int32 beyond 2**24)."""
    if dtype in FP8:
        return _FP8_TABLES[dtype.name][values.view(np.uint8)]
    return values.astype(np.float32)


def from_float32(values: np.ndarray, dtype: Dtype) -> np.ndarray:
    """float32 results -> storage of ``dtype`` (round to nearest even, as the engines' output casts)."""
    return np.asarray(values, dtype=np.float32).astype(dtype.np)
