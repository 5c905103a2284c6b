"""The subset of ``nki.language`` the project's kernels use: dtypes, buffers, ``ndarray``, loop ranges,
tile-size constants, and the math / activation functions passed to ``nki.isa`` instructions."""

from __future__ import annotations

import numpy as np

from . import machine
from .dynamic import dynamic_range  # noqa: F401  (nl.dynamic_range)
from .dtypes import (  # noqa: F401  (re-exported as nl.<dtype>)
    bfloat16,
    float8_e4m3,
    float8_e4m3fn,
    float8_e5m2,
    float16,
    float32,
    int8,
    int32,
    tfloat32,
    uint8,
    uint32,
)

# Buffers
sbuf = "sbuf"
psum = "psum"
hbm = "hbm"
shared_hbm = "hbm"
private_hbm = "hbm"


class tile_size:  # noqa: N801  (mirrors nl.tile_size)
    pmax = machine.PMAX
    psum_fmax = machine.PSUM_BANK_BYTES // 4
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512


_counter = [0]


def ndarray(shape, dtype, buffer=sbuf, name: str = ""):
    """Allocate a tensor: an on-chip tile (partition dim first) or an HBM tensor (kernel output)."""
    _counter[0] += 1
    return machine.new_tile(shape, dtype, buffer, name or f"tile{_counter[0]}")


def program_id(axis: int = 0) -> int:
    """Index of this program (logical core) in the launch grid; ``kernel[n]`` runs programs 0..n-1."""
    if axis != 0:
        raise machine.NkiValidationError(f"program_id(axis={axis}): the interpreter launches 1-D grids only")
    return machine.current().program_id


def num_programs(axes: int = 0) -> int:
    """Number of programs in the launch grid (the LNC a kernel is launched with)."""
    if axes != 0:
        raise machine.NkiValidationError(f"num_programs(axes={axes}): the interpreter launches 1-D grids only")
    return machine.current().num_programs


def affine_range(*args):
    """Iterations without loop-carried dependencies (the interpreter runs them in order)."""
    return range(*args)


def sequential_range(*args):
    """Iterations with loop-carried dependencies."""
    return range(*args)


def static_range(*args):
    return range(*args)


class _Op:
    """A named elementwise function (math operator or activation)."""

    def __init__(self, name, fn):
        self.name = name
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)

    def __repr__(self) -> str:
        return f"nl.{self.name}"


def _silu(x):
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


# Math operators (tensor_scalar / tensor_tensor / scalar_tensor_tensor)
add = _Op("add", np.add)
subtract = _Op("subtract", np.subtract)
multiply = _Op("multiply", np.multiply)
maximum = _Op("maximum", np.maximum)
minimum = _Op("minimum", np.minimum)
divide = _Op("divide", np.divide)

# Activation functions (nisa.activation)
copy = _Op("copy", lambda x: x)
identity = _Op("identity", lambda x: x)
silu = _Op("silu", _silu)
exp = _Op("exp", np.exp)
relu = _Op("relu", lambda x: np.maximum(x, 0.0))

MATH_OPS = (add, subtract, multiply, maximum, minimum, divide)
ACTIVATIONS = (copy, identity, silu, exp, relu)
