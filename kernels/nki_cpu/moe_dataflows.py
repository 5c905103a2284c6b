"""This project's MoE kernels (``kernels/moe_w8.py``) as counted by the interpreter, at full model shapes.

Running every local expert of a big shape through the interpreter is slow and adds nothing: each expert runs
the same instructions. :func:`kernel_stats` therefore runs the kernel with 1 and 2 experts and scales
analytically, ``stats(E) = stats(1) + (E - 1) * (stats(2) - stats(1))`` (checked exactly against a direct
run in ``tests/test_cost_model.py``). The weights are zero codes with unit scales: the counters do not depend
on values.

Dataflows built from it:

* decode: one call at the token bucket (``host.bucket_for``), dense over the local experts;
* dense prefill: the op's 256-token chunks, each chunk through every local expert (weights re-read per chunk);
* token-grouped prefill: one kernel call; each local expert's routed tokens gathered into 128-row tiles and
  run through that expert's body once per 256 rows (the same weight streaming as the dense kernel; the
  gather and scatter are the token load and store DMAs of a single-expert run). Routing is taken as uniform:
  N * top_k / experts routes per expert.
"""

from __future__ import annotations

import functools
import math

import torch

from .. import host, launch
from . import run
from .machine import Stats
from .reference_dataflows import bf16_compiled, combine, difference

MODES = ("pow2", "output-block")
DEQUANT = "dequant-bf16"  # kernels/moe_w8_dequant.py: pow2's weights, dequantised to bf16 on chip (decode rows)


def _kernel(mode: str):
    if mode == DEQUANT:
        from ..moe_w8_dequant import moe_w8_dequant_bf16

        return moe_w8_dequant_bf16
    return launch.KERNELS[mode]


def _weights(mode: str, experts: int, hidden: int, inter: int) -> host.KernelWeights:
    mode = "pow2" if mode == DEQUANT else mode
    g13, g2 = (hidden // 128, inter // 128) if mode == "pow2" else (1, 1)
    block = (128, 128) if mode == "pow2" else (128, 0)
    w13 = torch.zeros(experts, 2 * inter, hidden, dtype=torch.uint8)
    w2 = torch.zeros(experts, hidden, inter, dtype=torch.uint8)
    s13 = torch.ones(experts, 2 * inter // 128, g13)
    s2 = torch.ones(experts, hidden // 128, g2)
    return host.to_kernel_layout(w13, s13, w2, s2, *block, "e4m3")


def interpreted(mode: str, experts: int, hidden: int, inter: int, tokens: int, swiglu_limit: float = 0.0,
                vector_blocks: int | None = None) -> Stats:
    """Stats of one direct interpreter run of ``moe_w8`` (``tokens`` must be a bucket). ``vector_blocks``: the pow2
    kernel's engine schedule (kernels/schedule.py; None: the one loaded from the calibration file)."""
    kw = _weights(mode, experts, hidden, inter)
    x = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
    aff = torch.full((tokens, experts), 1.0 / max(experts, 1))
    extra = {} if mode != "pow2" or vector_blocks is None else {"vector_blocks": int(vector_blocks)}
    _, stats = run(_kernel(mode), *launch.kernel_args(x, aff, kw), float(swiglu_limit), **extra)
    return stats


def _affinity_dma(tokens: int, experts: int) -> Stats:
    """The kernel's affinity loads: one [TT, E] fp32 DMA per 128-token tile (a contiguous run of TT*E*4 B),
    the only DMA whose run length depends on E; it is taken out before scaling and put back after."""
    tt, n_tt = min(tokens, 128), -(-tokens // 128)
    s = Stats(hbm_read_bytes=n_tt * tt * experts * 4, dma_count=n_tt)
    s.dma_runs[tt * experts * 4] = n_tt * tt * experts * 4
    return s


@functools.lru_cache(maxsize=None)
def _one_and_per_expert(mode: str, hidden: int, inter: int, tokens: int, swiglu_limit: float,
                        vector_blocks: int | None) -> tuple[Stats, Stats]:
    one = difference(interpreted(mode, 1, hidden, inter, tokens, swiglu_limit, vector_blocks), _affinity_dma(tokens, 1))
    two = difference(interpreted(mode, 2, hidden, inter, tokens, swiglu_limit, vector_blocks), _affinity_dma(tokens, 2))
    return one, difference(two, one)


def kernel_stats(mode: str, experts: int, hidden: int, inter: int, tokens: int, swiglu_limit: float = 0.0,
                 vector_blocks: int | None = None) -> Stats:
    """Stats of one call with ``experts`` local experts, scaled from runs with 1 and 2."""
    one, per_expert = _one_and_per_expert(mode, hidden, inter, tokens, float(swiglu_limit), vector_blocks)
    return combine([(1, one), (experts - 1, per_expert), (1, _affinity_dma(tokens, experts))])


def decode(mode: str, experts: int, hidden: int, inter: int, tokens: int, swiglu_limit: float = 0.0,
           vector_blocks: int | None = None) -> Stats:
    return kernel_stats(mode, experts, hidden, inter, host.bucket_for(tokens), swiglu_limit, vector_blocks)


def dense_prefill(mode: str, experts: int, hidden: int, inter: int, tokens: int, swiglu_limit: float = 0.0,
                  vector_blocks: int | None = None) -> tuple[Stats, int]:
    """(Stats, calls): every 256-token chunk through every local expert."""
    parts: dict[int, int] = {}
    for _start, _stop, bucket in host.chunks(tokens):
        parts[bucket] = parts.get(bucket, 0) + 1
    return combine([(n, kernel_stats(mode, experts, hidden, inter, b, swiglu_limit, vector_blocks))
                    for b, n in parts.items()]), sum(parts.values())


def routes_per_expert(tokens: int, top_k: int, total_experts: int) -> int:
    return math.ceil(tokens * top_k / total_experts)


def _grouped_calls(routes: int) -> list[int]:
    rows = 128 * math.ceil(routes / 128)  # 128-row tiles
    return [min(host.T_MAX, rows - start) for start in range(0, rows, host.T_MAX)]


def grouped_prefill(mode: str, experts: int, hidden: int, inter: int, tokens: int, top_k: int, total_experts: int,
                    swiglu_limit: float = 0.0, vector_blocks: int | None = None) -> tuple[Stats, int]:
    """(Stats, calls) of the token-grouped dataflow over the local experts (one call)."""
    groups = _grouped_calls(routes_per_expert(tokens, top_k, total_experts))
    per_expert = combine([(1, kernel_stats(mode, 1, hidden, inter, rows, swiglu_limit, vector_blocks)) for rows in groups])
    return combine([(experts, per_expert)]), 1


def bf16_decode(experts: int, hidden: int, inter: int, tokens: int) -> Stats:
    return bf16_compiled(host.bucket_for(tokens), experts, hidden, inter)


def bf16_grouped_prefill(experts: int, hidden: int, inter: int, tokens: int, top_k: int, total_experts: int) -> Stats:
    calls = _grouped_calls(routes_per_expert(tokens, top_k, total_experts))
    return combine([(experts, bf16_compiled(rows, 1, hidden, inter)) for rows in calls])


def weight_bytes(experts: int, hidden: int, inter: int, itemsize: int = 1) -> int:
    return experts * 3 * hidden * inter * itemsize
