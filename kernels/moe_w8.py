"""NKI kernels: the routed experts of one rank with 1-byte FP8 weights (Trn2 ``float8_e4m3`` codes).

Two variants share one body:

* :func:`moe_w8_pow2` - exact 128x128 block scales: every contraction block's partial product is scaled
  (ScalarE, PSUM -> SBUF) before it is added (VectorE) to an fp32 SBUF accumulator.
* :func:`moe_w8_output_block` - one scale per 128 output rows: the whole contraction accumulates in
  PSUM and is scaled once while it is evacuated. It refuses 128x128 block scales (the grid is checked).

Shape contract (checked on entry, ``ValueError`` naming the tensor otherwise), P = 128:

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
contiguous expert range [p*ceil(E/n), (p+1)*ceil(E/n)): each weight byte is read by one logical core.

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
  whose output is scaled and added into the fp32 accumulator [T, H] in SBUF; one DMA per 128-token tile
  writes the result.
Precision: products are exact in fp32 (bf16 x fp8), accumulation fp32; the activation is rounded to
bf16 once before the down projection (the only rounding beyond fp32 accumulation).
"""

from __future__ import annotations

from .nki_api import nisa, nki, nl

P = 128  # partitions; contraction block and scale block
SLAB = 512  # moving free size: one PSUM bank of fp32
T_MAX = 256  # tokens per kernel call (SBUF: accumulators, hidden^T and activations scale with T)
POW2 = "pow2"
OUTPUT_BLOCK = "output-block"


def _fail(msg: str) -> None:
    raise ValueError(f"moe_w8 kernel: {msg}")


def check_contract(hidden, w13, w13_scales, w2, w2_scales, affinities, mode: str) -> dict:
    """Validate shapes/dtypes/scale grids; return the sizes. Raises ValueError naming the tensor."""
    if len(hidden.shape) != 2:
        _fail(f"hidden must be [T, H], got {tuple(hidden.shape)}")
    t, h = hidden.shape
    if len(w13.shape) != 4:
        _fail(f"w13 must be [E, 128, H/128, 2I] (host.to_kernel_layout), got {tuple(w13.shape)}")
    e, p, gh, two_i = w13.shape
    inter = two_i // 2
    if p != P or h % P or gh * P != h:
        _fail(f"w13 {tuple(w13.shape)} does not match hidden size H={h}: expected [E, 128, {h // P}, 2I] with H a multiple of 128")
    if inter % P or two_i != 2 * inter:
        _fail(f"intermediate size I={two_i / 2} (w13 last dim {two_i}) must be a multiple of 128")
    gi = inter // P
    if tuple(w2.shape) != (e, P, gi, h):
        _fail(f"w2 has shape {tuple(w2.shape)}; expected [E, 128, I/128, H] = {(e, P, gi, h)}")
    if tuple(affinities.shape) != (t, e):
        _fail(f"affinities has shape {tuple(affinities.shape)}; expected [T, E_local] = {(t, e)}")
    if not (1 <= t <= T_MAX and (t <= P or t % P == 0)):
        _fail(f"T={t} tokens: the kernel takes T <= 128 or a multiple of 128 up to {T_MAX}; pad to a bucket (host.bucket_for)")
    for name, tensor, dtype in (("hidden", hidden, nl.bfloat16), ("w13", w13, nl.uint8), ("w2", w2, nl.uint8),
                                ("w13_scales", w13_scales, nl.float32), ("w2_scales", w2_scales, nl.float32),
                                ("affinities", affinities, nl.float32)):
        if tensor.dtype != dtype:
            _fail(f"{name} has dtype {tensor.dtype}; expected {dtype}")
    if mode == POW2:
        g13, g2 = gh, gi
    elif mode == OUTPUT_BLOCK:
        g13, g2 = 1, 1
        for name, tensor, cols in (("w13_scales", w13_scales, gh), ("w2_scales", w2_scales, gi)):
            if len(tensor.shape) == 3 and tensor.shape[2] == cols and cols > 1:
                _fail(
                    f"{name} {tuple(tensor.shape)} is a 128x128 block-scale grid; the output-block kernel needs one scale "
                    "per 128 output rows ([E, rows/128, 1]). Use moe_w8_pow2 for block scales, or repack with mode='output-block'"
                )
    else:
        _fail(f"unknown mode {mode!r}")
    if tuple(w13_scales.shape) != (e, 2 * gi, g13):
        _fail(f"w13_scales has shape {tuple(w13_scales.shape)}; {mode} expects [E, 2I/128, {'H/128' if mode == POW2 else 1}] = {(e, 2 * gi, g13)}")
    if tuple(w2_scales.shape) != (e, h // P, g2):
        _fail(f"w2_scales has shape {tuple(w2_scales.shape)}; {mode} expects [E, H/128, {'I/128' if mode == POW2 else 1}] = {(e, h // P, g2)}")
    return dict(T=t, H=h, E=e, I=inter, gH=gh, gI=gi, G13=g13, G2=g2, TT=min(t, P), n_tt=(t + P - 1) // P)


@nki.jit
def moe_w8_pow2(hidden, w13, w13_scales, w2, w2_scales, affinities, swiglu_limit=0.0):
    """Routed MoE over local experts with exact 128x128 block scales (pow2 repack)."""
    return _moe(hidden, w13, w13_scales, w2, w2_scales, affinities, POW2, float(swiglu_limit))


@nki.jit
def moe_w8_output_block(hidden, w13, w13_scales, w2, w2_scales, affinities, swiglu_limit=0.0):
    """Routed MoE over local experts with one scale per 128 output rows (output-block repack)."""
    return _moe(hidden, w13, w13_scales, w2, w2_scales, affinities, OUTPUT_BLOCK, float(swiglu_limit))


def _moe(hidden, w13, w13_scales, w2, w2_scales, affinities, mode, swiglu_limit):
    s = check_contract(hidden, w13, w13_scales, w2, w2_scales, affinities, mode)
    if swiglu_limit < 0:
        _fail(f"swiglu_limit must be >= 0 (0: no clamp), got {swiglu_limit}")
    s["limit"] = swiglu_limit
    programs = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    per_program = (s["E"] + programs - 1) // programs
    out = nl.ndarray((programs, s["T"], s["H"]), dtype=nl.float32, buffer=nl.shared_hbm)
    ones = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    h_t, aff, acc = _load_tokens(hidden, affinities, s)
    sc13_rows = w13_scales.reshape((s["E"], 1, 2 * s["gI"] * s["G13"]))
    sc2_rows = w2_scales.reshape((s["E"], 1, (s["H"] // P) * s["G2"]))
    for e in nl.sequential_range(pid * per_program, min(s["E"], (pid + 1) * per_program)):
        _expert(e, h_t, aff, acc, ones, w13, sc13_rows, w2, sc2_rows, s, mode)
    for tt in range(s["n_tt"]):
        nisa.dma_copy(dst=out[pid, tt * s["TT"]:(tt + 1) * s["TT"], :], src=acc[:, tt, :])
    return out


def _load_tokens(hidden, affinities, s):
    """hidden^T [P, H/P, T] bf16, affinities [TT, n_tt, E] fp32, zeroed accumulators [TT, n_tt, H] fp32."""
    tt_rows, n_tt = s["TT"], s["n_tt"]
    h_t = nl.ndarray((P, s["gH"], s["T"]), dtype=nl.bfloat16, buffer=nl.sbuf)
    aff = nl.ndarray((tt_rows, n_tt, s["E"]), dtype=nl.float32, buffer=nl.sbuf)
    acc = nl.ndarray((tt_rows, n_tt, s["H"]), dtype=nl.float32, buffer=nl.sbuf)
    for tt in range(n_tt):
        rows = slice(tt * tt_rows, (tt + 1) * tt_rows)
        x = nl.ndarray((tt_rows, s["H"]), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=x, src=hidden[rows, :])
        nisa.dma_copy(dst=aff[:, tt, :], src=affinities[rows, :])
        nisa.memset(dst=acc[:, tt, :], value=0.0)
        for k in range(s["gH"]):
            x_t = nl.ndarray((P, tt_rows), dtype=nl.bfloat16, buffer=nl.psum)  # transposes keep the dtype
            nisa.nc_transpose(dst=x_t, data=x[:, k * P:(k + 1) * P])
            nisa.tensor_copy(dst=h_t[:, k, rows], src=x_t)
    return h_t, aff, acc


def _broadcast_row(row_hbm, rows, ones):
    """[1, n] fp32 in HBM -> [rows, n] fp32 in SBUF, every partition a copy (K=1 fp32 matmul: exact)."""
    n = row_hbm.shape[1]
    row = nl.ndarray((1, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=row, src=row_hbm)
    out = nl.ndarray((rows, n), dtype=nl.float32, buffer=nl.sbuf)
    for c in range((n + SLAB - 1) // SLAB):
        w = min(SLAB, n - c * SLAB)
        ps = nl.ndarray((rows, w), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=ones[:, 0:rows], moving=row[:, c * SLAB:c * SLAB + w], accumulate=False)
        nisa.tensor_copy(dst=out[:, c * SLAB:c * SLAB + w], src=ps)
    return out


def _contract(stationary, cols, weights, n_k, scales, scale_col, mode, rows, width):
    """sum_k stationary[:, k, cols].T @ weights[:, k, :] for a [rows, width] output slab.

    output-block: the unscaled PSUM accumulation (the caller scales while evacuating).
    pow2: an fp32 SBUF tile in which each k partial, per 128-column block nb, was multiplied by its own
    scale ``scales[:, scale_col(nb, k)]`` on ScalarE before VectorE added it.
    """
    codes = weights.view(nl.float8_e4m3)
    if mode == OUTPUT_BLOCK:
        ps = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.psum)
        for k in range(n_k):
            nisa.nc_matmul(dst=ps, stationary=stationary[:, k, cols], moving=codes[:, k, :], accumulate=(k > 0))
        return ps
    total = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.sbuf)
    for k in range(n_k):
        ps = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=stationary[:, k, cols], moving=codes[:, k, :], accumulate=False)
        for nb in range(width // P):
            blk = slice(nb * P, (nb + 1) * P)
            c = scale_col(nb, k)
            if k == 0:
                nisa.activation(dst=total[:, blk], op=nl.copy, data=ps[:, blk], scale=scales[:, c:c + 1])
            else:
                part = nl.ndarray((rows, P), dtype=nl.float32, buffer=nl.sbuf)
                nisa.activation(dst=part, op=nl.copy, data=ps[:, blk], scale=scales[:, c:c + 1])
                nisa.tensor_tensor(dst=total[:, blk], data1=total[:, blk], data2=part, op=nl.add)
    return total


def _expert(e, h_t, aff, acc, ones, w13, sc13_rows, w2, sc2_rows, s, mode):
    tt_rows, n_tt, inter, gi, g13, g2 = s["TT"], s["n_tt"], s["I"], s["gI"], s["G13"], s["G2"]
    sc13 = _broadcast_row(sc13_rows[e], tt_rows, ones)  # [TT, 2gI * G13]
    sc2 = _broadcast_row(sc2_rows[e], tt_rows, ones)  # [TT, gH * G2]
    act = nl.ndarray((tt_rows, n_tt, inter), dtype=nl.bfloat16, buffer=nl.sbuf)

    # gate / up projections, 512 intermediate columns at a time
    for c0 in range(0, inter, SLAB):
        w = min(SLAB, inter - c0)
        w_gate = nl.ndarray((P, s["gH"], w), dtype=nl.uint8, buffer=nl.sbuf)
        w_up = nl.ndarray((P, s["gH"], w), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.dma_copy(dst=w_gate, src=w13[e, :, :, c0:c0 + w])
        nisa.dma_copy(dst=w_up, src=w13[e, :, :, inter + c0:inter + c0 + w])
        gate_col = lambda nb, k, c0=c0: (c0 // P + nb) * g13 + k  # noqa: E731
        up_col = lambda nb, k, c0=c0: (gi + c0 // P + nb) * g13 + k  # noqa: E731
        for tt in range(n_tt):
            cols = slice(tt * tt_rows, (tt + 1) * tt_rows)
            gate = _contract(h_t, cols, w_gate, s["gH"], sc13, gate_col, mode, tt_rows, w)
            up = _contract(h_t, cols, w_up, s["gH"], sc13, up_col, mode, tt_rows, w)
            silu = nl.ndarray((tt_rows, w), dtype=nl.float32, buffer=nl.sbuf)
            limit = s["limit"]
            if mode == OUTPUT_BLOCK:
                for nb in range(w // P):
                    blk = slice(nb * P, (nb + 1) * P)
                    c = gate_col(nb, 0)
                    if limit > 0:  # SiLU(min(gate, limit)): scale and clamp on VectorE, then SiLU
                        nisa.tensor_scalar(dst=silu[:, blk], data=gate[:, blk], op0=nl.multiply, operand0=sc13[:, c:c + 1],
                                           op1=nl.minimum, operand1=limit)
                        nisa.activation(dst=silu[:, blk], op=nl.silu, data=silu[:, blk])
                    else:
                        nisa.activation(dst=silu[:, blk], op=nl.silu, data=gate[:, blk], scale=sc13[:, c:c + 1])
            else:
                if limit > 0:
                    nisa.tensor_scalar(dst=gate, data=gate, op0=nl.minimum, operand0=limit)
                    nisa.tensor_scalar(dst=up, data=up, op0=nl.maximum, operand0=-limit, op1=nl.minimum, operand1=limit)
                nisa.activation(dst=silu, op=nl.silu, data=gate)
            nisa.tensor_scalar(dst=silu, data=silu, op0=nl.multiply, operand0=aff[:, tt, e:e + 1], engine=nisa.engine.gpsimd)
            if mode == OUTPUT_BLOCK:
                for nb in range(w // P):
                    blk = slice(nb * P, (nb + 1) * P)
                    c = up_col(nb, 0)
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
            else:
                nisa.tensor_tensor(dst=act[:, tt, c0:c0 + w], data1=up, data2=silu, op=nl.multiply)

    # activation^T [P, I/P, T] bf16: the stationary operand of the down projection
    act_t = nl.ndarray((P, gi, s["T"]), dtype=nl.bfloat16, buffer=nl.sbuf)
    for tt in range(n_tt):
        cols = slice(tt * tt_rows, (tt + 1) * tt_rows)
        for k in range(gi):
            ps = nl.ndarray((P, tt_rows), dtype=nl.bfloat16, buffer=nl.psum)
            nisa.nc_transpose(dst=ps, data=act[:, tt, k * P:(k + 1) * P])
            nisa.tensor_copy(dst=act_t[:, k, cols], src=ps, engine=nisa.engine.scalar)

    # down projection, 512 hidden columns at a time, added into the fp32 accumulators
    for h0 in range(0, s["H"], SLAB):
        w = min(SLAB, s["H"] - h0)
        w_down = nl.ndarray((P, gi, w), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.dma_copy(dst=w_down, src=w2[e, :, :, h0:h0 + w])
        down_col = lambda nb, k, h0=h0: (h0 // P + nb) * g2 + k  # noqa: E731
        for tt in range(n_tt):
            cols = slice(tt * tt_rows, (tt + 1) * tt_rows)
            res = _contract(act_t, cols, w_down, gi, sc2, down_col, mode, tt_rows, w)
            if mode == OUTPUT_BLOCK:
                for nb in range(w // P):
                    c = down_col(nb, 0)
                    out_blk = acc[:, tt, h0 + nb * P:h0 + (nb + 1) * P]
                    nisa.scalar_tensor_tensor(dst=out_blk, data=res[:, nb * P:(nb + 1) * P], op0=nl.multiply,
                                              operand0=sc2[:, c:c + 1], op1=nl.add, operand1=out_blk)
            else:
                nisa.tensor_tensor(dst=acc[:, tt, h0:h0 + w], data1=acc[:, tt, h0:h0 + w], data2=res, op=nl.add)
