"""The pow2 repack's fallback body in numpy (used where the native one cannot be built, or with
``VLLM_MOE_W8_REPACK=numpy``): the same bytes, tile maxima and rounded counts as ``csrc/repack_pow2.cpp``.

:func:`pow2` has the native body's contract (:func:`vllm_moe_w8.codec.repack_native.pow2`). No byte array but
the output is made (a fresh buffer's first-touch page faults cost as much as a pass), and every pass over the
bytes is a torch op on the same memory (``torch.from_numpy``), so it runs on torch's own threads as the native
body does (Python threads would compete with torch's OpenMP threads, which spin after every op):

1. the tile maxima of the magnitudes ``c & 0x7F`` without making them: for sign-magnitude bytes the uint8
   maximum of a column is ``0x80 |`` its largest negative magnitude (or, with no negative, its largest
   magnitude) and the int8 maximum its largest non-negative one, so ``max(umax & 0x7F, max(imax, 0))`` is the
   column's largest magnitude -- two column reductions per tile row (one over the band when ``bk == k``), then
   a small reduction over each tile's columns.
2. the same way, whether a (32-row group, column) holds a magnitude below 0x10 (the uint8 minimum is the
   smallest non-negative magnitude, the int8 minimum ``-0x80 +`` the smallest negative one).
3. every byte halved as a normal into the output, ``c - 8`` (exact for magnitudes >= 0x10); tiles that do not
   shift get their bytes back (skipped when every tile shifts).
4. the magnitudes below 0x10 (rare in real checkpoints) are gathered only from the groups step 2 flagged, and
   those in shifted tiles are rounded to nearest even (:func:`vllm_moe_w8.codec.fp8.halve_codes`' rule); the odd
   ones are the rounded values, counted per tile.
"""

from __future__ import annotations

import numpy as np
import torch

FN_ONLY_MIN_MAG = 0x78  # a tile holding a magnitude >= this is halved (as in fp8.FN_ONLY_MIN_MAG)
SMALL_MAG = 0x10  # below: subnormal / smallest normal, halved by rounding instead of code - 8
SEARCH_ROWS = 32  # the small magnitudes are looked for in groups of this many rows of a column


def _reduce_rows(x: torch.Tensor, rows: int, op, flat: bool = False) -> torch.Tensor:
    """[groups, k] (or [groups] if ``flat``): ``op`` (torch.amax / torch.amin) over each group of ``rows`` rows
    of ``x`` [n, k], a ragged last group included; ``flat`` reduces over the group's columns too."""
    n, k = x.shape
    full = n // rows
    parts = []
    if full:
        parts.append(op(x[: full * rows].view(full, rows * k), dim=1) if flat else op(x[: full * rows].view(full, rows, k), dim=1))
    if full * rows < n:
        rest = x[full * rows:]
        parts.append(op(rest.reshape(1, -1), dim=1) if flat else op(rest, dim=0, keepdim=True))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _magnitude_max(ct: torch.Tensor, bn: int, flat: bool) -> np.ndarray:
    """The largest magnitude of each (tile row, column) of uint8 ``ct`` (or of each tile row if ``flat``)."""
    umax = _reduce_rows(ct, bn, torch.amax, flat)
    imax = _reduce_rows(ct.view(torch.int8), bn, torch.amax, flat)
    return np.maximum(umax.numpy() & 0x7F, np.maximum(imax.numpy(), 0).view(np.uint8))


def _small_positions(c: np.ndarray, ct: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) of every magnitude below SMALL_MAG, gathered only from the (group of SEARCH_ROWS rows, column)
    pairs whose uint8 or int8 minimum says they hold one (the small arrays in numpy: torch's uint8 compare and
    nonzero are not vectorised)."""
    n, k = c.shape
    umin = _reduce_rows(ct, SEARCH_ROWS, torch.amin).numpy()
    imin = _reduce_rows(ct.view(torch.int8), SEARCH_ROWS, torch.amin).numpy()
    cand = np.flatnonzero((umin < SMALL_MAG) | (imin < -0x80 + SMALL_MAG))
    if cand.size == 0:
        return cand, cand
    g, j = np.divmod(cand, k)
    full = n // SEARCH_ROWS
    rows, cols = [], []
    last = g >= full  # candidates in the ragged last group
    gf, jf = (g[~last], j[~last]) if last.any() else (g, j)
    if gf.size:  # [candidates, SEARCH_ROWS]: a group's column is one row of the transposed view
        group = c[: full * SEARCH_ROWS].reshape(full, SEARCH_ROWS, k).transpose(0, 2, 1)[gf, jf]
        ci, ri = np.nonzero((group & 0x7F) < SMALL_MAG)
        rows.append(gf[ci] * SEARCH_ROWS + ri)
        cols.append(jf[ci])
    if last.any():
        jl = j[last]
        ri, ci = np.nonzero((c[full * SEARCH_ROWS:][:, jl] & 0x7F) < SMALL_MAG)
        rows.append(full * SEARCH_ROWS + ri)
        cols.append(jl[ci])
    return (np.concatenate(rows), np.concatenate(cols)) if len(rows) > 1 else (rows[0], cols[0])


def _restore(ct: torch.Tensor, out_t: torch.Tensor, keep: np.ndarray, bn: int, bk: int) -> None:
    """Copy the bytes of the tiles marked in ``keep`` [gn, gk] (those that do not shift) back from ``ct``."""
    n, k = ct.shape
    cols = torch.from_numpy(np.repeat(keep, bk, axis=1)[:, :k].copy())  # [gn, k]
    full = n // bn
    if full:
        m = cols[:full, None, :]
        src, dst = ct[: full * bn].view(full, bn, k), out_t[: full * bn].view(full, bn, k)
        torch.where(m, src, dst, out=dst)
    if full * bn < n:
        torch.where(cols[full:], ct[full * bn:], out_t[full * bn:], out=out_t[full * bn:])


def pow2(c: np.ndarray, bn: int, bk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(out bytes [n, k], tile_max uint8 [gn, gk], rounded int64 [gn, gk]) for contiguous uint8 ``c`` [n, k]."""
    n, k = c.shape
    gk = -(-k // bk)
    ct = torch.from_numpy(c)
    if bk >= k:
        tile_max = _magnitude_max(ct, bn, flat=True)[:, None]
    else:
        tile_max = np.maximum.reduceat(_magnitude_max(ct, bn, flat=False), np.arange(0, k, bk), axis=1)
    gn = tile_max.shape[0]
    rounded = np.zeros((gn, gk), dtype=np.int64)
    shift = tile_max >= FN_ONLY_MIN_MAG
    if not shift.any():
        return c.copy(), tile_max, rounded
    out = np.empty_like(c)
    out_t = torch.from_numpy(out)
    torch.sub(ct, 8, out=out_t)  # uint8: wraps below 8; those bytes are restored or fixed below
    if not shift.all():
        _restore(ct, out_t, ~shift, bn, bk)
    rows, cols = _small_positions(c, ct)
    if rows.size:
        tg, tk = rows // bn, cols // bk
        shifted = shift[tg, tk]
        rows, cols, tg, tk = rows[shifted], cols[shifted], tg[shifted], tk[shifted]
        v = c[rows, cols]
        m = v & 0x7F
        half = m >> 1
        out[rows, cols] = (half + (m & half & 1)) | (v & 0x80)  # round half to even
        odd = (m & 1) == 1
        rounded += np.bincount(tg[odd] * gk + tk[odd], minlength=gn * gk).reshape(gn, gk)
    return out, tile_max, rounded
