"""The tile-level ``nki.language`` functions the interpreter supports (aws-neuron-sdk @81ce03ae ``nki/api/nki/language/
__init__.py``: ``load``, ``store``, ``broadcast_to``, ``sum``, ``shared_identity_matrix`` and the operators called on
tiles, e.g. ``nl.add(a, b)``), each lowered onto the ISA instruction that computes it (so the rules and counters are
that instruction's). The docs mark them experimental; anything else they offer is not modelled."""

from __future__ import annotations

import numpy as np

from . import machine, operators
from .rules import LANG, NkiValidationError, rule
from .tensor import Tensor

BROADCAST = rule("LANG-BROADCAST", LANG, "Each dimension must either match or be broadcast from size 1",
                 "broadcast_to: same rank, each dim equal or from 1; the result is a new SBUF tile")


def _new(shape, dtype, name="nl_result"):
    shape = tuple(int(s) for s in shape)
    return Tensor(machine.storage_for("sbuf", shape, dtype, name), dtype, shape, name=name)


def load(src: Tensor, dtype=None) -> Tensor:
    """A new SBUF tile holding ``src`` (one DMA)."""
    from .dma import dma_copy

    t = _new(src.shape, dtype or src.dtype)
    dma_copy(t, src)
    return t


def store(dst: Tensor, value: Tensor) -> None:
    from .dma import dma_copy

    dma_copy(dst, value)


def broadcast_to(x: Tensor, shape, dtype=None) -> Tensor:
    """A new SBUF tile of ``shape`` with ``x``'s values broadcast along its size-1 dims (one VectorE copy)."""
    from .engines import count
    from .tensor import read, write

    shape = tuple(int(s) for s in shape)
    BROADCAST.check(len(shape) == x.ndim and all(a == b or a == 1 for a, b in zip(x.shape, shape)),
                    f"broadcast_to {x.shape} -> {shape}")
    if shape == x.shape and (dtype is None or dtype is x.dtype):
        return x
    out = _new(shape, dtype or x.dtype)
    write(out, np.broadcast_to(read(x, "broadcast_to x"), shape))
    count("vector", "tensor_copy", out)
    return out


def sum(x: Tensor, axis, dtype=None, keepdims=False) -> Tensor:  # noqa: A001
    """A new SBUF tile: ``x`` summed over ``axis`` (tensor_reduce)."""
    from .vector_reduce import tensor_reduce

    axes = sorted(int(a) for a in (axis if isinstance(axis, (list, tuple)) else (axis,)))
    shape = tuple(1 if i in axes else n for i, n in enumerate(x.shape)) if keepdims else \
        tuple(n for i, n in enumerate(x.shape) if i not in axes)
    out = _new(shape, dtype or x.dtype)
    tensor_reduce(out, operators.OPS["add"], x, axes, keepdims=keepdims)
    return out


def shared_identity_matrix(n, dtype=None, dst=None) -> Tensor:
    """An [n, n] identity matrix in SBUF (a shared constant loaded by one DMA)."""
    from . import dtypes as dt
    from .tensor import write

    out = dst if dst is not None else _new((int(n), int(n)), dtype or dt.uint8, "identity")
    write(out, np.eye(int(n), dtype=np.float32).reshape(out.shape))
    machine.current().stats.dma_count += 1
    return out


def apply(op, *args, dtype=None, **kwargs):
    """``nl.<op>(tiles...)``: a new SBUF tile computed by the instruction for the operator's kind."""
    from . import scalar_engine, vector_engine

    tiles = [a for a in args if isinstance(a, Tensor)]
    if not tiles:
        raise NkiValidationError(f"nl.{op.name}{args}: called on no tile; use Python arithmetic for compile-time values")
    out = _new(tiles[0].shape, dtype or tiles[0].dtype)
    if op.kind in ("arith", "bitvec") and len(args) == 2:
        a, b = args
        if isinstance(a, Tensor) and isinstance(b, Tensor):
            vector_engine.tensor_tensor(out, a, b, op)
        else:
            vector_engine.tensor_scalar(out, a if isinstance(a, Tensor) else b, op, b if isinstance(a, Tensor) else a,
                                        reverse0=not isinstance(a, Tensor))
    elif op.activation and len(args) == 1:
        scalar_engine.activation(out, op, args[0])
    else:
        raise NkiValidationError(f"nl.{op.name} on tiles with {len(args)} argument(s) is not modelled by the interpreter")
    return out


operators.CALL[0] = apply
