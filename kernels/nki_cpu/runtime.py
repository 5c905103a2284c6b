"""Launching a kernel in the interpreter: ``@jit`` marks it, :func:`run` executes it on numpy inputs and
returns its outputs with the :class:`~.machine.Stats` of the run, :func:`simulate` mirrors
``nki.simulate(kernel)(*arrays)``."""

from __future__ import annotations

import functools
import inspect

import numpy as np
import torch

from . import machine
from .machine import Machine, NkiValidationError, Stats, Tensor
from .subset import check_traced_subset


class Kernel:
    """A function marked ``@nki.jit``; calling it runs it in the interpreter. Its source is checked against
    the traced-kernel Python subset (:mod:`.subset`) before its first run."""

    def __init__(self, fn):
        self.fn = fn
        self.subset_checked = False
        functools.update_wrapper(self, fn)

    def check(self) -> None:
        if not self.subset_checked:
            check_traced_subset(self.fn)
            self.subset_checked = True

    def __call__(self, *args, **kwargs):
        return run(self, *args, **kwargs)[0]


def jit(fn=None, **options):
    """``@jit`` / ``@jit()``. Compiler options (``mode``, ``platform_target``, ...) are not modelled: refused."""
    if options:
        raise NkiValidationError(
            f"nki.jit options {sorted(options)} are not implemented by the interpreter; use a bare @nki.jit"
        )
    if fn is None:
        return Kernel
    return Kernel(fn)


def _as_input(value, name: str):
    if isinstance(value, np.ndarray):
        return machine.hbm_input(value, name)
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor
        raise TypeError(f"argument {name!r} is a torch tensor: pass numpy arrays (bfloat16 via ml_dtypes) to the interpreter")
    return value  # trace-time constants: ints, strings, tuples


def _as_output(value, what: str):
    if isinstance(value, Tensor):
        if value.buffer != "hbm":
            raise NkiValidationError(f"kernel returned on-chip tile {value.name!r} ({what}); return HBM tensors (nl.shared_hbm)")
        if not value.written.all():
            machine.read(value, f"kernel output {what}")
        return value.data.copy()
    if isinstance(value, (tuple, list)):
        return type(value)(_as_output(v, f"{what}[{i}]") for i, v in enumerate(value))
    return value


def run(kernel, *args, **kwargs) -> tuple[object, Stats]:
    """Execute ``kernel`` (``@jit`` function) on numpy arrays; returns (outputs as numpy, Stats)."""
    if not isinstance(kernel, Kernel):
        kernel = Kernel(kernel)
    kernel.check()
    fn = kernel.fn
    bound = inspect.signature(fn).bind(*args, **kwargs)
    inputs = {name: _as_input(v, name) for name, v in bound.arguments.items()}
    m = Machine()
    machine._CURRENT.append(m)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of small GEMMs: threading costs more than it gains
    try:
        result = fn(**inputs)
        out = _as_output(result, "result")
    finally:
        torch.set_num_threads(threads)
        machine._CURRENT.pop()
    return out, m.stats


def simulate(kernel):
    """``simulate(kernel)(*arrays)``: the interpreter's counterpart of ``nki.simulate``."""
    return lambda *args, **kwargs: run(kernel, *args, **kwargs)[0]
