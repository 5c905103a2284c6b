"""Runtime-dependent NKI features: virtual registers, dynamic loops and dynamic access patterns (``.ap`` with
``scalar_offset`` / ``vector_offset``, ``nl.ds`` with a runtime start).

API read in aws-neuron/aws-neuron-sdk @81ce03ae (``nki/api/nki/isa/__init__.py``: ``register_alloc``,
``register_move``, ``register_load``, ``register_store``, ``dma_copy`` "Indirect addressing"; ``nki/api/nki/language/
__init__.py``: ``NkiTensor.ap``, ``dynamic_range``) and in its use by nki-library @d2ad3a57 ``core/moe``.

* A register is read (loop bound, scalar offset) only after ``register_alloc(x)`` / ``register_load`` /
  ``register_move`` gave it a value; it is not a Python int or bool (the tracer cannot branch on it).
* ``nl.dynamic_range``: step a compile-time positive int; start/stop ints or loaded registers; the loop variable is a
  runtime value (:class:`DynamicIndex`), usable only where a runtime value is (an ``nl.ds`` start, a scalar offset).
* A scalar offset (a register or a one-element integer SBUF tile) moves the whole pattern by ``value x`` the stride
  of ``indirect_dim``; when an instruction runs it is a static view (:meth:`AccessPattern.static`), so engines and
  DMAs take it alike. A vector offset (``[P, 1]`` integer SBUF tile) replaces the pattern's first (partition)
  dimension by one index per partition: a gather or scatter, on an HBM tensor, by DMA only.
* Every dynamic index is checked against the indexed dimension (``oob_mode.error``); ``oob_mode.skip`` (DMA only)
  drops the out-of-range rows (vector) or the whole transfer (scalar).

Counters (``Stats``): ``indirect_dmas[(kind, descriptors)]``, ``register_loads``, ``dynamic_loops``,
``dynamic_iterations`` - priced by :mod:`.cost_dynamic`.
"""

from __future__ import annotations

import numpy as np

from . import dtypes as dt
from .enums import oob_mode  # noqa: F401  (nisa.oob_mode)
from .machine import current
from .rules import ISA, LANG, NkiValidationError, rule
from . import tensor as _tensor
from .tensor import DynamicSlice, Tensor, parse_pattern, read_raw, write

INT_DTYPES = (dt.int32, dt.uint32, dt.int8, dt.uint8, dt.int16, dt.uint16)

LOAD = rule("REG-LOAD", ISA, "The source must be a NKI tensor with exactly one element (shape [1] or [1, 1])",
            "register_load / register_store take a one-element HBM or SBUF integer tensor, [1] or [1, 1]")
INDIRECT = rule("DMA-INDIRECT", ISA, "The tensor being indexed (the one ``.ap()`` is called on) must be in HBM",
                "a vector offset is a [P, 1] integer SBUF tile indexing an HBM tensor; scalar and vector offsets are "
                "mutually exclusive; every index lies inside the indexed dimension unless oob_mode.skip")


class VirtualRegister:
    """A 32-bit engine-sequencer register (``nisa.register_alloc``); ``value`` is None until it is set."""

    __slots__ = ("value", "name")

    def __init__(self, value=None, name: str = "reg"):
        self.value = value
        self.name = name

    def get(self, what: str) -> int:
        if self.value is None:
            raise NkiValidationError(
                f"{what} reads register {self.name!r} before it holds a value: give it one with "
                "nisa.register_alloc(x), nisa.register_load(reg, tile) or nisa.register_move(reg, x) first")
        return int(self.value)

    def __bool__(self):
        raise NkiValidationError(f"register {self.name!r} used as a Python bool: the traced kernel cannot branch on it")

    def __index__(self):
        raise NkiValidationError(f"register {self.name!r} used as a Python int: registers are runtime values")


_reg_counter = [0]


def register_alloc(x=None) -> VirtualRegister:
    if x is not None and not isinstance(x, (int, np.integer)):
        raise NkiValidationError(f"register_alloc(x={x!r}): the initial value must be a compile-time int or None")
    _reg_counter[0] += 1
    return VirtualRegister(None if x is None else int(x), f"reg{_reg_counter[0]}")


def _need_register(dst, what: str, write: bool = False) -> VirtualRegister:
    if not isinstance(dst, VirtualRegister):
        raise NkiValidationError(f"{what} needs a register from nisa.register_alloc(), got {type(dst).__name__}")
    if write and isinstance(dst, DynamicIndex):
        raise NkiValidationError(f"{what}: {dst.name} is a dynamic loop's induction variable, which is frozen")
    return dst


def register_move(dst, src) -> None:
    _need_register(dst, "register_move dst", write=True)
    if isinstance(src, VirtualRegister):
        dst.value = src.get("register_move src")
    elif isinstance(src, (int, np.integer)):
        dst.value = int(src)
    else:
        raise NkiValidationError(f"register_move src must be a compile-time int or a register, got {type(src).__name__}")


def _one_element(t, what: str) -> Tensor:
    LOAD.check(isinstance(t, Tensor) and t.buffer != "psum" and t.size == 1 and t.ndim in (1, 2),
               f"{what} must be a one-element HBM/SBUF tensor ([1] or [1, 1]), got {t!r}")
    LOAD.check(t.dtype in INT_DTYPES, f"{what} {t.name!r} is {t.dtype}: registers hold 32-bit integers; use an int32 tensor")
    return t


def register_load(dst, src: Tensor) -> None:
    """dst = the one integer element of ``src`` (HBM or SBUF)."""
    _need_register(dst, "register_load dst", write=True)
    dst.value = int(read_raw(_one_element(src, "register_load src"), "register_load src").reshape(-1)[0])
    current().stats.register_loads += 1


def register_store(dst: Tensor, src) -> None:
    """The register's value into a one-element integer tensor."""
    _one_element(dst, "register_store dst")
    write(dst, np.array(_need_register(src, "register_store src").get("register_store"), dtype=np.float32))


class DynamicIndex(VirtualRegister):
    """The iteration variable of ``nl.dynamic_range``: a frozen register (the Language Guide: "it is frozen: you cannot
    write to it with ``register_move`` or ``register_load``") usable as a tensor index or scalar offset."""

    __slots__ = ("loop",)

    def __init__(self, loop: str, value: int):
        super().__init__(value, f"{loop} index")
        self.loop = loop

    def _refuse(self, *_args):
        raise NkiValidationError(
            f"the iteration variable of {self.loop} is a runtime value: it cannot be a Python int or arithmetic operand "
            "(the compiler cannot compute with it); index tensors with it or use it as a scalar offset")

    __int__ = __add__ = __radd__ = __mul__ = __rmul__ = __sub__ = __rsub__ = __floordiv__ = __mod__ = _refuse


def _bound(v, what: str) -> int:
    if isinstance(v, VirtualRegister):
        return v.get(f"nl.dynamic_range {what}")
    if isinstance(v, (int, np.integer)):
        return int(v)
    raise NkiValidationError(f"nl.dynamic_range {what} must be an int or a register, got {type(v).__name__}")


def dynamic_range(start, stop=None, step=1):
    """Iterations from start to stop (registers allowed) executed on the device's sequencers."""
    if stop is None:
        start, stop = 0, start
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step <= 0:
        raise NkiValidationError(f"nl.dynamic_range step={step!r}: must be a compile-time positive int")
    lo, hi = _bound(start, "start"), _bound(stop, "stop")
    trips = max(0, (hi - lo + step - 1) // step)
    stats = current().stats
    stats.dynamic_loops += 1
    stats.dynamic_iterations += trips
    return (DynamicIndex(f"nl.dynamic_range({lo}, {hi})", lo + i * step) for i in range(trips))


# --- dynamic access patterns ------------------------------------------------------------------------------------

def offset_value(off, what: str) -> int:
    if isinstance(off, VirtualRegister):
        return off.get(what)
    INDIRECT.check(isinstance(off, Tensor) and off.onchip and off.size == 1 and off.dtype in INT_DTYPES,
                   f"{what} must be a register, a dynamic-loop variable or a one-element integer SBUF tile, got {off!r}")
    return int(read_raw(off, what).reshape(-1)[0])


class AccessPattern:
    """``tensor.ap(..., scalar_offset= | vector_offset=)``: resolved when the instruction using it runs."""

    def __init__(self, base: Tensor, pattern, offset, scalar_offset, vector_offset, indirect_dim, dtype):
        INDIRECT.check(scalar_offset is None or vector_offset is None, ".ap: scalar_offset and vector_offset are mutually exclusive")
        INDIRECT.check(0 <= int(indirect_dim) < base.ndim, f".ap indirect_dim={indirect_dim} outside {base.name!r}'s {base.ndim} dims")
        self.base, self.pairs, self.dtype = base, parse_pattern(pattern, base.name), dtype or base.dtype
        self.offset = int(offset or 0)
        self.scalar_offset, self.vector_offset, self.indirect_dim = scalar_offset, vector_offset, int(indirect_dim)
        self.buffer, self.name = base.buffer, base.name
        self.shape = tuple(c for _s, c in self.pairs)
        self.span = 1  # indices the offset may add along the indexed dimension beyond itself (nl.ds: its size)
        if vector_offset is not None:
            INDIRECT.check(not base.onchip, f".ap(vector_offset=) on {base.name!r} ({base.buffer}): {INDIRECT.quote}")

    @property
    def kind(self) -> str:
        return "vector" if self.vector_offset is not None else "scalar"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def onchip(self) -> bool:
        return self.base.onchip

    def _dim(self) -> tuple[int, int]:
        """(size, byte stride) of the base's indexed dimension."""
        return self.base.shape[self.indirect_dim], self.base.bstrides[self.indirect_dim]

    def _view(self, extra_bytes: int, pairs=None) -> Tensor:
        item = self.dtype.itemsize
        pairs = self.pairs if pairs is None else pairs
        return Tensor(self.base.storage, self.dtype, [c for _s, c in pairs], [s * item for s, _c in pairs],
                      self.base.boffset + self.offset * item + extra_bytes, self.name)

    def scalar(self) -> int:
        return offset_value(self.scalar_offset, f".ap scalar_offset of {self.name!r}")

    def in_range(self) -> bool:
        size, _ = self._dim()
        return 0 <= self.scalar() <= size - self.span

    def static(self, what: str = "operand") -> Tensor:
        """A scalar-offset pattern as the static view it is for the current offset value (checked in range)."""
        if self.kind != "scalar":
            raise INDIRECT.error(f"{what}: a vector-offset (gather / scatter) pattern is a DMA operand only")
        size, stride = self._dim()
        v = self.scalar()
        reach = f" (+ {self.span - 1})" if self.span > 1 else ""
        INDIRECT.check(0 <= v <= size - self.span,
                       f"scalar_offset {v}{reach} out of range for the indexed dimension of {self.name!r} (size "
                       f"{size}): an indirect access outside the tensor is an error (oob_mode.error)")
        return self._view(v * stride)

    def indices(self, skip: bool) -> tuple[np.ndarray, np.ndarray]:
        """Vector offset: (the per-partition index, which rows are in range); out-of-range rows are refused unless
        ``skip``."""
        vo = self.vector_offset
        INDIRECT.check(isinstance(vo, Tensor) and vo.onchip and vo.ndim == 2 and vo.shape[1] == 1 and vo.dtype in INT_DTYPES,
                       f".ap vector_offset of {self.name!r} must be a [P, 1] integer SBUF tile (offsets are integer tiles), got {vo!r}")
        INDIRECT.check(vo.shape[0] == self.shape[0], f".ap vector_offset {vo.name!r} has {vo.shape[0]} partitions; the "
                                                     f"pattern's partition count is {self.shape[0]}")
        idx = read_raw(vo, ".ap vector_offset").reshape(-1).astype(np.int64)
        size, _ = self._dim()
        keep = (idx >= 0) & (idx < size)
        if not skip and not keep.all():
            bad = int(idx[~keep][0])
            raise INDIRECT.error(f"vector_offset {bad} out of range for the indexed dimension of {self.name!r} (size {size}): "
                                 "an indirect DMA outside the tensor is an error (oob_mode.error)")
        return idx, keep

    def rows(self, skip: bool, unique: bool = False) -> list[tuple[int, Tensor]]:
        """Vector offset: (partition row, static view of the addressed row) for every row that moves; ``unique``
        (a write): no row addressed twice."""
        idx, keep = self.indices(skip)
        if unique and np.unique(idx[keep]).size != int(keep.sum()):
            raise NkiValidationError(f"indirect write into {self.name!r} addresses an element twice in one DMA; indices "
                                     "must be unique")
        _size, stride = self._dim()
        inner = self.pairs[1:] or [(1, 1)]
        return [(p, self._view(int(idx[p]) * stride, inner)) for p in np.flatnonzero(keep)]

    def run_bytes(self) -> int:
        """Bytes of the innermost contiguous run per descriptor."""
        run, expected = self.dtype.itemsize, 1
        dims = self.pairs[1:] if self.kind == "vector" else self.pairs
        for s, c in reversed(dims):
            if c == 1:
                continue
            if s != expected:
                break
            run *= c
            expected *= c
        return run

    def descriptors(self) -> int:
        """DMA descriptors software DGE writes: one per partition row for a vector offset, else one."""
        return self.shape[0] if self.kind == "vector" else 1


def dynamic_view(t: Tensor, index: tuple) -> AccessPattern:
    """``t[..., reg, ...]`` / ``t[..., nl.ds(runtime, size), ...]``: one runtime index on one axis, static elsewhere ->
    a scalar-offset access pattern along that axis (an integer register index removes the axis, as an int does)."""
    def dynamic(i):
        return isinstance(i, VirtualRegister) or (isinstance(i, Tensor) and i.size == 1) or \
            (isinstance(i, DynamicSlice) and not isinstance(i.start, (int, np.integer)))

    dyn = [a for a, i in enumerate(index) if dynamic(i)]
    INDIRECT.check(len(dyn) == 1 and all(dynamic(i) or isinstance(i, (int, np.integer, slice, DynamicSlice)) for i in index),
                   f"indexing {t.name!r} with {index!r}: one runtime index (register, 1x1 tile or nl.ds), the others static")
    axis = dyn[0]
    i = index[axis]
    start, size, drop = (i.start, i.size, False) if isinstance(i, DynamicSlice) else (i, 1, True)
    INDIRECT.check(not (t.onchip and axis == 0), f"indexing on-chip {t.name!r} with a runtime index on its partition dim")
    INDIRECT.check(not any(isinstance(x, (int, np.integer)) for x in index),
                   f"indexing {t.name!r} with {index!r}: integer indices beside a runtime index are not modelled")
    fixed = list(index) + [slice(None)] * (t.ndim - len(index))
    fixed[axis] = slice(0, size)
    view = t[tuple(fixed)]
    dims = [(n, b) for k, (n, b) in enumerate(zip(view.shape, view.bstrides)) if not (drop and k == axis)]
    item = t.dtype.itemsize
    pattern = [[b // item, n] for n, b in dims] or [[1, 1]]
    ap = AccessPattern(t, pattern, (view.boffset - t.boffset) // item, start, None, axis, t.dtype)
    ap.span = size
    return ap


_tensor.DYNAMIC.update(pattern=AccessPattern, view=dynamic_view)


def count_indirect(pattern: AccessPattern, nbytes: int, read_side: bool) -> None:
    """Counters of one dynamic-address DMA (its bytes, its descriptors for the cost model)."""
    stats = current().stats
    stats.indirect_dmas[(pattern.kind, pattern.descriptors())] += 1
    if not pattern.onchip:
        if read_side:
            stats.hbm_read_bytes += nbytes
        else:
            stats.hbm_write_bytes += nbytes
        stats.dma_runs[pattern.run_bytes()] += nbytes
