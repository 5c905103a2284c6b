"""NKI kernels: the routed experts of one rank with 1-byte FP8 weights (Trn2 ``float8_e4m3`` codes).

Two variants share one body:

* :func:`moe_w8_pow2` - exact 128x128 block scales: every contraction block's partial product is scaled and
  added to an fp32 SBUF accumulator, per 128-column block either by ScalarE (scaled copy PSUM -> SBUF) + GpSimdE
  (add in SBUF; GpSimd cannot read PSUM) or by one VectorE ``scalar_tensor_tensor`` (partial * scale + total).
  Which blocks go to VectorE is the trace-time constant ``vector_blocks`` (of every ``schedule.BLOCK_PERIOD``),
  chosen at load from the Neuron calibration file (``kernels/schedule.py``: which engines overlap on the device).
  The arithmetic is the same either way: one fp32 multiply and one fp32 add per block.
* :func:`moe_w8_output_block` - one scale per 128 output rows: the whole contraction accumulates in
  PSUM and is scaled once while it is evacuated. It refuses 128x128 block scales (the grid is checked).

Shape contract (checked on the host before every launch by ``host.check_kernel_args``, ``ValueError``
naming the tensor otherwise; the traced kernel body has no ``raise``), P = 128:

    hidden      [T, H]               bf16     T <= 128, or T in {256} (T % 128 == 0, T <= T_MAX = 256);
                                              the op wrapper pads T up to a static bucket (host.T_BUCKETS)
                                              and splits larger batches into T_MAX chunks
    w13         [E, P, H/P, 2I]      uint8    w13[e, p, k, n] = code of W13_e[n, k*P + p]; n < I gate, n >= I up
    w13_scales  [E, 2I/P, G13]       float32  pow2: G13 = H/P, entry [e, nb, kb] scales block (nb, kb);
                                              output-block: G13 = 1, one scale per 128 output rows
    w2          [E, P, I/P, H]       uint8    w2[e, p, k, h] = code of W2_e[h, k*P + p]
    w2_scales   [E, H/P, G2]         float32  pow2: G2 = I/P; output-block: G2 = 1
    affinities  [T, E]               float32  routing weight of token t for local expert e, 0 if not routed
                                              (duplicate routes summed)
    swiglu_limit  float (trace-time constant, default 0): > 0 clamps gate <= limit and |up| <= limit
                                              before SiLU(gate) * up (GLM-5.3-Flash)
    returns     [n, T, H]            float32  program p's partial sum over its experts of
                                              affinities[t, e] * W2_e (SiLU(W1_e x_t) * W3_e x_t);
                                              the host adds the n partials (n = launch grid = LNC)

Launched as ``kernel[n]`` (n = the LNC the runtime runs at), program p = ``nl.program_id(0)`` takes the
contiguous expert range [p*ceil(E/n), (p+1)*ceil(E/n)): each weight byte is read by one logical core. When the
experts do not divide evenly (E % n != 0, e.g. GLM-5.3-Flash's 9 local experts at LNC 2: 5 + 4) and each program's
share of I is whole 512-column slabs (:func:`split_inter`, a shape rule), every program takes every expert over its
own I / n intermediate rows instead (gate and up rows [p I/n, (p+1) I/n), the down projection over them: a partial
sum, added by the host like the expert split's), so the programs carry E / n experts each.

H and I are any multiples of 128. Codes are the op's storage (DEVELOPING.md) re-laid out once at load
time by ``host.to_kernel_layout`` so that every weight DMA reads 128 partitions x (contraction blocks x
up to 512 contiguous bytes).

Dataflow per expert (dense over the rank's local experts, as decode needs):
  hidden^T [P, H/P, T] bf16 is built once (TensorE transposes); the expert's scale grids are broadcast
  to the token partitions with a K=1 fp32 matmul (ones x scale row, exact). For each 512-column slab
  of gate and up, the FP8 codes stream from HBM as uint8, are viewed as ``nl.float8_e4m3`` in SBUF and
  are the *moving* operand of ``nisa.nc_matmul`` against the bf16 hidden^T chunk (stationary), fp32
  PSUM. SiLU(gate) (ScalarE, scale fused), times the affinity, times up gives the activation in bf16
  [T, I], transposed (TensorE) to [P, I/P, T] to be the stationary operand of the down projection,
  whose blocks are scaled and added straight into the fp32 accumulator [T, H] in SBUF (pow2; output-block: one
  scaled add per 128 columns); one DMA per 128-token tile writes the result. Weights move in few, large DMAs
  (gate and up together when I <= 512, down DOWN_DMA_COLS columns at a time); the expert's two scale grids are
  loaded side by side and broadcast to the token partitions together.
Precision: products are exact in fp32 (bf16 x fp8), accumulation fp32; the activation is rounded to
bf16 once before the down projection (the only rounding beyond fp32 accumulation).
"""

from __future__ import annotations

from . import block_scale, projections, schedule
from .nki_api import nisa, nki, nl

P = 128  # partitions; contraction block and scale block
SLAB = 512  # moving free size: one PSUM bank of fp32
T_MAX = 256  # tokens per kernel call (SBUF: accumulators, hidden^T and activations scale with T)
DOWN_DMA_COLS = 2048  # down-projection weight columns per DMA (fewer, larger DMAs; [P, I/P, 2048] uint8 in SBUF)
POW2_SCHEDULE = schedule.load()  # which engines carry the pow2 block scale-adds (the calibration file, at load)
POW2 = "pow2"
OUTPUT_BLOCK = "output-block"


def _dims(hidden, w13, mode):
    """Sizes from the (host-checked) shapes: (T, H, E, I, gH, gI, G13, G2, TT, n_tt)."""
    t, h = hidden.shape
    e, _p, gh, two_i = w13.shape
    inter = two_i // 2
    gi = inter // P
    g13, g2 = (gh, gi) if mode == POW2 else (1, 1)
    return t, h, e, inter, gh, gi, g13, g2, min(t, P), (t + P - 1) // P


@nki.jit
def moe_w8_pow2(hidden, w13, w13_scales, w2, w2_scales, affinities, swiglu_limit=0.0,
                vector_blocks=POW2_SCHEDULE.vector_blocks):
    """Routed MoE over local experts with exact 128x128 block scales (pow2 repack). ``vector_blocks`` (trace-time
    constant): of every ``schedule.BLOCK_PERIOD`` block scale-adds, how many run on VectorE (kernels/schedule.py)."""
    return _moe(hidden, w13, w13_scales, w2, w2_scales, affinities, POW2, float(swiglu_limit), int(vector_blocks))


@nki.jit
def moe_w8_output_block(hidden, w13, w13_scales, w2, w2_scales, affinities, swiglu_limit=0.0):
    """Routed MoE over local experts with one scale per 128 output rows (output-block repack)."""
    return _moe(hidden, w13, w13_scales, w2, w2_scales, affinities, OUTPUT_BLOCK, float(swiglu_limit), 0)


def split_inter(experts: int, programs: int, inter: int) -> bool:
    """Whether the dense kernel's programs split each expert's intermediate instead of the experts (a shape rule):
    when the experts do not divide evenly among them and each share of I is whole 512-column slabs."""
    return programs > 1 and experts % programs != 0 and inter % (programs * SLAB) == 0


def inter_start(pid, rows):
    """First intermediate row of program ``pid``'s share of I when the programs split it (``rows`` rows each)."""
    return pid * rows


def _moe(hidden, w13, w13_scales, w2, w2_scales, affinities, mode, swiglu_limit, vector_blocks):
    dims = _dims(hidden, w13, mode)
    t, h, e_local, inter, _gh, gi, g13, g2, tt_rows, n_tt = dims
    programs = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    per_program = (e_local + programs - 1) // programs
    first, last = pid * per_program, min(e_local, (pid + 1) * per_program)
    share = (inter, 0)  # (rows, first row) of I this program computes
    if split_inter(e_local, programs, inter):
        first, last = 0, e_local
        share = (inter // programs, inter_start(pid, inter // programs))
    out = nl.ndarray((programs, t, h), dtype=nl.float32, buffer=nl.shared_hbm)
    ones = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    h_t, aff, acc = _load_tokens(hidden, affinities, dims)
    sc13_rows = w13_scales.reshape((e_local, 1, 2 * gi * g13))
    sc2_rows = w2_scales.reshape((e_local, 1, (h // P) * g2))
    for e in nl.sequential_range(first, last):
        _expert(e, h_t, aff, acc, ones, w13, sc13_rows, w2, sc2_rows, dims, mode, swiglu_limit, vector_blocks, share)
    for tt in range(n_tt):
        nisa.dma_copy(dst=out[pid, tt * tt_rows:(tt + 1) * tt_rows, :], src=acc[:, tt, :])
    return out


def _load_tokens(hidden, affinities, dims):
    """hidden^T [P, H/P, T] bf16, affinities [TT, n_tt, E] fp32, zeroed accumulators [TT, n_tt, H] fp32."""
    t, h, e_local, _inter, gh, _gi, _g13, _g2, tt_rows, n_tt = dims
    h_t = nl.ndarray((P, gh, t), dtype=nl.bfloat16, buffer=nl.sbuf)
    aff = nl.ndarray((tt_rows, n_tt, e_local), dtype=nl.float32, buffer=nl.sbuf)
    acc = nl.ndarray((tt_rows, n_tt, h), dtype=nl.float32, buffer=nl.sbuf)
    for tt in range(n_tt):
        rows = slice(tt * tt_rows, (tt + 1) * tt_rows)
        x = nl.ndarray((tt_rows, h), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=x, src=hidden[rows, :])
        nisa.dma_copy(dst=aff[:, tt, :], src=affinities[rows, :])
        nisa.memset(dst=acc[:, tt, :], value=0.0)
        for k in range(gh):
            x_t = nl.ndarray((P, tt_rows), dtype=nl.bfloat16, buffer=nl.psum)  # transposes keep the dtype
            nisa.nc_transpose(dst=x_t, data=x[:, k * P:(k + 1) * P])
            nisa.tensor_copy(dst=h_t[:, k, rows], src=x_t)
    return h_t, aff, acc


def _transpose_act(act, gi, t, tt_rows, n_tt):
    """[tt_rows, n_tt, I] bf16 activation -> its transpose [P, I/P, T] bf16 in SBUF (TensorE transposes, ScalarE
    evacuates PSUM): the stationary operand of the down projection."""
    act_t = nl.ndarray((P, gi, t), dtype=nl.bfloat16, buffer=nl.sbuf)
    for tt in range(n_tt):
        cols = slice(tt * tt_rows, (tt + 1) * tt_rows)
        for k in range(gi):
            ps = nl.ndarray((P, tt_rows), dtype=nl.bfloat16, buffer=nl.psum)
            nisa.nc_transpose(dst=ps, data=act[:, tt, k * P:(k + 1) * P])
            nisa.tensor_copy(dst=act_t[:, k, cols], src=ps, engine=nisa.engine.scalar)
    return act_t


def _broadcast_rows(rows_hbm, rows, ones):
    """[1, n_i] fp32 rows in HBM -> one [rows, sum n_i] fp32 SBUF tile, every partition a copy (K=1 fp32 matmuls:
    exact), and the column where each row starts. The rows are loaded side by side so one matmul per 512 columns
    broadcasts all of them."""
    n = 0
    for r in rows_hbm:
        n += r.shape[1]
    row = nl.ndarray((1, n), dtype=nl.float32, buffer=nl.sbuf)
    starts = []
    c0 = 0
    for r in rows_hbm:
        starts.append(c0)
        nisa.dma_copy(dst=row[:, c0:c0 + r.shape[1]], src=r)
        c0 += r.shape[1]
    return projections.broadcast_row(row, rows, ones), starts


def _scale_col(block0, nb, k, per_block):
    """Column of the broadcast scale row for output block ``block0 + nb`` and contraction block ``k``."""
    return (block0 + nb) * per_block + k


def _contract(stationary, cols, weights, n_k, rows, width):
    """output-block: sum_k stationary[:, k, cols].T @ weights[:, k, :] accumulated in PSUM ([rows, width], unscaled;
    the caller scales while evacuating)."""
    codes = weights.view(nl.float8_e4m3)
    ps = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.psum)
    for k in range(n_k):
        nisa.nc_matmul(dst=ps, stationary=stationary[:, k, cols], moving=codes[:, k, :], accumulate=(k > 0))
    return ps


def _load_w13(w13, e, inter, c0, w):
    """(gate codes, up codes) [P, gH, w] uint8 of intermediate columns [c0, c0 + w): one DMA when the slab is the whole
    intermediate size (gate and up are then contiguous), else one each."""
    gh = w13.shape[2]
    if w == inter:
        both = nl.ndarray((P, gh, 2 * w), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.dma_copy(dst=both, src=w13[e])
        return both[:, :, 0:w], both[:, :, w:2 * w]
    w_gate = nl.ndarray((P, gh, w), dtype=nl.uint8, buffer=nl.sbuf)
    w_up = nl.ndarray((P, gh, w), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.dma_copy(dst=w_gate, src=w13[e, :, :, c0:c0 + w])
    nisa.dma_copy(dst=w_up, src=w13[e, :, :, inter + c0:inter + c0 + w])
    return w_gate, w_up


def _load_w13_share(w13, e, inter, i0, rows):
    """[P, gH, 2 rows] uint8: gate columns [i0, i0 + rows) then the same up columns of expert e (one DMA): a program's
    share of I when the programs split it."""
    e_all, _p, gh, _two_i = w13.shape
    both = nl.ndarray((P, gh, 2 * rows), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.dma_copy(dst=both, src=w13.reshape((e_all, P, gh, 2, inter))[e, :, :, :, i0:i0 + rows])
    return both


def _expert(e, h_t, aff, acc, ones, w13, sc13_rows, w2, sc2_rows, dims, mode, limit, vector_blocks, share):
    t, h, _e_local, inter, gh, gi, g13, g2, tt_rows, n_tt = dims
    rows_i, i0 = share  # the intermediate rows [i0, i0 + rows_i) this program computes (all of I unless split)
    scales, (s13, s2) = _broadcast_rows((sc13_rows[e], sc2_rows[e]), tt_rows, ones)  # [TT, 2gI*G13 + gH*G2]
    sc13 = scales[:, s13:s2]
    sc2 = scales[:, s2:s2 + (h // P) * g2]
    act = nl.ndarray((tt_rows, n_tt, rows_i), dtype=nl.bfloat16, buffer=nl.sbuf)
    counter = 0  # the expert's pow2 block count: the engine schedule's index

    both = _load_w13_share(w13, e, inter, i0, rows_i) if rows_i < inter else None  # a split share: one DMA

    # gate / up projections, 512 intermediate columns at a time
    for c0 in range(0, rows_i, SLAB):
        w = min(SLAB, rows_i - c0)
        if both is None:
            w_gate, w_up = _load_w13(w13, e, inter, c0, w)
        else:
            w_gate, w_up = both[:, :, c0:c0 + w], both[:, :, rows_i + c0:rows_i + c0 + w]
        gate0 = (i0 + c0) // P  # first gate row block of this slab in the w13 scale grid; up rows follow gI gate blocks
        up0 = gi + (i0 + c0) // P
        for tt in range(n_tt):
            cols = slice(tt * tt_rows, (tt + 1) * tt_rows)
            silu = nl.ndarray((tt_rows, w), dtype=nl.float32, buffer=nl.sbuf)
            if mode == OUTPUT_BLOCK:
                gate = _contract(h_t, cols, w_gate, gh, tt_rows, w)
                up = _contract(h_t, cols, w_up, gh, tt_rows, w)
                for nb in range(w // P):
                    blk = slice(nb * P, (nb + 1) * P)
                    c = _scale_col(gate0, nb, 0, g13)
                    if limit > 0:  # SiLU(min(gate, limit)): scale and clamp on VectorE, then SiLU
                        nisa.tensor_scalar(dst=silu[:, blk], data=gate[:, blk], op0=nl.multiply, operand0=sc13[:, c:c + 1],
                                           op1=nl.minimum, operand1=limit)
                        nisa.activation(dst=silu[:, blk], op=nl.silu, data=silu[:, blk])
                    else:
                        nisa.activation(dst=silu[:, blk], op=nl.silu, data=gate[:, blk], scale=sc13[:, c:c + 1])
            else:
                gate = nl.ndarray((tt_rows, w), dtype=nl.float32, buffer=nl.sbuf)
                up = nl.ndarray((tt_rows, w), dtype=nl.float32, buffer=nl.sbuf)
                counter = block_scale.contract_pow2(h_t, cols, w_gate.view(nl.float8_e4m3), gh, sc13, gate0, g13, tt_rows, w, gate,
                                         True, counter, vector_blocks)
                counter = block_scale.contract_pow2(h_t, cols, w_up.view(nl.float8_e4m3), gh, sc13, up0, g13, tt_rows, w, up,
                                         True, counter, vector_blocks)
                if limit > 0:
                    nisa.tensor_scalar(dst=gate, data=gate, op0=nl.minimum, operand0=limit)
                    nisa.tensor_scalar(dst=up, data=up, op0=nl.maximum, operand0=-limit, op1=nl.minimum, operand1=limit)
                nisa.activation(dst=silu, op=nl.silu, data=gate)
            nisa.tensor_scalar(dst=silu, data=silu, op0=nl.multiply, operand0=aff[:, tt, e:e + 1],
                               engine=nisa.engine.scalar)  # VectorE is the busier engine (pow2 block adds)
            if mode == OUTPUT_BLOCK:
                for nb in range(w // P):
                    blk = slice(nb * P, (nb + 1) * P)
                    c = _scale_col(up0, nb, 0, g13)
                    dst = act[:, tt, c0 + nb * P:c0 + (nb + 1) * P]
                    if limit > 0:  # clamp(up * scale, -limit, limit) * silu
                        up_c = nl.ndarray((tt_rows, P), dtype=nl.float32, buffer=nl.sbuf)
                        nisa.tensor_scalar(dst=up_c, data=up[:, blk], op0=nl.multiply, operand0=sc13[:, c:c + 1],
                                           op1=nl.maximum, operand1=-limit)
                        nisa.scalar_tensor_tensor(dst=dst, data=up_c, op0=nl.minimum, operand0=limit, op1=nl.multiply,
                                                  operand1=silu[:, blk])
                    else:
                        nisa.scalar_tensor_tensor(dst=dst, data=up[:, blk], op0=nl.multiply, operand0=sc13[:, c:c + 1],
                                                  op1=nl.multiply, operand1=silu[:, blk])
            else:  # both in SBUF: GpSimd takes the product (VectorE carries scaled block adds)
                nisa.tensor_tensor(dst=act[:, tt, c0:c0 + w], data1=up, data2=silu, op=nl.multiply,
                                   engine=nisa.engine.gpsimd if vector_blocks > 0 else nisa.engine.vector)

    # activation^T [P, I'/P, T] bf16: the stationary operand of the down projection
    g_s = rows_i // P
    k0 = i0 // P
    act_t = _transpose_act(act, g_s, t, tt_rows, n_tt)

    # down projection, 512 hidden columns at a time, added into the fp32 accumulators; its weights arrive
    # DOWN_DMA_COLS x (I / I') columns per DMA (the same bytes per DMA for a share of I)
    down_cols = min(h, DOWN_DMA_COLS * gi // g_s)
    for d0 in range(0, h, down_cols):
        dw = min(down_cols, h - d0)
        w_down_all = nl.ndarray((P, g_s, dw), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.dma_copy(dst=w_down_all, src=w2[e, :, k0:k0 + g_s, d0:d0 + dw])
        for h0 in range(d0, d0 + dw, SLAB):
            w = min(SLAB, d0 + dw - h0)
            w_down = w_down_all[:, :, h0 - d0:h0 - d0 + w]
            down0 = h0 // P
            for tt in range(n_tt):
                cols = slice(tt * tt_rows, (tt + 1) * tt_rows)
                out_slab = acc[:, tt, h0:h0 + w]
                if mode == OUTPUT_BLOCK:
                    res = _contract(act_t, cols, w_down, g_s, tt_rows, w)
                    for nb in range(w // P):
                        c = _scale_col(down0, nb, 0, g2)
                        out_blk = out_slab[:, nb * P:(nb + 1) * P]
                        nisa.scalar_tensor_tensor(dst=out_blk, data=res[:, nb * P:(nb + 1) * P], op0=nl.multiply,
                                                  operand0=sc2[:, c:c + 1], op1=nl.add, operand1=out_blk)
                else:  # every block's scaled partial straight into the accumulator
                    counter = block_scale.contract_pow2(act_t, cols, w_down.view(nl.float8_e4m3), g_s, sc2[:, k0:], down0, g2,
                                                        tt_rows, w, out_slab, False, counter, vector_blocks)
