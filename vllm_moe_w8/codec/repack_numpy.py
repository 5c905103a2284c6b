"""The pow2 repack's fallback body in numpy (used where the native one cannot be built, or with
``VLLM_MOE_W8_REPACK=numpy``): the same bytes, tile maxima and rounded counts as ``csrc/repack_pow2.cpp``.

:func:`pow2` has the native body's contract (:func:`vllm_moe_w8.codec.repack_native.pow2`). The output buffer is
the only byte array it makes (a fresh buffer's first-touch page faults cost as much as a pass over it), and each
pass over the bytes is a torch op on the same memory (``torch.from_numpy``), so it runs on torch's own threads as
the native body does (Python threads would compete with torch's OpenMP threads, which spin after every op);
the small arrays stay numpy (a torch op costs several numpy ones at that size). Three passes:

1. a key per byte into the output buffer, ``224 + 2 * code`` in uint8 = ``2 * magnitude - 32`` (mod 256): the
   sign bit drops out, magnitudes >= 0x10 keep their order (keys 0..222) and those below wrap to the top (>= 224).
2. the keys' column maxima over each group of 32 rows: a maximum >= 224 flags a (group, column) pair holding a
   magnitude below 0x10 (rare in real checkpoints); the others give the pair's largest magnitude. Tile maxima
   follow from the pairs' (when a tile's rows are whole groups; else, e.g. per-channel scales, one more pass:
   ``c + c`` and its maxima).
3. every byte halved as a normal into the same buffer, ``c - 8`` (exact for magnitudes >= 0x10), right after the
   maxima (with the numpy work between them the two-thread path measured slower: likely torch's threads going
   idle). Then the flagged pairs' bytes are gathered (their largest magnitude, and where the small ones are),
   tiles that do not shift get their bytes back (skipped when every tile shifts), and the small magnitudes in
   shifted tiles are rounded to nearest even (:func:`vllm_moe_w8.codec.fp8.halve_codes`' rule, as a 256-byte
   table); the odd ones are the rounded values, counted per tile.
"""

from __future__ import annotations

import numpy as np
import torch

FN_ONLY_MIN_MAG = 0x78  # a tile holding a magnitude >= this is halved (as in fp8.FN_ONLY_MIN_MAG)
SMALL_MAG = 0x10  # below: subnormal / smallest normal, halved by rounding instead of code - 8
SEARCH_ROWS = 32  # the small magnitudes are looked for in groups of this many rows of a column
KEY_SMALL = 256 - 2 * SMALL_MAG  # key = 2 * magnitude - 32 (mod 256): keys >= this are magnitudes < SMALL_MAG
_KEY_OFFSET = torch.tensor(KEY_SMALL, dtype=torch.uint8)
# byte -> its half rounded to nearest even for the magnitudes below SMALL_MAG (fp8.halve_codes' rule; the odd ones
# are the rounded values), the sign kept
_BYTES = np.arange(256, dtype=np.uint8)
_HALF = (_BYTES & 0x7F) >> 1
_HALVED_SMALL = (_HALF + (_BYTES & _HALF & 1)) | (_BYTES & 0x80)


def _reduce_rows(x: torch.Tensor, rows: int, flat: bool = False) -> np.ndarray:
    """[groups, k] (or [groups] if ``flat``): the maximum over each group of ``rows`` rows of ``x`` [n, k], a
    ragged last group included; ``flat`` reduces over the group's columns too."""
    n, k = x.shape
    full = n // rows
    parts = []
    if full:
        body = x[: full * rows]
        parts.append(torch.amax(body.view(full, rows * k) if flat else body.view(full, rows, k), dim=1))
    if full * rows < n:
        rest = x[full * rows:]
        parts.append(torch.amax(rest.reshape(1, -1), dim=1) if flat else torch.amax(rest, dim=0, keepdim=True))
    return (torch.cat(parts) if len(parts) > 1 else parts[0]).numpy()


def _gather_flagged(c: np.ndarray, cand: np.ndarray):
    """For the (group of SEARCH_ROWS rows, column) pairs ``cand`` (flat indices into [groups, k]): each pair's
    largest magnitude, and the flat positions of its magnitudes below SMALL_MAG."""
    n, k = c.shape
    # [32, cand]: flat position of row r of every pair (group g's row r is (32 g + r) k + j, with cand = g k + j)
    pos = (np.arange(SEARCH_ROWS) * k)[:, None] + (cand + cand // k * ((SEARCH_ROWS - 1) * k))
    inside = None
    if n % SEARCH_ROWS:  # a ragged last group reads its row n - 1 again in place of the missing ones
        inside = pos < c.size
        pos = np.where(inside, pos, (n - 1) * k + cand % k)
    mag = c.ravel().take(pos) & 0x7F
    small = mag < SMALL_MAG
    if inside is not None:
        small &= inside  # the repeats are not values of their own
    return mag.max(axis=0), pos.ravel()[np.flatnonzero(small)]


def _tile_max(m: np.ndarray, per: int, bk: int) -> np.ndarray:
    """[gn, gk]: the maximum of ``m`` [groups, k] over each ``per`` groups x ``bk`` columns (ragged edges too)."""
    groups, k = m.shape
    full = groups // per
    parts = [m[: full * per].reshape(full, per, k).max(axis=1)] if full else []
    if full * per < groups:
        parts.append(m[full * per:].max(axis=0, keepdims=True))
    rows = np.concatenate(parts) if len(parts) > 1 else parts[0]
    return np.maximum.reduceat(rows, np.arange(0, k, bk), axis=1)


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
    torch.add(_KEY_OFFSET, ct, alpha=2, out=out_t)  # the keys
    keys = _reduce_rows(out_t, SEARCH_ROWS)  # [groups, k]
    whole = bn % SEARCH_ROWS == 0  # tile rows made of whole groups: tile maxima from the keys
    if not whole:
        torch.add(ct, ct, out=out_t)  # 2 * magnitude
        twice = _reduce_rows(out_t, bn, flat=True)[:, None] if gk == 1 else _tile_max(_reduce_rows(out_t, bn), 1, bk)
    torch.sub(ct, 8, out=out_t)  # uint8: wraps below 8; those bytes are restored or fixed below
    cand = np.flatnonzero(keys >= KEY_SMALL)
    cand_max, pos = _gather_flagged(c, cand)
    if whole:
        mags = (keys >> 1) + SMALL_MAG  # each pair's largest magnitude where no small one hides it
        mags.ravel()[cand] = cand_max
        tile_max = _tile_max(mags, bn // SEARCH_ROWS, bk)
    else:
        tile_max = twice >> 1
    gn = tile_max.shape[0]
    shift = tile_max >= FN_ONLY_MIN_MAG
    shifting = np.count_nonzero(shift)
    if not shifting:
        out_t.copy_(ct)
        return out, tile_max, np.zeros((gn, gk), dtype=np.int64)
    rows, cols = np.divmod(pos, k)
    tile = rows // bn * gk + cols // bk  # of each small magnitude
    if shifting < shift.size:
        _restore(ct, out_t, ~shift, bn, bk)
        kept = shift.ravel()[tile]
        pos, tile = pos[kept], tile[kept]
    v = c.ravel()[pos]
    out.ravel()[pos] = _HALVED_SMALL[v]
    return out, tile_max, np.bincount(tile[(v & 1).astype(bool)], minlength=gn * gk).reshape(gn, gk)
