"""Launching the routed-expert NKI kernels: the one wrapper both Trainium and the CPU tests go through.

:func:`run_routed_experts` takes one layer's experts in the kernel layout (``kernels.host.KernelWeights``,
the only resident copy) and the routing, picks the dense kernel (decode: every token through every local
expert) or the token-grouped kernel (prefill: only the routed rows, ``kernels.grouping``) by token count,
and launches it as an SPMD grid of ``lnc`` programs:

* on a Neuron host (a ``/dev/neuron*`` device), the way vllm-neuron launches its own kernels:
  ``wrap_nki(kernel)[lnc](...)``, the higher-order op its ``torch.compile`` backend lowers
  (``libtorch_neuronx_lite.nki.nki_hop`` or ``vllm_neuron.nki.nki_hop``), with AWS's ``nki`` >= 0.3.0
  checked at start. Anything missing there is a :class:`NeuronLaunchError`, never a CPU fallback;
* elsewhere, the same calls run in the project's NKI interpreter (``kernels.nki_cpu.launch`` with the
  grid ``[lnc]``, refusing a grid that disagrees with the LNC), and the log says so once.

``torch.ops.moe_w8.nki_routed_experts`` is the same function as a torch custom op (the host-side
grouping is data-dependent: under ``torch.compile`` the op is one opaque node). Its schema is inferred
from the annotations when this module is imported, on every host, so a schema error cannot hide until a
Neuron host.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from vllm_moe_w8.kernels import grouping, host
from vllm_moe_w8.kernels.moe_w8 import moe_w8_output_block, moe_w8_pow2
from vllm_moe_w8.kernels.moe_w8_grouped import moe_w8_grouped_output_block, moe_w8_grouped_pow2

logger = logging.getLogger("vllm.neuron_w8")

MIN_NKI_VERSION = (0, 3, 0)  # nc_matmul(accumulate=) and the `import nki` namespace (SDK 2.29)
# Decode sizes run dense: up to one 128-token tile, the grouped kernel would already spend one tile per
# routed local expert (as many expert passes as the dense kernel), so grouping pays only beyond it.
DENSE_MAX_TOKENS = 128
TRN2_DEFAULT_LNC = 2
WRAP_NKI_MODULES = ("libtorch_neuronx_lite.nki.nki_hop", "vllm_neuron.nki.nki_hop")
DENSE = {"pow2": moe_w8_pow2, "output-block": moe_w8_output_block}
GROUPED = {"pow2": moe_w8_grouped_pow2, "output-block": moe_w8_grouped_output_block}


class NeuronLaunchError(RuntimeError):
    """A Neuron host on which the kernels cannot be launched (missing or too old packages)."""


@dataclass(frozen=True)
class Backend:
    name: str  # "neuron" or "interpreter"
    detail: str
    wrap_nki: object = None


def neuron_device_present() -> tuple[bool, str]:
    """(present, what was found): a Neuron device node on this host."""
    found = [f"/dev/neuron{i}" for i in range(64) if os.path.exists(f"/dev/neuron{i}")]
    return (True, f"{len(found)} Neuron device(s) ({found[0]}...)") if found else (False, "no Neuron device (/dev/neuron*)")


def parse_version(text: str) -> tuple[int, int, int]:
    """'0.5.0+2863...' -> (0, 5, 0); ValueError if the leading release numbers are missing."""
    parts = []
    for piece in str(text).split("+")[0].split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
    if not parts:
        raise ValueError(f"no version number in {text!r}")
    return tuple(parts + [0] * (3 - len(parts)))


def check_nki_version(version: str | None) -> str:
    """The installed NKI's version if it is new enough, else NeuronLaunchError with the remedy."""
    floor = ".".join(map(str, MIN_NKI_VERSION))
    if version is None:
        raise NeuronLaunchError(f"AWS nki is installed without __version__; the kernels need nki >= {floor} (Neuron SDK 2.29+)")
    try:
        found = parse_version(version)
    except ValueError:
        raise NeuronLaunchError(f"cannot read the AWS nki version {version!r}; the kernels need nki >= {floor}") from None
    if found < MIN_NKI_VERSION:
        raise NeuronLaunchError(
            f"AWS nki {version} is too old: the kernels use nc_matmul(accumulate=) and the `import nki` namespace, "
            f"which need nki >= {floor} (Neuron SDK 2.29+); upgrade the Neuron SDK"
        )
    return version


def import_wrap_nki() -> tuple[object, str]:
    """(wrap_nki, module it came from); NeuronLaunchError naming what was tried."""
    tried = []
    for name in WRAP_NKI_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001  (report every failure mode of a broken install)
            tried.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        if hasattr(mod, "wrap_nki"):
            return mod.wrap_nki, name
        tried.append(f"{name}: no wrap_nki")
    raise NeuronLaunchError("no NKI launcher (wrap_nki) importable: " + "; ".join(tried) +
                            ". Install vllm-neuron with libtorch-neuronx-lite from the Neuron SDK")


def real_nki() -> tuple[object, str]:
    """(AWS nki module or None, why)."""
    from vllm_moe_w8.kernels import nki_api

    return (nki_api.nki, nki_api.REASON) if nki_api.BACKEND == "nki" else (None, nki_api.REASON)


@functools.lru_cache(maxsize=1)
def backend() -> Backend:
    """Where the kernels run. A Neuron device with anything missing is an error (no silent CPU fallback);
    ``VLLM_MOE_W8_NKI=interpreter`` asks for the interpreter explicitly (neuron-check prices the kernels so)."""
    if os.environ.get("VLLM_MOE_W8_NKI", "").lower() == "interpreter":
        b = Backend("interpreter", "VLLM_MOE_W8_NKI=interpreter: the kernels run in the project's NKI interpreter (forced)")
        logger.warning("neuron-w8: %s", b.detail)
        return b
    present, where = neuron_device_present()
    if not present:
        b = Backend("interpreter", f"{where}: the kernels run in the project's NKI interpreter on CPU")
        logger.info("neuron-w8: %s", b.detail)
        return b
    nki, why = real_nki()
    if nki is None:
        raise NeuronLaunchError(f"{where} but AWS nki is unusable ({why}); install the Neuron SDK's nki (>= 0.3.0)")
    version = check_nki_version(getattr(nki, "__version__", None))
    wrap_nki, origin = import_wrap_nki()
    b = Backend("neuron", f"{where}; nki {version}; kernels launched by {origin}.wrap_nki", wrap_nki)
    logger.info("neuron-w8: %s", b.detail)
    return b


def runtime_lnc(env: dict | None = None) -> int:
    """The LNC the Neuron runtime runs at: NEURON_LOGICAL_NC_CONFIG, else trn2's default (2)."""
    value = (os.environ if env is None else env).get("NEURON_LOGICAL_NC_CONFIG", "").strip()
    if not value:
        return TRN2_DEFAULT_LNC
    if value not in ("1", "2"):
        raise ValueError(f"NEURON_LOGICAL_NC_CONFIG={value!r}: trn2 runs at LNC 1 or 2")
    return int(value)


def _numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.contiguous().numpy()


def launch(kernel, lnc: int, tensors: tuple, constants: dict, stats: list | None = None) -> torch.Tensor:
    """``kernel[lnc](*tensors, **constants)`` on the backend; the interpreter appends each program's Stats."""
    b = backend()
    if b.name == "neuron":
        return b.wrap_nki(kernel)[lnc](*tensors, **constants)
    from vllm_moe_w8.kernels import nki_cpu

    out, program_stats = nki_cpu.launch(kernel, (lnc,), *[_numpy(t) for t in tensors], lnc=lnc, **constants)
    if stats is not None:
        stats.append(program_stats)
    return torch.from_numpy(np.asarray(out, dtype=np.float32))


def _check(x, topk_weights, topk_ids, kw: host.KernelWeights, lnc: int, swiglu_limit: float) -> None:
    if x.dim() != 2 or x.shape[1] != kw.hidden_size:
        raise ValueError(f"run_routed_experts: x {tuple(x.shape)} must be [T, {kw.hidden_size}] (the experts' hidden size)")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"run_routed_experts: topk_weights {tuple(topk_weights.shape)} / topk_ids {tuple(topk_ids.shape)} must be [T, k] with T = {x.shape[0]}")
    if kw.mode not in DENSE:
        raise ValueError(f"run_routed_experts: no kernel for mode {kw.mode!r}; expected one of {sorted(DENSE)}")
    if lnc not in (1, 2):
        raise ValueError(f"run_routed_experts: lnc={lnc}; trn2 runs at LNC 1 or 2 (NEURON_LOGICAL_NC_CONFIG)")
    if swiglu_limit < 0:
        raise ValueError(f"run_routed_experts: swiglu_limit must be >= 0 (0: no clamp), got {swiglu_limit}")


def kernel_for(tokens: int, mode: str) -> tuple[str, object]:
    """('dense' | 'grouped', kernel) for a call with ``tokens`` tokens."""
    return ("dense", DENSE[mode]) if tokens <= DENSE_MAX_TOKENS else ("grouped", GROUPED[mode])


def run_routed_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, kw: host.KernelWeights, *,
                       lnc: int, swiglu_limit: float = 0.0, stats: list | None = None) -> torch.Tensor:
    """The routed sum [T, H] fp32 (DEVELOPING.md, "The MoE op", semantics) computed by the NKI kernels."""
    _check(x, topk_weights, topk_ids, kw, lnc, swiglu_limit)
    tokens = x.shape[0]
    weights = (kw.w13, kw.w13_scales, kw.w2, kw.w2_scales)
    limit = float(swiglu_limit)
    which, kernel = kernel_for(tokens, kw.mode)
    if tokens == 0:
        return torch.zeros(0, kw.hidden_size, dtype=torch.float32)
    if which == "dense":
        aff = host.dense_affinities(topk_weights, topk_ids, kw.num_experts)

        def dense(hidden, aff_chunk):
            host.check_kernel_args(hidden, *weights, aff_chunk, mode=kw.mode, swiglu_limit=limit)
            partial = launch(kernel, lnc, (hidden,) + weights + (aff_chunk,), {"swiglu_limit": limit}, stats)
            return partial.float().sum(dim=0)  # one partial sum per program (logical core)

        return host.run_chunked(dense, x, aff)
    groups = grouping.group_by_expert(topk_weights, topk_ids, kw.num_experts, programs=lnc)
    if groups.rows == 0:
        return torch.zeros(tokens, kw.hidden_size, dtype=torch.float32)
    rows = grouping.gather_rows(x, groups)
    host.check_grouped_args(rows, groups.row_weight, *weights, groups.expert_tiles, groups.expert_program, mode=kw.mode,
                            programs=lnc, swiglu_limit=limit)
    constants = {"expert_tiles": groups.expert_tiles, "expert_program": groups.expert_program, "swiglu_limit": limit}
    rows_out = launch(kernel, lnc, (rows, groups.row_weight) + weights, constants, stats)
    return grouping.scatter_rows(rows_out, groups, tokens)


@torch.library.custom_op("moe_w8::nki_routed_experts", mutates_args=())
def nki_routed_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                       w13_scales: torch.Tensor, w2: torch.Tensor, w2_scales: torch.Tensor, mode: str, lnc: int,
                       swiglu_limit: float) -> torch.Tensor:
    """:func:`run_routed_experts` as a torch op (weights unpacked from ``KernelWeights``)."""
    kw = host.KernelWeights(w13, w13_scales, w2, w2_scales, mode)
    return run_routed_experts(x, topk_weights, topk_ids, kw, lnc=lnc, swiglu_limit=swiglu_limit)


@nki_routed_experts.register_fake
def _nki_routed_experts_fake(x, topk_weights, topk_ids, w13, w13_scales, w2, w2_scales, mode, lnc, swiglu_limit):
    return x.new_empty((x.shape[0], w2.shape[3]), dtype=torch.float32)
