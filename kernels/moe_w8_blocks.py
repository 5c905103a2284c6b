"""NKI kernels: routed experts scheduled on the device in blocks of B token rows (selective decode, block prefill).

The schedule is data, not code: the routing metadata (:mod:`.routing`, device tensors made by traceable torch
ops) say which hidden rows each block gathers, with which weights, through which local expert; the kernel
walks the used blocks in a dynamic loop (``nl.dynamic_range`` over a register loaded from ``block_range``),
fetches each block's expert id by scalar-offset DMA and the expert's weights and scales by scalar-offset DMA
(``.ap(scalar_offset=expert, indirect_dim=0)``). Nothing in the kernel's Python constants or shapes depends on
the routing: one compile per (T, B, N) bucket; work and weight bytes follow the used blocks.

* T <= B (the selective bucket, <= 128): **selective decode** (:mod:`.selective_decode`) - one block per routed
  local expert, so a T=1 call reads only its routed experts' weights and scales. Every block's rows are the token
  rows, so the tokens are loaded and transposed once, each block's down projection is added into one SBUF
  accumulator and the slab is stored once; token- or weights-stationary (``stationary_weights``, pow2).
* B = 128: **block prefill** (here) - static capacity N = ceil((T*k - (E-1)) / 128) + E - 1 blocks. The program
  keeps the block index in an SBUF tile, gathers the block's token rows by vector-offset DMA, and stores each row's
  result into its token's output row: the token's first row in the program's blocks by a plain indirect write
  (``nisa.dma_copy`` to ``out.ap(vector_offset=...)``), its later rows by a DMA read-modify-write
  (``nisa.dma_compute``); both with ``oob_mode.skip``, each row's index in the other column of ``position_store``
  (and a padding row's in both) being T + position, past the [T, H] output, so the DMA moves nothing for it: the
  top-k contributions of a token are combined on the device (:func:`plain_first_rows`: always without a zero fill;
  with one, per mode). At one program the slab is zero-filled first (:func:`zero_fill`); at LNC > 1 it is not - a
  slab row its program never stores stays unwritten and the host sum selects each slab by ``program_tokens``.
  Order: a block holds at most one row of a token (routing sums a duplicate route into one row), so its write and
  its add never address the same row; a later block's add of a token follows the earlier block's write of it on the
  same ``out`` tensor, the dependency the adds of consecutive blocks already had. An expert's scales - and its codes
  when they fit SBUF (:func:`resident_weights`, a shape rule; then at LNC > 1 with few local experts each
  program's share of the blocks starts at an expert boundary, ``host_routed.aligned_shares``, so each expert's codes
  cross HBM once per call) - are loaded once per run of consecutive blocks of that expert: ``block_load_expert`` is
  the expert there and E elsewhere, and the loading DMAs (``oob_mode.skip``) move nothing for E, so the previous
  expert's stay in SBUF - no dynamic loop, the bytes of the former 0/1-trip reload loop. Otherwise the codes stream
  per block.

Arguments (checked on the host before every launch by ``host_routed.check_block_args``), P = 128:

    hidden                [T + B, H]        bf16     the tokens, then B zero rows (routing.padded_hidden)
    w13, w13_scales, w2, w2_scales                   the dense kernel's layout (host.to_kernel_layout)
    token_position_to_id  [N, B]            int32    hidden row of each block row (padding: T + row)
    position_weight       [N, B]            float32  routing weight of each block row (0 on padding)
    position_store        [N, B, 2]         int32    (plain-write token, read-modify-write token); T + row: neither
    block_to_expert       [N, 1]            int32    local expert of each block
    block_load_expert     [N, 1]            int32    the expert to load where it changes (or a share starts), else E
    block_range           [n, 2]            int32    (first block, block count) of program p
    swiglu_limit          float (trace-time constant): > 0 clamps gate <= limit and |up| <= limit
    split_inter           int (trace-time constant, ``host_routed.split_inter``): 1 splits I across the programs
    stationary_weights    int (trace-time constant, pow2, ``host_routed.stationary_weights``): selective decode
                          weights-stationary (kernels/weights_stationary.py)
    returns               [n, T, H]         float32  program p's partial sums (host: routing.combine)

In selective decode ``token_position_to_id``, ``position_store`` and ``block_load_expert`` are not read (the rows
are the token rows; every block is a new expert).

Launched as ``kernel[n]`` (n = LNC): program p = ``nl.program_id(0)`` computes blocks
[first_p, first_p + count_p) and writes only its own output slab (no cross-core read-modify-write; at LNC > 1
only the rows of the tokens it stores). With
``split_inter`` (selective decode at LNC 2: a lone routed expert would otherwise leave a core idle) every program
walks all the used blocks (``block_range`` rows (0, used)) over its own I / n intermediate rows - gate and up rows
[p I/n, (p+1) I/n), the down projection over those rows - so each program reads half of every routed expert's
codes (their scale rows whole) and its slab holds a partial sum over its share of I.
"""

from __future__ import annotations

from .moe_w8 import POW2_SCHEDULE
from .nki_api import nisa, nki, nl
from .projections import (OUTPUT_BLOCK, POW2, broadcast_row, down_slab, expert_rows, gate_up_act, load_expert,
                          transpose_rows)
from .selective_decode import selective_decode

P = 128
SLAB = 512
# SBUF per partition an expert's codes may keep across its blocks (Qwen3.5-35B: 24 KiB; GLM-5.3-Flash: 192 KiB, the
# kernel's other tiles then peak at 27 KiB: 219 of the 224 KiB per partition, the interpreter's live-range rule)
RESIDENT_BYTES = 192 * 1024


@nki.jit
def moe_w8_blocks_pow2(hidden, w13, w13_scales, w2, w2_scales, token_position_to_id, position_weight, position_store,
                       block_to_expert, block_load_expert, block_range, swiglu_limit=0.0,
                       vector_blocks=POW2_SCHEDULE.vector_blocks, split_inter=0, stationary_weights=0):
    """Block-scheduled routed MoE with exact 128x128 block scales (pow2 repack). ``vector_blocks`` (trace-time
    constant, the dense kernel's): of every ``schedule.BLOCK_PERIOD`` block scale-adds, how many run on VectorE;
    ``stationary_weights`` (selective decode only): the weights-stationary dataflow (kernels/weights_stationary.py)."""
    return _blocks(hidden, w13, w13_scales, w2, w2_scales, token_position_to_id, position_weight, position_store,
                   block_to_expert, block_load_expert, block_range, POW2, float(swiglu_limit), int(vector_blocks),
                   int(split_inter), int(stationary_weights))


@nki.jit
def moe_w8_blocks_output_block(hidden, w13, w13_scales, w2, w2_scales, token_position_to_id, position_weight,
                               position_store, block_to_expert, block_load_expert, block_range, swiglu_limit=0.0,
                               split_inter=0):
    """Block-scheduled routed MoE with one scale per 128 output rows (output-block repack)."""
    return _blocks(hidden, w13, w13_scales, w2, w2_scales, token_position_to_id, position_weight, position_store,
                   block_to_expert, block_load_expert, block_range, OUTPUT_BLOCK, float(swiglu_limit), 0,
                   int(split_inter), 0)


def resident_weights(hidden: int, inter: int) -> bool:
    """Whether one expert's codes stay in SBUF across its blocks (a shape rule: (3 H I / 128) B per partition)."""
    return 3 * hidden * inter // P <= RESIDENT_BYTES


def zero_fill(programs: int, tokens: int, block: int) -> bool:
    """Whether every row of the kernel's output slab is written (a trace-time rule of the grid and the bucket, never
    of the routing): in block prefill at one program (zero-filled first: the slab is the result) and in selective
    decode (T <= B: the slab is stored whole from its SBUF accumulator, kernels/selective_decode.py); not in block
    prefill at LNC > 1, where each slab holds only its program's rows and ``routing.combine`` selects them
    (``host_routed.block_call``'s ``program_tokens``)."""
    return programs == 1 or tokens <= block


def plain_first_rows(programs: int, tokens: int, block: int, mode: str) -> bool:
    """Whether a block stores its tokens' first rows by a plain indirect write (and only the later rows by
    read-modify-write): always without the zero fill (a slab row is uninitialised until its first write); on a
    zero-filled block-prefill slab where :data:`PLAIN_FIRST_AT_ONE_PROGRAM` says it is cheaper for the mode; never in
    selective decode."""
    if not zero_fill(programs, tokens, block):
        return True
    return tokens > block and PLAIN_FIRST_AT_ONE_PROGRAM[mode]


# One program (cost model, benchmarks/bench_grouped_prefill.py at 2k / 8k tokens, fitted / documented): the plain
# write saves the first rows' reads (DMA lane) but is one more 128-descriptor indirect DMA per block (GpSimd lane).
# output-block is DMA-bound: 1.00 / 0.89 ms at 2k and 2.51 / 1.84 ms at 8k with it, 1.00 / 0.92 and 2.51 / 1.97
# without; pow2 shares GpSimd with its block scale-adds: 1.12 / 0.95 and 2.82 / 2.39 ms with it, 1.01 / 0.92 and
# 2.53 / 2.10 without.
PLAIN_FIRST_AT_ONE_PROGRAM = {POW2: False, OUTPUT_BLOCK: True}


def _zero_output(out, pid, rows_total, hidden):
    """Program pid's output slab [rows_total, hidden] := 0 (the read-modify-writes add into it)."""
    zeros = nl.ndarray((P, hidden), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=zeros, value=0.0)
    for r0 in range(0, rows_total, P):
        n = min(P, rows_total - r0)
        nisa.dma_copy(dst=out[pid, r0:r0 + n, :], src=zeros[0:n, :])


def _blocks(hidden, w13, w13_scales, w2, w2_scales, token_position_to_id, position_weight, position_store,
            block_to_expert, block_load_expert, block_range, mode, limit, vector_blocks, split_inter,
            stationary_weights):
    rows_total, h = hidden.shape
    _n_blocks, b = token_position_to_id.shape
    tokens = rows_total - b  # the output holds the tokens only: padding rows (T + position) fall past it
    if tokens <= b:  # selective decode: block rows are token rows (kernels/selective_decode.py)
        return selective_decode(hidden, w13, w13_scales, w2, w2_scales, position_weight, block_to_expert, block_range,
                                mode, limit, vector_blocks, split_inter, stationary_weights)
    _e, _p, g_h, two_i = w13.shape
    inter = two_i // 2
    programs = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    dims = (b, g_h, inter, inter // P, w13_scales.shape[2], w2_scales.shape[2], limit, vector_blocks)
    out = nl.ndarray((programs, tokens, h), dtype=nl.float32, buffer=nl.shared_hbm)
    if zero_fill(programs, tokens, b):  # the tokens no block stores must read 0 (else routing.combine selects)
        _zero_output(out, pid, tokens, h)
    ones = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    # the current expert's scales (and, when they fit, its codes) persist across its blocks
    sc13 = nl.ndarray((b, w13_scales.shape[1] * w13_scales.shape[2]), dtype=nl.float32, buffer=nl.sbuf)
    sc2 = nl.ndarray((b, w2_scales.shape[1] * w2_scales.shape[2]), dtype=nl.float32, buffer=nl.sbuf)
    rows13 = sc13[0:1, :]  # the scale rows land in partition 0 of their broadcast (no tile of their own)
    rows2 = sc2[0:1, :]
    state = (ones, rows13, rows2, sc13, sc2)
    res13 = None
    res2 = None
    if resident_weights(h, inter):
        res13 = nl.ndarray((P, g_h, two_i), dtype=nl.uint8, buffer=nl.sbuf)
        res2 = nl.ndarray((P, inter // P, h), dtype=nl.uint8, buffer=nl.sbuf)
    share = nl.ndarray((1, 2), dtype=nl.int32, buffer=nl.sbuf)  # (first block, block count): one DMA
    nisa.dma_copy(dst=share, src=block_range[pid:pid + 1, :])
    block = share[:, 0:1]  # the current block index (runtime)
    count_reg = nisa.register_alloc()
    nisa.register_load(count_reg, share[:, 1:2])
    for _ in nl.dynamic_range(count_reg):
        expert = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=expert, src=block_to_expert.ap(pattern=[[1, 1], [1, 1]], offset=0, scalar_offset=block,
                                                         indirect_dim=0))
        load = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)  # the expert where it changes, else E: nothing moves
        nisa.dma_copy(dst=load, src=block_load_expert.ap(pattern=[[1, 1], [1, 1]], offset=0, scalar_offset=block,
                                                         indirect_dim=0))
        _load_expert_state(load, w13, w13_scales, w2, w2_scales, b, state, res13, res2)
        _one_block(block, expert, hidden, w13, w2, sc13, sc2, res13, res2, token_position_to_id, position_weight,
                   position_store, out, pid, dims, mode)
        nisa.tensor_scalar(dst=block, data=block, op0=nl.add, operand0=1)
    return out


def _load_expert_state(expert, w13, w13_scales, w2, w2_scales, b, state, res13, res2):
    """Expert ``expert``'s scale rows (and its codes when they stay resident) into SBUF - nothing moves when it is
    E (``oob_mode.skip``: the rows and codes of the block's expert are already there) - and the scale rows
    broadcast to the block's rows."""
    ones, rows13, rows2, sc13, sc2 = state
    broadcast_row(expert_rows(w13_scales, expert, rows13), b, ones, sc13)
    broadcast_row(expert_rows(w2_scales, expert, rows2), b, ones, sc2)
    if res13 is not None:
        load_expert(w13, expert, res13)
        load_expert(w2, expert, res2)


def _one_block(block, expert, hidden, w13, w2, sc13, sc2, res13, res2, token_position_to_id, position_weight,
               position_store, out, pid, dims, mode):
    b, g_h, _inter, g_i, _g13, _g2, _limit, _vector_blocks = dims
    rows_total, h = hidden.shape
    ids = nl.ndarray((b, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=ids, src=token_position_to_id.ap(pattern=[[1, b], [1, 1]], offset=0, scalar_offset=block, indirect_dim=0))
    weight = nl.ndarray((b, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=weight, src=position_weight.ap(pattern=[[1, b], [1, 1]], offset=0, scalar_offset=block, indirect_dim=0))
    x = nl.ndarray((b, h), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(dst=x, src=hidden.ap(pattern=[[h, b], [1, h]], offset=0, vector_offset=ids, indirect_dim=0))
    h_t = transpose_rows(x, b, g_h, nl.bfloat16)
    act, counter = gate_up_act(h_t, weight, w13, sc13, expert, dims, mode, res13)
    act_t = transpose_rows(act, b, g_i, nl.bfloat16)
    y = nl.ndarray((b, h), dtype=nl.float32, buffer=nl.sbuf)  # the block's rows, added to their tokens in one DMA
    for h0 in range(0, h, SLAB):
        w = min(SLAB, h - h0)
        _y, counter = down_slab(act_t, w2, sc2, expert, h0, w, dims, mode, y[:, h0:h0 + w], res2, counter)
    tokens = rows_total - b
    add_ids = ids  # one program: every row adds into the zero-filled slab (padding rows: T + row, skipped)
    if plain_first_rows(nl.num_programs(axes=0), tokens, b, mode):
        store = nl.ndarray((b, 2), dtype=nl.int32, buffer=nl.sbuf)  # (plain-write token, add token); T + row: neither
        nisa.dma_copy(dst=store, src=position_store.ap(pattern=[[2, b], [1, 2]], offset=0, scalar_offset=block,
                                                       indirect_dim=0))
        first = out.ap(pattern=[[h, b], [1, h]], offset=pid * tokens * h, vector_offset=store[:, 0:1], indirect_dim=1)
        nisa.dma_copy(dst=first, src=y, oob_mode=nisa.oob_mode.skip)  # a token's first row in this program: no read
        add_ids = store[:, 1:2]
    later = out.ap(pattern=[[h, b], [1, h]], offset=pid * tokens * h, vector_offset=add_ids, indirect_dim=1)
    nisa.dma_compute(dst=later, srcs=[later, y], reduce_op=nl.add, oob_mode=nisa.oob_mode.skip)
