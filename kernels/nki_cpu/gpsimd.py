"""GpSimdE instructions: ``iota``, ``nonzero_with_count`` (aws-neuron-sdk @81ce03ae ``nki/api/nki/isa/__init__.py``),
rules ``GP-*``. GpSimdE never touches PSUM (:data:`.engines.GPSIMD_PSUM`)."""

from __future__ import annotations

import numpy as np

from . import dtypes as dt
from .engines import count, tile
from .rules import ISA, rule
from .tensor import free_size, read_raw, write, write_raw

IOTA = rule("GP-IOTA", ISA, "The total number of elements in ``pattern`` must match the number of elements per partition in "
            "the ``dst`` tile", "iota: value = offset + partition * channel_multiplier + sum(index * step) in int32, cast to "
            "dst (SBUF); up to 4 [step, num] pairs")
NONZERO = rule("GP-NONZERO", ISA, "this instruction only operates on partitions [0, 16, 32, ..., 112] of the input tile",
               "nonzero_with_count reads and writes partitions 0, 16, ..., 112 only (others untouched); src float32/int32, "
               "dst int32 with one more element (the count last)")


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None) -> None:
    dst = tile(dst, "iota dst", ("sbuf",))
    pairs = [(int(s), int(n)) for s, n in pattern]
    IOTA.check(1 <= len(pairs) <= 4, f"iota pattern {pattern}: 1 to 4 [step, num] pairs")
    IOTA.check(int(np.prod([n for _s, n in pairs])) == free_size(dst),
               f"iota pattern {pattern} has {int(np.prod([n for _s, n in pairs]))} elements; dst has {free_size(dst)} per partition")
    grids = np.meshgrid(*[np.arange(n, dtype=np.int64) * s for s, n in pairs], indexing="ij")
    per = (int(offset) + sum(grids)).reshape(-1)
    values = per[None, :] + np.arange(dst.shape[0], dtype=np.int64)[:, None] * int(channel_multiplier)
    values = values.astype(np.int32).reshape(dst.shape)
    if dst.dtype.is_int:
        write_raw(dst, values.astype(dst.dtype.np))
    else:
        write(dst, values.astype(np.float32))
    count("gpsimd", "iota", dst)


def nonzero_with_count(dst, src, index_offset=0, padding_val=-1, name=None) -> None:
    src, dst = tile(src, "nonzero_with_count src", ("sbuf",)), tile(dst, "nonzero_with_count dst", ("sbuf",))
    NONZERO.check(src.dtype in (dt.float32, dt.int32) and dst.dtype is dt.int32,
                  f"nonzero_with_count: src {src.dtype} (float32 / int32), dst {dst.dtype} (int32)")
    n = free_size(src)
    NONZERO.check(dst.shape[0] == src.shape[0] and free_size(dst) == n + 1,
                  f"nonzero_with_count: dst {dst.shape} must have src's partitions and {n + 1} elements each")
    for p in range(0, src.shape[0], 16):
        row = read_raw(src[p], "nonzero_with_count src").reshape(-1)
        idx = np.flatnonzero(row != 0).astype(np.int64) + int(index_offset)
        out = np.full(n + 1, int(padding_val), dtype=np.int64)
        out[:idx.size] = idx
        out[n] = idx.size
        write_raw(dst[p], out.astype(np.int32).reshape(dst[p].shape))
    count("gpsimd", "nonzero_with_count", src)


GATHER = rule("GP-LOCAL-GATHER", ISA, "The partition axis size of ``src_buffer`` must match that of ``index`` and must be a "
              "multiple of 16", "local_gather: per GpSimd core (16 partitions) the core's uint16 indices, flattened "
              "column-major (the doc's numpy semantics, test_nki_isa_local_gather.py), are element offsets into each of its "
              "partitions; num_elem_per_idx in 1..32 (powers of 2) contiguous elements each; dtype kept; an index past "
              "the partition is refused (undefined on the device)")


def local_gather(dst, src_buffer, index, num_elem_per_idx=1, num_valid_indices=None, name=None) -> None:
    src, idx, dst = (tile(t, f"local_gather {w}", ("sbuf",)) for t, w in ((src_buffer, "src_buffer"), (index, "index"), (dst, "dst")))
    GATHER.check(src.shape[0] == idx.shape[0] and src.shape[0] % 16 == 0,
                 f"local_gather: src_buffer {src.shape} and index {idx.shape} partitions (equal, a multiple of 16)")
    GATHER.check(idx.dtype is dt.uint16, f"local_gather index {idx.name!r} is {idx.dtype}: uint16")
    GATHER.check(dst.dtype is src.dtype, f"local_gather: dst {dst.dtype} != src {src.dtype} (no casting)")
    nep = int(num_elem_per_idx)
    GATHER.check(nep in (1, 2, 4, 8, 16, 32), f"local_gather num_elem_per_idx={nep}: 1, 2, 4, 8, 16 or 32")
    per_core = idx.size // (idx.shape[0] // 16)
    valid = per_core if num_valid_indices is None else int(num_valid_indices)
    GATHER.check(0 < valid <= per_core and valid <= 4096, f"local_gather num_valid_indices={valid}: 1..{per_core} (<= 4096)")
    GATHER.check(dst.shape[0] == src.shape[0] and free_size(dst) == valid * nep,
                 f"local_gather dst {dst.shape}: [{src.shape[0]}, {valid} x {nep} elements]")
    values = read_raw(src, "local_gather src_buffer").reshape(src.shape[0], -1)
    offsets = read_raw(idx, "local_gather index").reshape(idx.shape[0], -1).astype(np.int64)
    out = np.empty((src.shape[0], valid * nep), dtype=values.dtype)
    for c in range(src.shape[0] // 16):
        flat = offsets[16 * c:16 * c + 16].flatten(order="F")[:valid]
        GATHER.check(flat.max(initial=0) + nep <= values.shape[1],
                     f"local_gather: an index ({int(flat.max())}) reaches past the {values.shape[1]} elements per partition")
        cols = (flat[:, None] + np.arange(nep)[None, :]).reshape(-1)
        out[16 * c:16 * c + 16] = values[16 * c:16 * c + 16][:, cols]
    write_raw(dst, out.reshape(dst.shape))
    count("gpsimd", "local_gather", dst)
