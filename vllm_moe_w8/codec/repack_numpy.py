"""The pow2 repack's fallback body in numpy (used where the native one cannot be built, or with
``VLLM_MOE_W8_REPACK=numpy``): the same bytes, tile maxima and rounded counts as ``csrc/repack_pow2.cpp``.

:func:`pow2` has the native body's contract (:func:`vllm_moe_w8.codec.repack_native.pow2`). It makes few passes
over the bytes, each a plain vectorised numpy loop (no reduceat over rows, no byte-indexed gather):

1. ``mag = c & 0x7F``; the column maxima and minima of ``mag`` over each tile row's ``bn`` rows (an elementwise
   ``max``/``min`` of rows); the tile maxima from the column maxima (small).
2. every byte halved as a normal: ``c - 8`` (exact for magnitudes >= 0x10); tiles that do not shift get their
   bytes back.
3. the magnitudes below 0x10 (rare in real checkpoints) are found only in the (32 rows, column) groups whose
   minimum says they hold one, and rounded to nearest even (:func:`vllm_moe_w8.codec.fp8.halve_codes`' rule); the odd ones in
   shifted tiles are the rounded values, counted per tile.

Tile rows are independent, so :func:`pow2_threaded` splits the tile rows into bands, one per thread (numpy's
loops release the GIL), as the native body does; the caller passes ``torch.get_num_threads()``. (Python threads
inherit the calling thread's CPU mask: under vLLM's CPU worker, which binds that thread to one CPU, they share it.)
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

FN_ONLY_MIN_MAG = 0x78  # a tile holding a magnitude >= this is halved (as in fp8.FN_ONLY_MIN_MAG)
SMALL_MAG = 0x10  # below: subnormal / smallest normal, halved by rounding instead of code - 8
SEARCH_ROWS = 32  # the small magnitudes are looked for in groups of this many rows of a column


def _column_reduce(mag: np.ndarray, bn: int, op) -> np.ndarray:
    """[gn, k]: ``op`` (np.maximum / np.minimum) of each column over each tile row's rows (ragged last included)."""
    n, k = mag.shape
    full = n // bn
    parts = [op.reduce(mag[: full * bn].reshape(full, bn, k), axis=1)] if full else []
    if full * bn < n:
        parts.append(op.reduce(mag[full * bn:], axis=0, keepdims=True))
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def _nonzero_flat(b: np.ndarray) -> np.ndarray:
    """np.flatnonzero of a bool array, scanning it 8 bytes at a time (numpy's own scan is per element)."""
    flat = b.ravel()
    pad = -flat.size % 8
    words = np.flatnonzero((np.concatenate([flat, np.zeros(pad, bool)]) if pad else flat).view(np.uint64))
    idx = (words[:, None] * 8 + np.arange(8)[None, :]).ravel()
    idx = idx[idx < flat.size]
    return idx[flat[idx]]


def _small_positions(mag: np.ndarray, bn: int = SEARCH_ROWS) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) of every magnitude below SMALL_MAG, looking only in the (group of bn rows, column) pairs whose
    minimum says they hold one."""
    n, k = mag.shape
    cand = _nonzero_flat(_column_reduce(mag, bn, np.minimum) < SMALL_MAG)
    if cand.size == 0:
        return cand, cand
    g, j = cand // k, cand % k
    rows = g[:, None] * bn + np.arange(bn)[None, :]  # [candidates, bn]
    inside = rows < n
    rows = np.minimum(rows, n - 1)
    hit = (mag.ravel().take(rows * k + j[:, None]) < SMALL_MAG) & inside
    return rows[hit], np.broadcast_to(j[:, None], rows.shape)[hit]


def pow2(c: np.ndarray, bn: int, bk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(out bytes [n, k], tile_max uint8 [gn, gk], rounded int64 [gn, gk]) for contiguous uint8 ``c`` [n, k]."""
    n, k = c.shape
    gk = -(-k // bk)
    mag = c & np.uint8(0x7F)
    cmax = _column_reduce(mag, bn, np.maximum)
    tile_max = np.maximum.reduceat(cmax, np.arange(0, k, bk), axis=1)
    gn = tile_max.shape[0]
    rounded = np.zeros((gn, gk), dtype=np.int64)
    shift = tile_max >= FN_ONLY_MIN_MAG
    if not shift.any():
        return c.copy(), tile_max, rounded
    out = c - np.uint8(8)
    if not shift.all():
        keep = ~np.repeat(np.repeat(shift, bn, axis=0)[:n], bk, axis=1)[:, :k]
        out[keep] = c[keep]
    rows, cols = _small_positions(mag)
    if rows.size:
        tg, tk = rows // bn, cols // bk
        shifted = shift[tg, tk]
        rows, cols, tg, tk = rows[shifted], cols[shifted], tg[shifted], tk[shifted]
        m = mag[rows, cols]
        half = m >> 1
        out[rows, cols] = (half + (m & half & 1)) | (c[rows, cols] & np.uint8(0x80))  # round half to even
        odd = (m & 1) == 1
        np.add.at(rounded, (tg[odd], tk[odd]), 1)
    return out, tile_max, rounded


def pow2_threaded(c: np.ndarray, bn: int, bk: int, threads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`pow2` over bands of whole tile rows, up to ``threads`` at once (one band per ~1 MB at least)."""
    n = c.shape[0]
    gn = -(-n // bn)
    bands = max(1, min(threads, gn, c.size >> 20))
    if bands == 1:
        return pow2(c, bn, bk)
    edges = [min(n, bn * (gn * b // bands)) for b in range(bands + 1)]
    with ThreadPoolExecutor(bands) as pool:
        parts = list(pool.map(lambda b: pow2(c[edges[b]:edges[b + 1]], bn, bk), range(bands)))
    return tuple(np.concatenate([part[i] for part in parts]) for i in range(3))
