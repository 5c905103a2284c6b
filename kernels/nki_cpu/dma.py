"""The DMA instructions: ``dma_copy``, ``dma_transpose``, ``dma_compute`` (aws-neuron-sdk @81ce03ae
``nki/api/nki/isa/__init__.py``), with their documented rules (:data:`RULES` ids ``DMA-*``).

A same-dtype copy moves bytes as they are (never-written bytes stay never-written: garbage travels, it is not an
error until an engine computes on it). Counters: ``dma_count``, HBM bytes and contiguous run lengths, indirect DMAs
and their descriptors (:mod:`.dynamic`), ``hwdge_dmas`` (descriptors written by the hardware DGE, not GpSimd).
"""

from __future__ import annotations

import numpy as np

from . import dtypes as dt
from .dynamic import AccessPattern, count_indirect
from .enums import coerce, dge_mode, engine_name, oob_mode
from .machine import current
from .rules import ISA, TRN2, MIGRATION, NkiValidationError, rule
from .tensor import Tensor, read, write

MEMORY = rule("DMA-MEMORY", ISA, "Both ``src`` and ``dst`` tiles can be in HBM or SBUF",
              "a DMA moves between HBM and SBUF; a PSUM operand is refused (evacuate PSUM with an engine instruction)")
CONVERT = rule("DMA-CONVERT", ISA, "The DMA engines automatically handle data type conversion when ``src`` and ``dst`` have "
               "different data types", "different dtypes convert through float32 (src -> float32 -> dst); equal dtypes copy bits")
COUNT = rule("DMA-COUNT", ISA, "The total number of data elements in ``src`` must match that of ``dst``",
             "shapes may differ; the element counts must match (elements pair up in row-major order)")
DGE = rule("DMA-DGE", ISA, "When ``sw_dge`` is selected, ``nisa.dma_copy`` can also perform a gather or scatter operation",
           "dge_mode is unknown / swdge / hwdge / none; a dynamic address needs swdge or hwdge (or unknown), a gather / "
           "scatter (vector offset) swdge (or unknown); engine= only with hwdge, and only sync or scalar")
PRIORITY = rule("DMA-PRIORITY", ISA, "DMA quality-of-service priority level 0-3 where lower is higher priority (NeuronCore-v4+ only)",
                "priority= is refused on Trn2 (NeuronCore-v3)")
OOB = rule("DMA-OOB", ISA, "skip the DMA transfer for a given dynamic address or index when it is out of bound",
           "oob_mode.skip drops out-of-range rows (vector offset) or the whole transfer (scalar offset); on a DMA without "
           "a dynamic address it is refused")
TRANSPOSE = rule("DMA-TRANSPOSE", TRN2, "Trainium2 DMA transpose supports bit-accurate transposition for both 2-byte and "
                 "4-byte data types", "dma_transpose: 2- or 4-byte dtypes (2-byte with hwdge), src.dtype == dst.dtype, dst in "
                 "SBUF, axes (1, 0) / (2, 1, 0) / (3, 1, 2, 0), dst.shape the permuted src.shape exactly; dge_mode unknown "
                 "or hwdge as the API reference says, and none, which nki-library's tested FP8 path uses (a doc conflict)")
TRANSPOSE_SHAPE = rule("DMA-TRANSPOSE-SHAPE", MIGRATION, "``nisa.dma_transpose`` now enforces that ``dst.shape`` matches the "
                       "transposed ``src.shape`` exactly, including rank", "dma_transpose dst shape = permuted src shape")
COMPUTE = rule("DMA-COMPUTE", ISA, "Currently, only ``nl.add`` is supported for ``reduce_op``",
               "dma_compute: reduce_op nl.add, scales all 1.0, up to 16 sources of equal element count, unique indices; "
               "read-modify-write with a vector offset takes exactly 2 sources, one of them dst itself")


_DGE = dge_mode
DGE_MODES = (None, dge_mode.unknown, dge_mode.swdge, dge_mode.hwdge, dge_mode.none)


def hbm_run_bytes(t: Tensor) -> int:
    """Bytes of the innermost contiguous run of an HBM view (a DMA descriptor's length)."""
    run = expected = t.dtype.itemsize
    for size, stride in zip(reversed(t.shape), reversed(t.bstrides)):
        if size == 1:
            continue
        if stride != expected:
            break
        run *= size
        expected *= size
    return run


def _operand(t, what: str):
    if not isinstance(t, (Tensor, AccessPattern)):
        raise NkiValidationError(f"{what} must be an NKI tensor or access pattern, got {type(t).__name__}")
    MEMORY.check(t.buffer != "psum", f"{what} {t.name!r} is in PSUM: DMA moves HBM <-> SBUF; evacuate PSUM with an "
                                     "engine instruction")
    return t


def _count(src: Tensor, dst: Tensor, hwdge: bool) -> None:
    stats = current().stats
    stats.dma_count += 1
    stats.hwdge_dmas += int(hwdge)
    for t, side in ((src, "read"), (dst, "write")):
        if not t.onchip:
            nbytes = t.size * t.dtype.itemsize
            setattr(stats, f"hbm_{side}_bytes", getattr(stats, f"hbm_{side}_bytes") + nbytes)
            stats.dma_runs[hbm_run_bytes(t)] += nbytes


def move(dst: Tensor, src: Tensor) -> None:
    """dst = src element for element in row-major order: bits when the dtypes agree (written-ness travels), else
    through float32 (:data:`CONVERT`)."""
    COUNT.check(dst.size == src.size, f"DMA element counts differ: src {src.name!r} {src.shape} ({src.size}) vs dst "
                                      f"{dst.name!r} {dst.shape} ({dst.size})")
    if dst.dtype is src.dtype or {dst.dtype, src.dtype} <= {dt.uint8, dt.bool_}:
        k = src.dtype.itemsize
        raw = np.array(src._np(src.storage.bytes, np.uint8, per_byte=True), copy=True).reshape(dst.shape + (k,))
        mask = np.array(src.written_bytes(), copy=True).reshape(dst.shape + (k,))
        dst._np(dst.storage.bytes, np.uint8, per_byte=True)[...] = raw
        dst.written_bytes()[...] = mask
        return
    ok = src.written.reshape(dst.shape)
    values = dt.to_float32(np.ascontiguousarray(src.data), src.dtype).reshape(dst.shape)
    dst.data[...] = dt.from_float32(values, dst.dtype)
    dst.written_bytes()[...] = ok[..., None]


def _dge(mode, engine, dynamic: bool, vector: bool) -> bool:
    """Validate dge_mode / engine; returns whether the hardware DGE writes the descriptors."""
    mode = coerce(_DGE, mode)
    DGE.check(mode in DGE_MODES, f"dge_mode={mode!r}: use nisa.dge_mode.unknown / swdge / hwdge / none")
    DGE.check(not (dynamic and mode == dge_mode.none), "a DMA with a dynamic address needs DGE (swdge or hwdge), not dge_mode.none")
    DGE.check(not (vector and mode in (dge_mode.hwdge, dge_mode.none)),
              "a gather / scatter (vector_offset) DMA runs on software DGE: dge_mode must be swdge or unknown")
    engine = engine_name(engine)
    if engine != "unknown":
        DGE.check(mode == dge_mode.hwdge and engine in ("sync", "scalar"),
                  f"dma_copy(engine={engine!r}): only valid with dge_mode=hwdge, and only sync or scalar")
    return mode == dge_mode.hwdge


def _skip(mode, dynamic: bool) -> bool:
    mode = coerce(oob_mode, mode)
    if mode is None or mode is oob_mode.error:
        return False
    OOB.check(mode is oob_mode.skip, f"oob_mode={mode!r}: use nisa.oob_mode.error or nisa.oob_mode.skip")
    OOB.check(dynamic, "oob_mode=oob_mode.skip on a DMA without a dynamic address (scalar_offset / vector_offset): "
                       "nothing can be out of bounds at run time; drop oob_mode")
    return True


def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=None, name=None) -> None:  # noqa: A002
    """dst = src between HBM and SBUF (static, scalar-offset or gather / scatter access patterns)."""
    PRIORITY.check(priority is None, f"dma_copy(priority={priority!r}): {PRIORITY.quote}")
    dst, src = _operand(dst, "dma_copy dst"), _operand(src, "dma_copy src")
    aps = [t for t in (dst, src) if isinstance(t, AccessPattern)]
    vector = [t for t in aps if t.kind == "vector"]
    hw = _dge(dge_mode, engine, bool(aps), bool(vector))
    skip = _skip(oob_mode, bool(aps))
    if vector:
        if len(vector) != 1 or isinstance(dst if vector[0] is src else src, AccessPattern):
            raise NkiValidationError("dma_copy: a gather / scatter takes one vector-offset pattern and a plain tile on the other side")
        return _gather_scatter(dst, src, vector[0], skip)
    for t in aps:  # scalar offsets: the whole transfer moves or (skip, out of range) nothing does
        if skip and not t.in_range():
            current().stats.dma_count += 1
            count_indirect(t, 0, read_side=t is src)
            return
    d = dst.static("dma_copy dst") if isinstance(dst, AccessPattern) else dst
    s = src.static("dma_copy src") if isinstance(src, AccessPattern) else src
    move(d, s)
    _count(s, d, hw)
    for t in aps:
        count_indirect(t, 0, read_side=t is src)


def _gather_scatter(dst, src, pattern: AccessPattern, skip: bool) -> None:
    """Row p of the tile <-> the row the vector offset names (rows out of range move nothing with skip)."""
    tile = dst if pattern is src else src
    COUNT.check(tile.shape[0] == pattern.shape[0] and tile.size == pattern.size,
                f"dma_copy: tile {tile.name!r} {tile.shape} does not match the gather/scatter pattern {pattern.shape}")
    rows = pattern.rows(skip)
    if pattern is dst:  # rows scattering to one address: the docs name no order; here the highest partition wins
        for p, row in rows:
            move(row, tile[p])
    else:
        for p, row in rows:
            move(tile[p], row)
    moved = sum(r.size for _p, r in rows) * pattern.dtype.itemsize
    current().stats.dma_count += 1
    count_indirect(pattern, moved, read_side=pattern is src)


def dma_transpose(dst, src, axes=None, priority=None, dge_mode=dge_mode.unknown, oob_mode=oob_mode.error, name=None) -> None:
    """dst = src transposed by ``axes`` on the DMA engines (HBM or SBUF -> SBUF)."""
    PRIORITY.check(priority is None, f"dma_transpose(priority={priority!r}): {PRIORITY.quote}")
    if isinstance(src, AccessPattern):
        raise NkiValidationError("dma_transpose with an indirect (vector_offset) source is not modelled by the interpreter")
    _operand(src, "dma_transpose src")
    TRANSPOSE.check(isinstance(dst, Tensor) and dst.buffer == "sbuf", f"dma_transpose dst must be an SBUF tile, got {dst!r}")
    dge_mode = coerce(_DGE, dge_mode)
    # The doc's direct-transpose constraints name unknown and hwdge only; nki-library's FP8 row-scale path, which its
    # tests run on hardware (mlp_tkg_gate_up_projection.py @d2ad3a57), passes dge_mode none (a static DMA): accepted.
    TRANSPOSE.check(dge_mode in (None, _DGE.unknown, _DGE.hwdge, _DGE.none),
                    f"dma_transpose dge_mode={dge_mode!r}: unknown, hwdge (or none)")
    _skip(oob_mode, False)
    TRANSPOSE.check(src.dtype is dst.dtype, f"dma_transpose: src {src.dtype} and dst {dst.dtype} differ (src.dtype == dst.dtype)")
    sizes = (2,) if dge_mode is _DGE.hwdge else (2, 4)
    TRANSPOSE.check(src.dtype.itemsize in sizes, f"dma_transpose of {src.dtype} ({src.dtype.itemsize}-byte elements): "
                                                 f"{TRANSPOSE.quote}" + (" (hwdge: 2-byte only)" if sizes == (2,) else ""))
    default = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}
    axes = tuple(axes) if axes is not None else default.get(src.ndim)
    TRANSPOSE.check(axes in default.values() and len(axes) == src.ndim,
                    f"dma_transpose axes={axes} for a {src.ndim}-d source: supported (1, 0), (2, 1, 0), (3, 1, 2, 0)")
    want = tuple(src.shape[a] for a in axes)
    TRANSPOSE_SHAPE.check(dst.shape == want, f"dma_transpose dst {dst.shape} != transposed src {want}")
    values = np.transpose(read(src, "dma_transpose src"), axes)
    write(dst, values)
    _count(src, dst, dge_mode is _DGE.hwdge)


def dma_compute(dst, srcs, reduce_op, scales=None, unique_indices=True, oob_mode=oob_mode.error, name=None) -> None:
    """dst = reduce_op(srcs[i] * scales[i]) in float32 on the DMA engines; with a vector offset, scatter or gather
    read-modify-write (``dst[idx] += tile`` / ``tile += src[idx]``)."""
    COMPUTE.check(getattr(reduce_op, "name", None) == "add", f"dma_compute reduce_op={reduce_op!r}: only nl.add is supported")
    srcs = list(srcs)
    COMPUTE.check(1 <= len(srcs) <= 16, f"dma_compute takes 1..16 sources, got {len(srcs)}")
    COMPUTE.check(scales is None or all(float(s) == 1.0 for s in scales), "dma_compute scales must all be 1.0")
    COMPUTE.check(bool(unique_indices), "dma_compute(unique_indices=False): non-unique indices are not supported")
    vector = [t for t in [dst, *srcs] if isinstance(t, AccessPattern) and t.kind == "vector"]
    skip = _skip(oob_mode, bool(vector) or any(isinstance(t, AccessPattern) for t in [dst, *srcs]))
    for t in [dst, *srcs]:
        _operand(t, "dma_compute operand")
    if not vector:
        d = dst.static("dma_compute dst") if isinstance(dst, AccessPattern) else dst
        ss = [s.static("dma_compute src") if isinstance(s, AccessPattern) else s for s in srcs]
        for s in ss:
            COUNT.check(s.size == d.size, f"dma_compute: source {s.name!r} {s.shape} and dst {d.shape} element counts differ")
        acc = sum(read(s, "dma_compute src").reshape(d.shape) for s in ss)
        write(d, acc)
        _count(ss[0], d, False)
        return
    COMPUTE.check(len(srcs) == 2, f"dma_compute read-modify-write takes exactly 2 sources, got {len(srcs)}")
    pattern = vector[0]
    same = [s for s in srcs if s is dst or (isinstance(s, AccessPattern) and isinstance(dst, AccessPattern)
                                            and s.base.storage is dst.base.storage and s.pairs == dst.pairs
                                            and s.offset == dst.offset and s.vector_offset is dst.vector_offset)]
    other = [s for s in srcs if not any(s is x for x in same)]
    COMPUTE.check(len(same) == 1 and len(other) == 1, "dma_compute read-modify-write: one source must be dst itself")
    tile = dst if pattern is not dst else other[0]
    COMPUTE.check(isinstance(tile, Tensor) and tile.buffer == "sbuf" and tile.size == pattern.size and tile.shape[0] == pattern.shape[0],
                  f"dma_compute: the SBUF side {tile!r} must match the pattern {pattern.shape}")
    rows = pattern.rows(skip, unique=pattern is dst)  # dma_compute: "``unique_indices`` must be ``True``"
    for p, row in rows:
        if pattern is dst:  # scatter RMW: dst(HBM)[idx] += tile
            write(row, read(row, "dma_compute dst").reshape(row.shape) + read(tile[p], "dma_compute src").reshape(row.shape))
        else:  # gather RMW: tile += src(HBM)[idx]
            write(tile[p], read(tile[p], "dma_compute dst").reshape(tile[p].shape) + read(row, "dma_compute src").reshape(tile[p].shape))
    nbytes = sum(r.size for _p, r in rows) * pattern.dtype.itemsize
    count_indirect(pattern, nbytes, read_side=True)
    stats = current().stats
    if pattern is dst:
        stats.hbm_write_bytes += nbytes
        stats.dma_runs[pattern.run_bytes()] += nbytes
    stats.dma_count += 1
