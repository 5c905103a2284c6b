"""The torch custom op ``torch.ops.moe_w8.fused_moe``: the one entry point of the routed-expert compute.

Why a custom op: vLLM compiles the model with ``torch.compile``; on CPU Dynamo traces into the MoE
method's ``apply()``, and a per-expert loop over data-dependent token sets cannot be traced
("Could not guard on data-dependent expression"). An opaque ``torch.library.custom_op`` with a
``register_fake`` (output shape = ``[T, H]`` in x's dtype) is traced as a single node for any token
count ``T``, and runs eagerly unchanged.

Dispatch (see DEVELOPING.md, "The MoE op", for the signature and semantics):

* tensors on CPU: the CPU implementation ``vllm_moe_w8.op.cpu.fused_moe_cpu`` (exact weights; touches only the
  routed experts; see its docstring for the BF16-h path);
* tensors on any other device: an error. On Trainium2 vLLM's own model classes (which call this op) do not
  run: vllm-neuron builds its own, and the experts there call the NKI kernels through
  ``vllm_moe_w8.neuron_glue.kernel_launch`` on their kernel-layout weights (the only resident copy).

The CPU implementation is imported directly: one that cannot be imported is an error naming it, never a
silent switch to the fp32 reference (``reference`` is what tests compare the op with, not a fallback).
:func:`compute_path` reports which path runs and why (the plugin logs it). Imports neither vLLM nor NKI.
"""

from __future__ import annotations

import torch

try:
    from vllm_moe_w8.op import cpu
except ImportError as exc:  # the CPU path is not optional: say which module is broken
    raise ImportError(f"moe_w8.fused_moe: its CPU implementation vllm_moe_w8.op.cpu failed to import: {exc}") from exc

OP_NAME = "moe_w8::fused_moe"
CODE_FORMATS = ("e4m3", "e4m3fn")
ACTIVATIONS = ("silu",)
CPU_IMPLEMENTATION = "op.cpu.fused_moe_cpu"
NEURON_PATH = ("the MoE op has no device path: on Trainium2 the experts run inside vllm-neuron's models through "
               "vllm_moe_w8.neuron_glue.kernel_launch (kernel-layout weights, NKI kernels launched with wrap_nki)")


def compute_path(device: torch.device | str = "cpu") -> tuple[str, str]:
    """(implementation name, reason) the op uses for tensors on ``device``."""
    device = torch.device(device)
    if device.type == "cpu":
        where = "tensors on CPU (on Neuron the experts run through vllm_moe_w8.neuron_glue, not this op)"
    else:
        where = f"tensors on {device.type}: refused ({NEURON_PATH})"
    return CPU_IMPLEMENTATION, f"CPU implementation: {cpu.describe_path()}; {where}"


def _check(x, topk_weights, topk_ids, w13, w13_scales, w2, w2_scales, block_n, block_k, code_format, activation):
    if code_format not in CODE_FORMATS:
        raise ValueError(f"moe_w8.fused_moe: code_format {code_format!r} unknown; expected one of {CODE_FORMATS}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"moe_w8.fused_moe: activation {activation!r} unsupported; expected one of {ACTIVATIONS}")
    if w13.dtype != torch.uint8 or w2.dtype != torch.uint8:
        raise ValueError(f"moe_w8.fused_moe: expert weights must be uint8 codes, got w13 {w13.dtype}, w2 {w2.dtype}")
    if x.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"moe_w8.fused_moe: shapes x {tuple(x.shape)}, topk_weights {tuple(topk_weights.shape)}, "
            f"topk_ids {tuple(topk_ids.shape)} do not agree (expected [T, H], [T, k], [T, k])"
        )
    if w13.shape[2] != x.shape[1] or w2.shape[1] != x.shape[1] or 2 * w2.shape[2] != w13.shape[1]:
        raise ValueError(
            f"moe_w8.fused_moe: weight shapes w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}"
        )
    if block_n < 1 or block_k < 0:
        raise ValueError(f"moe_w8.fused_moe: block ({block_n}, {block_k}) invalid")


@torch.library.custom_op(OP_NAME, mutates_args=())
def fused_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w13_scales: torch.Tensor,
    w2: torch.Tensor,
    w2_scales: torch.Tensor,
    block_n: int,
    block_k: int,
    code_format: str,
    activation: str = "silu",
    swiglu_limit: float = 0.0,
) -> torch.Tensor:
    """Routed-expert sum ``[T, H]`` in x's dtype (see the module docstring)."""
    _check(x, topk_weights, topk_ids, w13, w13_scales, w2, w2_scales, block_n, block_k, code_format, activation)
    args = (x, topk_weights, topk_ids, w13, w13_scales, w2, w2_scales, block_n, block_k, code_format, activation, swiglu_limit)
    if x.device.type != "cpu":
        raise RuntimeError(f"moe_w8.fused_moe: tensors on {x.device}, but {NEURON_PATH}")
    if x.shape[0] == 0:
        return x.new_zeros((0, w2.shape[1]))
    return cpu.fused_moe_cpu(*args).to(x.dtype)


@fused_moe.register_fake
def _fused_moe_fake(x, topk_weights, topk_ids, w13, w13_scales, w2, w2_scales, block_n, block_k, code_format, activation="silu", swiglu_limit=0.0):
    return x.new_empty((x.shape[0], w2.shape[1]))
