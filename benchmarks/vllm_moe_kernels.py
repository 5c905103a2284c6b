"""vLLM's own CPU MoE kernels for one checkpoint, as :mod:`benchmarks.bench_moe_op` compares neuron-w8 with them.

Which kernels vLLM 0.32 runs on this CPU (``vllm/model_executor/layers/fused_moe/experts/cpu_moe.py``):

* block-FP8 checkpoint: ``CPUExpertsFp8`` -- ``torch.ops._C.fused_experts_cpu(..., CPUQuantMethod.FP8_W8A16, ...)``
  on weights VNNI-prepacked by ``prepare_fp8_moe_layer_for_cpu`` (1-byte experts, like neuron-w8). Only where
  ``CPUExpertsFp8._supports_current_device()`` holds (x86 with AMX tiles); elsewhere vLLM cannot serve the FP8
  checkpoint at all and the record says "not available on this CPU".
* its BF16 twin: ``X86CPUUnquantizedExperts`` (``cpu_fused_moe`` ISA ``"amx"``) where AMX tiles exist, else
  ``CPUUnquantizedExperts`` (ISA ``"vec"``); zentorch's fused MoE instead where zentorch is loaded on a Zen CPU
  (recorded, not run: it is not installed here).
* ``"vec"`` always, for continuity with earlier records (the same kernel as the picked one on non-AMX hosts).

:func:`kernels` returns the runnable ones as ``name -> Kernel`` and a record of the choice (what, why).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Kernel:
    name: str  # "vllm_fp8", "vllm_bf16_amx", "vllm_bf16_vec"
    what: str  # human description for the table
    prepare: Callable  # (w13 codes, w13_s, w2 codes, w2_s, b13, b2) -> state
    run: Callable  # (x, topk_weights, topk_ids, state) -> out


def _bf16(isa: str) -> Kernel:
    import vllm._custom_ops as ops

    def prepare(w13, w13_s, w2, w2_s, b13, b2):
        return ops.cpu_prepack_moe_weight(b13, isa), ops.cpu_prepack_moe_weight(b2, isa)

    def run(x, topk_weights, topk_ids, state):
        out = torch.empty_like(x)
        ops.cpu_fused_moe(out, x, state[0], state[1], None, None, topk_weights, topk_ids, "silu", isa)
        return out

    return Kernel(f"vllm_bf16_{isa}", f"vLLM BF16 cpu_fused_moe isa={isa!r}", prepare, run)


# vLLM's FP8 kernel where vLLM itself does not pick it (no AMX): measured beside the others, never "the fastest vLLM
# kernel for the checkpoint" (vLLM cannot serve the checkpoint with it here); the plugin can (cpu_vllm_fp8.py).
FP8_NOT_PICKED = "vllm_fp8_noamx"


def _fp8(block, name: str = "vllm_fp8") -> Kernel:
    """vLLM's FP8 W8A16 MoE, the way CPUExpertsFp8 calls it."""
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import prepare_fp8_moe_layer_for_cpu

    def prepare(w13, w13_s, w2, w2_s, b13, b2):
        # The benchmark's codes are below 0x78: the same bytes are the same values in e4m3fn (the checkpoint's format).
        p13, p2 = prepare_fp8_moe_layer_for_cpu(w13.view(torch.float8_e4m3fn), w2.view(torch.float8_e4m3fn))
        return p13, p2, w13_s, w2_s

    def run(x, topk_weights, topk_ids, state):
        out = torch.empty_like(x)
        ops.fused_experts_cpu(out, x, state[0], state[1], topk_weights, topk_ids, ops.CPUQuantMethod.FP8_W8A16,
                              state[2], state[3], None, None, list(block), None, None, None, None, True)
        return out

    return Kernel(name, "vLLM FP8 W8A16 fused_experts_cpu (prepare_fp8_moe_layer_for_cpu)"
                  + ("" if name == "vllm_fp8" else ", which vLLM picks only on AMX hosts"), prepare, run)


def loaded_library() -> str:
    """File name of the vLLM kernel library this process loaded (_C, _C_AVX512 or _C_AVX2)."""
    with open("/proc/self/maps") as maps:
        names = {line.split()[-1].rsplit("/", 1)[-1] for line in maps if "/vllm/_C" in line}
    return ", ".join(sorted(names)) or "unknown"


def kernels(block=(128, 128)) -> tuple[dict[str, Kernel], dict]:
    """(runnable kernels by name, record: bf16_isa, fp8, zentorch, each with the reason)."""
    try:
        import vllm._custom_ops  # noqa: F401
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    except Exception as exc:  # noqa: BLE001 -- no vLLM CPU build: nothing to compare with
        raise SystemExit(f"vLLM's CPU MoE kernels cannot be imported ({type(exc).__name__}: {exc}): nothing to compare with")
    if not hasattr(torch.ops._C, "cpu_fused_moe"):
        raise SystemExit("vLLM's CPU fused MoE (torch.ops._C.cpu_fused_moe) is not available: nothing to compare with")
    amx = bool(cpu_moe.X86CPUUnquantizedExperts._supports_current_device())
    record = {"bf16_isa": "amx" if amx else "vec",
              "bf16_isa_reason": ("X86CPUUnquantizedExperts: AMX tiles supported" if amx else
                                  "no AMX tiles (torch.cpu._is_amx_tile_supported() is False): CPUUnquantizedExperts 'vec'")}
    try:
        from vllm.model_executor.kernels.linear.zentorch_utils import has_zentorch_op

        record["zentorch"] = "loaded (vLLM would run zentorch_fused_moe: not compared)" if has_zentorch_op(["zentorch_fused_moe"]) else "not loaded"
    except Exception as exc:  # noqa: BLE001
        record["zentorch"] = f"unknown ({type(exc).__name__})"
    from vllm_moe_w8.vllm_glue import cpu_vllm_fp8

    found = {}
    if cpu_moe.CPUExpertsFp8._supports_current_device() and hasattr(torch.ops._C, "fused_experts_cpu"):
        torch._C._cpu._init_amx()  # vLLM's AMX kernels need the tile state requested (docs/ENVIRONMENT.md)
        found["vllm_fp8"] = _fp8(block)
        record["fp8"] = "available: CPUExpertsFp8 (AMX)"
    elif cpu_vllm_fp8.unavailable_reason() is None:  # the kernel runs here (without AMX: avx512_bf16)
        found[FP8_NOT_PICKED] = _fp8(block, FP8_NOT_PICKED)
        record["fp8"] = ("not picked by vLLM on this CPU (CPUExpertsFp8 needs AMX tiles; vLLM cannot serve the FP8 "
                         "checkpoint here); its kernel runs here all the same: measured as vllm_fp8_noamx, which "
                         "neuron-w8 runs with VLLM_MOE_W8_CPU_KERNEL=vllm-fp8, not counted as vLLM's kernel for the goal")
    else:
        record["fp8"] = "not available on this CPU (CPUExpertsFp8 needs AMX tiles; vLLM cannot serve the FP8 checkpoint here)"
    if amx:
        found["vllm_bf16_amx"] = _bf16("amx")
    found["vllm_bf16_vec"] = _bf16("vec")
    return found, record
