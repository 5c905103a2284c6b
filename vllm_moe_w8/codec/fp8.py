"""FP8 codecs and the expert repack: OCP E4M3FN checkpoint bytes -> Trn2 ``float8_e4m3`` bytes.

Pure torch; imports neither vLLM nor NKI.

Formats (bias 7, 1 sign / 4 exponent / 3 mantissa bits; a byte's low 7 bits are its *magnitude code*):

* ``e4m3fn`` (OCP, ``torch.float8_e4m3fn``, what checkpoints store): no infinities, NaN only at
  magnitude 0x7F, largest finite 448 (0x7E).
* ``e4m3`` (IEEE-like, Trn2's ``nl.float8_e4m3``): exponent 1111 means inf/NaN, largest finite 240
  (0x77). The only FP8 format TensorE multiplies on Trn2 besides e5m2.

Both formats give the same value to every magnitude code below 0x78; codes 0x78..0x7E (256..448)
exist only in e4m3fn. Real checkpoints scale every block by amax/448, so most blocks use them.

Scale grids: a weight [N, K] has one scale per ``block = (bn, bk)`` tile, i.e. a grid
[ceil(N/bn), ceil(K/bk)]; the last tile row/column covers the remainder. ``bk = 0`` means "the
whole row" (grid [ceil(N/bn), 1]). Per-channel scales are ``block = (1, 0)``; output-block scales
are ``(128, 0)``. Scales are dequantisation *multipliers* (the checkpoint's ``weight_scale_inv``).

Modes of :func:`repack`:

* ``pow2`` (default, exact): a tile holding any e4m3fn-only code is halved and its scale doubled;
  every other tile keeps its bytes and scale bit for bit. Halving is exact except for odd
  subnormal / odd smallest-normal codes (magnitude < 0x10 and odd), which round to nearest even:
  an error of exactly 2**-9 * old scale per such value, counted in ``stats.values_changed``.
* ``output-block`` (lossy, opt-in): requantised from the exact dequantised weight with one scale
  per 128 output rows (amax / 240), so a kernel can accumulate a whole contraction and scale once.
  A row block of zeros gets scale 1.0 (its codes are zeros; any scale would be exact, 1.0 divides safely).
* ``lut`` (exact, portable): the original e4m3fn bytes with the scales as float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_moe_w8.codec import repack_native, repack_numpy

E4M3_MAX = 240.0  # Trn2 float8_e4m3
E4M3FN_MAX = 448.0  # OCP float8_e4m3fn
FN_ONLY_MIN_MAG = 0x78  # magnitude codes 0x78..0x7E are finite only in e4m3fn
NAN_MAG = 0x7F  # e4m3fn's NaN magnitude code (0x7F and 0xFF)
MODES = ("pow2", "output-block", "lut")
DEFAULT_BLOCK = (128, 128)
OUTPUT_BLOCK_ROWS = 128

# Which byte format each mode's codes are in.
CODE_FORMAT = {"pow2": "e4m3", "output-block": "e4m3", "lut": "e4m3fn"}


def _decode_table(fmt: str) -> torch.Tensor:
    """float32 value of each of the 256 bytes, from the bit layout (no FP8 library involved)."""
    code = torch.arange(256, dtype=torch.int64)
    sign = torch.where(code >= 128, -1.0, 1.0).double()
    exp = (code >> 3) & 0xF
    man = (code & 0x7).double()
    normal = (1.0 + man / 8.0) * torch.pow(2.0, (exp - 7).double())
    subnormal = man * 2.0**-9
    value = sign * torch.where(exp == 0, subnormal, normal)
    mag = code & 0x7F
    if fmt == "e4m3fn":
        value = torch.where(mag == NAN_MAG, torch.tensor(float("nan"), dtype=torch.float64), value)
    elif fmt == "e4m3":
        inf = sign * float("inf")
        value = torch.where(exp == 15, torch.where(man == 0, inf, torch.tensor(float("nan"), dtype=torch.float64)), value)
    else:
        raise ValueError(f"unknown FP8 format {fmt!r}; expected 'e4m3' or 'e4m3fn'")
    return value.float()


DECODE_E4M3FN = _decode_table("e4m3fn")
DECODE_E4M3 = _decode_table("e4m3")


def decode(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """Decode FP8 bytes (uint8) of format ``fmt`` ('e4m3' or 'e4m3fn') to float32."""
    table = {"e4m3": DECODE_E4M3, "e4m3fn": DECODE_E4M3FN}.get(fmt)
    if table is None:
        raise ValueError(f"unknown FP8 format {fmt!r}; expected 'e4m3' or 'e4m3fn'")
    # np.take on the uint8 bytes: ~4x torch's int64 gather and ~2x torch's fp8 cast on CPU
    return torch.from_numpy(np.take(table.numpy(), _np_bytes(codes))).reshape(codes.shape)


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """Trn2 ``float8_e4m3`` bytes -> float32."""
    return decode(codes, "e4m3")


def decode_e4m3fn(codes: torch.Tensor) -> torch.Tensor:
    """OCP ``float8_e4m3fn`` bytes -> float32."""
    return decode(codes, "e4m3fn")


def halve_codes(codes: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes -> e4m3 bytes of half the value, rounding to nearest even (NaN codes excluded).

    Magnitudes >= 0x10 are normal with exponent >= 2: halving lowers the exponent field by one
    (``code - 8``, exact). Below 0x10 a magnitude code *is* the value in units of 2**-9
    (subnormal m -> m, smallest normal 1.m -> 8 + m), so the half is ``mag / 2`` in the same units,
    rounded half to even, and that unit count is again its own code (8 -> 0x08, the smallest normal).
    """
    c = _np_bytes(codes)
    out, _ = _halve_bytes(c, c & 0x7F)
    return torch.from_numpy(out).reshape(codes.shape)


def _halve_bytes(c: np.ndarray, mag: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`halve_codes` on numpy bytes (``mag = c & 0x7F``); also the flat indices of magnitudes < 0x10.

    Every byte is halved as a normal (``code - 8``); the few magnitudes below 0x10 are then fixed up
    sparsely (real checkpoints have almost none), which keeps this to a few passes over the bytes.
    """
    out = c - np.uint8(8)
    small = np.flatnonzero(mag < 0x10)
    m = mag.ravel()[small]
    half = m >> 1
    out.ravel()[small] = (half + (m & half & 1)) | (c.ravel()[small] & 0x80)  # round half to even
    return out, small


@dataclass
class RepackStats:
    """What a repack changed. ``max_abs_error`` is in the weight's dequantised units."""

    blocks: int = 0
    blocks_shifted: int = 0
    values: int = 0
    values_changed: int = 0
    max_abs_error: float = 0.0

    def add(self, other: "RepackStats") -> "RepackStats":
        return RepackStats(
            self.blocks + other.blocks,
            self.blocks_shifted + other.blocks_shifted,
            self.values + other.values,
            self.values_changed + other.values_changed,
            max(self.max_abs_error, other.max_abs_error),
        )


@dataclass
class Repacked:
    """Repacked weight: ``dequantize(self) == codes decoded (fmt) * scales expanded over block``."""

    codes: torch.Tensor  # uint8 [N, K]
    scales: torch.Tensor  # float32: [ceil(N/bn), ceil(K/bk)] (bk=0: [ceil(N/bn), 1]); output-block: [ceil(N/128)]
    mode: str
    block: tuple[int, int]  # (bn, bk); bk == 0: whole row
    stats: RepackStats = field(default_factory=RepackStats)

    @property
    def fmt(self) -> str:
        return CODE_FORMAT[self.mode]

    @property
    def scale_grid(self) -> torch.Tensor:
        """Scales as a 2-D grid over ``block`` (output-block's 1-D scales become [nb, 1])."""
        return self.scales if self.scales.dim() == 2 else self.scales.unsqueeze(1)


def _where(name: str | None) -> str:
    return f" in tensor {name!r}" if name else ""


def _as_bytes(weight: torch.Tensor) -> torch.Tensor:
    if weight.dtype == torch.uint8:
        return weight
    if weight.dtype == torch.float8_e4m3fn:
        return weight.view(torch.uint8)
    raise ValueError(f"expected FP8 bytes as torch.float8_e4m3fn or torch.uint8, got {weight.dtype}")


def grid_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """Scale grid of a [N, K] weight for tiles ``block`` (bk == 0: one column)."""
    n, k = shape
    bn, bk = block
    return (math.ceil(n / bn), 1 if bk == 0 else math.ceil(k / bk))


def expand_scales(scales: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Scale grid -> one float32 scale per weight element, [N, K]."""
    n, k = shape
    bn, bk = block
    grid = scales if scales.dim() == 2 else scales.unsqueeze(1)
    out = grid.float().repeat_interleave(bn, dim=0)[:n]
    if bk == 0:
        return out.expand(n, k)
    return out.repeat_interleave(bk, dim=1)[:, :k]


def resolve_block(shape: tuple[int, int], scale_shape: tuple[int, ...], block: tuple[int, int] | str | None) -> tuple[int, int]:
    """The tile size a scale tensor implies: ``block`` if its grid matches, else per-channel [N, 1]."""
    n, k = shape
    if block == "channel":
        return (1, 0)
    block = tuple(block or DEFAULT_BLOCK)
    if len(block) != 2 or min(block) < 0 or block[0] == 0:
        raise ValueError(f"block must be (rows, cols) with rows >= 1 and cols >= 0, got {block}")
    if tuple(scale_shape) == grid_shape(shape, block):
        return block
    if tuple(scale_shape) in ((n, 1), (n,)):
        return (1, 0)
    return block  # mismatch: reported by _check_scales with the expected grid


_SCALE_OK_MAX = float(np.finfo(np.float32).max) / E4M3FN_MAX  # s <= this: s * 448 is finite in float32


def _check_scales(scale: torch.Tensor, shape, block, name) -> torch.Tensor:
    if scale.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"scale{_where(name)} has dtype {scale.dtype}; expected float32, bfloat16 or float16")
    expected = grid_shape(shape, block)
    if scale.dim() == 1 and block[1] == 0 and scale.shape[0] == expected[0]:
        scale = scale.unsqueeze(1)
    if tuple(scale.shape) != expected:
        per = "per-channel [N, 1]" if block == (1, 0) else f"{block[0]}x{block[1]} blocks"
        raise ValueError(
            f"scale grid {tuple(scale.shape)}{_where(name)} does not match weight {tuple(shape)} with {per}: "
            f"expected {expected} (or [N, 1] per-channel); check weight_block_size and that the scale belongs to this weight"
        )
    s = scale.float()
    sn = s.detach().cpu().numpy()
    if np.all((sn > 0) & (sn <= _SCALE_OK_MAX)):  # the usual case, in numpy (cheaper than torch on small grids)
        return s  # (conservative: anything else is judged exactly below)
    bad = ~torch.isfinite(s) | (s <= 0)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"scale{_where(name)} has {int(bad.sum())} non-finite or non-positive value(s), first at {idx} = {float(s[idx])}; "
            "a dequantisation scale must be a finite positive number (is the checkpoint corrupt?)"
        )
    huge = ~torch.isfinite(s * E4M3FN_MAX)
    if bool(huge.any()):
        idx = tuple(int(i) for i in huge.nonzero()[0])
        raise ValueError(
            f"scale{_where(name)} at {idx} = {float(s[idx])} is so large that its weights overflow float32 "
            f"(|w| up to {E4M3FN_MAX:g} x scale); the checkpoint is corrupt: re-export or re-download it"
        )
    return s


def _np_bytes(codes: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(_as_bytes(codes).detach().cpu().numpy())


NAN_SCAN_CHUNK = 1 << 16  # bytes per step: the temporaries stay below malloc's mmap threshold (no page faults)


def _has_nan_code(codes: torch.Tensor) -> bool:
    flat = _np_bytes(codes).reshape(-1)
    for i in range(0, flat.size, NAN_SCAN_CHUNK):  # numpy: uint8 elementwise is vectorised, torch's is not
        if np.any((flat[i:i + NAN_SCAN_CHUNK] & 0x7F) == NAN_MAG):
            return True
    return False


def count_nan_codes(codes: torch.Tensor) -> int:
    """Number of e4m3fn NaN bytes (0x7F / 0xFF)."""
    return int(((_as_bytes(codes) & 0x7F) == NAN_MAG).sum())


def _check_weight(weight: torch.Tensor, name, check_nan: bool = True) -> torch.Tensor:
    if weight.dim() != 2:
        raise ValueError(f"weight{_where(name)} must be 2-D [out, in], got shape {tuple(weight.shape)}")
    codes = _as_bytes(weight)
    if check_nan and _has_nan_code(codes):
        _raise_nan(codes, name)
    return codes


def _raise_nan(codes: torch.Tensor, name) -> None:
    nan = (codes & 0x7F) == NAN_MAG
    idx = tuple(int(i) for i in nan.nonzero()[0])
    raise ValueError(
        f"weight{_where(name)} holds {int(nan.sum())} FP8 NaN code(s) (0x7F/0xFF), first at {idx}; "
        "a NaN weight would be served as garbage: re-export the checkpoint"
    )


def _tiles(x: torch.Tensor, block: tuple[int, int], fill=0) -> torch.Tensor:
    """[N, K] -> [nb_n, bn, nb_k, bk] view over tiles (padding the ragged edge with ``fill``)."""
    n, k = x.shape
    bn, bk = block
    bk = bk or k
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    if (gn * bn, gk * bk) != (n, k):
        x = torch.nn.functional.pad(x, (0, gk * bk - k, 0, gn * bn - n), value=fill)
    return x.reshape(gn, bn, gk, bk)


def _untile(t: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    gn, bn, gk, bk = t.shape
    return t.reshape(gn * bn, gk * bk)[: shape[0], : shape[1]]


def repack(
    weight: torch.Tensor,
    scale: torch.Tensor,
    mode: str = "pow2",
    block: tuple[int, int] | str | None = DEFAULT_BLOCK,
    name: str | None = None,
) -> Repacked:
    """Repack one FP8 weight [N, K] (e4m3fn, or its bytes as uint8) with its dequantisation scales.

    ``scale`` is the checkpoint's ``weight_scale_inv`` over ``block`` tiles, or per-channel
    ``weight_scale`` [N, 1] (detected from its shape; or pass ``block="channel"``), in fp32/bf16/fp16.
    ``name`` (the checkpoint tensor's name) is quoted in every error.
    """
    if mode not in MODES:
        raise ValueError(f"unknown repack mode {mode!r}; choose one of {', '.join(MODES)}")
    codes = _check_weight(weight, name, check_nan=mode != "pow2")  # pow2 finds NaN codes in its tile maxima
    shape = (codes.shape[0], codes.shape[1])
    block = resolve_block(shape, tuple(scale.shape), block)
    s = _check_scales(scale, shape, block, name)
    if mode == "lut":
        gn, gk = s.shape
        return Repacked(codes.contiguous(), s.contiguous(), mode, block, RepackStats(gn * gk, 0, codes.numel(), 0, 0.0))
    if mode == "pow2":
        return _repack_pow2(codes, s, block, name)
    return _repack_output_block(codes, s, block, name)


def _repack_pow2(codes, s, block, name) -> Repacked:
    """One pass per tile row in the native library (:mod:`repack_native`, threads) where it builds; else the numpy
    body (:mod:`repack_numpy`, a few vectorised passes, the byte passes on torch's threads) -- the same bytes,
    tile maxima and counts either way."""
    n, k = codes.shape
    bn, bk = block[0], block[1] or k
    c = _np_bytes(codes)
    stats = RepackStats(blocks=s.numel(), values=c.size)
    if c.size == 0:
        return Repacked(codes.contiguous(), s.contiguous(), "pow2", block, stats)
    out, tile_max, rounded = repack_native.pow2(c, bn, bk) or repack_numpy.pow2(c, bn, bk)
    if int(tile_max.max()) == NAN_MAG:  # 0x7F is the largest magnitude: a tile holding it holds a NaN code
        _raise_nan(codes, name)
    # The small [gn, gk] arrays in numpy: a torch op costs several times a numpy one at this size.
    shift = tile_max >= FN_ONLY_MIN_MAG
    sn = s.detach().cpu().numpy()
    stats.blocks_shifted = int(np.count_nonzero(shift))
    stats.values_changed = int(rounded.sum())  # counted in shifted tiles only
    if stats.values_changed:
        # A rounded value moves by half a unit of 2**-9 at the doubled scale: 2**-10 * 2s = 2**-9 * s.
        stats.max_abs_error = float(sn[rounded > 0].max()) * 2.0**-9
    new_s = np.where(shift, sn * np.float32(2.0), sn)  # exact: _check_scales refused scales with s * 448 = inf
    return Repacked(torch.from_numpy(out), torch.from_numpy(new_s), "pow2", block, stats)


def _repack_output_block(codes, s, block, name) -> Repacked:
    shape = tuple(codes.shape)
    exact = decode_e4m3fn(codes) * expand_scales(s, shape, block)
    rows = _tiles(exact, (OUTPUT_BLOCK_ROWS, 0))  # [gn, 128, 1, K]
    amax = rows.abs().amax(dim=(1, 2, 3))
    new_s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (rows / new_s[:, None, None, None]).clamp(-E4M3_MAX, E4M3_MAX)
    # Below 0x78 e4m3fn and e4m3 share every byte, so torch's round-to-nearest-even e4m3fn cast of a
    # value within +-240 *is* the e4m3 encoding.
    new_codes = _untile(q.to(torch.float8_e4m3fn).view(torch.uint8), shape).contiguous()
    out = Repacked(new_codes, new_s.contiguous(), "output-block", (OUTPUT_BLOCK_ROWS, 0))
    err = (dequantize(out) - exact).abs()
    out.stats = RepackStats(
        blocks=new_s.numel(), blocks_shifted=new_s.numel(), values=codes.numel(),
        values_changed=int((err > 0).sum()), max_abs_error=float(err.max()) if err.numel() else 0.0,
    )
    return out


def dequantize(repacked: Repacked) -> torch.Tensor:
    """float32 [N, K] weight of a :class:`Repacked` (the inverse used by references and tests)."""
    shape = tuple(repacked.codes.shape)
    return decode(repacked.codes, repacked.fmt) * expand_scales(repacked.scale_grid, shape, repacked.block)


def dequantize_checkpoint(weight: torch.Tensor, scale: torch.Tensor, block=DEFAULT_BLOCK, name: str | None = None) -> torch.Tensor:
    """The checkpoint's own dequantised weight, float32: e4m3fn value x its tile's scale."""
    codes = _check_weight(weight, name)
    shape = (codes.shape[0], codes.shape[1])
    block = resolve_block(shape, tuple(scale.shape), block)
    s = _check_scales(scale, shape, block, name)
    return decode_e4m3fn(codes) * expand_scales(s, shape, block)
