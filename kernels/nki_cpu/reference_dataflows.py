"""Dataflows of the measured reference MoE kernels, as the :class:`~.machine.Stats` the interpreter would count.

The reference implementation (dstair/neuron-pytorch-native, ``contrib/qwen3.6-35b-a3b``, trn2.3xlarge TP=8/LNC=1)
published per-call times and a 2-layer profile for three FP8 all-expert decode kernels and a BF16 control. Their
structure, restated in this project's terms (one ``dma_copy`` = one DMA transfer, P = 128):

* ``first_pow2`` - weight-stationary, one 128x128 tile at a time: per tile one DMA of the FP8 codes
  (128-byte rows), one DMA of the tile's 128 scale values, a ScalarE cast of the scale, a VectorE multiply of
  the bf16 hidden^T [P, T] by that per-partition scale, and a matmul (stationary: the FP8 tile, moving: the
  scaled hidden, N = T). Partial sums of one output tile accumulate in PSUM; per expert the affinity is
  broadcast across partitions once. 6 * (H/P) * (I/P) + 1 DMAs per expert.
* ``coalesced_pow2`` - token-stationary: hidden^T chunks [P, T] are the stationary operand, FP8 slabs
  [P, 512] stream as the moving operand (gate and up of one contraction block in one 1 KiB-per-row DMA; down in
  512-byte rows). Every 128x128 block's partial product is evacuated PSUM -> SBUF by ScalarE (one copy per
  512-column slab) and scaled-and-added by one VectorE ``scalar_tensor_tensor`` per 128 columns. Each
  expert's scale tables are loaded once (2 DMAs). For T < 128 several contraction blocks are packed into one
  PSUM tile (column packing), which does not change the instruction counts.
* ``coalesced_output_block`` - the same streaming with one scale per 128 output rows: the whole contraction
  accumulates in PSUM and each 128-column block is scaled once while evacuated (VectorE ``tensor_scalar``).
* ``bf16_compiled`` - the BF16 control is PyTorch code compiled by neuronx-cc, not a published kernel. It is
  modelled (assumed) as token-stationary bf16 GEMMs with each expert's gate, up and down weights moved by one
  DMA each (+ its affinity column), evacuated like the coalesced kernels without block scales.

``REST_OF_GRAPH`` in :mod:`.calibrate` holds what the 2-layer profile spends outside the MoE kernels.
"""

from __future__ import annotations

from collections import Counter

from .machine import Stats

P = 128
SLAB = 512
FP8, BF16, FP32 = "float8_e4m3", "bfloat16", "float32"


class Program:
    """Accumulates a :class:`Stats` from a declarative description of a kernel's instructions."""

    def __init__(self):
        self.stats = Stats()

    def dma(self, nbytes: int, run: int, count: int = 1, write: bool = False) -> None:
        s = self.stats
        s.dma_count += count
        if write:
            s.hbm_write_bytes += nbytes * count
        else:
            s.hbm_read_bytes += nbytes * count
        s.dma_runs[int(run)] += nbytes * count

    def matmul(self, m: int, n: int, stationary: str, moving: str, count: int = 1, k: int = P) -> None:
        self.stats.matmuls[(k, m, n, stationary, moving)] += count

    def transpose(self, p: int, f: int, dtype: str, count: int = 1) -> None:
        self.stats.transposes[(p, f, dtype)] += count

    def op(self, engine: str, op: str, p: int, free: int, count: int = 1) -> None:
        self.stats.engine_ops[(engine, op, p, free)] += count


def _load_hidden(pr: Program, t: int, h: int) -> None:
    gh = h // P
    pr.dma(t * P * 2, P * 2, count=gh)  # [T, 128] bf16 per contraction block
    pr.transpose(t, P, BF16, count=gh)
    pr.op("vector", "tensor_copy", P, t, count=gh)


def first_pow2(t: int, e: int, h: int, i: int) -> Stats:
    """The weight-stationary 128x128-tile pow2 kernel (``block_pow2``)."""
    pr, gh, gi = Program(), h // P, i // P
    _load_hidden(pr, t, h)
    pr.op("vector", "memset", P, 1)
    tiles_gu, tiles_down = 2 * gi * gh, gh * gi
    for _ in range(e):
        pr.dma(t * 4, 4)  # affinity column
        pr.transpose(t, 1, FP32)
        pr.op("vector", "tensor_copy", 1, t)
        pr.op("vector", "stream_shuffle", 32, t, count=P // 32)  # broadcast to the partitions
        for tiles in (tiles_gu, tiles_down):
            pr.dma(P * 2, P * 2, count=tiles)  # the tile's 128 bf16 scales
            pr.op("scalar", "activation", P, 1, count=tiles)  # scale cast
            pr.dma(P * P, P, count=tiles)  # FP8 codes, 128-byte rows
            pr.op("vector", "tensor_scalar", P, t, count=tiles)  # scaled hidden^T / activation^T
            pr.matmul(P, t, FP8, BF16, count=tiles)
        pr.op("vector", "memset", P, gi * t, count=2)
        pr.op("vector", "tensor_copy", P, t, count=2 * gi + gh)  # PSUM evacuations
        pr.op("scalar", "activation", P, t, count=2 * gi)  # SiLU, bf16 cast
        pr.op("vector", "tensor_tensor", P, t, count=gi + 2 * gh)  # SiLU*up; affinity; accumulate
    pr.transpose(P, t, FP32, count=gh)
    pr.op("vector", "tensor_copy", t, P, count=gh)
    pr.dma(t * P * 4, P * 4, count=gh, write=True)
    return pr.stats


def _coalesced(t: int, e: int, h: int, i: int, output_block: bool) -> Stats:
    pr, gh, gi, slabs = Program(), h // P, i // P, h // SLAB
    _load_hidden(pr, t, h)
    pr.op("vector", "memset", t, h)
    for _ in range(e):
        pr.dma(P * 2 * gh * gi * 2, 2 * gh * gi * 2)  # both variants load the expert's scale tables once
        pr.dma(P * gi * gh * 2, gi * gh * 2)
        pr.op("scalar", "activation", P, 2 * gh * gi)
        pr.op("scalar", "activation", P, gi * gh)
        pr.op("vector", "memset", t, h)
        pr.dma(t * 4, 4)
        pr.op("scalar", "activation", t, 1)
        pr.op("vector", "memset", t, i, count=2)
        pr.dma(P * 2 * SLAB, 2 * SLAB, count=gh)  # gate+up slab of one contraction block
        pr.matmul(t, SLAB, BF16, FP8, count=2 * gh)
        if output_block:
            pr.op("vector", "tensor_scalar", t, P, count=2 * gi)
        else:
            pr.op("scalar", "activation", t, SLAB, count=2 * gh)
            pr.op("vector", "scalar_tensor_tensor", t, P, count=2 * gh * gi)
        pr.op("scalar", "activation", t, i, count=2)  # SiLU, bf16 cast
        pr.op("vector", "tensor_tensor", t, i)
        pr.transpose(t, P, BF16, count=gi)
        pr.op("vector", "tensor_copy", P, t, count=gi)
        pr.dma(P * SLAB, SLAB, count=slabs * gi)  # down slabs
        pr.matmul(t, SLAB, BF16, FP8, count=slabs * gi)
        if output_block:
            pr.op("vector", "tensor_scalar", t, P, count=slabs * (SLAB // P))
        else:
            pr.op("scalar", "activation", t, SLAB, count=slabs * gi)
            pr.op("vector", "scalar_tensor_tensor", t, P, count=slabs * gi * (SLAB // P))
        pr.op("vector", "scalar_tensor_tensor", t, P, count=gh)  # affinity * expert output + routed
    pr.dma(t * h * 4, h * 4, write=True)
    return pr.stats


def coalesced_pow2(t: int, e: int, h: int, i: int) -> Stats:
    """Slab-streaming pow2 kernel with exact 128x128 block scales (``block_pow2_coalesced``)."""
    return _coalesced(t, e, h, i, output_block=False)


def coalesced_output_block(t: int, e: int, h: int, i: int) -> Stats:
    """Slab-streaming kernel with one scale per 128 output rows, applied at PSUM evacuation."""
    return _coalesced(t, e, h, i, output_block=True)


def bf16_compiled(t: int, e: int, h: int, i: int) -> Stats:
    """The BF16 control (compiled PyTorch; dataflow assumed, see the module docstring). T > 128 runs the
    compute per 128-token tile against the same weight transfers."""
    pr, gh, gi, slabs = Program(), h // P, i // P, h // SLAB
    n_tt, tt = -(-t // P), min(t, P)
    pr.dma(t * h * 2, h * 2)
    pr.transpose(tt, P, BF16, count=gh * n_tt)
    pr.op("vector", "tensor_copy", P, tt, count=gh * n_tt)
    for _ in range(e):
        pr.dma(t * 4, 4)
        pr.dma(i * h * 2, h * 2, count=2)  # gate, up [I, H] bf16
        pr.dma(h * i * 2, i * 2)  # down [H, I] bf16
        pr.matmul(tt, SLAB, BF16, BF16, count=gh * (2 * i // SLAB) * n_tt)
        pr.op("scalar", "activation", tt, SLAB, count=(2 * i // SLAB) * n_tt)
        pr.op("scalar", "activation", tt, i, count=n_tt)
        pr.op("vector", "tensor_tensor", tt, i, count=n_tt)
        pr.transpose(tt, P, BF16, count=gi * n_tt)
        pr.op("vector", "tensor_copy", P, tt, count=gi * n_tt)
        pr.matmul(tt, SLAB, BF16, BF16, count=gi * slabs * n_tt)
        pr.op("vector", "scalar_tensor_tensor", tt, SLAB, count=slabs * n_tt)
    pr.dma(t * h * 4, h * 4, write=True)
    return pr.stats


KERNELS = {"bf16": bf16_compiled, "first_pow2": first_pow2, "coalesced_pow2": coalesced_pow2,
           "coalesced_output_block": coalesced_output_block}


_PEAKS = ("peak_sbuf_bytes", "peak_psum_banks")


def _fields() -> list[str]:
    from dataclasses import fields

    return [f.name for f in fields(Stats)]


def combine(parts: list[tuple[int, Stats]]) -> Stats:
    """sum of count * stats over every counter of :class:`Stats` (peaks are the maximum)."""
    out = Stats()
    for n, s in parts:
        for name in _fields():
            value = getattr(s, name)
            if name in _PEAKS:
                setattr(out, name, max(getattr(out, name), value))
            elif isinstance(value, Counter):
                acc: Counter = getattr(out, name)
                for key, v in value.items():
                    acc[key] += n * v
            else:
                setattr(out, name, getattr(out, name) + n * value)
    return out


def difference(a: Stats, b: Stats) -> Stats:
    """a - b over every counter, refusing a negative one (b must be a part of a)."""
    out = Stats(peak_sbuf_bytes=a.peak_sbuf_bytes, peak_psum_banks=a.peak_psum_banks)
    for name in _fields():
        if name in _PEAKS:
            continue
        left, right = getattr(a, name), getattr(b, name)
        if isinstance(left, Counter):
            acc: Counter = getattr(out, name)
            for key in set(left) | set(right):
                v = left.get(key, 0) - right.get(key, 0)
                if v < 0:
                    raise ValueError(f"Stats difference: {name}[{key}] would be negative ({v}); the subtrahend is not part of the run")
                if v:
                    acc[key] = v
        else:
            if left - right < 0:
                raise ValueError(f"Stats difference: {name} would be negative; the subtrahend is not part of the run")
            setattr(out, name, left - right)
    return out
