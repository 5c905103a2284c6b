"""Launching a kernel in the interpreter: ``@jit`` marks it, :func:`run` executes it on numpy inputs and
returns its outputs with the :class:`~.machine.Stats` of the run, :func:`simulate` mirrors
``nki.simulate(kernel)(*arrays)``.

Outputs: an HBM output element the kernel never wrote is returned as bytes ``0xFF`` (NaN in every float dtype,
-1 / the maximum in integer ones): uninitialised device memory is garbage, so a host step that reads it must
mask it (``routing.combine``); reading never-written memory inside the kernel stays an error.

SPMD grids: ``kernel[n](*arrays)`` / :func:`launch` run ``n`` programs (one per logical core under LNC=n),
each with its own SBUF/PSUM and counters, sharing HBM; ``nl.program_id(0)`` / ``nl.num_programs(0)`` tell
a program where it is. Given the runtime's LNC, a grid that disagrees with it is refused, as the Neuron
runtime refuses a kernel launched with a grid other than ``NEURON_LOGICAL_NC_CONFIG``."""

from __future__ import annotations

import functools
import inspect
import threading

import numpy as np
import torch

from . import machine
from .machine import Machine, NkiValidationError, Stats, Tensor
from .subset import check_traced_subset


UNWRITTEN_BYTE = 0xFF  # what a kernel output's never-written elements hold when returned (NaN in fp32/bf16/fp8)


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

    def __getitem__(self, grid):
        """``kernel[n](*arrays)``: an SPMD launch of ``n`` programs (no LNC check; see :func:`launch`)."""
        return lambda *args, **kwargs: launch(self, grid, *args, **kwargs)[0]


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
        out = value.data.copy()
        if not value.written.all():  # uninitialised HBM is garbage on the device: here every such byte is 0xFF
            out.view(np.uint8).reshape(out.shape + (-1,))[~value.written] = UNWRITTEN_BYTE  # NaN in every float dtype
        return out
    if isinstance(value, (tuple, list)):
        return type(value)(_as_output(v, f"{what}[{i}]") for i, v in enumerate(value))
    return value


def run(kernel, *args, **kwargs) -> tuple[object, Stats]:
    """Execute ``kernel`` (``@jit`` function) on numpy arrays; returns (outputs as numpy, Stats)."""
    out, stats = launch(kernel, (1,), *args, **kwargs)
    return out, stats[0]


def _grid_size(grid) -> int:
    grid = (grid,) if isinstance(grid, (int, np.integer)) else tuple(grid)
    if len(grid) != 1 or not isinstance(grid[0], (int, np.integer)) or int(grid[0]) < 1:
        raise NkiValidationError(f"launch grid {grid!r}: the interpreter launches 1-D grids [n] with n >= 1")
    return int(grid[0])


def launch(kernel, grid, *args, lnc: int | None = None, **kwargs) -> tuple[object, list[Stats]]:
    """Run ``kernel`` as an SPMD grid of programs; returns (outputs as numpy, one Stats per program).

    ``lnc``: the logical NeuronCore config the launch runs under (the Neuron runtime's
    ``NEURON_LOGICAL_NC_CONFIG``); when given, a grid other than ``[lnc]`` is refused."""
    n = _grid_size(grid)
    if lnc is not None and n != int(lnc):
        raise NkiValidationError(
            f"kernel {getattr(kernel, '__name__', kernel)!r} launched with grid [{n}] under LNC={lnc}: the runtime runs "
            f"every kernel on all {lnc} logical-core program(s); launch it as kernel[{lnc}] and split the work with "
            "nl.program_id(0)"
        )
    if not isinstance(kernel, Kernel):
        kernel = Kernel(kernel)
    kernel.check()
    fn = kernel.fn
    bound = inspect.signature(fn).bind(*args, **kwargs)
    inputs = {name: _as_input(v, name) for name, v in bound.arguments.items()}
    shared: list = []
    results, stats = [], []
    threads = torch.get_num_threads()
    # thousands of small GEMMs: threading costs more than it gains. The thread count is process-wide state that
    # torch.compile guards on (GLOBAL_STATE): changed only when no other Python thread can be tracing meanwhile
    # (the compile tests run ranks as threads; a change seen mid-trace is a spurious recompile).
    if threading.active_count() == 1:
        torch.set_num_threads(1)
    try:
        for pid in range(n):
            m = Machine(pid, n, shared)
            machine._CURRENT.append(m)
            try:
                results.append(fn(**inputs))
            finally:
                machine._CURRENT.pop()
            stats.append(m.stats)
        out = _as_output(results[0], "result")
    finally:
        torch.set_num_threads(threads)
    for pid, result in enumerate(results[1:], start=1):
        if not _same_outputs(result, results[0]):
            raise NkiValidationError(f"program {pid} returned different outputs from program 0: every program must return the shared HBM outputs")
    return out, stats


def _same_outputs(a, b) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_outputs(x, y) for x, y in zip(a, b))
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.data is b.data
    return a == b


def simulate(kernel):
    """``simulate(kernel)(*arrays)``: the interpreter's counterpart of ``nki.simulate``."""
    return lambda *args, **kwargs: run(kernel, *args, **kwargs)[0]
