"""Weights-stationary projections of one routed expert for a few tokens (selective decode, pow2 only).

The token-stationary projections (:mod:`.projections`, the dense kernel) make the tokens the stationary operand
and stream 512 weight columns per matmul: few wide matmuls, and one [T, 128] scale-add per 128x128 block whose
cost is set by the 128 columns, not by T. Here each 128x128 block of FP8 codes is the stationary operand and the
tokens' columns the moving one (``nc_matmul(dst [128, T], stationary=codes block [128, 128], moving=x^T [128, T])``),
as nki-library's ``moe_tkg`` does: many narrow matmuls (one per block) and a [128, T] partial per block - so the
partials of many blocks share one PSUM bank, ``[128, blocks, K, T]``, and their exact pow2 step is two VectorE
instructions per bank instead of one instruction per block: every partial times its block's scale (one fp32
multiply; the scales broadcast to the partitions, stride 0 along T), then the sum over the K contraction blocks
(fp32 adds). The arithmetic per block is the token-stationary step's - one fp32 multiply and fp32 adds of the
scaled partials - in another summation order.

Which is cheaper is a fact of the device: a matmul's fixed cost (the fitted scenario charges 616 cycles per matmul,
so many narrow matmuls lose) against the per-instruction cost of the block scale-adds (the documented scenario:
matmuls at ``max(N, 64)`` cycles, so at T = 1 the 768 block matmuls of a GLM-5.3-Flash share cost 20 us and the
768 scale-adds they replace ~60 us of VectorE/ScalarE/GpSimdE). ``host_routed.weights_stationary`` decides per
scenario and bucket, by measurement.

Layouts (P = 128, gH = H/128, S = the program's intermediate rows, gS = S/128, T tokens):
``h_t [P, gH, T]`` bf16 (moving), ``c13 [P, gH, 2S]`` uint8 codes of the share (gate columns [0, S), up [S, 2S)),
``c2 [P, gS, H]`` uint8 (the share's down-projection rows), ``bc [P, n]`` fp32: the expert's w13 and w2 scale rows
and the block's token weights broadcast to every partition. Outputs are transposed: intermediate (or hidden) rows
on the partitions, tokens on the free axis; ``act_t [P, gS, T]`` is the down projection's moving operand as is.
Traced kernel code (the subset of kernels/nki_cpu/subset.py).
"""

from __future__ import annotations

from .nki_api import nisa, nl

P = 128
PSUM_F32 = 512  # fp32 elements per partition in one 2 KiB PSUM bank
TRANSPOSE_BANK = PSUM_F32 // P  # 128-column fp32 transposes per PSUM bank


def fits(hidden: int, share: int, tokens: int) -> bool:
    """Whether a bank holds at least one block's K partials: gH x T and gS x T fp32 per partition (a shape rule)."""
    return (hidden // P) * tokens <= PSUM_F32 and (share // P) * tokens <= PSUM_F32


def scale_view(bc, offset, stride, blocks, k, tokens):
    """[P, blocks, k, tokens] view of the broadcast scales: block j's k-th scale at ``offset + j * stride + k``, the
    same for every token (stride 0)."""
    n = bc.shape[1]
    return bc.ap(pattern=[[n, P], [stride, blocks], [1, k], [0, tokens]], offset=offset)


def scaled_sum(dst, ps, bc, offset, stride, blocks, k, tokens):
    """dst [P, blocks, tokens] fp32 := sum_k scale(j, k) * ps[:, j, k, :] (ps [P, blocks, k, tokens] fp32 PSUM): one
    VectorE multiply (PSUM -> SBUF, written K-last) and one VectorE reduction over K."""
    prod = nl.ndarray((P, blocks, tokens, k), dtype=nl.float32, buffer=nl.sbuf)
    k_major = prod.ap(pattern=[[blocks * tokens * k, P], [tokens * k, blocks], [1, k], [k, tokens]], offset=0)
    nisa.tensor_tensor(dst=k_major, data1=ps, data2=scale_view(bc, offset, stride, blocks, k, tokens), op=nl.multiply)
    nisa.tensor_reduce(dst=dst, op=nl.add, data=prod, axis=3)


def gate_up(h_t, c13, bc, dims, i0, w_offset):
    """act_t [P, gS, T] bf16 = (up * (SiLU(gate) * weight))^T of the share (GLM clamp when limit > 0): the w13 scale
    of (output block nb, contraction block k) sits at ``nb * G13 + k`` of ``bc`` (its whole row), the token weights
    at ``w_offset``."""
    tokens, g_h, share, g_s, g13, _g2, g_i, limit = dims
    codes = c13.view(nl.float8_e4m3)
    gu = nl.ndarray((P, 2, g_s, tokens), dtype=nl.float32, buffer=nl.sbuf)  # (gate | up)^T of the share
    per_bank = PSUM_F32 // (g_h * tokens)
    for half in range(2):
        nb0 = half * g_i + i0 // P  # the share's first output row block in the w13 scale grid (up rows after gate's)
        for j0 in range(0, g_s, per_bank):
            n_j = min(per_bank, g_s - j0)
            ps = nl.ndarray((P, n_j, g_h, tokens), dtype=nl.float32, buffer=nl.psum)
            for j in range(n_j):
                col = half * share + (j0 + j) * P
                for k in range(g_h):
                    nisa.nc_matmul(dst=ps[:, j, k, :], stationary=codes[:, k, col:col + P], moving=h_t[:, k, :],
                                   accumulate=False)
            scaled_sum(gu[:, half, j0:j0 + n_j, :], ps, bc, (nb0 + j0) * g13, g13, n_j, g_h, tokens)
    gate = gu[:, 0, :, :]
    up = gu[:, 1, :, :]
    if limit > 0:
        nisa.tensor_scalar(dst=gate, data=gate, op0=nl.minimum, operand0=limit)
        nisa.tensor_scalar(dst=up, data=up, op0=nl.maximum, operand0=-limit, op1=nl.minimum, operand1=limit)
    silu = nl.ndarray((P, g_s, tokens), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=silu, op=nl.silu, data=gate)
    weight = bc.ap(pattern=[[bc.shape[1], P], [0, g_s], [1, tokens]], offset=w_offset)  # token t's weight, every row
    nisa.tensor_tensor(dst=silu, data1=silu, data2=weight, op=nl.multiply, engine=nisa.engine.gpsimd)
    act_t = nl.ndarray((P, g_s, tokens), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=act_t, data1=up, data2=silu, op=nl.multiply, engine=nisa.engine.gpsimd)
    return act_t


def down_add(acc_t, act_t, c2, bc, dims, i0, s2_offset):
    """acc_t [P, H/P, T] fp32 += (W2 act)^T over the share's rows: the w2 scale of (output block hb, contraction
    block k) at ``s2_offset + hb * G2 + k`` of ``bc``, k counted from the share's first row block."""
    tokens, _g_h, _share, g_s, _g13, g2, _g_i, _limit = dims
    g_out = acc_t.shape[1]
    codes = c2.view(nl.float8_e4m3)
    per_bank = PSUM_F32 // (g_s * tokens)
    for hb0 in range(0, g_out, per_bank):
        n_h = min(per_bank, g_out - hb0)
        ps = nl.ndarray((P, n_h, g_s, tokens), dtype=nl.float32, buffer=nl.psum)
        for j in range(n_h):
            for k in range(g_s):
                nisa.nc_matmul(dst=ps[:, j, k, :], stationary=codes[:, k, (hb0 + j) * P:(hb0 + j + 1) * P],
                               moving=act_t[:, k, :], accumulate=False)
        y = nl.ndarray((P, n_h, tokens), dtype=nl.float32, buffer=nl.sbuf)
        scaled_sum(y, ps, bc, s2_offset + hb0 * g2 + i0 // P, g2, n_h, g_s, tokens)
        nisa.tensor_tensor(dst=acc_t[:, hb0:hb0 + n_h, :], data1=acc_t[:, hb0:hb0 + n_h, :], data2=y, op=nl.add,
                           engine=nisa.engine.gpsimd)


def store_transposed(out_rows, acc_t, tokens):
    """out_rows ([T, H] fp32 HBM) := acc_t^T: fp32 TensorE transposes of [128, T] into [T, 512] PSUM banks, each bank
    evacuated by one ScalarE copy into an SBUF [T, H] tile, then one DMA."""
    g_out = acc_t.shape[1]
    rows = nl.ndarray((tokens, g_out * P), dtype=nl.float32, buffer=nl.sbuf)
    for c0 in range(0, g_out, TRANSPOSE_BANK):
        n_c = min(TRANSPOSE_BANK, g_out - c0)
        ps = nl.ndarray((tokens, n_c * P), dtype=nl.float32, buffer=nl.psum)
        for j in range(n_c):
            nisa.nc_transpose(dst=ps[:, j * P:(j + 1) * P], data=acc_t[:, c0 + j, :])
        nisa.tensor_copy(dst=rows[:, c0 * P:(c0 + n_c) * P], src=ps, engine=nisa.engine.scalar)
    nisa.dma_copy(dst=out_rows, src=rows)
