"""NKI kernels: a block-scaled 1-byte linear layer, y[T, N] = x[T, K] @ W.T, for the non-expert FP8 projections.

``W [N, K]`` comes from an FP8 checkpoint (E4M3FN bytes, one fp32 scale per 128x128 block), repacked exactly to
Trn2 ``float8_e4m3`` by the pow2 rule (``codec.fp8.repack(mode="pow2")``: a block using the E4M3FN-only codes
256..448 halved, its scale doubled - the routed experts' rule) and re-laid out once by ``host_linear.linear_weights``.
The codes stay uint8 in HBM and are viewed as ``nl.float8_e4m3`` in SBUF. Two kernels share the layout:

* :func:`linear_w8_pow2` (decode, T <= 128: exact) - tokens stationary (x^T [128, K/128, T] bf16, loaded by one
  DMA transpose), FP8 codes moving in 512-column slabs, one PSUM tile per 128-row contraction block, each
  [T, 128] partial scaled by its block's scale and added into an fp32 SBUF total: the shared pow2 step
  ``block_scale.contract_pow2`` (engines by ``kernels/schedule.py``'s ``vector_blocks``, as the expert kernels).
  Products bf16 x fp8 are exact in fp32; the only roundings are fp32 accumulation and the fp32 scale multiply.
* :func:`linear_w8_dequant` (prefill, T > 128) - every 128x128 code block multiplied by its scale and rounded to
  bf16 once in SBUF (``moe_w8_dequant._dequantise``: ScalarE / VectorE alternating), then bf16 x bf16 matmuls that
  accumulate the whole contraction in PSUM. Its numbers are those of the BF16 model dequantised from the checkpoint
  (bf16(w * s) per weight: the weight today's BF16 path loads, ``neuron_glue.slice_hook``), not the exact pow2
  result: the exact per-block scale-adds cost T x N x K/128 element operations, more than TensorE's own time at
  prefill under AWS's documented engine rates (benchmarks/bench_linear.py prices both).

Shape contract (checked on the host before every launch by ``host_linear.check_linear_args``; the traced body has
no ``raise``), P = 128, G = K / 128:

    x        [T, K]          bf16     T a bucket of host_linear.bucket_for (16, 32, 64, 128, then multiples of
                                      128 x LNC)
    w        [P, G, N]       uint8    w[p, g, n] = pow2 code of W[n, g*P + p]
    scales   [N/P, G]        float32  scale of block (n // P, k // P) (pow2: doubled where the block was halved)
    split_tokens   int (trace-time constant, host_linear.split_tokens of the bucket and LNC): how the programs share
    vector_blocks  int (pow2 only, trace-time constant): of every schedule.BLOCK_PERIOD block scale-adds, how many
                   run on VectorE (the expert kernels' engine schedule, read from the Neuron calibration file)
    returns  [T, N]          float32  y = x @ W.T (pow2: exact products, fp32 accumulation)

Launched as ``kernel[n]`` (n = LNC). ``split_tokens = 0`` (decode): program p computes the output columns
[p N/n, (p+1) N/n) (N/128 a multiple of n, checked on the host) over all T and reads only those rows of W, once.
``split_tokens = 1`` (prefill at LNC > 1): program p computes the token rows [p T/n, (p+1) T/n) over all N - every
program streams the weights, so each matmul is a whole 512-column slab (q+k+v's N/2 = 1280 is not). A program keeps
the weights of its columns resident in SBUF across its token tiles, in column chunks of at most ``RESIDENT_BYTES``
per partition (one chunk at Qwen3.5-35B-A3B TP=4 widths); x is loaded once per (token tile, chunk) by a DMA
transpose. Weight, token, scale and output DMAs use the hardware DGE (``dge_mode.hwdge``: no GpSimd descriptor
work; GpSimd carries pow2's block adds); the scales reach their partitions by one DMA whose source repeats the scale
rows (partition stride 0).
"""

from __future__ import annotations

from . import block_scale
from .moe_w8 import POW2_SCHEDULE  # the engine schedule read once at load (kernels/schedule.py)
from .moe_w8_dequant import _dequantise
from .nki_api import nisa, nki, nl

P = 128
SLAB = 512  # moving free size: one PSUM bank of fp32
RESIDENT_BYTES = 96 * 1024  # per partition: a program's resident weights (dequant: bf16; pow2: the codes)
MAX_CHUNK_COLUMNS = 4096  # per partition the chunk's fp32 accumulator [rows, chunk] is 4 B a column


@nki.jit
def linear_w8_pow2(x, w, scales, split_tokens=0, vector_blocks=POW2_SCHEDULE.vector_blocks):
    """y = x @ W.T with exact 128x128 block scales (pow2 codes); ``vector_blocks``: the engine schedule."""
    return _linear(x, w, scales, int(split_tokens), True, int(vector_blocks))


@nki.jit
def linear_w8_dequant(x, w, scales, split_tokens=0):
    """y = x @ bf16(W).T: each block dequantised to bf16 on chip, the contraction accumulated in PSUM."""
    return _linear(x, w, scales, int(split_tokens), False, 0)


def chunk_columns(groups: int, columns: int, exact: bool) -> int:
    """Output columns per resident chunk of one program (a multiple of 512 unless it is the program's whole share):
    the largest that keeps the chunk's weights within RESIDENT_BYTES per partition (1 byte per code when exact,
    2 per bf16 weight when dequantised) and its accumulator within MAX_CHUNK_COLUMNS. A shape rule, shared with the
    host (``host_linear.read_bytes``)."""
    per_column = groups * (1 if exact else 2)
    fit = min(RESIDENT_BYTES // per_column, MAX_CHUNK_COLUMNS)
    if fit >= columns:
        return columns
    return max(SLAB, fit // SLAB * SLAB)


def _linear(x, w, scales, split_tokens, exact, vector_blocks):
    t, k = x.shape
    _p, g, n = w.shape
    programs = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    out = nl.ndarray((t, n), dtype=nl.float32, buffer=nl.shared_hbm)
    # program pid's rows [t0, t0 + t_share) and columns [c0, c0 + share) (host-checked: whole 128-row tiles / blocks)
    t_share = t // programs if split_tokens else t
    share = n if split_tokens else n // programs
    t0 = pid * t_share if split_tokens else 0
    c0 = 0 if split_tokens else pid * share
    rows = min(t_share, P)
    x3 = x.reshape((t, g, P))
    chunk = chunk_columns(g, share, exact)
    counter = 0  # the program's pow2 block count: the engine schedule's index
    for h0 in range(0, share, chunk):
        width = min(chunk, share - h0)
        # this chunk's scales on every partition that uses them (token rows / weight partitions): one DMA whose
        # source repeats the scale rows (partition stride 0)
        parts = rows if exact else P
        n_sc = (width // P) * g
        sc = nl.ndarray((parts, n_sc), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=sc, src=scales.ap(pattern=[[0, parts], [1, n_sc]], offset=((c0 + h0) // P) * g),
                      dge_mode=nisa.dge_mode.hwdge)
        slabs = _load_chunk(w, c0 + h0, width, g, sc, exact)
        for r0 in range(t0, t0 + t_share, rows):
            x_t = nl.ndarray((P, g, rows), dtype=nl.bfloat16, buffer=nl.sbuf)
            nisa.dma_transpose(dst=x_t, src=x3[r0:r0 + rows, :, :], axes=(2, 1, 0), dge_mode=nisa.dge_mode.hwdge)
            acc = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.sbuf)
            for i in range(len(slabs)):
                s0 = i * SLAB
                sw = min(SLAB, width - s0)
                if exact:
                    counter = block_scale.contract_pow2(x_t, slice(0, rows), slabs[i].view(nl.float8_e4m3), g, sc,
                                                        s0 // P, g, rows, sw, acc[:, s0:s0 + sw], True, counter,
                                                        vector_blocks)
                else:
                    ps = nl.ndarray((rows, sw), dtype=nl.float32, buffer=nl.psum)
                    for kb in range(g):
                        nisa.nc_matmul(dst=ps, stationary=x_t[:, kb, :], moving=slabs[i][:, kb, :],
                                       accumulate=(kb > 0))
                    nisa.tensor_copy(dst=acc[:, s0:s0 + sw], src=ps,
                                     engine=nisa.engine.scalar if i % 2 == 0 else nisa.engine.vector)
            nisa.dma_copy(dst=out[r0:r0 + rows, c0 + h0:c0 + h0 + width], src=acc, dge_mode=nisa.dge_mode.hwdge)
    return out


def _load_chunk(w, col0, width, g, sc, exact):
    """The chunk's weights in SBUF, one tile per 512-column slab (one DMA each): the uint8 codes (exact), or the
    codes dequantised to bf16 with ``sc`` ([P, blocks * G] broadcast scales; block (nb, k) at column nb * G + k)."""
    slabs = []
    for s0 in range(0, width, SLAB):
        sw = min(SLAB, width - s0)
        codes = nl.ndarray((P, g, sw), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.dma_copy(dst=codes, src=w[:, :, col0 + s0:col0 + s0 + sw], dge_mode=nisa.dge_mode.hwdge)
        slabs.append(codes if exact else _dequantise(codes, g, sw, sc, s0 // P, g))
    return slabs
