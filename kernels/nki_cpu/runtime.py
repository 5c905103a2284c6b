"""Launching a kernel in the interpreter: ``@jit`` marks it, :func:`run` executes it on numpy inputs and returns its
outputs with the :class:`~.machine.Stats` of the run, :func:`simulate` mirrors ``nki.simulate(kernel)(*arrays)``.

Outputs: an HBM output element the kernel never wrote is returned as bytes ``0xFF`` (NaN in every float dtype,
-1 / the maximum in integer ones): uninitialised device memory is garbage, so a host step that reads it must mask it
(``routing.combine``); computing on never-written memory inside the kernel stays an error.

SPMD grids: ``kernel[n](*arrays)`` / :func:`launch` run ``n`` programs (one per logical core under LNC=n), each with its
own SBUF/PSUM and counters, sharing the inputs and ``shared_hbm`` tensors (:mod:`.spmd` schedules them). Given the
runtime's LNC, a grid that disagrees with it is refused, as the Neuron runtime refuses a kernel launched with a grid
other than ``NEURON_LOGICAL_NC_CONFIG`` (``nki/api/nki/__init__.py`` @81ce03ae: "The LNC value must match the
``NEURON_LOGICAL_NC_CONFIG`` environment variable")."""

from __future__ import annotations

import copy
import functools
import inspect
import threading

import numpy as np
import torch

from . import machine
from .machine import PRIVATE, Launch, Machine, Stats
from .rules import JIT, MIGRATION, NkiValidationError, rule
from .spmd import Deadlock, Spmd
from .subset import check_traced_subset
from .tensor import Tensor

UNWRITTEN_BYTE = 0xFF  # what a kernel output's never-written bytes hold when returned (NaN in fp32/bf16/fp8)

JIT_OPTIONS = rule("JIT-OPTIONS", MIGRATION, "Passing ``platform_target`` to ``@nki.jit`` raises an error in NKI 0.3.0",
                   "nki.jit takes mode= (no effect here: the interpreter always executes the kernel); platform_target= "
                   "and any other option are refused")
LNC = rule("JIT-LNC", JIT, "The LNC value must match the ``NEURON_LOGICAL_NC_CONFIG`` environment variable set for the "
           "Neuron Runtime", "a launch under a given LNC must use grid [LNC]")


class Kernel:
    """A function marked ``@nki.jit``; calling it runs it in the interpreter. Its source is checked against the
    traced-kernel Python subset (:mod:`.subset`) before its first run."""

    def __init__(self, fn):
        self.fn = fn
        self.subset_checked = False
        functools.update_wrapper(self, fn)

    def check(self) -> None:
        if not self.subset_checked:
            check_traced_subset(self.fn)
            self.subset_checked = True

    def __call__(self, *args, **kwargs):
        if machine.active() is not None:  # called from a running kernel: a sub-kernel, traced inline
            return self.fn(*args, **kwargs)
        return run(self, *args, **kwargs)[0]

    def __getitem__(self, grid):
        """``kernel[n](*arrays)``: an SPMD launch of ``n`` programs (no LNC check; see :func:`launch`)."""
        return lambda *args, **kwargs: launch(self, grid, *args, **kwargs)[0]


def jit(fn=None, **options):
    """``@jit`` / ``@jit()`` / ``@jit(mode=...)``."""
    unknown = sorted(set(options) - {"mode"})
    JIT_OPTIONS.check(not unknown, f"nki.jit options {unknown} are not implemented by the interpreter; use @nki.jit or "
                                   "@nki.jit(mode=...)")
    if fn is None:
        return Kernel
    return Kernel(fn)


def _as_input(value, name: str):
    if isinstance(value, np.ndarray):
        from .dtypes import from_numpy

        return Tensor(machine.input_storage(value, name), from_numpy(value.dtype), value.shape, name=name)
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor
        raise TypeError(f"argument {name!r} is a torch tensor: pass numpy arrays (bfloat16 via ml_dtypes) to the interpreter")
    from .language import NKIObject

    if isinstance(value, NKIObject):  # the Language Guide: "convert the Python class instance ... using the objects dictionary"
        converted = copy.copy(value)
        for k, v in vars(value).items():
            setattr(converted, k, _as_input(v, f"{name}.{k}"))
        return converted
    return value  # trace-time constants: ints, strings, tuples, enums


def _as_output(value, what: str, programs: int):
    if isinstance(value, Tensor):
        if value.onchip:
            raise NkiValidationError(f"kernel returned on-chip tile {value.name!r} ({what}); return HBM tensors (nl.shared_hbm)")
        PRIVATE.check(value.buffer != "private_hbm" or programs == 1,
                      f"kernel returned private_hbm tensor {value.name!r} ({what}) from a grid of {programs} programs: each "
                      "program has its own; return an nl.shared_hbm tensor")
        out = np.ascontiguousarray(value.data).copy()
        ok = value.written_bytes()
        if not ok.all():  # uninitialised HBM is garbage on the device: here every such byte is 0xFF
            out.view(np.uint8).reshape(out.shape + (-1,))[~ok] = UNWRITTEN_BYTE
        return out
    if isinstance(value, (tuple, list)):
        return type(value)(_as_output(v, f"{what}[{i}]", programs) for i, v in enumerate(value))
    return value


def run(kernel, *args, **kwargs) -> tuple[object, Stats]:
    """Execute ``kernel`` (``@jit`` function) on numpy arrays without a grid; returns (outputs as numpy, Stats)."""
    out, stats = _launch(kernel, 1, 0, args, kwargs)
    return out, stats[0]


def _grid_size(grid) -> int:
    grid = (grid,) if isinstance(grid, (int, np.integer)) else tuple(grid)
    if len(grid) != 1 or not isinstance(grid[0], (int, np.integer)) or int(grid[0]) < 1:
        raise NkiValidationError(f"launch grid {grid!r}: the interpreter launches 1-D grids [n] with n >= 1")
    return int(grid[0])


def launch(kernel, grid, *args, lnc: int | None = None, **kwargs) -> tuple[object, list[Stats]]:
    """Run ``kernel`` as an SPMD grid of programs; returns (outputs as numpy, one Stats per program).

    ``lnc``: the logical NeuronCore config the launch runs under (the Neuron runtime's ``NEURON_LOGICAL_NC_CONFIG``);
    when given, a grid other than ``[lnc]`` is refused."""
    n = _grid_size(grid)
    LNC.check(lnc is None or n == int(lnc),
              f"kernel {getattr(kernel, '__name__', kernel)!r} launched with grid [{n}] under LNC={lnc}: the runtime runs "
              f"every kernel on all {lnc} logical-core program(s); launch it as kernel[{lnc}] and split the work with "
              "nl.program_id(0)")
    return _launch(kernel, n, 1, args, kwargs)


def _launch(kernel, n: int, grid_ndim: int, args, kwargs):
    if not isinstance(kernel, Kernel):
        kernel = Kernel(kernel)
    kernel.check()
    fn = kernel.fn
    bound = inspect.signature(fn).bind(*args, **kwargs)
    inputs = {name: _as_input(v, name) for name, v in bound.arguments.items()}
    shared = Launch(n)
    shared.grid_ndim = grid_ndim
    if n > 1:
        shared.spmd = Spmd(n)
    programs = [Machine(pid, n, shared) for pid in range(n)]
    results: list = [None] * n
    errors: list = [None] * n
    threads = torch.get_num_threads()
    # thousands of small GEMMs: threading costs more than it gains. The thread count is process-wide state that
    # torch.compile guards on (GLOBAL_STATE): changed only when no other Python thread can be tracing meanwhile
    # (the compile tests run ranks as threads; a change seen mid-trace is a spurious recompile).
    if threading.active_count() == 1:
        torch.set_num_threads(1)

    def body(pid: int) -> None:
        prev = machine.enter(programs[pid])
        try:
            if shared.spmd is not None:
                shared.spmd.start(pid)
            results[pid] = fn(**inputs)
            programs[pid].check_capacity()
        except BaseException as exc:  # noqa: BLE001  (re-raised below, program order)
            errors[pid] = exc
        finally:
            if shared.spmd is not None:
                shared.spmd.finish(pid)
            machine.enter(prev)

    try:
        if n == 1:
            body(0)
        else:
            workers = [threading.Thread(target=body, args=(pid,), name=f"nki-program-{pid}") for pid in range(n)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        first = next((e for e in errors if e is not None and not isinstance(e, Deadlock)), None) or \
            next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        out = _as_output(results[0], "result", n)
    finally:
        torch.set_num_threads(threads)
    for pid, result in enumerate(results[1:], start=1):
        if not _same_outputs(result, results[0]):
            raise NkiValidationError(f"program {pid} returned different outputs from program 0: every program must return the shared HBM outputs")
    return out, [p.stats for p in programs]


def _same_outputs(a, b) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_outputs(x, y) for x, y in zip(a, b))
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (isinstance(a, Tensor) and isinstance(b, Tensor) and a.storage is b.storage and a.boffset == b.boffset
                and a.shape == b.shape)
    return a == b


def simulate(kernel):
    """``simulate(kernel)(*arrays)``: the interpreter's counterpart of ``nki.simulate``."""
    return lambda *args, **kwargs: run(kernel, *args, **kwargs)[0]
