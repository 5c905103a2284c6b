"""What the compute-engine instructions share: engine choice, operand checks, per-partition scalars, counters.

GpSimdE cannot access PSUM (aws-neuron-sdk @81ce03ae ``nki/api/nki/isa/__init__.py``, ``tensor_copy``: "since GpSimd
Engine cannot access PSUM in NeuronCore, Scalar or Vector Engine must be chosen when the input or output tile is in
PSUM"): :data:`GPSIMD_PSUM`.
"""

from __future__ import annotations

import numpy as np

from . import dtypes as dt
from .dynamic import AccessPattern
from .enums import engine_name
from .machine import PMAX, current
from .rules import ISA, NkiValidationError, rule
from .tensor import Tensor, free_size, read

GPSIMD_PSUM = rule("ENG-GPSIMD-PSUM", ISA, "since GpSimd Engine cannot access PSUM in NeuronCore, Scalar or Vector Engine must "
                   "be chosen when the input or output tile is in PSUM", "an instruction on GpSimdE with a PSUM operand is refused")
ENGINE = rule("ENG-CHOICE", ISA, "the engine to use for the operation: `nki.isa.engine.vector`, `nki.isa.engine.scalar`, "
              "`nki.isa.engine.gpsimd` or `nki.isa.engine.unknown`",
              "each instruction runs on the engines its doc names; unknown lets the interpreter pick (VectorE unless stated)")
SHAPES = rule("ENG-SHAPES", ISA, "The partition dimension size of input ``data`` and output ``dst`` tiles must be the same and "
              "must not exceed 128", "operands on-chip (SBUF/PSUM) with <= 128 partitions; input and output of an "
              "elementwise instruction have the same partitions and elements per partition")
PER_PARTITION = rule("ENG-SCALAR-OPERAND", ISA, "a scalar constant or a tile of shape ``(data.shape[0], 1)``",
                     "a per-partition operand is a compile-time scalar or a [P, 1] SBUF/PSUM tile")


def tile(t, what: str, buffers=("sbuf", "psum")) -> Tensor:
    if isinstance(t, AccessPattern):
        t = t.static(what)
    if not isinstance(t, Tensor):
        raise NkiValidationError(f"{what} must be an NKI tensor, got {type(t).__name__}")
    SHAPES.check(t.buffer in buffers, f"{what} {t.name!r} is in {t.buffer}; this instruction needs it in {' or '.join(buffers)}")
    SHAPES.check(t.shape[0] <= PMAX, f"{what} {t.name!r} spans {t.shape[0]} partitions > {PMAX}")
    return t


def same_layout(a: Tensor, b: Tensor, what: str) -> None:
    SHAPES.check(a.shape[0] == b.shape[0] and free_size(a) == free_size(b),
                 f"{what}: {a.name!r} {a.shape} and {b.name!r} {b.shape} differ in partitions or elements per partition")


def pick(eng, default="vector", allowed=("vector", "scalar", "gpsimd"), tensors=()) -> str:
    """The engine an instruction runs on (:data:`ENGINE`, :data:`GPSIMD_PSUM`)."""
    eng = engine_name(eng)
    eng = default if eng == "unknown" else eng
    ENGINE.check(eng in allowed, f"engine {eng!r} cannot run this instruction (allowed: {', '.join(allowed)})")
    if eng == "gpsimd":
        for t in tensors:
            GPSIMD_PSUM.check(not (isinstance(t, Tensor) and t.buffer == "psum"),
                              f"GpSimdE cannot access PSUM ({getattr(t, 'name', t)!r} is a PSUM tile): run this instruction on "
                              "the vector or scalar engine, or evacuate PSUM to SBUF first")
    return eng


def per_partition(operand, data: Tensor, what: str, float32_only: bool = False, rule_=None):
    """A compile-time scalar, or a [P, 1] tile broadcast along the free dims (as float32)."""
    if isinstance(operand, (bool, np.bool_)):
        operand = float(operand)
    if isinstance(operand, (int, float, np.floating, np.integer)):
        return np.float32(operand)
    t = tile(operand, what)
    PER_PARTITION.check(t.shape[0] == data.shape[0] and free_size(t) == 1,
                        f"{what} {t.name!r} must be a scalar or a [{data.shape[0]}, 1] tile (one value per partition), got {t.shape}")
    if float32_only:
        (rule_ or PER_PARTITION).check(t.dtype is dt.float32, f"{what} {t.name!r} is {t.dtype}; it must be float32")
    return read(t, what).reshape((data.shape[0],) + (1,) * (data.ndim - 1))


def count(eng: str, op: str, t: Tensor, factor: int = 1) -> None:
    current().stats.engine_ops[(eng, op, int(t.shape[0]), free_size(t) * factor)] += 1
