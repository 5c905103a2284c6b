"""One MoE layer through the real kernel launch path against the fp32 reference: the numerics gate that
``vllm-moe-w8 neuron-check`` runs on a host and the tests run on CPU.

A layer is random checkpoint-like FP8 experts (each 128x128 block quantised with amax / 448 in E4M3FN,
as real checkpoints are), repacked by ``fp8.repack`` for the kernel mode, laid out once by
``host.to_kernel_layout``, and called through ``kernel_launch.run_routed_experts`` compiled as vllm-neuron's
runner compiles the model (``torch.compile(fullgraph=True)``; wrap_nki on Neuron, the interpreter elsewhere). The reference is ``op.reference.reference_moe`` on the same repacked bytes.

The gate: the kernels' only rounding beyond fp32 accumulation is the activation
SiLU(gate) * up * routing weight rounded to bf16 (unit roundoff 2**-9) before the down projection, so
|kernel - reference| <= 2**-9 * sum_e w_e |act_e| @ |W2_e|^T per output element (:func:`error_bound`),
with ``BOUND_SLACK`` for fp32 accumulation order and fp32 SiLU, and ``ABS_FLOOR`` for outputs that cancel.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from vllm_moe_w8.codec import fp8
from vllm_moe_w8.kernels import host
from vllm_moe_w8.op.reference import activate, dequantize_expert, dequantize_w13, reference_moe

ACT_BF16_ROUNDOFF = 2.0**-9  # bf16 unit roundoff: the activation's one rounding
BOUND_SLACK = 1.5  # fp32 accumulation over <= 4096 terms (2**-24 each) and fp32 SiLU / scale products
ABS_FLOOR = 1e-6  # outputs that cancel to ~0 in fp32


def checkpoint_experts(num_experts: int, hidden: int, inter: int, seed: int = 0):
    """((w13 E4M3FN [E, 2I, H], scales [E, 2I/128, H/128]), (w2 [E, H, I], scales)) like an FP8 checkpoint."""
    gen = torch.Generator().manual_seed(seed)

    def quantise(rows, cols):
        w = torch.randn(num_experts, rows, cols, generator=gen) * 0.02
        tiles = w.reshape(num_experts, rows // 128, 128, cols // 128, 128)
        scale = tiles.abs().amax(dim=(2, 4)) / fp8.E4M3FN_MAX
        codes = (tiles / scale[:, :, None, :, None]).to(torch.float8_e4m3fn).reshape(num_experts, rows, cols)
        return codes, scale

    return quantise(2 * inter, hidden), quantise(hidden, inter)


def repacked(ckpt, mode: str):
    """The op storage (w13, w13_scales, w2, w2_scales, block) after ``fp8.repack`` per expert matrix."""
    (c13, s13), (c2, s2) = ckpt
    inter = c13.shape[1] // 2
    g = inter // 128
    parts = [[], [], [], []]
    for e in range(c13.shape[0]):
        gate = fp8.repack(c13[e, :inter], s13[e, :g], mode=mode)
        up = fp8.repack(c13[e, inter:], s13[e, g:], mode=mode)
        down = fp8.repack(c2[e], s2[e], mode=mode)
        for dst, t in zip(parts, (torch.cat([gate.codes, up.codes]), torch.cat([gate.scale_grid, up.scale_grid]),
                                  down.codes, down.scale_grid)):
            dst.append(t)
    return tuple(torch.stack(p) for p in parts) + (gate.block,)


def routing(tokens: int, num_experts: int, top_k: int, seed: int, empty_expert: int | None = None):
    """Top-k over 2E experts (about half the routes leave the rank: id -1), a duplicate route, a token with
    no local expert, and optionally one local expert that receives no token."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts * 2, generator=gen)[:top_k] for _ in range(tokens)])
    ids = torch.where(ids < num_experts, ids, -1)
    if empty_expert is not None:
        ids = torch.where(ids == empty_expert, -1, ids)
    ids[0, 0] = 0 if empty_expert != 0 else 1
    if tokens > 2:
        ids[1, :2] = ids[0, 0]  # the same local expert twice
        ids[-1] = -1  # no local expert at all
    weights = torch.rand(tokens, top_k, generator=gen)
    return weights / weights.sum(dim=1, keepdim=True), ids


def error_bound(x, topk_weights, topk_ids, w13, s13, w2, s2, block, swiglu_limit: float = 0.0) -> torch.Tensor:
    """Per-element bound [T, H] on |kernel - reference| (see the module docstring)."""
    aff = host.dense_affinities(topk_weights, topk_ids, w13.shape[0])
    out = torch.zeros(x.shape[0], w2.shape[1])
    xf = x.float()
    for e in range(w13.shape[0]):
        rows = aff[:, e].nonzero().flatten()
        if rows.numel() == 0:
            continue
        gate, up = dequantize_w13(w13, s13, e, block, "e4m3")
        down = dequantize_expert(w2[e], s2[e], block, "e4m3")
        act = activate(xf[rows] @ gate.T, xf[rows] @ up.T, swiglu_limit=swiglu_limit) * aff[rows, e:e + 1]
        out[rows] += act.abs() @ down.abs().T
    return ABS_FLOOR + BOUND_SLACK * ACT_BF16_ROUNDOFF * out


def within_bound(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> tuple[bool, float, float]:
    """(passes, max |out - ref|, max |out - ref| / bound): the gate every kernel check uses."""
    err = (out.double() - ref.double()).abs()  # float64: the reference may be float64
    ratio = float((err / bound.double()).max()) if err.numel() else 0.0
    return bool(out.shape == ref.shape and torch.isfinite(out).all() and ratio <= 1.0), float(err.max()) if err.numel() else 0.0, ratio


@dataclass
class CaseResult:
    name: str
    kernel: str  # dense | grouped
    mode: str
    tokens: int
    lnc: int
    passed: bool
    max_abs_err: float
    err_over_bound: float
    modelled_s: float | None  # cost model (interpreter Stats), max over the LNC programs, summed over launches
    measured_s: float  # median wall time of the launch path (device time on Neuron; interpreter time on CPU)


def modelled_seconds(launch_stats: list) -> float:
    """Cost-model time of a call: per launch the slowest program (they run in parallel), summed over launches."""
    from vllm_moe_w8.kernels.nki_cpu import cost

    return sum(max(cost.estimate(s).time_s for s in programs) for programs in launch_stats)


def compiled_routed(kw: host.KernelWeights, lnc: int, swiglu_limit: float, compile_backend="eager"):
    """``kernel_launch.run_routed_experts`` for these weights as vllm-neuron runs it: inside
    ``torch.compile(fullgraph=True, dynamic=False)`` with the backend and its callers resolved beforehand."""
    from vllm_moe_w8.neuron_glue import kernel_launch

    where = kernel_launch.backend()
    # as vllm-neuron's runner does before compiling (every case is its own graph; recompiles are not an error here)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2**62)

    def routed(x, topk_weights, topk_ids):
        return kernel_launch.run_routed_experts(x, topk_weights, topk_ids, kw, lnc=lnc, swiglu_limit=swiglu_limit, where=where)

    return torch.compile(routed, backend=compile_backend, fullgraph=True, dynamic=False)


def run_case(name: str, ckpt, mode: str, tokens: int, top_k: int, lnc: int, seed: int = 0, repeats: int = 1,
             swiglu_limit: float = 0.0, empty_expert: int | None = None, layer=None, device: str = "cpu",
             kernel: str = "dense", compile_backend="eager", reference_dtype=torch.float32) -> CaseResult:
    """One layer call (tensors on ``device``) vs the reference (computed in ``reference_dtype``: float32, or float64
    for the GLM cases): ``kernel="dense"`` through the compiled served path (:func:`compiled_routed`), ``"grouped"``
    through ``kernel_launch.run_grouped_experts`` (eager)."""
    from vllm_moe_w8.neuron_glue import interpreter_hop, kernel_launch

    w13, s13, w2, s2, block = layer if layer is not None else repacked(ckpt, mode)
    kw = host.to_kernel_layout(w13, s13, w2, s2, block[0], block[1], "e4m3")
    kw_dev = host.KernelWeights(*(t.to(device) for t in (kw.w13, kw.w13_scales, kw.w2, kw.w2_scales)), kw.mode)
    x = torch.randn(tokens, w2.shape[1], generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    topk_weights, topk_ids = routing(tokens, w13.shape[0], top_k, seed, empty_expert)
    if kernel == "grouped":
        def call(*args):
            return kernel_launch.run_grouped_experts(*args, kw_dev, lnc=lnc, swiglu_limit=swiglu_limit)
        label = "grouped"
    else:
        call = compiled_routed(kw_dev, lnc, swiglu_limit, compile_backend)
        label = kernel_launch.kernel_for(tokens, mode)[0]
    times, first_stats = [], []
    for i in range(max(1, repeats)):
        t0 = time.perf_counter()
        with interpreter_hop.collect_stats(first_stats if i == 0 else []):
            out = call(x.to(device), topk_weights.to(device), topk_ids.to(device))
        times.append(time.perf_counter() - t0)
    ref = reference_moe(x, topk_weights, topk_ids, w13, s13, w2, s2, block[0], block[1], "e4m3", swiglu_limit=swiglu_limit,
                        dtype=reference_dtype)
    ok, err, ratio = within_bound(out.cpu(), ref, error_bound(x, topk_weights, topk_ids, w13, s13, w2, s2, block, swiglu_limit))
    modelled = modelled_seconds(first_stats) if first_stats else None
    return CaseResult(name, label, mode, tokens, lnc, ok, err, ratio, modelled, statistics.median(times))
