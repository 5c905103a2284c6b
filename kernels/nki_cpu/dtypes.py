"""The NKI dtypes (aws-neuron/aws-neuron-sdk @81ce03ae ``nki/api/nki.api.shared.rst``, "Supported Data Types"),
backed by numpy / ml_dtypes storage types.

Values are computed in float32 (the engines' internal precision, ``nki/api/nki/isa/__init__.py``: "casts input data
types to float32 and performs the ... operation in float32 math") and stored in the tile's dtype with round to nearest
even. FP8 bytes decode through 256-entry tables built from ml_dtypes, the independent truth for both FP8 formats.
The 4x packed MX types are storage only here (their instructions, ``nc_matmul_mx`` / ``quantize_mx``, are
NeuronCore-v4 ones: any arithmetic on them is refused).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np


class Dtype:
    """An NKI dtype: a name, its numpy storage type and its size in bytes. Compares equal to itself only (and to
    the numpy dtype it stands for, when that is unambiguous), hashes by name."""

    __slots__ = ("name", "np", "itemsize", "is_float", "is_int", "packed")

    def __init__(self, name: str, np_type, packed: bool = False):
        self.name = name
        self.np = np.dtype(np_type)
        self.itemsize = self.np.itemsize
        self.packed = packed
        self.is_float = name.startswith(("float", "bfloat", "tfloat")) and not packed
        self.is_int = name.startswith(("int", "uint", "bool"))

    def __repr__(self) -> str:
        return f"nl.{self.name}"

    def __str__(self) -> str:  # the plain name, as NKI's dtypes print (nki-library compares str(dtype) to names)
        return self.name

    def __eq__(self, other) -> bool:
        if isinstance(other, Dtype):
            return other is self
        if isinstance(other, (type, np.dtype, str)) and self.name not in ("tfloat32", "bool_") and not self.packed:
            try:
                return np.dtype(other) == self.np
            except TypeError:
                return False
        return NotImplemented

    def __hash__(self) -> int:
        return hash(("nki-dtype", self.name))


float32 = Dtype("float32", np.float32)
tfloat32 = Dtype("tfloat32", np.float32)  # storage as fp32; TensorE treats it as a reduced-mantissa input
bfloat16 = Dtype("bfloat16", ml_dtypes.bfloat16)
float16 = Dtype("float16", np.float16)
float8_e4m3 = Dtype("float8_e4m3", ml_dtypes.float8_e4m3)  # Trn2 FP8 (IEEE-like, max 240)
float8_e4m3fn = Dtype("float8_e4m3fn", ml_dtypes.float8_e4m3fn)  # OCP FP8: a matmul operand on Trn3 only
float8_e5m2 = Dtype("float8_e5m2", ml_dtypes.float8_e5m2)
float8_e8m0fnu = Dtype("float8_e8m0fnu", ml_dtypes.float8_e8m0fnu)
uint8 = Dtype("uint8", np.uint8)
int8 = Dtype("int8", np.int8)
uint16 = Dtype("uint16", np.uint16)
int16 = Dtype("int16", np.int16)
int32 = Dtype("int32", np.int32)
uint32 = Dtype("uint32", np.uint32)
bool_ = Dtype("bool_", np.uint8)  # "boolean stored as uint8"
float8_e5m2_x4 = Dtype("float8_e5m2_x4", np.uint32, packed=True)
float8_e4m3fn_x4 = Dtype("float8_e4m3fn_x4", np.uint32, packed=True)
float4_e2m1fn_x4 = Dtype("float4_e2m1fn_x4", np.uint16, packed=True)

ALL = (float32, tfloat32, bfloat16, float16, float8_e4m3, float8_e4m3fn, float8_e5m2, float8_e8m0fnu, uint8, int8,
       uint16, int16, int32, uint32, bool_, float8_e5m2_x4, float8_e4m3fn_x4, float4_e2m1fn_x4)
_BY_NUMPY = {d.np: d for d in (float32, bfloat16, float16, float8_e4m3, float8_e4m3fn, float8_e5m2, float8_e8m0fnu,
                               uint8, int8, uint16, int16, int32, uint32)}
_BY_NUMPY[np.dtype(np.bool_)] = bool_

# Operand dtypes TensorE multiplies on Trn2 (NeuronCore-v3). float8_e4m3fn is Trn3-only.
MATMUL_DTYPES_TRN2 = (float8_e4m3, float8_e5m2, bfloat16, float16, tfloat32, float32)
FP8 = (float8_e4m3, float8_e4m3fn, float8_e5m2, float8_e8m0fnu)
INT32 = (int32, uint32)

_FP8_TABLES = {d.name: np.arange(256, dtype=np.uint8).view(d.np).astype(np.float32) for d in FP8}


def from_numpy(dtype: np.dtype) -> Dtype:
    try:
        return _BY_NUMPY[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"no NKI dtype for numpy dtype {dtype}; pass float32/bfloat16/float16/fp8/(u)int8/16/32 arrays") from None


def to_float32(values: np.ndarray, dtype: Dtype) -> np.ndarray:
    """Stored values -> float32 (exact for every dtype here except 32-bit integers beyond 2**24)."""
    if dtype.packed:
        raise TypeError(f"{dtype} is a 4x packed MX type: only NeuronCore-v4's MX instructions compute on it")
    if dtype in FP8:
        return _FP8_TABLES[dtype.name][values.view(np.uint8)]
    return values.astype(np.float32)


def from_float32(values: np.ndarray, dtype: Dtype) -> np.ndarray:
    """float32 results -> storage of ``dtype`` (round to nearest even, as the engines' output casts). Integer
    destinations: truncated toward zero and saturated to the type's range, NaN as 0 (not documented by AWS: a C-like
    conversion is assumed; a device check)."""
    if dtype.packed:
        raise TypeError(f"{dtype} is a 4x packed MX type: only NeuronCore-v4's MX instructions write it")
    values = np.asarray(values, dtype=np.float32)
    if dtype.is_int:
        info = np.iinfo(dtype.np)
        with np.errstate(invalid="ignore"):
            return np.clip(np.trunc(np.nan_to_num(values)), info.min, info.max).astype(dtype.np)
    return values.astype(dtype.np)
