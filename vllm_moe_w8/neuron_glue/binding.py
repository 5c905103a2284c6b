"""Neuron binding: runs ``moe_w8::fused_moe`` on a Trainium device with the NKI kernels in ``kernels/``.

Import-guarded and import-light: importing this module never imports torch_neuronx or nki;
:func:`available` tries them and says why not. The op (``vllm_moe_w8.op.custom_op``) calls :func:`available` and
:func:`fused_moe_neuron` (the op's signature, DEVELOPING.md); a MoE method may call
:func:`prepare_weights` once per layer at load time, otherwise the first call re-lays out and caches.

How the kernels reach the device (assumed from AWS's public material, to be confirmed on trn2):
each kernel variant is wrapped in a torch custom op with ``torch_neuronx.nki_op("moe_w8::...")``
(TorchNeuron, the native PyTorch backend that vllm-neuron's ``VLLM_NEURON_BACKEND=neuron_native`` lane
runs on) so it is one graph node under ``torch.compile(backend=..., dynamic=False)``; token counts are
padded to static buckets (``kernels.host.T_BUCKETS``) because NKI kernels reject symbolic shapes.
Without ``torch_neuronx.nki_op`` but with ``libtorch_neuronx_lite`` (the public "Lite" runtime), its
``_compiler.nki_op`` is used the same way.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

from vllm_moe_w8.kernels import host

_PREPARED: dict[tuple, host.KernelWeights] = {}


def _import(name: str):
    try:
        return importlib.import_module(name), ""
    except Exception as exc:  # noqa: BLE001  (a broken Neuron install must not break CPU serving)
        return None, f"{name} not importable ({type(exc).__name__}: {exc})"


def _nki_op_factory():
    """(decorator factory ``nki_op(name, mutates_args=...)``, origin) or (None, reason)."""
    tnx, why = _import("torch_neuronx")
    if tnx is not None and hasattr(tnx, "nki_op"):
        return tnx.nki_op, "torch_neuronx.nki_op"
    lite, why_lite = _import("libtorch_neuronx_lite._compiler")
    if lite is not None and hasattr(lite, "nki_op"):
        return lite.nki_op, "libtorch_neuronx_lite._compiler.nki_op"
    return None, f"no nki_op registration API: {why or 'torch_neuronx has no nki_op'}; {why_lite or 'Lite has no _compiler.nki_op'}"


def _neuron_device_present() -> tuple[bool, str]:
    if any(os.path.exists(f"/dev/neuron{i}") for i in range(64)):
        return True, "/dev/neuron* present"
    return False, "no Neuron device (/dev/neuron*) on this host"


@functools.lru_cache(maxsize=1)
def available() -> tuple[bool, str]:
    """(usable, reason): real NKI, a kernel registration API and a Neuron device are all present."""
    from vllm_moe_w8.kernels import nki_api

    if nki_api.BACKEND != "nki":
        return False, f"AWS NKI unavailable: {nki_api.REASON}"
    factory, origin = _nki_op_factory()
    if factory is None:
        return False, origin
    ok, why = _neuron_device_present()
    if not ok:
        return False, why
    try:
        _registered_ops()
    except Exception as exc:  # noqa: BLE001
        return False, f"registering the NKI kernels with {origin} failed: {type(exc).__name__}: {exc}"
    return True, f"NKI kernels ({nki_api.REASON}) registered with {origin}; token buckets {host.T_BUCKETS}"


@functools.lru_cache(maxsize=1)
def _registered_ops() -> dict:
    """One torch op per kernel variant: (hidden, w13, w13_scales, w2, w2_scales, affinities) -> [T, H] fp32."""
    from vllm_moe_w8.kernels.moe_w8 import moe_w8_output_block, moe_w8_pow2

    factory, _ = _nki_op_factory()
    ops = {}
    host_mode = {moe_w8_pow2: "pow2", moe_w8_output_block: "output-block"}
    for mode, kernel in (("pow2", moe_w8_pow2), ("output-block", moe_w8_output_block)):
        name = "moe_w8::nki_routed_" + mode.replace("-", "_")

        def call(hidden: torch.Tensor, w13: torch.Tensor, w13_scales: torch.Tensor, w2: torch.Tensor,
                 w2_scales: torch.Tensor, affinities: torch.Tensor, swiglu_limit: float, _kernel=kernel) -> torch.Tensor:
            host.check_kernel_args(hidden, w13, w13_scales, w2, w2_scales, affinities, mode=host_mode[_kernel], swiglu_limit=swiglu_limit)
            return _kernel(hidden, w13, w13_scales, w2, w2_scales, affinities, swiglu_limit)

        op = factory(name, mutates_args=())(call)
        if hasattr(op, "register_fake"):
            op.register_fake(lambda hidden, *_weights: hidden.new_empty(tuple(hidden.shape), dtype=torch.float32))
        ops[mode] = op
    return ops


def supports(block_n: int, block_k: int, code_format: str) -> tuple[bool, str]:
    """(True, kernel variant) if a layer with these scale tiles / codes has an NKI kernel, else (False, why)."""
    try:
        return True, host.kernel_mode(block_n, block_k, code_format)
    except ValueError as exc:
        return False, str(exc)


def prepare_weights(w13, w13_scales, w2, w2_scales, block_n: int, block_k: int, code_format: str) -> host.KernelWeights:
    """Re-lay out one layer's experts for the kernels (on CPU, then to the weights' device) and cache it."""
    key = (w13.data_ptr(), tuple(w13.shape), w2.data_ptr(), tuple(w2.shape), block_n, block_k)
    kw = _PREPARED.get(key)
    if kw is None:
        cpu = host.to_kernel_layout(w13.cpu(), w13_scales.cpu(), w2.cpu(), w2_scales.cpu(), block_n, block_k, code_format)
        dev = w13.device
        kw = host.KernelWeights(cpu.w13.to(dev), cpu.w13_scales.to(dev), cpu.w2.to(dev), cpu.w2_scales.to(dev), cpu.mode)
        _PREPARED[key] = kw
    return kw


def dense_affinities(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, k] routing -> [T, E] fp32 with static-shape ops only (traceable; ids < 0 contribute 0)."""
    ids = topk_ids.long()
    onehot = torch.nn.functional.one_hot(ids.clamp(min=0), num_experts).float()
    return (onehot * (topk_weights.float() * (ids >= 0).float()).unsqueeze(-1)).sum(dim=1)


def fused_moe_neuron(x, topk_weights, topk_ids, w13, w13_scales, w2, w2_scales, block_n: int, block_k: int,
                     code_format: str, activation: str = "silu", swiglu_limit: float = 0.0) -> torch.Tensor:
    """``moe_w8::fused_moe`` on a Neuron device: bucketed calls of the pow2 / output-block NKI kernel."""
    if activation != "silu":
        raise ValueError(f"neuron_binding: activation {activation!r} has no NKI kernel (only 'silu')")
    if swiglu_limit < 0:
        raise ValueError(f"neuron_binding: swiglu_limit must be >= 0, got {swiglu_limit}")
    kw = prepare_weights(w13, w13_scales, w2, w2_scales, block_n, block_k, code_format)
    op = _registered_ops()[kw.mode]
    aff = dense_affinities(topk_weights, topk_ids, kw.num_experts)
    limit = float(swiglu_limit)
    out = host.run_chunked(lambda hidden, a: op(hidden, kw.w13, kw.w13_scales, kw.w2, kw.w2_scales, a, limit), x, aff)
    return out.to(x.dtype)
