"""The exact pow2 per-block step, shared by every schedule that runs 128x128 block-scaled FP8 projections
(the dense kernel ``moe_w8.py``; the routed/block schedules call the same helpers).

:func:`contract_pow2` runs one [rows, width] output slab of a token-stationary projection: per contraction block
k one matmul into its own PSUM tile (bf16 stationary x FP8 moving, fp32), then per 128-column block the scaled
add of that partial into an fp32 SBUF total (:func:`scale_add`). The engine of each block follows the schedule
(``kernels/schedule.py``: ``vector_blocks`` of every ``BLOCK_PERIOD`` on VectorE, the rest on ScalarE + GpSimd);
the arithmetic is one fp32 multiply and one fp32 add per block either way. Traced kernel code (the subset of
``kernels/nki_cpu/subset.py``).
"""

from __future__ import annotations

from . import schedule
from .nki_api import nisa, nl

P = 128


def scale_add(total, ps, scale, first, block, vector_blocks):
    """total (fp32 SBUF) (+)= ps * scale for one [rows, 128] block: the pow2 kernel's per-block step.

    ``first``: total is written (ScalarE activation, PSUM -> SBUF). Otherwise the block's engine follows the
    schedule (kernels/schedule.py): VectorE ``scalar_tensor_tensor`` (ps * scale + total), or a ScalarE scaled copy
    to SBUF then a GpSimd add in SBUF (GpSimd cannot read PSUM). Both: one fp32 multiply, one fp32 add."""
    if first:
        nisa.activation(dst=total, op=nl.copy, data=ps, scale=scale)
    elif schedule.on_vector(block, vector_blocks):
        nisa.scalar_tensor_tensor(dst=total, data=ps, op0=nl.multiply, operand0=scale, op1=nl.add, operand1=total)
    else:
        part = nl.ndarray(total.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=part, op=nl.copy, data=ps, scale=scale)
        nisa.tensor_tensor(dst=total, data1=total, data2=part, op=nl.add, engine=nisa.engine.gpsimd)


def contract_pow2(stationary, cols, codes, n_k, scales, block0, per_block, rows, width, total, fresh, counter,
                  vector_blocks):
    """total[rows, width] (fp32 SBUF) (+)= sum_k sum_nb scale(nb, k) * (stationary[:, k, cols].T @ codes[:, k, nb])

    Every k partial lands in its own PSUM tile and each 128-column block is scaled by its own scale
    ``scales[:, (block0 + nb) * per_block + k]`` before it is added (``scale_add``). ``fresh``: total holds
    nothing yet (the k = 0 blocks write it). ``counter`` is the expert's running block count (the schedule's index);
    returns it advanced."""
    for k in range(n_k):
        ps = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=stationary[:, k, cols], moving=codes[:, k, :], accumulate=False)
        for nb in range(width // P):
            blk = slice(nb * P, (nb + 1) * P)
            c = (block0 + nb) * per_block + k
            scale_add(total[:, blk], ps[:, blk], scales[:, c:c + 1], fresh and k == 0, counter, vector_blocks)
            counter += 1
    return counter
