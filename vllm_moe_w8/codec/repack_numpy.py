"""The pow2 repack's fallback body in numpy (used where the native one cannot be built, or with
``VLLM_MOE_W8_REPACK=numpy``): the same bytes, tile maxima and rounded counts as ``csrc/repack_pow2.cpp``.

:func:`pow2` has the native body's contract (:func:`vllm_moe_w8.codec.repack_native.pow2`). The output buffer is
the only byte array it makes (a fresh buffer's first-touch page faults cost as much as a pass over it), and each
pass over the bytes is a torch op on the same memory (``torch.from_numpy``), so it runs on torch's own threads as
the native body does (Python threads would compete with torch's OpenMP threads, which spin after every op);
the small arrays stay numpy (a torch op costs several numpy ones at that size):

1. ``2 * magnitude`` into the output buffer: ``c + c`` in uint8 drops the sign bit.
2. its column maxima over each tile row (over the whole band when ``bk == k``) give the tile maxima; its column
   minima over groups of 32 rows say which (group, column) pairs hold a magnitude below 0x10.
3. every byte halved as a normal into the same buffer, ``c - 8`` (exact for magnitudes >= 0x10); tiles that do
   not shift get their bytes back (skipped when every tile shifts).
4. the magnitudes below 0x10 (rare in real checkpoints) are gathered only from the pairs step 2 flagged, and those
   in shifted tiles are rounded to nearest even (:func:`vllm_moe_w8.codec.fp8.halve_codes`' rule); the odd ones
   are the rounded values, counted per tile.
"""

from __future__ import annotations

import numpy as np
import torch

FN_ONLY_MIN_MAG = 0x78  # a tile holding a magnitude >= this is halved (as in fp8.FN_ONLY_MIN_MAG)
SMALL_MAG = 0x10  # below: subnormal / smallest normal, halved by rounding instead of code - 8
SEARCH_ROWS = 32  # the small magnitudes are looked for in groups of this many rows of a column


def _reduce_rows(x: torch.Tensor, rows: int, op, flat: bool = False) -> np.ndarray:
    """[groups, k] (or [groups] if ``flat``): ``op`` (torch.amax / torch.amin) over each group of ``rows`` rows
    of ``x`` [n, k], a ragged last group included; ``flat`` reduces over the group's columns too."""
    n, k = x.shape
    full = n // rows
    parts = []
    if full:
        body = x[: full * rows]
        parts.append(op(body.view(full, rows * k), dim=1) if flat else op(body.view(full, rows, k), dim=1))
    if full * rows < n:
        rest = x[full * rows:]
        parts.append(op(rest.reshape(1, -1), dim=1) if flat else op(rest, dim=0, keepdim=True))
    return (torch.cat(parts) if len(parts) > 1 else parts[0]).numpy()


def _small_positions(c: np.ndarray, flagged: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) of every magnitude below SMALL_MAG in the (group of SEARCH_ROWS rows, column) pairs
    ``flagged`` [groups, k] marks (a column of a group is one row of the transposed view: one gather)."""
    n, k = c.shape
    cand = np.flatnonzero(flagged)
    if cand.size == 0:
        return cand, cand
    g, j = np.divmod(cand, k)
    full = n // SEARCH_ROWS
    rows, cols = [], []
    last = g >= full  # candidates in the ragged last group
    gf, jf = (g[~last], j[~last]) if last.any() else (g, j)
    if gf.size:
        group = c[: full * SEARCH_ROWS].reshape(full, SEARCH_ROWS, k).transpose(0, 2, 1)[gf, jf]  # [cand, 32]
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
        dst = out_t[: full * bn].view(full, bn, k)
        torch.where(cols[:full, None, :], ct[: full * bn].view(full, bn, k), dst, out=dst)
    if full * bn < n:
        dst = out_t[full * bn:]
        torch.where(cols[full:], ct[full * bn:], dst, out=dst)


def pow2(c: np.ndarray, bn: int, bk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(out bytes [n, k], tile_max uint8 [gn, gk], rounded int64 [gn, gk]) for contiguous uint8 ``c`` [n, k]."""
    n, k = c.shape
    gk = -(-k // bk)
    ct = torch.from_numpy(c)
    out = np.empty_like(c)
    out_t = torch.from_numpy(out)
    torch.add(ct, ct, out=out_t)  # 2 * magnitude
    if bk >= k:
        tile_max = (_reduce_rows(out_t, bn, torch.amax, flat=True) >> 1)[:, None]
    else:
        tile_max = np.maximum.reduceat(_reduce_rows(out_t, bn, torch.amax) >> 1, np.arange(0, k, bk), axis=1)
    gn = tile_max.shape[0]
    rounded = np.zeros((gn, gk), dtype=np.int64)
    shift = tile_max >= FN_ONLY_MIN_MAG
    if not shift.any():
        out_t.copy_(ct)
        return out, tile_max, rounded
    flagged = _reduce_rows(out_t, SEARCH_ROWS, torch.amin) < 2 * SMALL_MAG
    torch.sub(ct, 8, out=out_t)  # uint8: wraps below 8; those bytes are restored or fixed below
    if not shift.all():
        _restore(ct, out_t, ~shift, bn, bk)
    rows, cols = _small_positions(c, flagged)
    if rows.size:
        tg, tk = rows // bn, cols // bk
        shifted = shift[tg, tk]
        if not shifted.all():
            rows, cols, tg, tk = rows[shifted], cols[shifted], tg[shifted], tk[shifted]
        idx = rows * k + cols
        v = c.ravel().take(idx)
        m = v & 0x7F
        half = m >> 1
        out.ravel()[idx] = (half + (m & half & 1)) | (v & 0x80)  # round half to even
        odd = (m & 1).astype(bool)
        rounded += np.bincount(tg[odd] * gk + tk[odd], minlength=gn * gk).reshape(gn, gk)
    return out, tile_max, rounded
