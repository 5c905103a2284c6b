"""Selective decode (T <= B): the block kernel's schedule when every block's rows are the call's token rows.

In selective decode (``routing.block_schedule`` at T <= B) each used block is one routed local expert and row r of
every block is token r (its weight 0 where the token is not routed there), so a block needs no gather and no
scatter: the program loads the tokens once and transposes them once (``x^T [128, H/128, T]``), walks its blocks in
a dynamic loop, adds every block's down projection into one fp32 accumulator in SBUF and stores it once at the end
- no zero fill, no gathered rows, no read-modify-write of the output. A token routed to no block of the program gets
exactly 0 (the accumulator's memset; every block adds ``weight 0 x finite``).

Per block: the expert id (scalar-offset DMA from ``block_to_expert``), its scale rows (two), the block's token
weights (one) and its codes - the program's share of them (gate and up rows in one DMA, down rows in one) when they
fit :data:`WHOLE_SHARE_BYTES`, else 512-column slabs as the dense kernel streams them. With ``split_inter`` every
program walks every used block from block 0 over its own I / n intermediate rows (``block_range`` rows (0, used)):
the count is read into a register straight from ``block_range`` and the loop variable is the block index.

Two dataflows per block (``weights_stationary``, a trace-time constant, pow2 only): token-stationary (the dense
kernel's, :mod:`.projections` / :func:`.block_scale.contract_pow2`: x^T stationary, 512-column slabs of codes moving,
accumulator [T, H]) or weights-stationary (:mod:`.weights_stationary`: every 128x128 code block stationary, x^T
moving, accumulator [H, T] transposed at the store). ``host_routed.weights_stationary`` chooses by scenario and
bucket. Traced kernel code (the subset of kernels/nki_cpu/subset.py).
"""

from __future__ import annotations

from .block_scale import contract_pow2
from .nki_api import nisa, nl
from .projections import OUTPUT_BLOCK, broadcast_row, expert_rows, swiglu_slab, transpose_rows, weight_slab
from .weights_stationary import down_add, gate_up, store_transposed

P = 128
SLAB = 512
WHOLE_SHARE_BYTES = 96 * 1024  # SBUF per partition a block's share of codes takes in one piece (GLM, LNC 2: 96 KiB)


def whole_share(hidden: int, share: int) -> bool:
    """Whether a program's share of one expert's codes (3 H S / 128 bytes per partition) loads in one piece."""
    return 3 * hidden * share // P <= WHOLE_SHARE_BYTES


def inter_start(pid, share):
    """First intermediate row of program ``pid``'s share of I when the intermediate is split (``share`` rows each)."""
    return pid * share


def selective_decode(hidden, w13, w13_scales, w2, w2_scales, position_weight, block_to_expert, block_range, mode,
                     limit, vector_blocks, split_inter, stationary_weights):
    """[n, T, H] fp32: program p's partial sums (the block kernel's output contract, kernels/moe_w8_blocks.py)."""
    rows_total, h = hidden.shape
    _n_blocks, b = position_weight.shape
    tokens = rows_total - b
    _e, _p, g_h, two_i = w13.shape
    inter = two_i // 2
    programs = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    share = inter
    i0 = 0
    if split_inter:
        share = inter // programs
        i0 = inter_start(pid, share)
    g_s = share // P
    dims = (tokens, g_h, share, g_s, w13_scales.shape[2], w2_scales.shape[2], inter // P, limit)
    out = nl.ndarray((programs, tokens, h), dtype=nl.float32, buffer=nl.shared_hbm)
    x = nl.ndarray((tokens, h), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(dst=x, src=hidden[0:tokens, :])
    h_t = transpose_rows(x, tokens, g_h, nl.bfloat16)
    ones = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    if stationary_weights:
        acc = nl.ndarray((P, h // P, tokens), dtype=nl.float32, buffer=nl.sbuf)
    else:
        acc = nl.ndarray((tokens, h), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=acc, value=0.0, engine=nisa.engine.gpsimd)
    count = nisa.register_alloc()
    block = None
    if split_inter:  # every program starts at block 0: the count from HBM, the loop variable is the block
        nisa.register_load(count, block_range[pid:pid + 1, 1:2])
    else:
        first = nl.ndarray((1, 2), dtype=nl.int32, buffer=nl.sbuf)  # (first block, block count): one DMA
        nisa.dma_copy(dst=first, src=block_range[pid:pid + 1, :])
        block = first[:, 0:1]
        nisa.register_load(count, first[:, 1:2])
    for i in nl.dynamic_range(count):
        at = i if split_inter else block
        expert = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=expert, src=block_to_expert.ap(pattern=[[1, 1], [1, 1]], offset=0, scalar_offset=at,
                                                         indirect_dim=0))
        c13, c2 = share_codes(w13, w2, expert, i0, share, h)
        if stationary_weights:
            ws_block(acc, h_t, w13_scales, w2_scales, position_weight, at, expert, c13, c2, ones, dims, i0, b)
        else:
            ts_block(acc, h_t, w13, w13_scales, w2, w2_scales, position_weight, at, expert, c13, c2, ones, dims, i0,
                     mode, vector_blocks, b)
        if not split_inter:
            nisa.tensor_scalar(dst=block, data=block, op0=nl.add, operand0=1)
    if stationary_weights:
        store_transposed(out[pid, :, :], acc, tokens)
    else:
        nisa.dma_copy(dst=out[pid, :, :], src=acc)
    return out


def share_codes(w13, w2, expert, i0, share, h):
    """(c13 [P, gH, 2S], c2 [P, gS, H]) uint8: expert ``expert``'s gate and up rows [i0, i0 + S) (one DMA) and down
    rows (one DMA) when they fit :data:`WHOLE_SHARE_BYTES`, else (None, None): the blocks stream slabs."""
    _e, p, g_h, two_i = w13.shape
    g_i = w2.shape[2]
    g_s = share // P
    if not whole_share(h, share):
        return None, None
    c13 = nl.ndarray((p, g_h, 2 * share), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.dma_copy(dst=c13, src=w13.ap(pattern=[[g_h * two_i, p], [two_i, g_h], [two_i // 2, 2], [1, share]], offset=i0,
                                      scalar_offset=expert, indirect_dim=0))
    c2 = nl.ndarray((p, g_s, h), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.dma_copy(dst=c2, src=w2.ap(pattern=[[g_i * h, p], [h, g_s], [1, h]], offset=(i0 // P) * h,
                                    scalar_offset=expert, indirect_dim=0))
    return c13, c2


def scale_rows(w13_scales, w2_scales, expert, extra):
    """[1, n13 + n2 + extra] fp32 SBUF: the expert's w13 and w2 scale rows side by side (two scalar-offset DMAs),
    ``extra`` columns left for the caller; and (n13, n2)."""
    n13 = w13_scales.shape[1] * w13_scales.shape[2]
    n2 = w2_scales.shape[1] * w2_scales.shape[2]
    row = nl.ndarray((1, n13 + n2 + extra), dtype=nl.float32, buffer=nl.sbuf)
    expert_rows(w13_scales, expert, row[:, 0:n13])
    expert_rows(w2_scales, expert, row[:, n13:n13 + n2])
    return row, n13, n2


def ws_block(acc_t, h_t, w13_scales, w2_scales, position_weight, at, expert, c13, c2, ones, dims, i0, b):
    """One block, weights-stationary: the scale rows and the block's token weights broadcast to the 128 partitions
    in one pass, then :func:`.weights_stationary.gate_up` and :func:`.weights_stationary.down_add`."""
    tokens = dims[0]
    row, n13, n2 = scale_rows(w13_scales, w2_scales, expert, tokens)
    nisa.dma_copy(dst=row[:, n13 + n2:n13 + n2 + tokens],
                  src=position_weight.ap(pattern=[[b, 1], [1, tokens]], offset=0, scalar_offset=at, indirect_dim=0))
    bc = broadcast_row(row, P, ones)
    act_t = gate_up(h_t, c13, bc, dims, i0, n13 + n2)
    down_add(acc_t, act_t, c2, bc, dims, i0, n13)


def ts_block(acc, h_t, w13, w13_scales, w2, w2_scales, position_weight, at, expert, c13, c2, ones, dims, i0, mode,
             vector_blocks, b):
    """One block, token-stationary (the dense kernel's per-expert dataflow on the share): gate/up 512 columns at a
    time, the activation transposed, the down projection's scaled blocks added into ``acc`` [T, H]."""
    tokens, g_h, share, g_s, g13, g2, _g_i, limit = dims
    h = acc.shape[1]
    inter = w13.shape[3] // 2
    weight = nl.ndarray((tokens, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=weight, src=position_weight.ap(pattern=[[1, tokens], [1, 1]], offset=0, scalar_offset=at,
                                                     indirect_dim=0))
    row, n13, n2 = scale_rows(w13_scales, w2_scales, expert, 0)
    sc = broadcast_row(row, tokens, ones)
    sc13 = sc[:, 0:n13]
    sc2 = sc[:, n13:n13 + n2]
    act = nl.ndarray((tokens, share), dtype=nl.bfloat16, buffer=nl.sbuf)
    counter = 0
    for c0 in range(0, share, SLAB):
        w = min(SLAB, share - c0)
        if c13 is None:
            w_gate = weight_slab(w13, expert, i0 + c0, w)
            w_up = weight_slab(w13, expert, inter + i0 + c0, w)
        else:
            w_gate = c13[:, :, c0:c0 + w]
            w_up = c13[:, :, share + c0:share + c0 + w]
        counter = swiglu_slab(h_t, w_gate, w_up, (i0 + c0) // P, (inter + i0 + c0) // P, weight, sc13, g_h, g13, mode,
                              tokens, w, limit, vector_blocks, act[:, c0:c0 + w], counter)
    act_t = transpose_rows(act, tokens, g_s, nl.bfloat16)
    k0 = i0 // P
    for h0 in range(0, h, SLAB):
        w = min(SLAB, h - h0)
        if c2 is None:
            w_down = weight_slab(w2, expert, h0, w, None, k0, g_s)
        else:
            w_down = c2[:, :, h0:h0 + w]
        total = acc[:, h0:h0 + w]
        if mode == OUTPUT_BLOCK:
            ps = nl.ndarray((tokens, w), dtype=nl.float32, buffer=nl.psum)
            codes = w_down.view(nl.float8_e4m3)
            for k in range(g_s):
                nisa.nc_matmul(dst=ps, stationary=act_t[:, k, :], moving=codes[:, k, :], accumulate=(k > 0))
            for nb in range(w // P):
                c = h0 // P + nb
                blk = total[:, nb * P:(nb + 1) * P]
                nisa.scalar_tensor_tensor(dst=blk, data=ps[:, nb * P:(nb + 1) * P], op0=nl.multiply,
                                          operand0=sc2[:, c:c + 1], op1=nl.add, operand1=blk)
        else:
            counter = contract_pow2(act_t, slice(0, tokens), w_down.view(nl.float8_e4m3), g_s, sc2[:, k0:], h0 // P,
                                    g2, tokens, w, total, False, counter, vector_blocks)
