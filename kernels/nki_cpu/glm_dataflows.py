"""Dataflows of the vllm-neuron fork's GLM expert kernels, as the :class:`~.machine.Stats` the interpreter would count.

Restated in this project's terms (as :mod:`.reference_dataflows` does for the seed's reference kernels) from the
fork jinhuang12/vllm-neuron, read with the search tools at these file versions (nothing copied):

* GLM-5.3-Flash (``glm5_next``): ``vllm_neuron/functional/moe/moe_fused_fp8.py`` @625d6b89ca6f3be3cec838dae1c57a31d4cfd23d
  (``moe_fused_fp8_kernel``), its tile policy ``fused_fp8_config.py`` @784ed68d28a0bb6839136eca745401b25115ad83
  (``select_tiles``) and launcher ``fused_fp8.py`` @4847755d092dfecf2cfd6e2b576f2fd7d4fc7e4b (``wrap_nki(kernel)[2]``);
  a later stored ``fused_fp8.py`` (search-store text id 71163253858, no commit named) routes the registered decode
  geometry (LNC=2, hidden [2, 4096], row_ids [8, 1], 18 experts, I 512, tiles (1, 4096, 4096)) to
  ``compact_decode_kernel`` (``moe_fused_fp8_decode.py`` @3579cafd615119c9b97d547654c3bf5349572dbd), whose per-block
  body is the same as the fused kernel's with BLOCK_M = 1.
* GLM-5.3-Flash decode, T <= 64: that later ``fused_fp8.py`` also has ``fused_fp8_decode_experts`` ->
  ``expert_decode_kernel`` (``expert_decode.py`` @29a83ce7bd247ec07a8f8a61e95d429980655036), which its docstring
  introduces as the replacement of the per-block decode path (:func:`expert_decode`).
* GLM-5 (``glm_moe_dsa``): ``vllm_neuron/model/glm_moe_dsa/block_fp8_moe.py`` @7d004450b61cf529ca3961e2671c5c73de3c9a96
  (``_selective_block_fp8_moe_nki``), dispatched by ``moe.py`` @a800e8413b98ec3aa4b056d463f832c2ab617329
  (``_block_fp8_nki``: block size 128, tokens padded to a multiple of 128, at least 128).

**GLM-5.3-Flash fused kernel** (:func:`fused_fp8`). Packed FP8 bank ``[E, 3*I/128, 128, H/128, 128]`` (gate, up,
down panels of 128 channels) and fp32 scales ``[E, 3*I/128, H/128]``; the blocks are split round-robin over the two
programs, every block computed (a static loop). Per block: its expert id (a 4-byte DMA, a register load), all its
scales broadcast to 128 partitions (one scalar-offset DMA); per 128-row token tile the row ids, a vector-offset
gather of the rows [r, H] bf16 and of their affinities, H/128 transposes through PSUM; then the weight panels by
scalar-offset DMA (gate/up: one DMA per panel and BLOCK_K group, 128 rows of BLOCK_K bytes; down: one per I-block and
BLOCK_N group), **weights stationary** (the 128x128 tile, declared bf16 in SBUF: the DMA converts the FP8 bank) and
the tokens moving (N = the block's rows, at most BLOCK_M); each 128x128 partial scaled while evacuated from PSUM
(VectorE ``tensor_scalar`` for the first contraction block, ``scalar_tensor_tensor`` scale-and-add for the rest);
the clamp (3 ``tensor_scalar``), sigmoid on ScalarE, two ``scalar_tensor_tensor`` and a bf16 copy per I-block;
the output transposed back (fp32, H/128 transposes), scaled by the affinity and written [r, H] fp32 per block (the
caller combines the blocks).

**GLM-5.3-Flash decode kernel** (:func:`expert_decode`). No block mapping: each program reads this rank's [T, E]
affinities, visits each routed local expert once (a register-driven loop) and streams all T tokens through it
(N = T); program c takes half of the intermediate blocks (half the weight bytes), the 128x128 products of one PSUM
bank are scaled by one VectorE ``tensor_tensor`` and summed over the hidden blocks by one ``tensor_reduce``; the
two programs add their partial sums once (``sendrecv``) and each stores half of H. As declared its weight panels and
product tiles of one expert are live together: :func:`expert_decode_sbuf_bytes` exceeds the 224 KiB per partition at
the seed's I = 2048 per rank from T = 8 on (199 KiB at T = 1; the bench then prices the fused kernel there).

**GLM-5 selective kernel** (:func:`glm5_selective`). Both programs run the same control flow: a 4-phase static
loop over the 4 local experts, each a dynamic loop over that expert's active 128-row blocks (register from a
VectorE count over the mapping). Per block: its row ids (scalar-offset DMA), a memset and vector-offset gather of
[128, H] bf16; per (I-block, H-block) a DMA transpose of the hidden block, two 128x128 FP8 weight DMAs (128-byte
rows), each cast to bf16, transposed on TensorE and copied back, **weights stationary** x the transposed tokens
moving (N = 128), the partial copied from PSUM, its fp32 scale (a 4-byte DMA, broadcast by 4 stream shuffles),
scaled and added (VectorE); SiLU on ScalarE, multiply, and the [128, 128] bf16 intermediate written to HBM. The
down projection: **each program computes 64 of every 128 output rows** (gate/up are computed by both programs),
reading the intermediate back per (H-block, I-block), a [64, 128] weight DMA, the same cast/transpose/copy,
matmul, scale DMA and two shuffles; per H-block a fp32 transpose, the affinity scale and a vector-offset
read-modify-write of [128, 64] bf16 into the output.

Counted as the interpreter counts (``isa.py``, ``dynamic.py``): engine defaults VectorE (``tensor_copy``,
``tensor_scalar``, ``tensor_tensor``, ``memset``, stream shuffles, reductions), ScalarE for ``activation``; an
SBUF -> SBUF DMA (the DMA transpose) counts one DMA and no HBM bytes; a DMA with a scalar offset counts one
descriptor, a vector offset one per row. **Assumed, not read**: that the DMA's FP8 -> bf16 conversion costs nothing
beyond the bytes read (1 per weight); that the GLM-5.3-Flash caller gives each routed local expert one block whose
rows are the most any of them receives (``q``; the fork's caller was not read for T > 1, and at T = 1 this is its
registered decode geometry: one row per block); ``core_barrier``, ``iota``/scan prologues and the compact decode's
active-block ordering are not counted (a few dozen one-element instructions); the decode kernel's ``sendrecv`` is one
on-chip DMA, its ``nonzero_with_count`` one VectorE instruction (the source names no engine), and whether its tiles
fit SBUF is judged from their declared sizes (:func:`expert_decode_sbuf_bytes`); the GLM-5 block mapping's size N
is nkilib's static capacity (:func:`glm5_blocks`; it only sizes a few one-row instructions) and its active blocks
per expert ceil(routed rows / 128).
"""

from __future__ import annotations

from dataclasses import dataclass

from .machine import Stats
from .reference_dataflows import BF16, FP8, FP32, P, Program


class Dynamic(Program):
    """A :class:`~.reference_dataflows.Program` with the dynamic features the block kernels use."""

    def dma_indirect(self, nbytes: int, run: int, kind: str, descriptors: int = 1, count: int = 1, write: bool = False,
                     rmw: bool = False) -> None:
        """``count`` scalar- or vector-offset DMAs of ``nbytes`` each (``rmw``: a ``dma_compute`` read-modify-write,
        read and written)."""
        s = self.stats
        s.indirect_dmas[(kind, descriptors)] += count
        s.dma_count += count
        if write or rmw:
            s.hbm_write_bytes += nbytes * count
            s.dma_runs[int(run)] += nbytes * count
        if not write:
            s.hbm_read_bytes += nbytes * count
            s.dma_runs[int(run)] += nbytes * count

    weight_read_bytes: int = 0  # the expert weights' share of hbm_read_bytes (codes only, not scales)

    def weights(self, nbytes: int, run: int, count: int = 1, kind: str | None = None) -> None:
        """``count`` DMAs of expert weight codes (``kind``: scalar-offset when given)."""
        self.weight_read_bytes += nbytes * count
        if kind is None:
            self.dma(nbytes, run, count=count)
        else:
            self.dma_indirect(nbytes, run, kind, count=count)

    def on_chip_dma(self, count: int = 1) -> None:
        self.stats.dma_count += count

    def loop(self, trips: int) -> None:
        self.stats.register_loads += 1
        self.stats.dynamic_loops += 1
        self.stats.dynamic_iterations += trips


@dataclass(frozen=True)
class Tiles:
    m: int  # BLOCK_M: token rows per pass
    n: int  # BLOCK_N: output channels per weight DMA group (multiple of 128)
    k: int  # BLOCK_K: contraction per weight DMA group (multiple of 128)


def select_tiles(hidden: int, inter: int, rows: int) -> Tiles:
    """The fork's default tile policy (``fused_fp8_config.select_tiles`` @784ed68, restated): BLOCK_K 4096; BLOCK_N
    from max(H, 2I) halved until the live gate group 2*min(N, 2I)*min(K, H) bytes fits 8 MiB; BLOCK_M = min(rows, 512)
    halved until its working-set estimate fits 24 MiB."""
    k = 4096
    n = max(hidden, 2 * inter)
    while n > P and 2 * min(n, 2 * inter) * min(k, hidden) > 8 * 1024**2:
        n = max(P, (n // 256) * P)
    m = min(rows, 512)
    weight = 2 * min(n, 2 * inter) * min(k, hidden)
    scale = 4 * 3 * (inter // P) * (hidden // P) * P
    while m > 1 and (6 * hidden + 10 * inter) * m + 6 * hidden * min(m, P) + weight + scale > 24 * 1024**2:
        m = max(1, m // 2)
    return Tiles(m, n, k)


def _panel_run(tiles: int, nh: int) -> int:
    """Contiguous bytes of one packed panel load of ``tiles`` 128-column FP8 tiles: the 128 rows of a panel are
    ``nh`` tiles long, so a load of all of them is one run."""
    return P * tiles * P if tiles == nh else tiles * P


def _fused_block(pr: Dynamic, q: int, h: int, i: int, tiles: Tiles, scale_ops: bool = True) -> None:
    nh, ni = h // P, i // P
    panels = 3 * ni
    nstep, kstep = tiles.n // P, tiles.k // P
    pr.dma(4, 4)  # expert id
    pr.stats.register_loads += 1
    pr.dma_indirect(P * panels * nh * 4, panels * nh * 4, "scalar")  # all its scales, broadcast to 128 partitions
    for m0 in range(0, q, tiles.m):
        m = min(tiles.m, q - m0)
        for t0 in range(0, m, P):
            r = min(P, m - t0)
            pr.dma(r * 4, r * 4)  # row ids (contiguous)
            pr.op("vector", "tensor_scalar", r, 1, count=2)
            pr.op("gpsimd", "tensor_tensor", r, 1)  # int32 add: GpSimdE
            pr.dma_indirect(r * h * 2, h * 2, "vector", r)  # the rows, bf16
            pr.transpose(r, P, BF16, count=nh)
            pr.op("vector", "tensor_copy", P, r, count=nh)
            pr.dma(r * 4, 4)  # expert id per row
            pr.op("vector", "tensor_scalar", r, 1)
            pr.op("gpsimd", "tensor_tensor", r, 1)
            pr.dma_indirect(r * 4, 4, "vector", r)  # affinities
        k_groups = [min(kstep, nh - k0) for k0 in range(0, nh, kstep)]
        for nk in k_groups:  # gate/up: one DMA per panel and K group
            pr.weights(P * nk * P, _panel_run(nk, nh), count=2 * ni, kind="scalar")
        pr.matmul(P, m, BF16, BF16, count=2 * ni * nh)
        if scale_ops:
            pr.op("vector", "tensor_scalar", P, m, count=2 * ni)
            pr.op("vector", "scalar_tensor_tensor", P, m, count=2 * ni * (nh - 1))
        else:  # fault model: the per-block scale step not counted (partials accumulated in PSUM, one evacuation each)
            pr.op("vector", "tensor_copy", P, m, count=2 * ni)
        pr.op("vector", "tensor_scalar", P, m, count=3 * ni)  # clamp
        pr.op("scalar", "activation", P, m, count=ni)  # sigmoid
        pr.op("vector", "scalar_tensor_tensor", P, m, count=2 * ni)
        pr.op("vector", "tensor_copy", P, m, count=ni)
        for n0 in range(0, nh, nstep):  # down: one DMA per I-block and N group
            nn = min(nstep, nh - n0)
            pr.weights(P * nn * P, _panel_run(nn, nh), count=ni, kind="scalar")
        pr.matmul(P, m, BF16, BF16, count=ni * nh)
        if scale_ops:
            pr.op("vector", "tensor_scalar", P, m, count=nh)
            pr.op("vector", "scalar_tensor_tensor", P, m, count=nh * (ni - 1))
        else:
            pr.op("vector", "tensor_copy", P, m, count=nh)
        for t0 in range(0, m, P):
            r = min(P, m - t0)
            pr.transpose(P, r, FP32, count=nh)
            pr.op("vector", "tensor_copy", r, P, count=nh)
            pr.op("vector", "tensor_scalar", r, h)
            pr.dma(r * h * 4, r * h * 4, write=True)  # the block's rows are contiguous in the output


def fused_fp8(rows_per_block: list[int], h: int, i: int, programs: int = 2, scale_ops: bool = True,
              weight_bytes: list | None = None) -> list[Stats]:
    """Per-program Stats of ``moe_fused_fp8_kernel`` over blocks of ``q = max(rows_per_block)`` rows (one block per
    routed local expert; blocks round-robin over the programs)."""
    q = max(rows_per_block)
    tiles = select_tiles(h, i, q)
    out = []
    for prog in range(programs):
        pr = Dynamic()
        pr.dma(P * 3 * 4, P * 3 * 4)  # SwiGLU bounds (one contiguous [128, 3] fp32 run)
        for _ in range(prog, len(rows_per_block), programs):
            _fused_block(pr, q, h, i, tiles, scale_ops)
        out.append(pr.stats)
        if weight_bytes is not None:
            weight_bytes.append(pr.weight_read_bytes)
    return out


GLM5_LOCAL_EXPERTS = 4  # the kernel's static phase count (E=256 / EP64)


def _glm5_block(pr: Dynamic, b: int, h: int, i: int, scale_ops: bool) -> None:
    gh, gi, half = h // P, i // P, P // 2
    pr.dma_indirect(b * 4, b * 4, "scalar")  # the block's row ids
    pr.op("vector", "memset", b, h)
    pr.dma_indirect(b * h * 2, h * 2, "vector", b)  # gather [B, H] bf16
    tiles = gi * gh
    pr.op("vector", "memset", P, b, count=2 * gi)
    pr.on_chip_dma(count=tiles)  # DMA transpose of the hidden block, per (I-block, H-block)
    pr.weights(P * P, P, count=2 * tiles)  # gate, up 128x128 FP8 tiles, 128-byte rows
    pr.op("vector", "tensor_copy", P, P, count=2 * tiles)  # FP8 -> bf16
    pr.transpose(P, P, BF16, count=2 * tiles)
    pr.op("vector", "tensor_copy", P, P, count=2 * tiles)  # PSUM -> SBUF, back to FP8
    pr.matmul(P, b, FP8, BF16, count=2 * tiles)
    pr.op("vector", "tensor_copy", P, b, count=2 * tiles)  # partial PSUM -> SBUF
    if scale_ops:
        pr.dma(4, 4, count=2 * tiles)  # the block's fp32 scale
        pr.op("vector", "stream_shuffle", 32, 1, count=8 * tiles)  # broadcast to 128 partitions
        pr.op("vector", "tensor_scalar", P, b, count=2 * tiles)
    pr.op("vector", "tensor_tensor", P, b, count=2 * tiles)  # accumulate
    pr.op("vector", "tensor_copy", P, b, count=2 * gi)  # bf16 rounding
    pr.op("scalar", "activation", P, b, count=gi)  # SiLU
    pr.op("vector", "tensor_tensor", P, b, count=gi)
    pr.dma(P * b * 2, b * 2, count=gi, write=True)  # intermediate to HBM
    pr.op("vector", "memset", b, 1)
    pr.op("vector", "tensor_scalar", b, 1)
    pr.op("vector", "stream_shuffle", 32, 1, count=4)
    pr.op("vector", "tensor_tensor", b, 1)
    pr.dma_indirect(b * 4, 4, "vector", b)  # affinities
    down = gh * gi
    pr.op("vector", "memset", half, b, count=gh)
    pr.dma(P * b * 2, b * 2, count=down)  # intermediate back
    pr.weights(half * P, P, count=down)  # this program's 64 rows of the down tile
    pr.op("vector", "tensor_copy", half, P, count=down)
    pr.transpose(half, P, BF16, count=down)
    pr.op("vector", "tensor_copy", P, half, count=down)
    pr.matmul(half, b, FP8, BF16, count=down)
    pr.op("vector", "tensor_copy", half, b, count=down)
    if scale_ops:
        pr.dma(4, 4, count=down)
        pr.op("vector", "stream_shuffle", 32, 1, count=2 * down)
        pr.op("vector", "tensor_scalar", half, b, count=down)
    pr.op("vector", "tensor_tensor", half, b, count=down)
    pr.transpose(half, b, FP32, count=gh)
    pr.op("vector", "tensor_copy", b, half, count=gh)
    pr.op("vector", "tensor_scalar", b, half, count=gh)
    pr.dma_indirect(b * half * 2, half * 2, "vector", b, count=gh, rmw=True)  # scatter-add into the output
    pr.op("vector", "tensor_scalar", 1, 1)  # block index += 1


def glm5_blocks(rows_per_expert: list[int], tokens: int, block: int = P) -> tuple[int, list[int]]:
    """(mapping blocks N, active blocks per local expert) of the fork's blockwise mapping, assumed as nkilib's
    static capacity ceil((T*k - (E-1)) / B) + E - 1 with k = min(top_k, E) = E local."""
    e = GLM5_LOCAL_EXPERTS
    padded = max(block, -(-tokens // block) * block)
    routes = padded * e
    n = -(-(routes - (e - 1)) // block) + e - 1
    return n, [-(-r // block) for r in rows_per_expert]


def glm5_selective(rows_per_expert: list[int], tokens: int, h: int, i: int, scale_ops: bool = True,
                   weight_bytes: list | None = None) -> list[Stats]:
    """Per-program Stats (two programs, identical control flow) of ``_selective_block_fp8_moe_nki``."""
    if len(rows_per_expert) != GLM5_LOCAL_EXPERTS:
        raise ValueError(f"the GLM-5 selective kernel is specialised for {GLM5_LOCAL_EXPERTS} local experts, got "
                         f"{len(rows_per_expert)}")
    b = P
    padded = max(b, -(-tokens // b) * b)
    n, active = glm5_blocks(rows_per_expert, tokens, b)
    out = []
    for _prog in range(2):
        pr = Dynamic()
        for t0 in range(0, padded, P):  # zero this program's 64 of every 128 output columns
            ts = min(P, padded - t0)
            pr.op("vector", "memset", ts, P // 2)
            pr.dma(ts * (P // 2) * 2, (P // 2) * 2, count=h // P, write=True)
        pr.dma(n * 4, n * 4, count=2)  # conditions, block_to_expert
        pr.op("vector", "memset", 1, 1)
        for blocks in active:
            pr.op("vector", "tensor_scalar", 1, n)
            pr.op("vector", "tensor_tensor", 1, n)
            pr.op("vector", "tensor_reduce", 1, n)
            pr.op("vector", "memset", 1, 1)
            pr.loop(blocks)
            for _ in range(blocks):
                _glm5_block(pr, b, h, i, scale_ops)
        out.append(pr.stats)
        if weight_bytes is not None:
            weight_bytes.append(pr.weight_read_bytes)
    return out



EXPERT_DECODE_MAX_TOKENS = 64  # the fork's decode route serves 1..64 tokens in one launch
PSUM_BANK_FP32 = 512


def expert_decode_sbuf_bytes(tokens: int, h: int, i: int, programs: int = 2, experts_local: int = 18) -> int:
    """Per-partition SBUF of the decode kernel's tiles that are live during one expert's visit, as declared (bf16 weight
    panels of its I half, its scales, the fp32 product tiles, x^T, the accumulator, the broadcast gate weights);
    assumed: the compiler does not split them further."""
    nh, nic = h // P, i // P // programs
    panels = 3 * nic * nh * P * 2
    scales = 3 * nic * nh * 4
    products = (2 * nic * nh + 2 * nh * nic) * tokens * 4  # scaled gate/up, down weights and terms
    return panels + scales + products + nh * tokens * (2 + 4) + tokens * experts_local * 4


def expert_decode(routed_experts: int, tokens: int, h: int, i: int, experts_local: int, programs: int = 2,
                  scale_ops: bool = True, weight_bytes: list | None = None) -> list[Stats]:
    """Per-program Stats of the fork's ``expert_decode_kernel`` (``expert_decode.py`` @29a83ce; GLM-5.3-Flash decode,
    T <= 64): every program visits each routed local expert once (a register-driven loop), computes its half of the
    intermediate blocks over all T tokens (weights stationary, N = T), applies the block scales one PSUM bank of
    products at a time (one ``tensor_tensor`` per bank, one ``tensor_reduce`` over the hidden blocks), the programs
    exchange their partial sums once (``sendrecv``, counted as one on-chip DMA) and store half of H each."""
    if not 1 <= tokens <= EXPERT_DECODE_MAX_TOKENS:
        raise ValueError(f"the fork's decode kernel serves 1..{EXPERT_DECODE_MAX_TOKENS} tokens, got {tokens}")
    nh, ni = h // P, i // P
    nic, own = ni // programs, nh // programs
    per_bank = max(1, PSUM_BANK_FP32 // tokens)
    out = []
    for _prog in range(programs):
        pr = Dynamic()
        pr.dma(4, 4)  # rank
        pr.op("vector", "tensor_scalar", 1, 1)
        pr.stats.register_loads += 1
        pr.dma_indirect(tokens * experts_local * 4, experts_local * 4, "scalar")  # this group's affinities
        pr.op("vector", "tensor_reduce", 1, tokens * experts_local)
        pr.op("vector", "nonzero_with_count", 1, experts_local)  # engine not stated in the source: assumed VectorE
        pr.stats.register_loads += 1
        pr.op("vector", "memset", 1, P)
        for c0 in range(0, tokens * experts_local, PSUM_BANK_FP32):  # gate weights broadcast by a K=1 product
            cn = min(PSUM_BANK_FP32, tokens * experts_local - c0)
            pr.matmul(P, cn, FP32, FP32, k=1)
            pr.op("vector", "tensor_copy", P, cn)
        chunk = max(1, P // nh)
        for t0 in range(0, tokens, chunk):  # x^T
            nt = min(chunk, tokens - t0)
            pr.dma(nt * h * 2, nt * h * 2)
            pr.transpose(nt * nh, P, BF16)
            pr.op("vector", "tensor_copy", P, nt * nh)
        pr.dma(P * 3 * 4, 3 * 4)  # SwiGLU bounds
        pr.op("vector", "memset", P, nh * tokens)
        pr.loop(routed_experts)
        for _ in range(routed_experts):
            pr.op("vector", "tensor_copy", 1, 1)
            pr.stats.register_loads += 1
            pr.dma_indirect(P * 3 * nic * nh * 4, nic * nh * 4, "scalar")  # this program's scale rows, broadcast
            pr.weights(P * h, h, count=3 * nic, kind="scalar")  # gate, up, down panels of its I half
            pr.op("vector", "tensor_copy", P, tokens)
            for slots in (2 * nic * nh, nh * nic):  # gate/up, then down
                pr.matmul(P, tokens, BF16, BF16, count=slots)
                for s0 in range(0, slots, per_bank):
                    sn = min(per_bank, slots - s0)
                    if scale_ops:  # one multiply by the broadcast block scales per PSUM bank of products
                        pr.op("vector", "tensor_tensor", P, sn * tokens)
                pr.op("vector", "tensor_reduce", P, slots * tokens)
                if slots == 2 * nic * nh:
                    pr.op("vector", "tensor_scalar", P, nic * tokens, count=2)  # clamp
                    pr.op("scalar", "activation", P, nic * tokens)  # sigmoid
                    pr.op("vector", "tensor_tensor", P, nic * tokens, count=2)
                    pr.op("vector", "tensor_tensor", P, nh * nic * tokens)  # down scale x gate weight
            pr.op("vector", "tensor_tensor", P, nh * tokens)  # accumulate
        if programs == 2:
            pr.on_chip_dma()  # sendrecv of the other half
            pr.op("vector", "tensor_tensor", P, own * tokens)
        pr.transpose(P, tokens, FP32, count=own)
        pr.op("vector", "tensor_copy", tokens, 4 * P, count=-(-own // 4))
        pr.dma(tokens * own * P * 2, own * P * 2, write=True)
        out.append(pr.stats)
        if weight_bytes is not None:
            weight_bytes.append(pr.weight_read_bytes)
    return out
