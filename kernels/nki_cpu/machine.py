"""Memory of one NeuronCore-v3 as the interpreter models it: tensors, allocations, capacity, counters.

* A :class:`Tensor` is a numpy view plus a same-shaped ``written`` mask; reading any element that was
  never written raises (uninitialised SBUF/PSUM/HBM is garbage on hardware).
* On-chip tiles (``sbuf``/``psum``) have the partition dimension first, at most 128. Capacity counts the
  bytes per partition of every *live* tile (a tile dies when the kernel drops its last reference, as a
  Python name rebound on the next loop iteration does): SBUF 224 KiB per partition; PSUM 8 banks of
  2 KiB per partition, each tile occupying whole banks. The real compiler may double-buffer loop tiles,
  so kernels should leave headroom; :class:`Stats` records the peaks.
* PSUM locations carry an "initialised by a matmul" mask so ``accumulate=True`` can be checked.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from . import dtypes as dt

PMAX = 128  # partitions
SBUF_BYTES_PER_PARTITION = 224 * 1024
PSUM_BANKS = 8
PSUM_BANK_BYTES = 2 * 1024
BUFFERS = ("sbuf", "psum", "hbm")


class NkiValidationError(Exception):
    """A kernel did something Trn2 (or the NKI compiler) does not allow."""


@dataclass
class Stats:
    """What one kernel run did. Counters are keyed by the instruction's shape; see cost.py."""

    hbm_read_bytes: int = 0
    hbm_write_bytes: int = 0
    dma_count: int = 0
    dma_runs: Counter = field(default_factory=Counter)  # contiguous HBM run bytes -> bytes moved
    matmuls: Counter = field(default_factory=Counter)  # (K, M, N, stationary dtype, moving dtype) -> count
    transposes: Counter = field(default_factory=Counter)  # (P, F, dtype) -> count (TensorE)
    engine_ops: Counter = field(default_factory=Counter)  # (engine, op, partitions, free elems) -> count
    peak_sbuf_bytes: int = 0  # per partition
    peak_psum_banks: int = 0
    # runtime-dependent features (dynamic.py; priced by cost_dynamic.py)
    indirect_dmas: Counter = field(default_factory=Counter)  # (scalar | vector, descriptors) -> DMAs
    register_loads: int = 0
    dynamic_loops: int = 0
    dynamic_iterations: int = 0

    @property
    def matmul_count(self) -> int:
        return sum(self.matmuls.values())

    def engine_elements(self, engine: str) -> int:
        return sum(p * f * n for (e, _op, p, f), n in self.engine_ops.items() if e == engine)


class _Allocation:
    """One on-chip tile's memory (freed when the last tensor viewing it dies)."""

    def __init__(self, machine: "Machine", buffer: str, shape, dtype: dt.Dtype, name: str):
        self.buffer = buffer
        self.row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize if len(shape) > 1 else dtype.itemsize
        self.banks = math.ceil(self.row_bytes / PSUM_BANK_BYTES) if buffer == "psum" else 0
        self.base_ptr = 0
        self.machine = machine
        machine.allocate(self, name)

    def __del__(self):
        self.machine.release(self.buffer, self.row_bytes, self.banks)


class Machine:
    """Live allocation totals and the counters of the current run."""

    def __init__(self, program_id: int = 0, num_programs: int = 1, shared_hbm: list | None = None):
        self.stats = Stats()
        self.sbuf_bytes = 0
        self.psum_banks = 0
        # SPMD launch (grid [n]): each program (logical core) has its own SBUF/PSUM and counters; HBM tensors
        # the kernel allocates are shared, matched by allocation order across the programs of one launch.
        self.program_id = program_id
        self.num_programs = num_programs
        self.shared_hbm = [] if shared_hbm is None else shared_hbm
        self.hbm_allocations = 0

    def allocate(self, alloc: _Allocation, name: str) -> None:
        if alloc.buffer == "sbuf":
            if self.sbuf_bytes + alloc.row_bytes > SBUF_BYTES_PER_PARTITION:
                raise NkiValidationError(
                    f"SBUF overflow allocating {name!r}: {alloc.row_bytes} B/partition on top of {self.sbuf_bytes} B live "
                    f"exceeds {SBUF_BYTES_PER_PARTITION} B (224 KiB) per partition; tile smaller or free tiles earlier"
                )
            self.sbuf_bytes += alloc.row_bytes
            self.stats.peak_sbuf_bytes = max(self.stats.peak_sbuf_bytes, self.sbuf_bytes)
        elif alloc.buffer == "psum":
            if self.psum_banks + alloc.banks > PSUM_BANKS:
                raise NkiValidationError(
                    f"PSUM overflow allocating {name!r}: {alloc.banks} bank(s) of 2 KiB/partition on top of {self.psum_banks} live "
                    f"exceeds the {PSUM_BANKS} banks (16 KiB) per partition"
                )
            self.psum_banks += alloc.banks
            self.stats.peak_psum_banks = max(self.stats.peak_psum_banks, self.psum_banks)

    def release(self, buffer: str, row_bytes: int, banks: int) -> None:
        if buffer == "sbuf":
            self.sbuf_bytes -= row_bytes
        elif buffer == "psum":
            self.psum_banks -= banks


_CURRENT: list[Machine] = []


def current() -> Machine:
    if not _CURRENT:
        raise NkiValidationError("NKI operations run only inside a kernel launched by nki_cpu.simulate / nki_cpu.run")
    return _CURRENT[-1]


class Tensor:
    """An NKI tensor: a view of HBM or of an on-chip tile (``.view(dtype)`` reinterprets bytes; ``.ap(...)``, the
    explicit / indirect access pattern, is installed by :mod:`.dynamic`, which builds on this module)."""

    __slots__ = ("data", "written", "mm_init", "dtype", "buffer", "alloc", "name")

    def __init__(self, data, written, dtype: dt.Dtype, buffer: str, alloc=None, name: str = "tensor", mm_init=None):
        self.data = data
        self.written = written
        self.mm_init = mm_init  # PSUM only: element last written by a matmul (accumulate=True allowed)
        self.dtype = dtype
        self.buffer = buffer
        self.alloc = alloc
        self.name = name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def ndim(self) -> int:
        return self.data.ndim

    def __repr__(self) -> str:
        return f"Tensor({self.name!r}, {self.shape}, {self.dtype}, {self.buffer})"

    def __getitem__(self, index) -> "Tensor":
        if not isinstance(index, tuple):
            index = (index,)
        for i in index:
            if not isinstance(i, (int, np.integer, slice)) and i is not Ellipsis:
                raise NkiValidationError(f"indexing {self.name!r} with {type(i).__name__}: the interpreter supports ints and slices (static access patterns)")
        _check_bounds(self, index)
        if self.buffer != "hbm" and index and isinstance(index[0], (int, np.integer)):
            index = (slice(int(index[0]), int(index[0]) + 1),) + index[1:]  # keep the partition dim of a tile
        mm = self.mm_init[index] if self.mm_init is not None else None
        return Tensor(self.data[index], self.written[index], self.dtype, self.buffer, self.alloc, self.name, mm)

    def view(self, dtype: dt.Dtype) -> "Tensor":
        """Reinterpret the bytes as ``dtype`` (same element size), as ``NkiTensor.view`` does."""
        if dtype.itemsize != self.dtype.itemsize:
            raise NkiValidationError(f"view of {self.name!r} from {self.dtype} to {dtype}: element sizes differ ({self.dtype.itemsize} vs {dtype.itemsize} B)")
        return Tensor(self.data.view(dtype.np), self.written, dtype, self.buffer, self.alloc, self.name, self.mm_init)

    def reshape(self, shape) -> "Tensor":
        """Reshape a contiguous HBM tensor (a new access pattern over the same bytes)."""
        shape = tuple(int(s) for s in shape)
        if self.buffer != "hbm":
            raise NkiValidationError(f"reshape of on-chip tile {self.name!r}: allocate the tile in the shape you need")
        if not self.data.flags.c_contiguous:
            raise NkiValidationError(f"reshape of non-contiguous HBM view of {self.name!r}")
        if int(np.prod(shape)) != self.data.size:
            raise NkiValidationError(f"reshape of {self.name!r} {self.shape} to {shape}: element counts differ")
        return Tensor(self.data.reshape(shape), self.written.reshape(shape), self.dtype, self.buffer, self.alloc, self.name)


def _check_bounds(t: Tensor, index) -> None:
    dims = [i for i in index if i is not Ellipsis]
    if len(dims) > t.ndim:
        raise NkiValidationError(f"too many indices for {t.name!r} of shape {t.shape}")
    for axis, i in enumerate(dims):
        size = t.shape[axis]
        if isinstance(i, slice):
            start, stop = i.start or 0, size if i.stop is None else i.stop
            if start < 0 or stop > size or start > stop:
                raise NkiValidationError(f"slice {start}:{stop} out of bounds for axis {axis} (size {size}) of {t.name!r}")
        elif not 0 <= int(i) < size:
            raise NkiValidationError(f"index {int(i)} out of bounds for axis {axis} (size {size}) of {t.name!r}")


def new_tile(shape, dtype: dt.Dtype, buffer: str, name: str) -> Tensor:
    shape = tuple(int(s) for s in shape)
    if buffer not in BUFFERS:
        raise NkiValidationError(f"unknown buffer {buffer!r} for {name!r}")
    if any(s <= 0 for s in shape):
        raise NkiValidationError(f"tensor {name!r} has a non-positive dimension: {shape}")
    if buffer == "hbm":
        return _shared_hbm(shape, dtype, name)
    if len(shape) < 2:
        raise NkiValidationError(f"on-chip tile {name!r} needs a partition dim and at least one free dim, got {shape}")
    if shape[0] > PMAX:
        raise NkiValidationError(f"partition dim of {name!r} is {shape[0]} > {PMAX}: the first dim of an on-chip tile is the partition dim")
    machine = current()
    alloc = _Allocation(machine, buffer, shape, dtype, name)
    data = np.empty(shape, dtype=dtype.np)
    alloc.base_ptr = data.ctypes.data
    mm = np.zeros(shape, dtype=bool) if buffer == "psum" else None
    return Tensor(data, np.zeros(shape, dtype=bool), dtype, buffer, alloc, name, mm)


def _shared_hbm(shape, dtype: dt.Dtype, name: str) -> Tensor:
    """A kernel-allocated HBM tensor; every program of a launch gets the same one (by allocation order)."""
    m = current()
    index = m.hbm_allocations
    m.hbm_allocations += 1
    if index < len(m.shared_hbm):
        t = m.shared_hbm[index]
        if t.shape != shape or t.dtype is not dtype:
            raise NkiValidationError(
                f"program {m.program_id} allocates HBM tensor #{index} {name!r} as {shape} {dtype}, but program 0 allocated "
                f"{t.shape} {t.dtype}: the programs of one launch must allocate their shared outputs identically"
            )
        return t
    t = Tensor(np.zeros(shape, dtype=dtype.np), np.zeros(shape, dtype=bool), dtype, "hbm", None, name)
    m.shared_hbm.append(t)
    return t


def hbm_input(array: np.ndarray, name: str) -> Tensor:
    array = np.ascontiguousarray(array)
    return Tensor(array, np.ones(array.shape, dtype=bool), dt.from_numpy(array.dtype), "hbm", None, name)


def read(t: Tensor, what: str = "operand") -> np.ndarray:
    """The tensor's values as float32, refusing never-written elements."""
    if not t.written.all():
        bad = np.argwhere(~t.written)[0]
        raise NkiValidationError(
            f"{what} reads never-written memory: {t.name!r} ({t.buffer}, shape {t.shape}) element {tuple(int(i) for i in bad)} "
            "was not written before this read"
        )
    return dt.to_float32(t.data, t.dtype)


def write(t: Tensor, values: np.ndarray, by_matmul: bool = False) -> None:
    t.data[...] = dt.from_float32(values, t.dtype)
    t.written[...] = True
    if t.mm_init is not None:
        t.mm_init[...] = by_matmul


def hbm_run_bytes(t: Tensor) -> int:
    """Bytes of the innermost contiguous run of an HBM access pattern (a DMA descriptor's length)."""
    run = t.dtype.itemsize
    expected = t.dtype.itemsize
    for size, stride in zip(reversed(t.data.shape), reversed(t.data.strides)):
        if size == 1:
            continue
        if stride != expected:
            break
        run *= size
        expected *= size
    return run
