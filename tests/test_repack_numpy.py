"""The numpy pow2 body (vllm_moe_w8/codec/repack_numpy.py) on the cases its key shortcut could get wrong.

Its tile maxima come from the maxima of a key (2 * magnitude - 32, mod 256) over groups of 32 rows of a column,
where a magnitude below 0x10 wraps to the top and hides the group's real maximum (then read from the bytes).
References, written here from the definitions: a tile's maximum is the largest ``code & 0x7F`` in it; a tile with
a magnitude >= 0x78 is halved, each value becoming ml_dtypes' round-to-nearest-even float8_e4m3 of half its
float8_e4m3fn value (other tiles keep their bytes); a value is rounded when that half is not exact. A NaN code's
(magnitude 0x7F) own byte is left unspecified: its tile maximum is what makes ``fp8.repack`` refuse the weight.
Shapes cover groups and tiles with ragged edges, tiles made of whole groups (the shortcut) and not (bn 48, 16, 1).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from vllm_moe_w8.codec import repack_numpy

GROUP = 32  # rows per group of the key maxima (repack_numpy.SEARCH_ROWS)


def _tiles(n, k, bn, bk):
    for i in range(-(-n // bn)):
        for j in range(-(-k // bk)):
            yield i, j, np.s_[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]


def check(got, want, c):
    for name, w, g in zip(("bytes", "tile maxima", "rounded counts"), want, got):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        if name == "bytes":
            g, w = g[(c & 0x7F) != 0x7F], w[(c & 0x7F) != 0x7F]
        np.testing.assert_array_equal(g, w, err_msg=name)


def reference(c: np.ndarray, bn: int, bk: int):
    n, k = c.shape
    gn, gk = -(-n // bn), -(-k // bk)
    tile_max = np.zeros((gn, gk), np.uint8)
    rounded = np.zeros((gn, gk), np.int64)
    out = c.copy()
    half = c.view(ml_dtypes.float8_e4m3fn).astype(np.float64) / 2
    halved = half.astype(ml_dtypes.float8_e4m3)
    inexact = (halved.astype(np.float64) != half) & ~np.isnan(half)
    for i, j, t in _tiles(n, k, bn, bk):
        tile_max[i, j] = (c[t] & 0x7F).max()
        if tile_max[i, j] >= 0x78:
            out[t] = halved[t].view(np.uint8)
            rounded[i, j] = np.count_nonzero(inexact[t])
    return out, tile_max, rounded


def checkpoint_like(n, k, bn, bk, seed):
    """Magnitudes 0x10..0x77 with ~2% below 0x10; per tile a maximum, 0x78..0x7F (shifts) in every other tile
    and in the last one, else 0x00..0x77 (all small below 0x10); in half of the tiles (the first one always) that
    maximum shares its 32-row group column with a small magnitude, which hides it from the key maxima; an odd
    small magnitude in the last row (a ragged last group's repeated row) of the last tile."""
    rng = np.random.default_rng(seed)
    mag = rng.integers(0x10, 0x78, (n, k))
    small = rng.random((n, k)) < 0.02
    mag[small] = rng.integers(0, 0x10, int(small.sum()))
    gn, gk = -(-n // bn), -(-k // bk)
    hidden = 0
    for i, j, t in _tiles(n, k, bn, bk):
        shifts = (i + j) % 2 == (gn + gk) % 2
        top = int(rng.integers(0x78, 0x80) if shifts else rng.integers(0, 0x78))
        mag[t] = rng.integers(0, top + 1, mag[t].shape) if top < 0x10 else np.minimum(mag[t], top)
        r, q = i * bn + int(rng.integers(0, min(bn, n - i * bn))), j * bk + int(rng.integers(0, min(bk, k - j * bk)))
        if (r, q) == (n - 1, k - 1):
            r, q = i * bn, j * bk  # that cell is the small one (below)
        mag[r, q] = top
        g0 = r // GROUP * GROUP
        rows = [x for x in range(max(g0, i * bn), min(g0 + GROUP, n, (i + 1) * bn)) if x != r]
        if top >= 0x10 and rows and (hidden == 0 or rng.random() < 0.5):
            mag[rows[int(rng.integers(0, len(rows)))], q] = int(rng.integers(0, 0x10))
            hidden += 1
    mag[n - 1, k - 1] = 0x0B  # odd: rounded, as its tile shifts
    sign = rng.integers(0, 2, (n, k)) << 7
    return np.ascontiguousarray((mag | sign).astype(np.uint8)), hidden


CASES = [  # n, k, bn, bk
    (256, 256, 128, 128),
    (100, 200, 64, 128),  # ragged groups (100 = 3 x 32 + 4) and tiles
    (70, 130, 32, 64),
    (31, 17, 128, 128),  # fewer rows than a group
    (100, 200, 48, 64),  # tile rows not whole groups: the extra pass
    (100, 200, 16, 16),
    (33, 40, 1, 40),  # per-channel
]


@pytest.mark.parametrize("n,k,bn,bk", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_numpy_pow2_matches_the_definitions(n, k, bn, bk, seed):
    c, hidden = checkpoint_like(n, k, bn, bk, seed)
    want = reference(c, bn, bk)
    got = repack_numpy.pow2(c, bn, bk)
    assert hidden > 0 or bn == 1  # the case the shortcut must read from the bytes is really built
    assert np.count_nonzero(want[1] >= 0x78) > 0 and (want[1].size == 1 or not (want[1] >= 0x78).all())
    assert want[2][-1, -1] > 0  # the last tile rounds (its last value at least)
    check(got, want, c)


def test_every_magnitude_as_a_tile_maximum():
    """Tile t's largest magnitude is t (0x00..0x7F), alone in its tile or beside a small one in its group column."""
    rows = []
    for top in range(0x80):
        tile = np.zeros((64, 64), np.uint8)
        tile[5, 7] = top | (0x80 if top % 3 else 0)
        tile[6, 7] = min(top, 0x0F)  # a small magnitude in the same group column (or the maximum itself)
        rows.append(tile)
    c = np.ascontiguousarray(np.concatenate(rows))  # [128 x 64, 64]: one tile per 64 rows
    want, got = reference(c, 64, 64), repack_numpy.pow2(c, 64, 64)
    np.testing.assert_array_equal(got[1][:, 0], np.arange(0x80, dtype=np.uint8))
    check(got, want, c)
