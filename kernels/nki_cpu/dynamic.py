"""Runtime-dependent NKI features: virtual registers, dynamic loops, indirect (scalar- / vector-offset) DMA
access patterns and DMA read-modify-write, as the routed-expert kernels use them.

API read in aws-neuron/aws-neuron-sdk @81ce03ae261e12925e53437a0f690478e6366155 (``nki/api/nki/isa/__init__.py``:
``register_alloc(x=None)``, ``register_move(dst, src)``, ``register_load(dst, src)``, ``dma_copy`` "Indirect
addressing", ``dma_compute(dst, srcs, reduce_op, scales=None, unique_indices=True, oob_mode=..)``;
``nki/api/nki/language/__init__.py``: ``NkiTensor.ap(pattern, offset=None, scalar_offset=None, vector_offset=None,
indirect_dim=0, dtype=None)``, ``dynamic_range(start, stop=None, step=1)``) and in their use by
aws-neuron/nki-library @d2ad3a579498d1888aa8740af97fd325dd5f2740 ``core/moe/moe_cte/bwmm_shard_on_I.py``.

What the interpreter enforces (each with a test in tests/test_nki_dynamic_rules.py):

* a register is read (loop bound, scalar offset) only after ``register_alloc(x)`` / ``register_load`` /
  ``register_move`` gave it a value; ``register_load`` reads a one-element integer tensor;
* ``nl.dynamic_range``: step a compile-time positive int; start/stop ints or loaded registers; the loop variable
  is a runtime value (:class:`DynamicIndex`): using it as a static index or Python int is refused - kernels keep
  the iteration's block index in an SBUF tile, as nki-library's kernel does;
* ``.ap`` on HBM tensors only (the indirect-DMA side), the pattern inside the tensor, ``scalar_offset`` a [1, 1]
  integer SBUF tile or a loaded register, ``vector_offset`` a [P, 1] integer SBUF tile with P = the pattern's
  partition count; every offset element is checked against the indexed dimension's size (``oob_mode.error``,
  the default: out of range is an error, never a silent skip);
* ``dma_compute`` with ``nl.add`` only, scales 1.0, two sources for read-modify-write, indices unique within one
  instruction (``unique_indices=True`` is the only supported mode); ``oob_mode=oob_mode.skip`` (the API: "silently
  skips any operations involving out-of-bounds indices"; ``dma_copy``'s text: it skips "the DMA transfer" of such an
  index) leaves the rows whose index is outside the indexed dimension untouched and moves no bytes for them, every
  in-range row still checked and added; any other mode value is refused;
* ``dma_copy(..., oob_mode=oob_mode.skip)`` (the API: "skip the DMA transfer for a given dynamic address or index
  when it is out of bound") on a scalar- or vector-offset access pattern: a vector offset's out-of-range rows, or a
  scalar offset's whole transfer when it is out of range, move nothing and leave their destination as it was (an
  SBUF destination row never written stays unreadable); on a static DMA (no dynamic address) it is refused.

Counters (``Stats``): ``indirect_dmas[(kind, descriptors)]``, ``register_loads``, ``dynamic_loops``,
``dynamic_iterations`` - priced by :mod:`.cost_dynamic`.
"""

from __future__ import annotations

import numpy as np

from . import dtypes as dt
from .machine import NkiValidationError, Tensor, current, read

INT_DTYPES = (dt.int32, dt.uint32, dt.int8, dt.uint8)


class oob_mode:  # noqa: N801  (mirrors nisa.oob_mode)
    error = "oob_mode.error"
    skip = "oob_mode.skip"


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
                "nisa.register_alloc(x), nisa.register_load(reg, tile) or nisa.register_move(reg, x) first"
            )
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


def _need_register(dst, what: str) -> VirtualRegister:
    if not isinstance(dst, VirtualRegister):
        raise NkiValidationError(f"{what} dst must be a register from nisa.register_alloc(), got {type(dst).__name__}")
    return dst


def register_move(dst, src) -> None:
    _need_register(dst, "register_move")
    if isinstance(src, VirtualRegister):
        dst.value = src.get("register_move src")
    elif isinstance(src, (int, np.integer)):
        dst.value = int(src)
    else:
        raise NkiValidationError(f"register_move src must be a compile-time int or a register, got {type(src).__name__}")


def register_load(dst, src: Tensor) -> None:
    """dst = the one integer element of ``src`` (HBM or SBUF)."""
    _need_register(dst, "register_load")
    if not isinstance(src, Tensor) or src.buffer == "psum" or src.data.size != 1:
        raise NkiValidationError(f"register_load src must be a one-element HBM/SBUF tensor ([1] or [1, 1]), got {src!r}")
    if src.dtype not in INT_DTYPES:
        raise NkiValidationError(f"register_load src {src.name!r} is {src.dtype}: registers hold 32-bit integers; load an int32 tile")
    dst.value = int(read(src, "register_load src").reshape(-1)[0])
    current().stats.register_loads += 1


class DynamicIndex:
    """The iteration variable of ``nl.dynamic_range``: a runtime value, not a Python int."""

    __slots__ = ("loop",)

    def __init__(self, loop: str):
        self.loop = loop

    def _refuse(self, *_args):
        raise NkiValidationError(
            f"the iteration variable of {self.loop} is a runtime value: it cannot be a static index, Python int or "
            "arithmetic operand; keep the block index in an SBUF tile and address with .ap(scalar_offset=tile)"
        )

    __index__ = __int__ = __add__ = __radd__ = __mul__ = __rmul__ = __sub__ = __bool__ = _refuse


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
    return (DynamicIndex(f"nl.dynamic_range({lo}, {hi})") for _ in range(trips))


# --- access patterns ----------------------------------------------------------------------------------

def _offset_value(off, what: str) -> int:
    if isinstance(off, VirtualRegister):
        return off.get(what)
    if not isinstance(off, Tensor) or off.buffer != "sbuf" or off.data.size != 1:
        raise NkiValidationError(f"{what} must be a [1, 1] SBUF tile or a register, got {off!r}")
    if off.dtype not in INT_DTYPES:
        raise NkiValidationError(f"{what} {off.name!r} is {off.dtype}; offsets are integer tiles (int32)")
    return int(read(off, what).reshape(-1)[0])


class AccessPattern:
    """``tensor.ap(...)``: explicit element addresses into a contiguous HBM tensor (resolved when a DMA runs)."""

    def __init__(self, base: Tensor, pattern, offset, scalar_offset, vector_offset, indirect_dim, dtype):
        if base.buffer != "hbm":
            raise NkiValidationError(f".ap on {base.name!r} ({base.buffer}): the interpreter models access patterns on HBM tensors (the indirect-DMA side)")
        if not base.data.flags.c_contiguous:
            raise NkiValidationError(f".ap on a non-contiguous view of {base.name!r}: call it on the whole HBM tensor")
        if dtype is not None and dtype is not base.dtype:
            raise NkiValidationError(f".ap(dtype={dtype}) reinterpretation is not modelled; use .view(dtype) on the tile")
        if scalar_offset is not None and vector_offset is not None:
            raise NkiValidationError(".ap: scalar_offset and vector_offset are mutually exclusive")
        try:
            pattern = [(int(s), int(c)) for s, c in pattern]
        except (TypeError, ValueError):
            raise NkiValidationError(f".ap pattern {pattern!r} must be a list of [stride, count] pairs") from None
        if not pattern or any(c <= 0 or s < 0 for s, c in pattern):
            raise NkiValidationError(f".ap pattern {pattern!r}: counts must be positive, strides non-negative")
        if not 0 <= int(indirect_dim) < base.ndim:
            raise NkiValidationError(f".ap indirect_dim={indirect_dim} outside {base.name!r}'s {base.ndim} dims")
        self.base, self.pattern, self.offset = base, pattern, int(offset or 0)
        self.scalar_offset, self.vector_offset, self.indirect_dim = scalar_offset, vector_offset, int(indirect_dim)
        self.dtype, self.buffer, self.name = base.dtype, "hbm", base.name
        self.shape = tuple(c for _s, c in pattern)

    @property
    def kind(self) -> str:
        return "vector" if self.vector_offset is not None else "scalar" if self.scalar_offset is not None else "static"

    def addresses(self, skip: bool = False) -> np.ndarray:
        """Flat element index into the base tensor for every element of the pattern (checked in range).
        ``skip`` (``oob_mode.skip``): a vector offset's partition rows whose index lies outside the indexed
        dimension are dropped (:meth:`kept_rows`), a scalar offset outside it drops every element; not refused."""
        dim_stride = int(np.prod(self.base.shape[self.indirect_dim + 1:], dtype=np.int64))
        dim_size = self.base.shape[self.indirect_dim]
        grids = np.meshgrid(*[np.arange(c, dtype=np.int64) * s for s, c in self.pattern], indexing="ij")
        addr = self.offset + sum(grids)
        if self.kind == "scalar":
            v = _offset_value(self.scalar_offset, f".ap scalar_offset of {self.name!r}")
            if skip and not 0 <= v < dim_size:  # oob_mode.skip: the whole transfer is skipped
                return addr.reshape(-1)[:0]
            _check_index(np.array([v]), dim_size, self.name, "scalar_offset")
            addr = addr + v * dim_stride
        elif self.kind == "vector":
            vo = self.vector_offset
            if not isinstance(vo, Tensor) or vo.buffer != "sbuf" or vo.ndim != 2 or vo.shape[1] != 1:
                raise NkiValidationError(f".ap vector_offset of {self.name!r} must be a [P, 1] SBUF tile, got {vo!r}")
            if vo.dtype not in INT_DTYPES:
                raise NkiValidationError(f".ap vector_offset {vo.name!r} is {vo.dtype}; offsets are integer tiles")
            if vo.shape[0] != self.shape[0]:
                raise NkiValidationError(f".ap vector_offset {vo.name!r} has {vo.shape[0]} partitions; the pattern's partition count is {self.shape[0]}")
            idx = read(vo, ".ap vector_offset").reshape(-1).astype(np.int64)
            keep = (idx >= 0) & (idx < dim_size) if skip else np.ones(idx.shape, dtype=bool)
            _check_index(idx[keep], dim_size, self.name, "vector_offset")
            # the partition dim is addressed by the per-partition index, not by the pattern's first stride
            addr = (addr - grids[0] + (idx * dim_stride).reshape((-1,) + (1,) * (len(self.shape) - 1)))[keep]
            if addr.size == 0:
                return addr
        if addr.min() < 0 or addr.max() >= self.base.data.size:
            raise NkiValidationError(
                f".ap on {self.name!r} {self.base.shape}: the pattern {self.pattern} at offset {self.offset} reaches element "
                f"{int(addr.max())} outside the tensor's {self.base.data.size} elements"
            )
        return addr

    def kept_rows(self) -> np.ndarray:
        """[P] bool: the partition rows an ``oob_mode.skip`` DMA moves - a vector offset's rows whose index lies
        inside the indexed dimension; a scalar offset's every row or none."""
        size = self.base.shape[self.indirect_dim]
        if self.kind == "scalar":
            v = _offset_value(self.scalar_offset, f".ap scalar_offset of {self.name!r}")
            return np.full(self.shape[0], 0 <= v < size, dtype=bool)
        idx = read(self.vector_offset, ".ap vector_offset").reshape(-1).astype(np.int64)
        return (idx >= 0) & (idx < size)

    def run_bytes(self) -> int:
        """Bytes of the innermost contiguous run per descriptor."""
        run, expected = self.dtype.itemsize, 1
        dims = self.pattern[1:] if self.kind == "vector" else self.pattern
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


def _check_index(idx: np.ndarray, size: int, name: str, what: str) -> None:
    bad = (idx < 0) | (idx >= size)
    if bad.any():
        raise NkiValidationError(
            f"{what} {int(idx[bad][0])} out of range for the indexed dimension of {name!r} (size {size}): "
            "an indirect DMA outside the tensor is an error (oob_mode.error)"
        )


def ap(tensor: Tensor, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None):
    """``NkiTensor.ap(pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None)``."""
    return AccessPattern(tensor, pattern, offset, scalar_offset, vector_offset, indirect_dim, dtype)


Tensor.ap = ap  # the method NKI tensors have (machine.Tensor cannot import this module: it is built on it)


def gather(src: AccessPattern, skip: bool = False) -> tuple[np.ndarray, np.ndarray]:
    addr = src.addresses(skip)
    flat, written = src.base.data.reshape(-1), src.base.written.reshape(-1)
    return flat[addr], written[addr]


def scatter(dst: AccessPattern, values: np.ndarray, skip: bool = False) -> None:
    addr = dst.addresses(skip)
    if np.unique(addr).size != addr.size:
        raise NkiValidationError(f"indirect write into {dst.name!r} addresses an element twice in one DMA; indices must be unique")
    dst.base.data.reshape(-1)[addr] = values
    dst.base.written.reshape(-1)[addr] = True


def count_indirect(pattern: AccessPattern, nbytes: int, read_side: bool) -> None:
    stats = current().stats
    if pattern.kind != "static":
        stats.indirect_dmas[(pattern.kind, pattern.descriptors())] += 1
    if read_side:
        stats.hbm_read_bytes += nbytes
    else:
        stats.hbm_write_bytes += nbytes
    stats.dma_runs[pattern.run_bytes()] += nbytes


def dma_compute(dst, srcs, reduce_op, scales=None, unique_indices=True, oob_mode=None, name=None) -> None:
    """dst = srcs[0] + srcs[1] computed in the DMA engine (fp32): the scatter read-modify-write form
    ``out.ap(vector_offset=idx) += tile`` (one source is ``dst`` itself, the other an SBUF tile).
    ``oob_mode``: error (default: an index outside the indexed dimension is refused) or skip (such rows are left
    untouched and move no bytes; their descriptors are still written)."""
    modes = (None, globals()["oob_mode"].error, globals()["oob_mode"].skip)
    if not any(oob_mode is m for m in modes):
        raise NkiValidationError(f"dma_compute(oob_mode={oob_mode!r}): use nisa.oob_mode.error or nisa.oob_mode.skip")
    skip = oob_mode is globals()["oob_mode"].skip
    if getattr(reduce_op, "name", None) != "add":  # nl.add (language imports this module: compared by name)
        raise NkiValidationError(f"dma_compute reduce_op={reduce_op!r}: only nl.add is supported")
    if scales is not None and any(float(s) != 1.0 for s in scales):
        raise NkiValidationError("dma_compute scales must all be 1.0")
    if not unique_indices:
        raise NkiValidationError("dma_compute(unique_indices=False) is not supported (non-unique indices)")
    srcs = list(srcs)
    if len(srcs) != 2:
        raise NkiValidationError(f"dma_compute read-modify-write takes exactly 2 sources, got {len(srcs)}")
    if not isinstance(dst, AccessPattern) or dst.kind != "vector":
        raise NkiValidationError("dma_compute: the interpreter models the scatter read-modify-write form (dst = HBM .ap with vector_offset)")
    same = [s for s in srcs if isinstance(s, AccessPattern) and s.base is dst.base and s.pattern == dst.pattern
            and s.offset == dst.offset and s.vector_offset is dst.vector_offset]
    tiles = [s for s in srcs if isinstance(s, Tensor) and s.buffer == "sbuf"]
    if len(same) != 1 or len(tiles) != 1:
        raise NkiValidationError("dma_compute read-modify-write: one source must be dst itself, the other an SBUF tile")
    tile = tiles[0]
    if tile.shape != dst.shape:
        raise NkiValidationError(f"dma_compute: tile {tile.name!r} {tile.shape} does not match the destination pattern {dst.shape}")
    old, old_written = gather(dst, skip)
    if not old_written.all():
        raise NkiValidationError(f"dma_compute reads never-written elements of {dst.name!r}: initialise the output first")
    values = read(tile, "dma_compute src")
    if skip:
        values = values[dst.kept_rows()]
    acc = dt.to_float32(old, dst.dtype) + values.reshape(old.shape)
    scatter(dst, dt.from_float32(acc, dst.dtype), skip)
    nbytes = int(values.size) * dst.dtype.itemsize
    count_indirect(dst, nbytes, read_side=True)
    stats = current().stats
    stats.hbm_write_bytes += nbytes
    stats.dma_runs[dst.run_bytes()] += nbytes
    stats.dma_count += 1
