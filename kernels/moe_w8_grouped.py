"""NKI kernels: the routed experts of one rank for prefill, token-grouped, with 1-byte FP8 weights.

Where the dense kernel (:mod:`.moe_w8`) runs every token through every local expert (right for decode),
these run each expert only on the rows routed to it, gathered on the host into 128-row tiles
(:mod:`.grouping`): the work grows with the routed rows (T x top_k), not with T x E_local. Weight
streaming and scale application are the dense kernel's: FP8 codes stream from HBM as 512-column slabs,
viewed as ``nl.float8_e4m3`` and used as the *moving* operand against bf16 hidden^T (stationary), fp32
PSUM; pow2 scales each 128x128 block partial on ScalarE before VectorE adds it, output-block scales the
whole PSUM accumulation once per 128 output columns.

* :func:`moe_w8_grouped_pow2` - exact 128x128 block scales.
* :func:`moe_w8_grouped_output_block` - one scale per 128 output rows.

Arguments, P = 128 (shape contract checked on the host before every launch by ``host.check_grouped_args``;
the traced kernel body has no ``raise``):

    rows           [R, H]            bf16     gathered hidden states, R = 128 * sum(expert_tiles)
    row_weight     [R, 1]            float32  routing weight of each row (0 on padding rows)
    w13, w13_scales, w2, w2_scales            the dense kernel's layout (host.to_kernel_layout)
    expert_tiles   tuple[int]        trace-time: 128-row tiles per local expert, rows in expert order
    expert_program tuple[int]        trace-time: the program (``nl.program_id(0)``) computing each expert
    swiglu_limit   float             trace-time: > 0 clamps gate <= limit and |up| <= limit
    returns        [R, H]            float32  row_weight[r] * W2_e (SiLU(W1_e x_r) * W3_e x_r)

Each output row belongs to one expert and so to one program: the programs of an LNC grid write
disjoint rows, and the host scatters the rows back to their tokens (``grouping.scatter_rows``).
An expert with more tiles than fit SBUF at once is processed in passes of ``max_tiles`` tiles, its
weights streamed once per pass.
"""

from __future__ import annotations

from .nki_api import nisa, nki, nl

P = 128
SLAB = 512
HT_BUDGET_BYTES = 48 * 1024  # SBUF per partition for one pass's hidden^T (bf16): GLM width peaks ~170 of 224 KiB
POW2 = "pow2"
OUTPUT_BLOCK = "output-block"


def max_tiles(hidden: int) -> int:
    """Row tiles one pass holds: hidden^T [P, H/P, tiles * P] bf16 within HT_BUDGET_BYTES per partition."""
    return max(1, HT_BUDGET_BYTES // ((hidden // P) * P * 2))


@nki.jit
def moe_w8_grouped_pow2(rows, row_weight, w13, w13_scales, w2, w2_scales, expert_tiles, expert_program, swiglu_limit=0.0):
    """Token-grouped routed MoE with exact 128x128 block scales (pow2 repack)."""
    return _grouped(rows, row_weight, w13, w13_scales, w2, w2_scales, expert_tiles, expert_program, POW2, swiglu_limit)


@nki.jit
def moe_w8_grouped_output_block(rows, row_weight, w13, w13_scales, w2, w2_scales, expert_tiles, expert_program,
                                swiglu_limit=0.0):
    """Token-grouped routed MoE with one scale per 128 output rows (output-block repack)."""
    return _grouped(rows, row_weight, w13, w13_scales, w2, w2_scales, expert_tiles, expert_program, OUTPUT_BLOCK,
                    swiglu_limit)


def _grouped(rows, row_weight, w13, w13_scales, w2, w2_scales, expert_tiles, expert_program, mode, swiglu_limit):
    num_rows, hidden = rows.shape
    experts, _, g_h, two_i = w13.shape
    inter = two_i // 2
    g13 = w13_scales.shape[2]
    g2 = w2_scales.shape[2]
    pid = nl.program_id(axis=0)
    out = nl.ndarray((num_rows, hidden), dtype=nl.float32, buffer=nl.shared_hbm)
    ones = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    sc13_rows = w13_scales.reshape((experts, 1, two_i // P * g13))
    sc2_rows = w2_scales.reshape((experts, 1, hidden // P * g2))
    dims = (hidden, g_h, inter, inter // P, g13, g2, float(swiglu_limit))
    per_pass = max_tiles(hidden)
    first = 0
    for e in range(experts):
        if expert_tiles[e] > 0 and expert_program[e] == pid:
            sc13 = _broadcast_row(sc13_rows[e], ones)
            sc2 = _broadcast_row(sc2_rows[e], ones)
            for start in range(0, expert_tiles[e], per_pass):
                n_tiles = min(per_pass, expert_tiles[e] - start)
                _expert_pass(e, first + start, n_tiles, rows, row_weight, out, w13, sc13, w2, sc2, dims, mode)
        first += expert_tiles[e]
    return out


def _broadcast_row(row_hbm, ones):
    """[1, n] fp32 in HBM -> [P, n] fp32 in SBUF, every partition a copy (K=1 fp32 matmul: exact)."""
    n = row_hbm.shape[1]
    row = nl.ndarray((1, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=row, src=row_hbm)
    out = nl.ndarray((P, n), dtype=nl.float32, buffer=nl.sbuf)
    for c in range((n + SLAB - 1) // SLAB):
        w = min(SLAB, n - c * SLAB)
        ps = nl.ndarray((P, w), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=ones, moving=row[:, c * SLAB:c * SLAB + w], accumulate=False)
        nisa.tensor_copy(dst=out[:, c * SLAB:c * SLAB + w], src=ps)
    return out


def _scaled_contract(stationary, cols, weights, n_k, scales, block0, groups, mode, width):
    """[P, width] fp32 in SBUF: sum_k stationary[:, k, cols].T @ weights[:, k, :], every 128-column block nb
    scaled by ``scales[:, (block0 + nb) * groups + k]`` (pow2: per k partial) or ``scales[:, block0 + nb]``
    (output-block: once, on the PSUM accumulation)."""
    codes = weights.view(nl.float8_e4m3)
    total = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.sbuf)
    if mode == OUTPUT_BLOCK:
        ps = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.psum)
        for k in range(n_k):
            nisa.nc_matmul(dst=ps, stationary=stationary[:, k, cols], moving=codes[:, k, :], accumulate=(k > 0))
        for nb in range(width // P):
            c = block0 + nb
            nisa.activation(dst=total[:, nb * P:(nb + 1) * P], op=nl.copy, data=ps[:, nb * P:(nb + 1) * P],
                            scale=scales[:, c:c + 1])
        return total
    for k in range(n_k):
        ps = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=stationary[:, k, cols], moving=codes[:, k, :], accumulate=False)
        for nb in range(width // P):
            blk = slice(nb * P, (nb + 1) * P)
            c = (block0 + nb) * groups + k
            if k == 0:
                nisa.activation(dst=total[:, blk], op=nl.copy, data=ps[:, blk], scale=scales[:, c:c + 1])
            else:
                part = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
                nisa.activation(dst=part, op=nl.copy, data=ps[:, blk], scale=scales[:, c:c + 1])
                nisa.tensor_tensor(dst=total[:, blk], data1=total[:, blk], data2=part, op=nl.add)
    return total


def _expert_pass(e, tile0, n_tiles, rows, row_weight, out, w13, sc13, w2, sc2, dims, mode):
    """Rows of tiles [tile0, tile0 + n_tiles) (all routed to expert ``e``) through expert ``e``."""
    hidden, g_h, inter, g_i, g13, g2, limit = dims
    width_rows = n_tiles * P
    h_t = nl.ndarray((P, g_h, width_rows), dtype=nl.bfloat16, buffer=nl.sbuf)
    weight = nl.ndarray((P, n_tiles), dtype=nl.float32, buffer=nl.sbuf)
    for i in range(n_tiles):
        r0 = (tile0 + i) * P
        x = nl.ndarray((P, hidden), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=x, src=rows[r0:r0 + P, :])
        nisa.dma_copy(dst=weight[:, i:i + 1], src=row_weight[r0:r0 + P, :])
        for k in range(g_h):
            x_t = nl.ndarray((P, P), dtype=nl.bfloat16, buffer=nl.psum)
            nisa.nc_transpose(dst=x_t, data=x[:, k * P:(k + 1) * P])
            nisa.tensor_copy(dst=h_t[:, k, i * P:(i + 1) * P], src=x_t)

    # gate / up, 512 intermediate columns at a time; act = SiLU(gate) * weight * up in bf16
    act = nl.ndarray((P, n_tiles, inter), dtype=nl.bfloat16, buffer=nl.sbuf)
    for c0 in range(0, inter, SLAB):
        w = min(SLAB, inter - c0)
        w_gate = nl.ndarray((P, g_h, w), dtype=nl.uint8, buffer=nl.sbuf)
        w_up = nl.ndarray((P, g_h, w), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.dma_copy(dst=w_gate, src=w13[e, :, :, c0:c0 + w])
        nisa.dma_copy(dst=w_up, src=w13[e, :, :, inter + c0:inter + c0 + w])
        for i in range(n_tiles):
            cols = slice(i * P, (i + 1) * P)
            gate = _scaled_contract(h_t, cols, w_gate, g_h, sc13, c0 // P, g13, mode, w)
            up = _scaled_contract(h_t, cols, w_up, g_h, sc13, g_i + c0 // P, g13, mode, w)
            if limit > 0:
                nisa.tensor_scalar(dst=gate, data=gate, op0=nl.minimum, operand0=limit)
                nisa.tensor_scalar(dst=up, data=up, op0=nl.maximum, operand0=-limit, op1=nl.minimum, operand1=limit)
            silu = nl.ndarray((P, w), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=silu, op=nl.silu, data=gate)
            nisa.tensor_scalar(dst=silu, data=silu, op0=nl.multiply, operand0=weight[:, i:i + 1])
            nisa.tensor_tensor(dst=act[:, i, c0:c0 + w], data1=up, data2=silu, op=nl.multiply)

    # act^T [P, I/P, rows] bf16: the stationary operand of the down projection
    act_t = nl.ndarray((P, g_i, width_rows), dtype=nl.bfloat16, buffer=nl.sbuf)
    for i in range(n_tiles):
        for k in range(g_i):
            ps = nl.ndarray((P, P), dtype=nl.bfloat16, buffer=nl.psum)
            nisa.nc_transpose(dst=ps, data=act[:, i, k * P:(k + 1) * P])
            nisa.tensor_copy(dst=act_t[:, k, i * P:(i + 1) * P], src=ps, engine=nisa.engine.scalar)

    # down projection, 512 hidden columns at a time, written straight to the rows' output
    for h0 in range(0, hidden, SLAB):
        w = min(SLAB, hidden - h0)
        w_down = nl.ndarray((P, g_i, w), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.dma_copy(dst=w_down, src=w2[e, :, :, h0:h0 + w])
        for i in range(n_tiles):
            res = _scaled_contract(act_t, slice(i * P, (i + 1) * P), w_down, g_i, sc2, h0 // P, g2, mode, w)
            r0 = (tile0 + i) * P
            nisa.dma_copy(dst=out[r0:r0 + P, h0:h0 + w], src=res)
