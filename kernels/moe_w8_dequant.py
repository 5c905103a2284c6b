"""NKI kernel: the routed experts with 1-byte weights dequantised to BF16 on chip (offered beside output-block).

The weights cross HBM as the pow2 kernel's FP8 codes and 128x128 block scales (same arguments, same host layout
and contract: ``host.check_kernel_args(..., mode="pow2")``, see kernels/moe_w8.py). In SBUF every 128x128 code
block is multiplied by its scale and rounded to bf16 once (ScalarE ``activation`` or VectorE ``tensor_scalar``,
alternating), and the bf16 weights are the moving operand of bf16 x bf16 matmuls that accumulate the whole
contraction in PSUM, as the BF16 model does: no per-block scaled adds. The numbers are those of a BF16 model
dequantised from the checkpoint (one bf16 rounding of w * s per weight, unit roundoff 2**-9), not the exact pow2
result; output-block requantises instead (one scale per 128 output rows). Opt-in; not wired into the serving path.

Per expert: scale grids broadcast to the 128 weight partitions (K=1 fp32 matmul, exact); gate/up slabs of 512
columns dequantised, contracted per token tile, SiLU(gate) * affinity * up rounded to bf16, transposed; down slabs
dequantised and contracted, added to the fp32 accumulator.
"""

from __future__ import annotations

from .moe_w8 import DOWN_DMA_COLS, P, SLAB, _broadcast_rows, _dims, _load_tokens, _load_w13, _transpose_act
from .nki_api import nisa, nki, nl

POW2 = "pow2"


@nki.jit
def moe_w8_dequant_bf16(hidden, w13, w13_scales, w2, w2_scales, affinities, swiglu_limit=0.0):
    """Routed MoE over local experts, FP8 codes + 128x128 scales dequantised to bf16 in SBUF."""
    dims = _dims(hidden, w13, POW2)
    t, h, e_local, _inter, _gh, gi, g13, g2, tt_rows, n_tt = dims
    programs = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    per_program = (e_local + programs - 1) // programs
    out = nl.ndarray((programs, t, h), dtype=nl.float32, buffer=nl.shared_hbm)
    ones = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    h_t, aff, acc = _load_tokens(hidden, affinities, dims)
    sc13_rows = w13_scales.reshape((e_local, 1, 2 * gi * g13))
    sc2_rows = w2_scales.reshape((e_local, 1, (h // P) * g2))
    for e in nl.sequential_range(pid * per_program, min(e_local, (pid + 1) * per_program)):
        _expert(e, h_t, aff, acc, ones, w13, sc13_rows, w2, sc2_rows, dims, float(swiglu_limit))
    for tt in range(n_tt):
        nisa.dma_copy(dst=out[pid, tt * tt_rows:(tt + 1) * tt_rows, :], src=acc[:, tt, :])
    return out


def _dequantise(codes, n_k, width, scales, block0, per_block):
    """[P, n_k, width] uint8 codes -> bf16 weights: block (nb, k) times ``scales[:, (block0 + nb) * per_block + k]``."""
    fp8 = codes.view(nl.float8_e4m3)
    wts = nl.ndarray((P, n_k, width), dtype=nl.bfloat16, buffer=nl.sbuf)
    i = 0
    for k in range(n_k):
        for nb in range(width // P):
            blk = slice(nb * P, (nb + 1) * P)
            c = (block0 + nb) * per_block + k
            if i % 2 == 0:
                nisa.activation(dst=wts[:, k, blk], op=nl.copy, data=fp8[:, k, blk], scale=scales[:, c:c + 1])
            else:
                nisa.tensor_scalar(dst=wts[:, k, blk], data=fp8[:, k, blk], op0=nl.multiply, operand0=scales[:, c:c + 1],
                                   engine=nisa.engine.vector)
            i += 1
    return wts


def _contract(stationary, cols, wts, n_k, rows, width):
    ps = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.psum)
    for k in range(n_k):
        nisa.nc_matmul(dst=ps, stationary=stationary[:, k, cols], moving=wts[:, k, :], accumulate=(k > 0))
    return ps


def _expert(e, h_t, aff, acc, ones, w13, sc13_rows, w2, sc2_rows, dims, limit):
    t, h, _e_local, inter, gh, gi, g13, g2, tt_rows, n_tt = dims
    scales, (s13, s2) = _broadcast_rows((sc13_rows[e], sc2_rows[e]), P, ones)  # [P, 2gI*G13 + gH*G2]
    sc13 = scales[:, s13:s2]
    sc2 = scales[:, s2:s2 + (h // P) * g2]
    act = nl.ndarray((tt_rows, n_tt, inter), dtype=nl.bfloat16, buffer=nl.sbuf)
    for c0 in range(0, inter, SLAB):
        w = min(SLAB, inter - c0)
        c_gate, c_up = _load_w13(w13, e, inter, c0, w)
        w_gate = _dequantise(c_gate, gh, w, sc13, c0 // P, g13)
        w_up = _dequantise(c_up, gh, w, sc13, gi + c0 // P, g13)
        for tt in range(n_tt):
            cols = slice(tt * tt_rows, (tt + 1) * tt_rows)
            gate = _contract(h_t, cols, w_gate, gh, tt_rows, w)
            up = _contract(h_t, cols, w_up, gh, tt_rows, w)
            silu = nl.ndarray((tt_rows, w), dtype=nl.float32, buffer=nl.sbuf)
            if limit > 0:
                nisa.tensor_scalar(dst=silu, data=gate, op0=nl.minimum, operand0=limit)
                nisa.activation(dst=silu, op=nl.silu, data=silu)
                up_c = nl.ndarray((tt_rows, w), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=up_c, data=up, op0=nl.maximum, operand0=-limit, op1=nl.minimum, operand1=limit)
                up = up_c
            else:
                nisa.activation(dst=silu, op=nl.silu, data=gate)
            nisa.tensor_scalar(dst=silu, data=silu, op0=nl.multiply, operand0=aff[:, tt, e:e + 1], engine=nisa.engine.scalar)
            nisa.tensor_tensor(dst=act[:, tt, c0:c0 + w], data1=up, data2=silu, op=nl.multiply)
    act_t = _transpose_act(act, gi, t, tt_rows, n_tt)
    for d0 in range(0, h, DOWN_DMA_COLS):
        dw = min(DOWN_DMA_COLS, h - d0)
        codes = nl.ndarray((P, gi, dw), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.dma_copy(dst=codes, src=w2[e, :, :, d0:d0 + dw])
        for h0 in range(d0, d0 + dw, SLAB):
            w = min(SLAB, d0 + dw - h0)
            w_down = _dequantise(codes[:, :, h0 - d0:h0 - d0 + w], gi, w, sc2, h0 // P, g2)
            for tt in range(n_tt):
                cols = slice(tt * tt_rows, (tt + 1) * tt_rows)
                res = _contract(act_t, cols, w_down, gi, tt_rows, w)
                nisa.tensor_tensor(dst=acc[:, tt, h0:h0 + w], data1=acc[:, tt, h0:h0 + w], data2=res, op=nl.add)
