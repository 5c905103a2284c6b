"""Run the MoE kernels on torch tensors through a simulator: AWS's ``nki.simulate`` when real NKI is
importable, else the project's interpreter (which also returns the run's counters). Tests and the
benchmark use this; ``vllm_moe_w8.neuron_glue.kernel_launch`` launches the kernels on a Neuron device (and
through the interpreter with an LNC grid elsewhere)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from . import host
from .moe_w8 import moe_w8_output_block, moe_w8_pow2
from .nki_api import BACKEND, simulate

KERNELS = {"pow2": moe_w8_pow2, "output-block": moe_w8_output_block}
MODE_OF = {kernel: mode for mode, kernel in KERNELS.items()}


def run_kernel(kernel, *args, stats: list | None = None):
    """Check the launch contract on the host (host.check_kernel_args), then run ``kernel`` on numpy ``args``
    (hidden, w13, w13_scales, w2, w2_scales, affinities[, swiglu_limit]) in the simulator; returns the output.
    With the interpreter, the run's :class:`nki_cpu.Stats` is appended to ``stats`` when given."""
    tensors, limit = args[:6], (args[6] if len(args) > 6 else 0.0)
    host.check_kernel_args(*tensors, mode=MODE_OF[kernel], swiglu_limit=limit)
    if BACKEND == "interpreter":
        from .nki_cpu import run

        out, st = run(kernel, *args)
        if stats is not None:
            stats.append(st)
        return out
    return simulate(kernel)(*args)


def bf16_numpy(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)


def kernel_args(hidden: torch.Tensor, affinities: torch.Tensor, kw: host.KernelWeights) -> tuple:
    return (bf16_numpy(hidden.to(torch.bfloat16)), kw.w13.numpy(), kw.w13_scales.numpy(), kw.w2.numpy(),
            kw.w2_scales.numpy(), affinities.float().contiguous().numpy())


def simulate_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, kw: host.KernelWeights,
                 stats: list | None = None, kernel=None, swiglu_limit: float = 0.0) -> torch.Tensor:
    """Routed sum [T, H] fp32 computed by the kernel for ``kw.mode`` (or ``kernel``), bucketed like ``neuron_glue.kernel_launch``.

    With the interpreter, each call's :class:`nki_cpu.Stats` is appended to ``stats`` when given."""
    kernel = kernel or KERNELS[kw.mode]
    aff = host.dense_affinities(topk_weights, topk_ids, kw.num_experts)

    def launch(hidden, aff_chunk):
        out = run_kernel(kernel, *kernel_args(hidden, aff_chunk, kw), float(swiglu_limit), stats=stats)
        return torch.from_numpy(np.asarray(out, dtype=np.float32)).sum(dim=0)  # [1, B, H]: one program

    return host.run_chunked(launch, x, aff)


def numpy_arg(t: torch.Tensor) -> np.ndarray:
    return bf16_numpy(t) if t.dtype == torch.bfloat16 else t.contiguous().numpy()


def simulate_routed(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, kw: host.KernelWeights, *,
                    lnc: int = 1, stats: list | None = None, swiglu_limit: float = 0.0, block: int | None = None,
                    vector_blocks: int | None = None, stationary_max_tokens: int | None = None) -> torch.Tensor:
    """Routed sum [T, H] fp32 by the block-scheduled kernel (selective decode or block prefill, host_routed) in the
    interpreter, as an LNC grid; each launch's per-program Stats list is appended to ``stats`` when given.
    ``vector_blocks``: the pow2 engine schedule (kernels/schedule.py; None: the one loaded from the calibration file);
    ``stationary_max_tokens``: selective decode's weights-stationary threshold (None: the loaded scenario's,
    ``host_routed.WEIGHTS_STATIONARY_MAX_TOKENS``)."""
    from . import host_routed, routing
    from .nki_cpu import launch as nki_launch

    routing.check_routing(topk_ids, kw.num_experts)
    kernel, tensors, consts, program_tokens = host_routed.block_call(x, topk_weights, topk_ids, kw, lnc, swiglu_limit,
                                                                     block, stationary_max_tokens)
    if vector_blocks is not None and "vector_blocks" in consts:
        consts = {**consts, "vector_blocks": int(vector_blocks)}
    host_routed.check_block_args(tensors, consts, kw.mode, lnc, x.shape[0], topk_ids.shape[1])
    out, program_stats = nki_launch(kernel, (lnc,), *[numpy_arg(t) for t in tensors], lnc=lnc, **consts)
    if stats is not None:
        stats.append(program_stats)
    return routing.combine(torch.from_numpy(np.asarray(out, dtype=np.float32)), x.shape[0], program_tokens)
