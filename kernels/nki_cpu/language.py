"""``nki.language`` as the interpreter implements it (aws-neuron-sdk @81ce03ae ``nki/api/nki/language/__init__.py``):
dtypes, memory regions, ``ndarray`` and its fill helpers, SPMD queries, loop ranges, ``ds``, tile-size constants,
``NKIObject``, and the operators / activation functions (:mod:`.operators`), which are also callable on tiles
(:mod:`.language_ops`). The face only: every rule lives in the module that implements the instruction."""

from __future__ import annotations

from . import machine
from . import operators as _ops
from .dtypes import (  # noqa: F401  (nl.<dtype>)
    bfloat16, bool_, float4_e2m1fn_x4, float8_e4m3, float8_e4m3fn, float8_e4m3fn_x4, float8_e5m2, float8_e5m2_x4,
    float8_e8m0fnu, float16, float32, int8, int16, int32, tfloat32, uint8, uint16, uint32,
)
from .dynamic import dynamic_range  # noqa: F401  (nl.dynamic_range)
from .language_ops import broadcast_to, load, shared_identity_matrix, store, sum  # noqa: F401,A004
from .rules import GUIDE, LANG, rule
from .tensor import Tensor, ds  # noqa: F401  (nl.ds)

bool = bool_  # noqa: A001  (nki-library writes nl.bool)
tensor = Tensor  # the type kernels annotate with (nl.tensor, nki.typing.tensor)

# Memory regions (``MemoryRegion``): hbm is an alias of private_hbm.
sbuf = "sbuf"
psum = "psum"
private_hbm = "private_hbm"
hbm = private_hbm
shared_hbm = "shared_hbm"

GRID = rule("LANG-GRID", LANG, "Number of dimensions in the SPMD launch grid", "program_id / num_programs / program_ndim "
            "describe the 1-D launch grid [n]; other axes are refused")

for _name, _op in _ops.OPS.items():
    globals()[_name] = _op
MATH_OPS = tuple(o for o in _ops.OPS.values() if o.kind == "arith")
ACTIVATIONS = tuple(o for o in _ops.OPS.values() if o.activation)


CLASSES = rule("LANG-CLASS", GUIDE, "def __init__(self, x = None, y = False)",
               "an NKIObject class's fields without a default default to None (the compiler's generated initializer), "
               "with or without @dataclass")


class NKIObject:
    """Base class for NKI kernel dataclasses and configuration objects (keyword fields). A field a subclass declares
    without a default gets ``None`` (:data:`CLASSES`), which ``@dataclass`` then takes as its default."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for field_name in cls.__dict__.get("__annotations__", {}):
            if field_name not in cls.__dict__:
                setattr(cls, field_name, None)

    def __init__(self, **kwargs) -> None:
        for k, v in kwargs.items():
            setattr(self, k, v)


class tile_size:  # noqa: N801  (nl.tile_size; documented values for NeuronCore-v3)
    pmax = machine.PMAX
    psum_fmax = machine.PSUM_BANK_BYTES // 4  # deprecated name of psum_bank_fmax
    psum_bank_fmax = machine.PSUM_BANK_BYTES // 4
    psum_bank_fmax_bytes = machine.PSUM_BANK_BYTES
    psum_num_banks = machine.PSUM_BANKS
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512
    bn_stats_fmax = 512  # "must not exceed 512 (nl.tile_size.bn_stats_fmax)" (nki/api/nki/isa/__init__.py, bn_stats)
    sbuf_fmax_bytes = machine.SBUF_BYTES_PER_PARTITION  # assumed: the whole 224 KiB partition is usable
    sbuf_fmax = machine.SBUF_BYTES_PER_PARTITION // 4
    sbuf_size_bytes = machine.SBUF_BYTES_PER_PARTITION * machine.PMAX
    total_available_sbuf_size = machine.SBUF_BYTES_PER_PARTITION  # deprecated: per partition, in bytes


_counter = [0]


def ndarray(shape, dtype, buffer=sbuf, name: str = "", address=None) -> Tensor:
    """Allocate a tensor: an on-chip tile (partition dim first, placed by the compiler or at ``address``) or HBM."""
    _counter[0] += 1
    name = name or f"tile{_counter[0]}"
    shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    if buffer not in machine.BUFFERS:
        raise machine.NkiValidationError(f"unknown buffer {buffer!r} for {name!r}: nl.sbuf, nl.psum, nl.hbm / nl.private_hbm, "
                                         "nl.shared_hbm")
    if any(s <= 0 for s in shape) or not shape:
        raise machine.NkiValidationError(f"tensor {name!r} has an empty or non-positive shape: {shape}")
    if buffer in machine.ONCHIP and shape[0] > machine.PMAX:
        raise machine.NkiValidationError(f"partition dim of {name!r} is {shape[0]} > {machine.PMAX}: the first dim of an "
                                         "on-chip tile is the partition dim")
    return Tensor(machine.storage_for(buffer, shape, dtype, name, address), dtype, shape, name=name)


def _filled(shape, dtype, buffer, name, value) -> Tensor:
    from .vector_engine import memset

    t = ndarray(shape, dtype, buffer=buffer, name=name)
    if buffer in machine.ONCHIP:
        memset(t, value)
    else:
        from .tensor import write

        write(t, value)
    return t


def zeros(shape, dtype, buffer=sbuf, name="") -> Tensor:
    return _filled(shape, dtype, buffer, name, 0)


def ones(shape, dtype, buffer=sbuf, name="") -> Tensor:
    return _filled(shape, dtype, buffer, name, 1)


def full(shape, fill_value, dtype, buffer=sbuf, name="") -> Tensor:
    return _filled(shape, dtype, buffer, name, fill_value)


def zeros_like(x, dtype=None, buffer=None, name="") -> Tensor:
    return zeros(x.shape, dtype or x.dtype, buffer or sbuf, name)


def empty_like(x, dtype=None, buffer=None, name="") -> Tensor:
    return ndarray(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def program_id(axis: int = 0) -> int:
    """Index of this program (logical core) in the launch grid; ``kernel[n]`` runs programs 0..n-1."""
    GRID.check(axis == 0, f"program_id(axis={axis}): the interpreter launches 1-D grids only")
    return machine.current().program_id


def num_programs(axes: int = 0) -> int:
    """Number of programs in the launch grid (the LNC a kernel is launched with)."""
    GRID.check(axes in (0, None, (0,)), f"num_programs(axes={axes}): the interpreter launches 1-D grids only")
    return machine.current().num_programs


def program_ndim() -> int:
    """Number of dimensions of the launch grid: 1 for ``kernel[n]``, 0 for a call without a grid."""
    return machine.current().launch.grid_ndim


def is_hbm(buffer) -> bool:
    return buffer in machine.HBM


def is_on_chip(buffer) -> bool:
    return buffer in machine.ONCHIP


def is_psum(buffer) -> bool:
    return buffer == psum


def is_sbuf(buffer) -> bool:
    return buffer == sbuf


def affine_range(start, stop=None, step=1):
    """Iterations without loop-carried dependencies (the interpreter runs them in order)."""
    return range(start, stop, step) if stop is not None else range(start)


def sequential_range(start, stop=None, step=1):
    """Iterations with loop-carried dependencies."""
    return range(start, stop, step) if stop is not None else range(start)


def static_range(start, stop=None, step=1):
    return range(start, stop, step) if stop is not None else range(start)
