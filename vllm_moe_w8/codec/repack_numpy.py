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

The passes over every byte (1, 2 and the column minima of 3) are torch ops on the same memory
(``torch.from_numpy``), so they run on torch's own threads, as the native body does (Python threads would compete
with torch's OpenMP threads, which spin after every op); the sparse steps stay numpy.
"""

from __future__ import annotations

import numpy as np
import torch

FN_ONLY_MIN_MAG = 0x78  # a tile holding a magnitude >= this is halved (as in fp8.FN_ONLY_MIN_MAG)
SMALL_MAG = 0x10  # below: subnormal / smallest normal, halved by rounding instead of code - 8
SEARCH_ROWS = 32  # the small magnitudes are looked for in groups of this many rows of a column


def _column_reduce(mag: torch.Tensor, bn: int, op) -> np.ndarray:
    """[gn, k]: ``op`` (torch.amax / torch.amin) of each column over each tile row's rows (ragged last included)."""
    n, k = mag.shape
    full = n // bn
    parts = [op(mag[: full * bn].view(full, bn, k), dim=1)] if full else []
    if full * bn < n:
        parts.append(op(mag[full * bn:], dim=0, keepdim=True))
    return (torch.cat(parts) if len(parts) > 1 else parts[0]).numpy()


def _nonzero_flat(b: np.ndarray) -> np.ndarray:
    """np.flatnonzero of a bool array, scanning it 8 bytes at a time (numpy's own scan is per element)."""
    flat = b.ravel()
    pad = -flat.size % 8
    words = np.flatnonzero((np.concatenate([flat, np.zeros(pad, bool)]) if pad else flat).view(np.uint64))
    idx = (words[:, None] * 8 + np.arange(8)[None, :]).ravel()
    idx = idx[idx < flat.size]
    return idx[flat[idx]]


def _small_positions(mag_t: torch.Tensor, bn: int = SEARCH_ROWS) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) of every magnitude below SMALL_MAG, looking only in the (group of bn rows, column) pairs whose
    minimum says they hold one."""
    n, k = mag_t.shape
    mag = mag_t.numpy()
    cand = _nonzero_flat(_column_reduce(mag_t, bn, torch.amin) < SMALL_MAG)
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
    ct = torch.from_numpy(c)
    mag_t = ct & 0x7F
    mag = mag_t.numpy()
    cmax = _column_reduce(mag_t, bn, torch.amax)
    tile_max = np.maximum.reduceat(cmax, np.arange(0, k, bk), axis=1)
    gn = tile_max.shape[0]
    rounded = np.zeros((gn, gk), dtype=np.int64)
    shift = tile_max >= FN_ONLY_MIN_MAG
    if not shift.any():
        return c.copy(), tile_max, rounded
    out_t = ct - 8  # uint8: wraps below 8, as numpy's does; those bytes are restored or fixed below
    if not shift.all():
        keep = ~torch.from_numpy(shift).repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        out_t = torch.where(keep, ct, out_t)
    out = out_t.numpy()
    rows, cols = _small_positions(mag_t)
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

