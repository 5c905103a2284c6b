"""NKI tensors as views: ``NkiTensor`` of aws-neuron-sdk @81ce03ae ``nki/api/nki/language/__init__.py`` (indexing,
``view``, ``reshape``, ``ap`` and the shape-view methods), over a :class:`~.machine.Storage`.

A :class:`Tensor` is (storage, dtype, shape, byte strides, byte offset) in the storage's logical layout; instructions
read and write it through numpy views (:meth:`Tensor.data`, :meth:`Tensor.written_bytes`). Dynamic access patterns
(``.ap`` with ``scalar_offset`` / ``vector_offset``) are :class:`~.dynamic.AccessPattern` objects resolved when a DMA
runs; everything here is static.
"""

from __future__ import annotations

import math

import numpy as np

from . import dtypes as dt
from .rules import GUIDE, LANG, NkiValidationError, rule

VIEW = rule("VIEW-PARTITION", LANG, "For on-chip tensors (SBUF, PSUM), the partition dim (dim 0) is skipped: partitions are "
            "physically independent memory banks",
            "an on-chip view's first dimension walks whole partitions and every other dimension stays inside its "
            "partition's bytes; views never leave their storage")
RESHAPE = rule("VIEW-RESHAPE", LANG, "On-chip tensors: ``shape[0]`` must equal ``t.shape[0]`` (partition dim preserved)",
               "reshape keeps the element count, an on-chip tile's partition count, and needs a layout that allows it "
               "without a copy (as numpy's in-place reshape)")
VIEW_DTYPE = rule("VIEW-DTYPE", LANG, "The last dimension must be contiguous in memory",
                  "view(dtype) reinterprets bytes; a different element size scales the last dimension, which must be "
                  "contiguous (and divisible by the ratio when the element grows)")
AP_PARTITION = rule("VIEW-AP-PARTITION", GUIDE, "For SBUF and PSUM tensors, the partition stride (the first ``[stride, count]`` "
                    "pair) must be equal to the storage's free-dim element count",
                    ".ap on an on-chip tensor: the first pair walks partitions with the storage's elements per partition "
                    "as its stride (in the pattern's dtype)")
INDEX = rule("VIEW-INDEX", LANG, "integer indexing on dim 0 produces a size-1 slice (partition dim is preserved, not removed)",
             "an integer index keeps an on-chip tensor's partition dim and removes any other dim (HBM: every dim); "
             "indices and slices must lie inside the tensor")


# Dynamic access patterns live in .dynamic, which builds on this module; it installs its constructors here at import
# ("pattern": AccessPattern, "view": dynamic_view) - the interpreter's package imports it with isa.
DYNAMIC: dict = {}


class DynamicSlice:
    """``nl.ds(start, size)``: ``start`` a compile-time int (a plain slice) or a runtime value."""

    __slots__ = ("start", "size")

    def __init__(self, start, size):
        self.start, self.size = start, int(size)

    def __repr__(self) -> str:
        return f"nl.ds({self.start!r}, {self.size})"


def ds(start, size) -> DynamicSlice:
    return DynamicSlice(start, size)


class Tensor:
    """An NKI tensor view. ``strides`` / ``offset``: logical bytes in the storage."""

    __slots__ = ("storage", "dtype", "shape", "bstrides", "boffset", "name")

    def __init__(self, storage, dtype: dt.Dtype, shape, bstrides=None, boffset: int = 0, name: str | None = None):
        self.storage, self.dtype = storage, dtype
        self.shape = tuple(int(s) for s in shape)
        if bstrides is None:
            bstrides, acc = [], dtype.itemsize
            for size in reversed(self.shape):
                bstrides.append(acc)
                acc *= size
            bstrides = tuple(reversed(bstrides))
        self.bstrides, self.boffset = tuple(int(s) for s in bstrides), int(boffset)
        self.name = name or storage.name
        _check_extent(self)

    # --- what instructions and kernels see ----------------------------------------------------------------
    @property
    def buffer(self) -> str:
        return self.storage.buffer

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def strides(self) -> tuple[int, ...]:
        return tuple(s // self.dtype.itemsize for s in self.bstrides)

    @property
    def offset(self) -> int:
        return self.boffset // self.dtype.itemsize

    @property
    def onchip(self) -> bool:
        return self.storage.onchip

    def __repr__(self) -> str:
        return f"Tensor({self.name!r}, {self.shape}, {self.dtype}, {self.buffer})"

    def _np(self, flat: np.ndarray, dtype, logical: bool = False, per_byte: bool = False) -> np.ndarray:
        s = self.storage
        if s.life is not None:
            s.machine.touch(s)
        shape, strides, off = list(self.shape), list(self.bstrides), self.boffset
        if s.onchip and not logical:
            p0, fb = divmod(off, s.row_bytes)
            off = s.base + p0 * s.pitch + fb
            if shape:
                strides[0] = (strides[0] // s.row_bytes) * s.pitch
        if per_byte:
            shape, strides = shape + [self.dtype.itemsize], strides + [1]
        return np.ndarray(tuple(shape), dtype=dtype, buffer=flat, offset=off, strides=tuple(strides))

    @property
    def data(self) -> np.ndarray:
        """The stored values (a writable numpy view in the tensor's dtype)."""
        return self._np(self.storage.bytes, self.dtype.np)

    def written_bytes(self) -> np.ndarray:
        """[*shape, itemsize] bool view: which bytes hold a written value."""
        return self._np(self.storage.written, bool, per_byte=True)

    @property
    def written(self) -> np.ndarray:
        """[*shape] bool (a copy): elements whose every byte was written."""
        return self.written_bytes().all(axis=-1)

    def mm_bytes(self) -> np.ndarray | None:
        """PSUM: [*shape, itemsize] uint8 view of each byte's state since the tile was allocated: 0 never written,
        1 last written by a non-matmul instruction, 2 last written by a matmul (nc_matmul's accumulate rules)."""
        mm = self.storage.mm
        return None if mm is None else self._np(mm, np.uint8, logical=True, per_byte=True)

    def mark_written(self, by_matmul: bool = False) -> None:
        self.written_bytes()[...] = True
        mm = self.mm_bytes()
        if mm is not None:
            mm[...] = 2 if by_matmul else 1

    # --- views ------------------------------------------------------------------------------------------
    def _derive(self, shape, bstrides, boffset, dtype=None) -> "Tensor":
        return Tensor(self.storage, dtype or self.dtype, shape, bstrides, boffset, self.name)

    def __getitem__(self, index) -> "Tensor":
        if not isinstance(index, tuple):
            index = (index,)
        if any(i is Ellipsis for i in index):
            at = index.index(Ellipsis)
            index = index[:at] + (slice(None),) * (self.ndim - len(index) + 1) + index[at + 1:]
        INDEX.check(len(index) <= self.ndim, f"too many indices ({len(index)}) for {self.name!r} of shape {self.shape}")
        shape, strides, off = [], [], self.boffset
        for axis, (size, stride) in enumerate(zip(self.shape, self.bstrides)):
            i = index[axis] if axis < len(index) else slice(None)
            if isinstance(i, DynamicSlice):
                if not isinstance(i.start, (int, np.integer)):
                    return DYNAMIC["view"](self, index)
                i = slice(int(i.start), int(i.start) + i.size)
            if isinstance(i, (int, np.integer)) and not isinstance(i, bool):
                i = int(i) + size if i < 0 else int(i)
                INDEX.check(0 <= i < size, f"index {i} out of bounds for axis {axis} (size {size}) of {self.name!r}")
                off += i * stride
                if axis == 0 and self.onchip:
                    shape.append(1)
                    strides.append(stride)
                continue
            if not isinstance(i, slice):
                return DYNAMIC["view"](self, index)
            start, stop, step = i.start, i.stop, 1 if i.step is None else int(i.step)
            INDEX.check(step >= 1, f"slice step {step} on axis {axis} of {self.name!r}: steps must be positive")
            start = 0 if start is None else int(start) + (size if int(start) < 0 else 0)
            stop = size if stop is None else int(stop) + (size if int(stop) < 0 else 0)
            INDEX.check(0 <= start <= stop <= size,
                        f"slice {start}:{stop} out of bounds for axis {axis} (size {size}) of {self.name!r}")
            shape.append(len(range(start, stop, step)))
            strides.append(stride * step)
            off += start * stride
        return self._derive(shape, strides, off)

    def view(self, dtype: dt.Dtype) -> "Tensor":
        """Reinterpret the bytes as ``dtype``; a different element size scales the last dimension."""
        old, new = self.dtype.itemsize, dtype.itemsize
        if old == new:
            return self._derive(self.shape, self.bstrides, self.boffset, dtype)
        VIEW_DTYPE.check(self.ndim >= 1 and (self.shape[-1] == 1 or self.bstrides[-1] == old),
                         f"view of {self.name!r} as {dtype}: its last dimension is not contiguous")
        last = self.shape[-1] * old
        VIEW_DTYPE.check(last % new == 0 and self.boffset % new == 0,
                         f"view of {self.name!r} {self.shape} {self.dtype} as {dtype}: {last} bytes in the last dimension "
                         f"(offset {self.boffset}) do not divide into {new}-byte elements")
        return self._derive(self.shape[:-1] + (last // new,), self.bstrides[:-1] + (new,), self.boffset, dtype)

    reinterpret_cast = view

    def reshape(self, shape) -> "Tensor":
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        if -1 in shape:
            known = int(np.prod([s for s in shape if s != -1], dtype=np.int64))
            shape = tuple(self.size // max(known, 1) if s == -1 else s for s in shape)
        RESHAPE.check(int(np.prod(shape, dtype=np.int64)) == self.size,
                      f"reshape of {self.name!r} {self.shape} to {shape}: element counts differ")
        if self.onchip:
            RESHAPE.check(shape[0] == self.shape[0], f"reshape of on-chip {self.name!r} {self.shape} to {shape}: the "
                                                     "partition dimension must stay")
        probe = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), self.shape, self.bstrides)
        try:
            moved = probe.view()
            moved.shape = shape
        except AttributeError:
            raise RESHAPE.error(f"reshape of {self.name!r} {self.shape} (strides {self.strides}) to {shape} needs a copy: "
                                "the layout does not allow it") from None
        return self._derive(shape, moved.strides, self.boffset)

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None):
        """``NkiTensor.ap``: ``[[stride, count], ...]`` in elements of ``dtype`` (default: the tensor's) over the
        storage, ``offset`` elements added to this view's offset. With a dynamic offset: an access pattern resolved
        when a DMA runs (:mod:`.dynamic`)."""
        dtype = dtype or self.dtype
        if scalar_offset is not None or vector_offset is not None:
            return DYNAMIC["pattern"](self, pattern, offset, scalar_offset, vector_offset, indirect_dim, dtype)
        pairs = parse_pattern(pattern, self.name)
        if self.onchip and pairs[0][1] > 1:
            AP_PARTITION.check(pairs[0][0] * dtype.itemsize == self.storage.row_bytes,
                               f".ap on {self.name!r}: partition stride {pairs[0][0]} != {self.storage.row_bytes // dtype.itemsize}, "
                               f"its storage's {dtype} elements per partition")
        base = self.boffset + int(offset or 0) * dtype.itemsize
        return Tensor(self.storage, dtype, [c for _s, c in pairs], [s * dtype.itemsize for s, _c in pairs], base, self.name)

    def get_pattern(self) -> list[list[int]]:
        return [[s, c] for s, c in zip(self.strides, self.shape)]

    def is_contiguous(self) -> bool:
        dims = list(zip(self.shape, self.bstrides))[1 if self.onchip else 0:]
        expected = self.dtype.itemsize
        for size, stride in reversed(dims):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def is_indirect(self) -> bool:
        return False

    def permute(self, dims) -> "Tensor":
        dims = tuple(int(d) for d in dims)
        VIEW.check(sorted(dims) == list(range(self.ndim)) and (not self.onchip or dims[0] == 0),
                   f"permute{dims} of {self.name!r}: a permutation of its dims, the partition dim first on-chip")
        return self._derive([self.shape[d] for d in dims], [self.bstrides[d] for d in dims], self.boffset)

    def broadcast(self, dim: int, size: int) -> "Tensor":
        VIEW.check(self.shape[dim] == 1 and not (self.onchip and dim == 0),
                   f"broadcast({dim}, {size}) of {self.name!r}: the dim must have size 1 (and not be the partition dim)")
        return self._derive(self.shape[:dim] + (int(size),) + self.shape[dim + 1:],
                            self.bstrides[:dim] + (0,) + self.bstrides[dim + 1:], self.boffset)

    def expand_dim(self, dim: int) -> "Tensor":
        VIEW.check(not (self.onchip and dim == 0), f"expand_dim(0) of on-chip {self.name!r}")
        return self._derive(self.shape[:dim] + (1,) + self.shape[dim:], self.bstrides[:dim] + (0,) + self.bstrides[dim:],
                            self.boffset)

    def squeeze_dim(self, dim: int) -> "Tensor":
        VIEW.check(self.shape[dim] == 1 and not (self.onchip and dim == 0), f"squeeze_dim({dim}) of {self.name!r}")
        return self._derive(self.shape[:dim] + self.shape[dim + 1:], self.bstrides[:dim] + self.bstrides[dim + 1:],
                            self.boffset)


def parse_pattern(pattern, name: str) -> list[tuple[int, int]]:
    try:
        pairs = [(int(s), int(c)) for s, c in pattern]
    except (TypeError, ValueError):
        raise NkiValidationError(f".ap pattern {pattern!r} of {name!r} must be a list of [stride, count] pairs") from None
    if not pairs or any(c <= 0 or s < 0 for s, c in pairs):
        raise NkiValidationError(f".ap pattern {pattern!r} of {name!r}: counts must be positive, strides non-negative")
    return pairs


def _check_extent(t: Tensor) -> None:
    """Every byte a view addresses lies inside its storage; on-chip, inside whole partitions (:data:`VIEW`)."""
    s, item = t.storage, t.dtype.itemsize
    if any(n <= 0 for n in t.shape):
        raise NkiValidationError(f"tensor {t.name!r} has a non-positive dimension: {t.shape}")
    if any(b < 0 for b in t.bstrides) or t.boffset < 0:
        raise VIEW.error(f"view of {t.name!r}: negative strides or offset")
    if not s.onchip:
        end = t.boffset + sum((n - 1) * b for n, b in zip(t.shape, t.bstrides)) + item
        VIEW.check(end <= s.row_bytes, f"view of HBM tensor {t.name!r} reaches byte {end} of its {s.row_bytes}")
        return
    p0, fb = divmod(t.boffset, s.row_bytes)
    rows = t.shape[0] if t.shape else 1
    pstride = t.bstrides[0] if t.shape else 0
    VIEW.check(rows == 1 or pstride % s.row_bytes == 0,
               f"view of on-chip {t.name!r}: its partition stride {pstride} B is not a whole number of partitions "
               f"({s.row_bytes} B each)")
    last = p0 + (rows - 1) * (pstride // s.row_bytes if rows > 1 else 0)
    VIEW.check(last < s.partitions, f"view of on-chip {t.name!r} reaches partition {last} of its {s.partitions}")
    end = fb + sum((n - 1) * b for n, b in zip(t.shape[1:], t.bstrides[1:])) + item
    VIEW.check(end <= s.row_bytes, f"view of on-chip {t.name!r}: its free dimensions reach byte {end} of a "
                                   f"{s.row_bytes}-byte partition (they may not cross into the next partition)")


# --- reading and writing values (every engine goes through these) -------------------------------------------

UNWRITTEN = rule("MEM-UNWRITTEN", "nki/guides/nki_simulator.rst", "The simulator automatically fills all newly allocated "
                 "tensors with **sentinel values** — ``NaN`` for floating-point types and ``4`` for integer types",
                 "computing on never-written elements is allowed (garbage on the device): they read as NaN (float dtypes) "
                 "or 4 (integer dtypes), so they show in the results, and Stats.unwritten_reads counts them; DMA moves "
                 "never-written bytes as they are and a kernel output returns them as 0xFF")


def _sentinel(t: Tensor, values: np.ndarray, raw: bool) -> np.ndarray:
    """``values`` with the never-written elements replaced by the simulator's sentinels (:data:`UNWRITTEN`)."""
    ok = t.written
    from .machine import current

    current().stats.unwritten_reads += int(ok.size - np.count_nonzero(ok))
    values = np.array(values, copy=True)
    if raw:
        if t.dtype.is_float:
            values[~ok] = np.array(np.nan, dtype=np.float32).astype(t.dtype.np)
        else:
            values[~ok] = 4
    else:
        values[~ok] = np.float32(np.nan) if t.dtype.is_float else np.float32(4)
    return values


def read(t: Tensor, what: str = "operand") -> np.ndarray:
    """The tensor's values as float32 (never-written elements as the sentinels of :data:`UNWRITTEN`)."""
    if t.dtype.packed:
        raise NkiValidationError(f"{what} {t.name!r} is {t.dtype}, a 4x packed MX type: only NeuronCore-v4 MX instructions "
                                 "compute on it")
    values = dt.to_float32(np.ascontiguousarray(t.data), t.dtype)
    return values if t.written_bytes().all() else _sentinel(t, values, raw=False)


def read_raw(t: Tensor, what: str = "operand") -> np.ndarray:
    """The stored values in their own dtype (bit patterns of integer / bitvec operations)."""
    values = np.array(t.data, copy=True)
    return values if t.written_bytes().all() else _sentinel(t, values, raw=True)


def write(t: Tensor, values: np.ndarray, by_matmul: bool = False) -> None:
    """Store float32 ``values`` (broadcast to the tensor's shape) with the engines' output cast."""
    if any(b == 0 and n > 1 for n, b in zip(t.shape, t.bstrides)):
        raise NkiValidationError(f"write into {t.name!r}: a broadcast view (stride 0) cannot be an instruction's destination")
    t.data[...] = dt.from_float32(np.broadcast_to(values, t.shape), t.dtype)
    t.mark_written(by_matmul)


def write_raw(t: Tensor, values: np.ndarray) -> None:
    """Store values already in the tensor's dtype (bit-exact)."""
    t.data[...] = np.broadcast_to(values, t.shape)
    t.mark_written()


def free_size(t: Tensor) -> int:
    """Elements per partition of an on-chip tensor (the free dims flattened)."""
    return math.prod(t.shape[1:])
