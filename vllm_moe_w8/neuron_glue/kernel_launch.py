"""Launching the NKI kernels (routed experts, 1-byte linears): the one wrapper Trainium and the CPU tests go through.

The launch contract (what the kernel engineers plug into; ``kernels/moe_w8.py`` documents each tensor):

    kernel                      tensors (positional, device tensors, in this order)           constants     output
    moe_w8_pow2 /               hidden [T, H] bf16 (T a bucket <= 128, host.T_BUCKETS),        swiglu_limit  [lnc, T, H] fp32
    moe_w8_output_block         w13 [E, 128, H/128, 2I] u8, w13_scales [E, 2I/128, G13] f32,   (float)       (one partial sum
                                w2 [E, 128, I/128, H] u8, w2_scales [E, H/128, G2] f32,                      per program)
                                affinities [T, E] f32 (0 where not routed)

Every launch is ``wrap_nki(kernel)[lnc](*tensors, **constants)``, as vllm-neuron launches its own kernels:
the callers are made once (:func:`backend`, resolved when a block is adopted, never in a forward), the
tensors are built by torch ops on the input's device, and the constants do not depend on the data (no
recompile per routing). :func:`run_routed_experts` is trace-safe under ``torch.compile(fullgraph=True,
dynamic=False)``: every call is one launch, chosen by ``host_routed.schedule_for(T)`` (kernels/host_routed.py
holds the block kernels' launch contract): selective decode (the block kernel, one block per routed local
expert, T padded to its decode bucket) up to ``SELECTIVE_MAX_TOKENS``, the dense all-expert kernel up to 128
tokens, block prefill (the block kernel with 128-row blocks over the whole T) beyond; the block kernels' metadata
are made by ``kernels/routing.py``'s torch ops inside the traced forward. A new kernel joins :data:`KERNELS`
with its output contract and :func:`backend` makes its caller.

    moe_w8_blocks_pow2 /        hidden [T + B, H] bf16, the four weight tensors, token_position_to_id [N, B] i32,
    moe_w8_blocks_output_block  position_weight [N, B] f32, position_store [N, B, 2] i32, block_to_expert /
                                block_load_expert [N, 1] i32, block_range [lnc, 2] i32; constants swiglu_limit
                                (+ vector_blocks for pow2), split_inter (0/1: host_routed.split_inter of the
                                bucket, LNC and I - selective decode at LNC 2 splits each block's I across the
                                programs); output [lnc, T, H] fp32, a partial sum per program either way: LNC 1
                                zero-filled, LNC > 1 only the rows its program stores (routing.combine with
                                block_call's program_tokens selects them)

    linear_w8_pow2 /            x [T, K] bf16 (T = host_linear.bucket_for(T, lnc)), w [128, K/128, N] u8,
    linear_w8_dequant           scales [N/128, K/128] f32 (the resident host_linear.LinearWeights); constants
                                split_tokens (0/1: host_linear.split_tokens of the bucket and LNC; 0 = the
                                programs split N, 1 = prefill splits the token tiles) (+ vector_blocks for pow2);
                                output [T, N] fp32 (each program writes its columns / rows). run_linear_w8 picks
                                pow2 (exact) for T <= 128, dequant (bf16 weights on chip) beyond
                                (host_linear.path_for)

Where the kernels run:

* on a Neuron host (a ``/dev/neuron*`` device): vllm-neuron's ``wrap_nki`` (``libtorch_neuronx_lite.nki.nki_hop``
  or ``vllm_neuron.nki.nki_hop``), with AWS's ``nki`` >= 0.3.0 checked. Anything missing there is a
  :class:`NeuronLaunchError`, never a CPU fallback;
* elsewhere, :func:`vllm_moe_w8.neuron_glue.interpreter_hop.wrap_nki`: the same calls and the same graph shape
  (one opaque node per launch, output shapes from the contract), executed by the project's NKI interpreter
  (grid ``[lnc]``, a grid that disagrees with the LNC refused), and the log says so once.

:func:`run_grouped_experts` (the token-grouped kernel on a host-built schedule) is eager only: its tile
schedule is read from the routing and becomes kernel constants; the served forward does not use it.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from dataclasses import dataclass, field

import torch

from vllm_moe_w8.kernels import grouping, host, host_linear, host_routed, routing
from vllm_moe_w8.kernels.linear_w8 import POW2_SCHEDULE, linear_w8_dequant, linear_w8_pow2
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
LINEAR = {"pow2": linear_w8_pow2, "dequant": linear_w8_dequant}


class NeuronLaunchError(RuntimeError):
    """A Neuron host on which the kernels cannot be launched (missing or too old packages)."""


@dataclass(frozen=True)
class Backend:
    name: str  # "neuron" or "interpreter"
    detail: str
    wrap_nki: object = None
    callers: dict = field(default_factory=dict)  # kernel name -> wrap_nki(kernel), made once


def _dense_output(tensors, grid: int):
    hidden, w2 = tensors[0], tensors[3]
    return (grid, hidden.shape[0], w2.shape[3]), torch.float32


def _blocks_output(tensors, grid: int):
    hidden, w2, t2i = tensors[0], tensors[3], tensors[5]
    return (grid, hidden.shape[0] - t2i.shape[1], w2.shape[3]), torch.float32  # hidden is [T + B, H]


def _linear_output(tensors, grid: int):
    x, w = tensors[0], tensors[1]
    return (x.shape[0], w.shape[2]), torch.float32


def _grouped_output(tensors, grid: int):
    rows, w2 = tensors[0], tensors[4]
    return (rows.shape[0], w2.shape[3]), torch.float32


# Every kernel the glue launches, with its output contract (the interpreter's fake implementation uses it;
# on Neuron, vllm-neuron's wrap_nki compiles the kernel for its shapes).
KERNELS = {k.__name__: (k, _dense_output) for k in DENSE.values()}
KERNELS.update({k.__name__: (k, _grouped_output) for k in GROUPED.values()})
KERNELS.update({k.__name__: (k, _blocks_output) for k in host_routed.BLOCKS.values()})  # [lnc, T, H] fp32
KERNELS.update({k.__name__: (k, _linear_output) for k in LINEAR.values()})  # [T, N] fp32


def _callers(wrap) -> dict:
    return {name: wrap(kernel) for name, (kernel, _) in KERNELS.items()}


def _interpreter_backend(detail: str) -> Backend:
    from vllm_moe_w8.neuron_glue import interpreter_hop

    return Backend("interpreter", detail, interpreter_hop.wrap_nki,
                   {name: interpreter_hop.wrap_nki(kernel, output) for name, (kernel, output) in KERNELS.items()})


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
    """Where the kernels run, with their callers (resolved once: at adoption, never inside a forward). A Neuron
    device with anything missing is an error (no silent CPU fallback); ``VLLM_MOE_W8_NKI=interpreter`` asks for
    the interpreter explicitly (neuron-check prices the kernels so)."""
    if os.environ.get("VLLM_MOE_W8_NKI", "").lower() == "interpreter":
        b = _interpreter_backend("VLLM_MOE_W8_NKI=interpreter: the kernels run in the project's NKI interpreter (forced)")
        logger.warning("neuron-w8: %s", b.detail)
        return b
    present, where = neuron_device_present()
    if not present:
        b = _interpreter_backend(f"{where}: the kernels run in the project's NKI interpreter on CPU")
        logger.info("neuron-w8: %s", b.detail)
        return b
    nki, why = real_nki()
    if nki is None:
        raise NeuronLaunchError(f"{where} but AWS nki is unusable ({why}); install the Neuron SDK's nki (>= 0.3.0)")
    version = check_nki_version(getattr(nki, "__version__", None))
    wrap_nki, origin = import_wrap_nki()
    b = Backend("neuron", f"{where}; nki {version}; kernels launched by {origin}.wrap_nki", wrap_nki, _callers(wrap_nki))
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


def launch(kernel, lnc: int, tensors: tuple, constants: dict, stats: list | None = None,
           where: Backend | None = None) -> torch.Tensor:
    """``wrap_nki(kernel)[lnc](*tensors, **constants)`` on the backend (``where``, else :func:`backend`, eager only);
    with the interpreter, ``stats`` gets each program's counters."""
    b = where or backend()
    wrapped = b.callers.get(kernel.__name__)
    if wrapped is None:  # a kernel outside KERNELS (neuron-check's microbenchmarks): vllm-neuron's wrap_nki takes any
        if b.name != "neuron":
            raise KeyError(f"launch: {kernel.__name__} is not in kernel_launch.KERNELS (the interpreter needs its output "
                           "contract); register it there")
        wrapped = b.wrap_nki(kernel)
    caller = wrapped[lnc]
    if stats is None:
        return caller(*tensors, **constants)
    from vllm_moe_w8.neuron_glue import interpreter_hop

    with interpreter_hop.collect_stats(stats):
        return caller(*tensors, **constants)


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
    """('selective' | 'dense' | 'blocks', kernel): how :func:`run_routed_experts` runs ``tokens`` tokens
    (``host_routed.schedule_for``)."""
    which = host_routed.schedule_for(tokens)
    return which, (DENSE[mode] if which == "dense" else host_routed.BLOCKS[mode])


def _pad_routing(x, topk_weights, topk_ids, rows: int):
    """Tokens and routing padded to ``rows`` (padded tokens: zero rows, weight 0, id -1: no route)."""
    pad = rows - x.shape[0]
    if pad == 0:
        return x, topk_weights, topk_ids
    return (host.pad_rows(x, rows), host.pad_rows(topk_weights, rows),
            torch.cat([topk_ids, topk_ids.new_full((pad, topk_ids.shape[1]), -1)]))


def run_routed_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, kw: host.KernelWeights, *,
                       lnc: int, swiglu_limit: float = 0.0, stats: list | None = None,
                       where: Backend | None = None) -> torch.Tensor:
    """The routed sum [T, H] fp32 (DEVELOPING.md, "The MoE op", semantics), trace-safe (see the module docstring):
    ``host_routed.schedule_for(T)`` picks the selective decode kernel (T padded to its decode bucket), the dense
    all-expert kernel (one decode bucket) or the block prefill kernel (the whole T in one launch); the block
    kernels' metadata come from ``kernels/routing.py``'s torch ops inside the traced forward. ``where``: the
    backend resolved beforehand (required under trace)."""
    _check(x, topk_weights, topk_ids, kw, lnc, swiglu_limit)
    tokens = x.shape[0]
    if tokens == 0:
        return x.new_zeros((0, kw.hidden_size), dtype=torch.float32)
    limit = float(swiglu_limit)
    which, kernel = kernel_for(tokens, kw.mode)
    if which == "dense":
        weights = (kw.w13, kw.w13_scales, kw.w2, kw.w2_scales)
        bucket = host.bucket_for(tokens)
        hidden = host.pad_rows(x.to(torch.bfloat16), bucket)
        aff = host.pad_rows(host.dense_affinities(topk_weights, topk_ids, kw.num_experts), bucket)  # padded: 0
        host.check_kernel_args(hidden, *weights, aff, mode=kw.mode, swiglu_limit=limit)
        partial = launch(kernel, lnc, (hidden,) + weights + (aff,), {"swiglu_limit": limit}, stats, where)
        return partial.float().sum(dim=0)[:tokens]  # one partial sum per program (logical core)
    rows = host_routed.selective_bucket(tokens) if which == "selective" else tokens
    xp, wp, ip = _pad_routing(x, topk_weights, topk_ids, rows)
    kernel, tensors, consts, program_tokens = host_routed.block_call(xp, wp, ip, kw, lnc, limit)
    host_routed.check_block_args(tensors, consts, kw.mode, lnc, rows, topk_ids.shape[1])
    out = launch(kernel, lnc, tensors, consts, stats, where)
    return routing.combine(out.float(), rows, program_tokens)[:tokens]


def run_linear_w8(x: torch.Tensor, lw: host_linear.LinearWeights, *, lnc: int, where: Backend | None = None,
                  stats: list | None = None) -> torch.Tensor:
    """y [T, N] fp32 = x [T, K] @ W.T through the 1-byte linear kernel (kernels/linear_w8.py), one launch, trace-safe
    like :func:`run_routed_experts`: x padded to ``host_linear.bucket_for(T, lnc)``; T <= 128 runs the exact pow2
    kernel, longer T the dequant kernel (``host_linear.path_for``); the constants are functions of the bucket and LNC
    only. ``lw.splits`` cuts a fused linear's output. ``where``: the backend resolved beforehand (required under trace)."""
    if x.dim() != 2 or x.shape[1] != lw.k:
        raise ValueError(f"run_linear_w8({lw.name}): x {tuple(x.shape)} must be [T, {lw.k}] (the linear's K)")
    host_linear.check_lnc(lw, lnc)
    tokens = x.shape[0]
    if tokens == 0:
        return x.new_zeros((0, lw.n), dtype=torch.float32)
    bucket = host_linear.bucket_for(tokens, lnc)
    path = host_linear.path_for(tokens)
    split = host_linear.split_tokens(bucket, lnc)
    xp = host.pad_rows(x.to(torch.bfloat16), bucket)
    consts = {"split_tokens": split}
    if path == "pow2":
        consts["vector_blocks"] = POW2_SCHEDULE.vector_blocks
    host_linear.check_linear_args(xp, lw.codes, lw.scales, lnc, split)
    return launch(LINEAR[path], lnc, (xp, lw.codes, lw.scales), consts, stats, where)[:tokens]


def run_grouped_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, kw: host.KernelWeights, *,
                        lnc: int, swiglu_limit: float = 0.0, stats: list | None = None) -> torch.Tensor:
    """The routed sum through the token-grouped kernel on a host-built schedule (eager only, see the module docstring)."""
    _check(x, topk_weights, topk_ids, kw, lnc, swiglu_limit)
    tokens = x.shape[0]
    weights = (kw.w13, kw.w13_scales, kw.w2, kw.w2_scales)
    limit = float(swiglu_limit)
    groups = grouping.group_by_expert(topk_weights, topk_ids, kw.num_experts, programs=lnc)
    if groups.rows == 0:
        return torch.zeros(tokens, kw.hidden_size, dtype=torch.float32, device=x.device)
    rows = grouping.gather_rows(x, groups)
    host.check_grouped_args(rows, groups.row_weight, *weights, groups.expert_tiles, groups.expert_program, mode=kw.mode,
                            programs=lnc, swiglu_limit=limit)
    constants = {"expert_tiles": groups.expert_tiles, "expert_program": groups.expert_program, "swiglu_limit": limit}
    rows_out = launch(GROUPED[kw.mode], lnc, (rows, groups.row_weight) + weights, constants, stats)
    return grouping.scatter_rows(rows_out, groups, tokens)
