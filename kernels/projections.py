"""Per-block projection helpers of the routed-expert kernels: one block of ``rows`` (<= 128) token rows through
one expert whose index is a runtime value (a [1, 1] int32 SBUF tile), its weights and scales fetched by
scalar-offset DMA (``.ap(scalar_offset=expert, indirect_dim=0)``). The selective decode and block prefill
schedules (:mod:`.moe_w8_blocks`) call these; the dataflow per block is the dense kernel's (kernels/moe_w8.py):
FP8 codes stream as 512-column slabs, viewed as ``nl.float8_e4m3``, moving operand against bf16 hidden^T
(stationary), fp32 PSUM. pow2 runs the shared per-block step :func:`.block_scale.contract_pow2` (each 128x128
partial scaled and added on VectorE or ScalarE + GpSimdE as ``kernels/schedule.py``'s ``vector_blocks`` says; the
block's running count is the schedule index); output-block scales the PSUM accumulation once. ``dims`` is
``(rows, gH, I, gI, G13, G2, swiglu_limit, vector_blocks)``. Traced kernel code: the subset of
kernels/nki_cpu/subset.py.
"""

from __future__ import annotations

from . import block_scale
from .nki_api import nisa, nl

P = 128
SLAB = 512
POW2 = "pow2"
OUTPUT_BLOCK = "output-block"


def expert_rows(table, expert, row=None):
    """[1, n] fp32 in SBUF (``row`` when given): row ``expert`` of an [E, a, b] HBM scale table (n = a*b), by
    scalar-offset DMA; an ``expert`` outside [0, E) moves nothing (``oob_mode.skip``: ``row`` keeps what it held)."""
    n = table.shape[1] * table.shape[2]
    if row is None:
        row = nl.ndarray((1, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=row, src=table.ap(pattern=[[n, 1], [1, n]], offset=0, scalar_offset=expert, indirect_dim=0),
                  oob_mode=nisa.oob_mode.skip)
    return row


def broadcast_row(row, rows, ones, out=None):
    """[1, n] fp32 SBUF -> [rows, n] fp32 SBUF (``out`` when given), every partition a copy (K=1 fp32 matmul: exact)."""
    n = row.shape[1]
    if out is None:
        out = nl.ndarray((rows, n), dtype=nl.float32, buffer=nl.sbuf)
    for c in range((n + SLAB - 1) // SLAB):
        w = min(SLAB, n - c * SLAB)
        ps = nl.ndarray((rows, w), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=ones[:, 0:rows], moving=row[:, c * SLAB:c * SLAB + w], accumulate=False)
        nisa.tensor_copy(dst=out[:, c * SLAB:c * SLAB + w], src=ps)
    return out


def load_expert(weights, expert, out):
    """out [P, G, C] uint8 SBUF := all of expert ``expert`` of an [E, P, G, C] HBM tensor (one scalar-offset DMA;
    an ``expert`` outside [0, E) moves nothing: ``oob_mode.skip``, ``out`` keeps the expert it held)."""
    _e, p, g, cols = weights.shape
    nisa.dma_copy(dst=out, src=weights.ap(pattern=[[g * cols, p], [cols, g], [1, cols]], offset=0, scalar_offset=expert,
                                          indirect_dim=0), oob_mode=nisa.oob_mode.skip)


def weight_slab(weights, expert, col0, width, resident=None, group0=0, groups=None):
    """[P, groups, width] uint8 in SBUF: columns [col0, col0 + width) of groups [group0, group0 + groups) (default:
    all G) of expert ``expert`` of an [E, P, G, C] HBM tensor (a slice of ``resident``, the expert already in SBUF,
    when given)."""
    _e, p, g, cols = weights.shape
    n_g = g - group0 if groups is None else groups
    if resident is not None:
        return resident[:, group0:group0 + n_g, col0:col0 + width]
    slab = nl.ndarray((p, n_g, width), dtype=nl.uint8, buffer=nl.sbuf)
    pattern = [[g * cols, p], [cols, n_g], [1, width]]
    nisa.dma_copy(dst=slab, src=weights.ap(pattern=pattern, offset=group0 * cols + col0, scalar_offset=expert,
                                           indirect_dim=0))
    return slab


def scaled_contract(stationary, weights, n_k, scales, block0, groups, mode, rows, width, total=None, counter=0,
                    vector_blocks=0):
    """([rows, width] fp32 SBUF, counter): sum_k stationary[:, k, :].T @ weights[:, k, :], each 128-column block nb
    scaled by ``scales[:, (block0 + nb) * groups + k]`` (pow2, per k partial: :func:`.block_scale.contract_pow2`,
    the engines of ``vector_blocks``, ``counter`` the block's running pow2 block count, returned advanced) or
    ``scales[:, block0 + nb]`` (output-block). ``total``: the [rows, width] fp32 SBUF tile to write (a new one when
    None); written, not added to (the k = 0 partials write it)."""
    codes = weights.view(nl.float8_e4m3)
    if total is None:
        total = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.sbuf)
    if mode == OUTPUT_BLOCK:
        ps = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.psum)
        for k in range(n_k):
            nisa.nc_matmul(dst=ps, stationary=stationary[:, k, :], moving=codes[:, k, :], accumulate=(k > 0))
        for nb in range(width // P):
            c = block0 + nb
            nisa.activation(dst=total[:, nb * P:(nb + 1) * P], op=nl.copy, data=ps[:, nb * P:(nb + 1) * P],
                            scale=scales[:, c:c + 1])
        return total, counter
    counter = block_scale.contract_pow2(stationary, slice(0, rows), codes, n_k, scales, block0, groups, rows, width,
                                        total, True, counter, vector_blocks)
    return total, counter


def transpose_rows(x, rows, blocks, dtype):
    """[rows, blocks * P] SBUF -> [P, blocks, rows] SBUF (TensorE transposes through PSUM)."""
    out = nl.ndarray((P, blocks, rows), dtype=dtype, buffer=nl.sbuf)
    for k in range(blocks):
        ps = nl.ndarray((P, rows), dtype=dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=ps, data=x[:, k * P:(k + 1) * P])
        nisa.tensor_copy(dst=out[:, k, :], src=ps, engine=nisa.engine.scalar)
    return out


def gate_up_act(h_t, weight, w13, sc13, expert, dims, mode, resident=None, i0=0):
    """(act [rows, I'] bf16 = SiLU(gate) * weight * up for one block (gate/up scaled; GLM clamp when limit > 0),
    the block's pow2 block count so far). ``dims``' I' (<= the expert's I) intermediate rows from ``i0`` (a multiple
    of 128): the whole expert by default, one program's share when the intermediate is split across the programs;
    ``sc13`` holds the expert's whole scale row."""
    rows, g_h, inter, _g_i, g13, _g2, limit, vector_blocks = dims
    full = w13.shape[3] // 2  # the expert's I: up's rows follow gate's
    act = nl.ndarray((rows, inter), dtype=nl.bfloat16, buffer=nl.sbuf)
    counter = 0
    for c0 in range(0, inter, SLAB):
        w = min(SLAB, inter - c0)
        w_gate = weight_slab(w13, expert, i0 + c0, w, resident)
        w_up = weight_slab(w13, expert, full + i0 + c0, w, resident)
        counter = swiglu_slab(h_t, w_gate, w_up, (i0 + c0) // P, (full + i0 + c0) // P, weight, sc13, g_h, g13, mode,
                              rows, w, limit, vector_blocks, act[:, c0:c0 + w], counter)
    return act, counter


def swiglu_slab(h_t, w_gate, w_up, gate_block, up_block, weight, sc13, g_h, g13, mode, rows, w, limit, vector_blocks,
                dst, counter):
    """``dst`` [rows, w] bf16 = SiLU(gate) * weight * up of one slab of w intermediate columns: the gate and up code
    slabs contracted and scaled from scale-row blocks ``gate_block`` / ``up_block`` of ``sc13`` (GLM clamp when
    ``limit`` > 0); the pow2 block count so far."""
    gate, counter = scaled_contract(h_t, w_gate, g_h, sc13, gate_block, g13, mode, rows, w, None, counter, vector_blocks)
    up, counter = scaled_contract(h_t, w_up, g_h, sc13, up_block, g13, mode, rows, w, None, counter, vector_blocks)
    if limit > 0:
        nisa.tensor_scalar(dst=gate, data=gate, op0=nl.minimum, operand0=limit)
        nisa.tensor_scalar(dst=up, data=up, op0=nl.maximum, operand0=-limit, op1=nl.minimum, operand1=limit)
    silu = nl.ndarray((rows, w), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=silu, op=nl.silu, data=gate)
    nisa.tensor_scalar(dst=silu, data=silu, op0=nl.multiply, operand0=weight, engine=nisa.engine.scalar)
    # both in SBUF: GpSimd takes the product when VectorE carries block scale-adds (as the dense kernel)
    product_engine = nisa.engine.gpsimd if (mode == POW2 and vector_blocks > 0) else nisa.engine.vector
    nisa.tensor_tensor(dst=dst, data1=up, data2=silu, op=nl.multiply, engine=product_engine)
    return counter


def down_slab(act_t, w2, sc2, expert, h0, width, dims, mode, total=None, resident=None, counter=0, i0=0):
    """([rows, width] fp32 SBUF (``total`` when given): hidden columns [h0, h0 + width) of the block's down
    projection over ``dims``' I' intermediate rows from ``i0`` (as :func:`gate_up_act`), scaled; the pow2 block
    count advanced). A share of I is a partial sum: output-block's one scale per output block applies to each."""
    rows, _g_h, _inter, g_i, _g13, g2, _limit, vector_blocks = dims
    k0 = i0 // P
    w_down = weight_slab(w2, expert, h0, width, resident, k0, g_i)
    scales = sc2[:, k0:] if mode == POW2 else sc2  # pow2: scale (block, k) sits at block * G2 + k0 + k
    return scaled_contract(act_t, w_down, g_i, scales, h0 // P, g2, mode, rows, width, total, counter, vector_blocks)
