"""The CPU implementation of the MoE op (``torch.ops.moe_w8.fused_moe``'s CPU body).

``fused_moe_cpu`` computes ``out[t] = sum_j w[t, j] * W2_e (silu(W1_e x_t) * W3_e x_t)`` over the
experts ``e = topk_ids[t, j] >= 0`` with every ``W`` the exactly dequantised weight (FP8 code x its
tile's float32 scale, rounded once to float32 -- the same numbers as :func:`vllm_moe_w8.codec.fp8.dequantize`),
in float32, returned in ``x``'s dtype. See DEVELOPING.md, "The MoE op", for the storage layout.

Two implementations (both touch only the routed experts and group tokens by expert):

* ``native`` (:mod:`vllm_moe_w8.op.native` picks the variant for this CPU and builds it at first use,
  a few seconds of g++, cached per instruction set):
  - ``avx512bf16``: each FP8 byte becomes its exact BF16 value by two byte-permute lookups; ``vdpbf16ps`` dot
    products against the activations split into BF16 planes that sum to them exactly (one plane for BF16
    inputs); each scale tile's partial sum is multiplied by its float32 scale. The intermediate
    ``h = silu(gate) * up`` (float32) enters the down projection as two BF16 planes (2^-18 relative: the
    exact path, the default) or, for BF16 activations with ``VLLM_MOE_W8_CPU_H=bf16``, as one: h rounded to nearest BF16, as vLLM's own BF16 MoE
    rounds its intermediate -- half the down projection's dot products (see :func:`h_precision`).
  - ``avx2``: FP8 byte -> float16 bits with one shift/and/add, float16 -> float32 with F16C, times the tile's
    scale -- the same float32 weight as ``fp8.dequantize`` -- and FMA; h stays float32.
  An expert routed to <= 3 tokens (8 on avx2) has each group of codes decoded in registers and used at once by all its
  tokens (memory-bound, reads 1 byte per weight); more tokens (prefill): four rows are decoded into an
  L1-resident panel that register tiles of (row, token) dot products reuse. ``torch.get_num_threads()`` threads:
  a team of torch's own OpenMP threads (``codec/csrc/team.h``), which claim work items from atomic counters, so
  under vLLM's CPU worker, which binds each OpenMP thread to a CPU, the work runs on every CPU it was given. Codes must be finite in their format (repack and
  the checkpoint validation guarantee it). The first call that reads an expert tensor backs its memory with 2 MiB
  pages (:mod:`vllm_moe_w8.op.hugepages`, ``VLLM_MOE_W8_CPU_HUGEPAGES``): decode streams the codes (``w8_4k`` in
  ``benchmarks/bench_moe_op.py``: what 4 KiB pages cost).
* ``torch`` (the portable fallback): dequantises each routed expert once per call and uses torch
  matmuls (exact, float32 h). Used where no native variant fits the CPU, the build fails, or the shapes are
  not covered.

Numbers: with the exact h the result equals the float32 computation over exactly dequantised weights up to
float32 summation order; with the BF16 h it additionally carries h's rounding (<= 2^-9 of each |h_i|, so
<= 2^-9 * sum_i |W2[n, i] h_i| per output), the same order as rounding the BF16 output itself.
The implementation, instruction set and h precision that run are logged once per process
(:func:`implementation`, :func:`h_precision` say which). ``VLLM_MOE_W8_CPU_ISA=avx512bf16|avx2|torch`` forces
a variant (an ISA the CPU lacks is an error); ``VLLM_MOE_W8_CPU_H=bf16`` rounds h to BF16 for BF16 inputs (opt-in).
"""

from __future__ import annotations

import ctypes
import logging
import math
import os

import torch

from vllm_moe_w8.codec import fp8
from vllm_moe_w8.op import hugepages

logger = logging.getLogger("vllm.vllm_moe_w8.op.cpu")

CODE_FORMATS = ("e4m3", "e4m3fn")
ACTIVATIONS = ("silu",)
_LOGGED: set[str] = set()


def _log_once(key: str, msg: str, *args, level=logging.INFO) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.log(level, msg, *args)


# ----------------------------------------------------------------------------------------------
# Argument checks (clear errors naming the tensor and the remedy)
# ----------------------------------------------------------------------------------------------


def check_args(x, topk_weights, topk_ids, w13, w13_scales, w2, w2_scales, block_n, block_k, code_format, activation):
    """Validate shapes/dtypes of the op's arguments; returns (T, H, I, E)."""
    if code_format not in CODE_FORMATS:
        raise ValueError(f"code_format={code_format!r} is not supported; expected one of {CODE_FORMATS}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported by the neuron-w8 MoE op; expected one of {ACTIVATIONS}")
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be [T, H] bf16/fp16/fp32, got {tuple(x.shape)} {x.dtype}")
    if w13.dtype != torch.uint8 or w2.dtype != torch.uint8:
        raise ValueError(f"w13/w2 must hold uint8 FP8 codes, got {w13.dtype}/{w2.dtype}; repack the experts with vllm_moe_w8.codec.fp8.repack")
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 must be [E, 2I, H] and w2 [E, H, I], got {tuple(w13.shape)} and {tuple(w2.shape)}")
    t, h = x.shape
    e, two_i, h13 = w13.shape
    if two_i % 2 or h13 != h or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(
            f"inconsistent expert shapes: x {tuple(x.shape)}, w13 {tuple(w13.shape)} (expected [E, 2I, {h}]), "
            f"w2 {tuple(w2.shape)} (expected [E, {h}, I])"
        )
    inter = two_i // 2
    if block_n < 1 or block_k < 0:
        raise ValueError(f"block_n must be >= 1 and block_k >= 0 (0: whole row), got ({block_n}, {block_k})")
    g_i = math.ceil(inter / block_n)
    g_h = 1 if block_k == 0 else math.ceil(h / block_k)
    g_h2 = math.ceil(h / block_n)
    g_i2 = 1 if block_k == 0 else math.ceil(inter / block_k)
    if tuple(w13_scales.shape) != (e, 2 * g_i, g_h):
        raise ValueError(f"w13_scales has shape {tuple(w13_scales.shape)}; expected {(e, 2 * g_i, g_h)} for I={inter}, H={h}, block=({block_n}, {block_k})")
    if tuple(w2_scales.shape) != (e, g_h2, g_i2):
        raise ValueError(f"w2_scales has shape {tuple(w2_scales.shape)}; expected {(e, g_h2, g_i2)} for H={h}, I={inter}, block=({block_n}, {block_k})")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be [T={t}, k]")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    return t, h, inter, e


def check_ids(topk_ids: torch.Tensor, e: int) -> None:
    if topk_ids.numel() and int(topk_ids.max()) >= e:
        raise ValueError(f"topk_ids holds expert id {int(topk_ids.max())} but only {e} local experts exist (ids must be local; -1 = not on this rank)")


# ----------------------------------------------------------------------------------------------
# Routing: group (token, slot) pairs by expert
# ----------------------------------------------------------------------------------------------


def group_by_expert(topk_ids: torch.Tensor, topk_weights: torch.Tensor):
    """Routed pairs sorted by expert: (experts [n_e], counts [n_e], tokens [P], weights [P] fp32).

    Pairs with id < 0 are dropped; duplicate routes stay separate pairs. Stable: within an expert
    the pairs keep token order.
    """
    k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1).long()
    keep = (ids >= 0).nonzero().squeeze(1)
    ids = ids[keep]
    order = torch.argsort(ids, stable=True)
    pair = keep[order]
    experts, counts = torch.unique_consecutive(ids[order], return_counts=True)
    tokens = pair // k
    weights = topk_weights.reshape(-1).float()[pair]
    return experts, counts, tokens, weights


# ----------------------------------------------------------------------------------------------
# The portable torch implementation
# ----------------------------------------------------------------------------------------------


def decode_codes(codes: torch.Tensor, code_format: str) -> torch.Tensor:
    """uint8 FP8 codes -> float32 values (torch's float8_e4m3fn cast; e4m3's inf/NaN codes fixed up)."""
    values = codes.view(torch.float8_e4m3fn).float()
    if code_format == "e4m3":
        mag = codes & 0x7F
        special = mag >= fp8.FN_ONLY_MIN_MAG
        if bool(special.any()):  # exponent 1111: inf (mantissa 0) or NaN in Trn2's e4m3
            values = torch.where(special, fp8.decode(codes, "e4m3"), values)
    return values


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, block_n: int, block_k: int, code_format: str) -> torch.Tensor:
    """[N, K] codes with their scale grid -> the exactly dequantised float32 [N, K] weight."""
    return decode_codes(codes, code_format) * fp8.expand_scales(scales, tuple(codes.shape), (block_n, block_k))


def _activate(gate: torch.Tensor, up: torch.Tensor, swiglu_limit: float) -> torch.Tensor:
    if swiglu_limit > 0:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(-swiglu_limit, swiglu_limit)
    return torch.nn.functional.silu(gate) * up


def fused_moe_torch(x, topk_weights, topk_ids, w13, w13_scales, w2, w2_scales, block_n, block_k, code_format,
                    activation="silu", swiglu_limit=0.0) -> torch.Tensor:
    """Pure-torch exact implementation: each routed expert dequantised once per call, fp32 matmuls."""
    t, h, inter, e = check_args(x, topk_weights, topk_ids, w13, w13_scales, w2, w2_scales, block_n, block_k, code_format, activation)
    check_ids(topk_ids, e)
    g_i = math.ceil(inter / block_n)
    out = torch.zeros(t, h, dtype=torch.float32)
    experts, counts, tokens, weights = group_by_expert(topk_ids, topk_weights)
    xf = x.float()
    start = 0
    for e, n in zip(experts.tolist(), counts.tolist()):
        tok = tokens[start:start + n]
        wt = weights[start:start + n]
        start += n
        gate = dequantize_rows(w13[e, :inter], w13_scales[e, :g_i], block_n, block_k, code_format)
        up = dequantize_rows(w13[e, inter:], w13_scales[e, g_i:], block_n, block_k, code_format)
        down = dequantize_rows(w2[e], w2_scales[e], block_n, block_k, code_format)
        xe = xf.index_select(0, tok)
        act = _activate(xe @ gate.T, xe @ up.T, swiglu_limit)
        out.index_add_(0, tok, (act @ down.T) * wt[:, None])
    return out.to(x.dtype)


# ----------------------------------------------------------------------------------------------
# The native kernel
# ----------------------------------------------------------------------------------------------


def native_available(isa: str | None = None) -> bool:
    """Whether native variant ``isa`` (default: the selected one) builds and runs here (built on first call)."""
    from vllm_moe_w8.op import native

    return native.load(isa) is not None


def native_supports(h: int, inter: int, block_k: int, isa: str = "avx2") -> bool:
    """Shapes a native variant covers: H, I multiples of 16 (every real model); the scale tile's width a
    multiple of 16 (avx2) or of 64 (avx512bf16, whose decode groups must not straddle tiles); 0 = whole rows."""
    tile = 64 if isa == "avx512bf16" else 16
    return h % 16 == 0 and inter % 16 == 0 and block_k % tile == 0


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


# bf16 planes of the activations that sum to them exactly: bf16 values are one plane, float16 two, float32 three.
X_PLANES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


H_EXACT, H_BF16 = "exact", "bf16"


def h_precision(x_dtype: torch.dtype, isa: str, choice: str | None = None) -> str:
    """How variant ``isa`` carries h = silu(gate) * up into the down projection for activations of ``x_dtype``.

    ``"exact"`` by default (two BF16 planes on avx512bf16; float32 on avx2 and torch). ``"bf16"`` (one BF16
    plane, h rounded to nearest: half the down projection's work) only when ``VLLM_MOE_W8_CPU_H=bf16``
    (``choice``), on ``avx512bf16``, for BF16 activations (opt-in: see ``native.ENV_H``).
    """
    from vllm_moe_w8.op import native

    choice = native.h_choice() if choice is None else choice
    return H_BF16 if isa == "avx512bf16" and x_dtype == torch.bfloat16 and choice == H_BF16 else H_EXACT


def h_reason(x_dtype: torch.dtype, isa: str, precision: str) -> str:
    """Why :func:`h_precision` chose ``precision`` (the load log's wording)."""
    from vllm_moe_w8.op import native

    if precision == H_BF16:
        return (f"h = SiLU(gate)*up rounded to BF16 before the down projection, as vLLM's BF16 MoE does (BF16 "
                f"activations, {native.ENV_H}=bf16: opt-in, lossier than the exact default)")
    if isa != "avx512bf16":
        return f"h exact (float32: the {isa} variant gains nothing from rounding it)"
    if x_dtype != torch.bfloat16:
        return f"h exact (two BF16 planes, 2^-18 relative: {x_dtype} activations)"
    return f"h exact (two BF16 planes, 2^-18 relative: the default; {native.ENV_H}=bf16 rounds it)"


def describe_path() -> str:
    """The load log's words for what the CPU op will run: the selected variant and h's precision, and why."""
    from vllm_moe_w8.op import native

    isa = native.selected_isa()
    forced = native.ENV_ISA + " set" if os.environ.get(native.ENV_ISA, "auto").strip().lower() not in ("", "auto") else "chosen for this CPU"
    if isa == "torch":
        return f"torch implementation ({native.unavailable_reason('torch')}); weights exact, h float32"
    if isa != "avx512bf16":
        return f"native {isa} kernel ({forced}); weights exact, h float32"
    if native.h_choice() == H_EXACT:
        return f"native avx512bf16 kernel ({forced}); weights exact, h exact (the default; {native.ENV_H}=bf16 rounds it)"
    return (f"native avx512bf16 kernel ({forced}); weights exact; h = SiLU(gate)*up rounded to BF16 for BF16 activations "
            f"as vLLM's BF16 MoE does ({native.ENV_H}=bf16, opt-in), exact for other dtypes")


def fused_moe_native(x, topk_weights, topk_ids, w13, w13_scales, w2, w2_scales, block_n, block_k, code_format,
                     activation="silu", swiglu_limit=0.0, isa: str | None = None, h_mode: str | None = None) -> torch.Tensor:
    """The native kernel, variant ``isa`` (default: the selected one), h precision ``h_mode`` (default:
    :func:`h_precision`; ``"bf16"`` needs avx512bf16); RuntimeError where it is unavailable."""
    from vllm_moe_w8.op import native

    t, h, inter, _ = check_args(x, topk_weights, topk_ids, w13, w13_scales, w2, w2_scales, block_n, block_k, code_format, activation)
    isa = isa or native.selected_isa()
    lib = native.load(isa)
    if lib is None:
        raise RuntimeError(f"native CPU MoE kernel ({isa}) unavailable: {native.unavailable_reason(isa)}")
    if not native_supports(h, inter, block_k, isa):
        raise RuntimeError(f"native CPU MoE kernel ({isa}) does not cover H={h}, I={inter}, block_k={block_k} "
                           "(H, I multiples of 16; block_k of 16 for avx2, of 64 for avx512bf16)")
    h_prec = h_mode or h_precision(x.dtype, isa)
    if h_prec == H_BF16 and isa != "avx512bf16":
        raise ValueError(f"h precision 'bf16' is an avx512bf16 path; the {isa} variant keeps h exact")
    h_planes = 0 if isa == "avx2" else (1 if h_prec == H_BF16 else 2)
    out = torch.zeros(t, h, dtype=torch.float32)
    if t == 0:
        return out.to(x.dtype)
    xf = x.float().contiguous()
    ids = topk_ids.contiguous()
    wts = topk_weights.float().contiguous()
    w13c, w2c = w13.contiguous(), w2.contiguous()
    for codes in (w13c, w2c):  # resident codes in 2 MiB pages, once per tensor (op/hugepages.py)
        got = hugepages.ensure(codes)
        _log_once("hugepages:" + got.split(" ")[0], "neuron-w8 CPU MoE: expert codes in 2 MiB pages (%s=%s): %s "
                  "(first such tensor, %s)", hugepages.ENV, hugepages.choice(), got, tuple(codes.shape))
    s13, s2 = w13_scales.float().contiguous(), w2_scales.float().contiguous()
    bad = ctypes.c_int64(0)
    rc = lib.moe_w8_forward(
        _ptr(xf), X_PLANES[x.dtype], h_planes, t, h, inter, w13.shape[0], _ptr(w13c), _ptr(s13), _ptr(w2c), _ptr(s2),
        _ptr(ids), int(ids.dtype == torch.int32), _ptr(wts), ids.shape[1],
        block_n, block_k, float(swiglu_limit), torch.get_num_threads(), _ptr(out), ctypes.byref(bad),
    )
    if rc == 2:
        raise ValueError(f"topk_ids holds expert id {bad.value} but only {w13.shape[0]} local experts exist (ids must be local; -1 = not on this rank)")
    if rc != 0:
        raise RuntimeError(f"native CPU MoE kernel ({isa}) rejected its arguments (code {rc})")
    return out.to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------


def implementation(h: int, inter: int, block_k: int) -> str:
    """What :func:`fused_moe_cpu` runs for these shapes: ``native-avx512bf16``, ``native-avx2`` or ``torch``."""
    from vllm_moe_w8.op import native

    isa = native.selected_isa()
    if isa == "torch":
        return "torch"
    candidates = [isa] + (["avx2"] if isa == "avx512bf16" and "avx2" in native.host_isas() else [])
    for cand in candidates:
        if native_supports(h, inter, block_k, cand) and native_available(cand):
            return f"native-{cand}"
    return "torch"


def fused_moe_cpu(x, topk_weights, topk_ids, w13, w13_scales, w2, w2_scales, block_n, block_k, code_format,
                  activation="silu", swiglu_limit=0.0) -> torch.Tensor:
    """The MoE op on CPU (see module docstring); returns [T, H] in ``x.dtype``."""
    from vllm_moe_w8.op import native

    args = (x, topk_weights, topk_ids, w13, w13_scales, w2, w2_scales, block_n, block_k, code_format, activation, swiglu_limit)
    h, inter = x.shape[-1], w2.shape[-1]
    impl = implementation(h, inter, block_k)
    if impl.startswith("native-"):
        isa = impl.removeprefix("native-")
        selected = native.selected_isa()
        if isa != selected:
            why = (f"shapes H={h} I={inter} block_k={block_k} not covered" if native_available(selected)
                   else f"build unavailable: {native.unavailable_reason(selected)}")
            _log_once(f"fallback:{selected}:{why}", "neuron-w8 CPU MoE: the %s kernel is not used (%s); %s runs instead",
                      selected, why, isa, level=logging.WARNING)
        h_prec = h_precision(x.dtype, isa)
        _log_once(f"{impl}:{h_prec}:{x.dtype}", "neuron-w8 CPU MoE: native kernel, instruction set %s (CPU flags: %s), "
                  "%d threads, %s activations; %s", isa, " ".join(native.ISAS[isa].cpu_flags), torch.get_num_threads(),
                  str(x.dtype).removeprefix("torch."), h_reason(x.dtype, isa, h_prec))
        return fused_moe_native(*args, isa=isa, h_mode=h_prec)
    selected = native.selected_isa()
    if selected == "torch":
        why = native.unavailable_reason("torch")
    elif native_supports(h, inter, block_k, selected) or not native_available(selected):
        why = f"{selected} build unavailable: {native.unavailable_reason(selected)}"
    else:
        why = f"shapes H={h} I={inter} block_k={block_k} not covered by the {selected} kernel"
    _log_once(f"torch:{why}", "neuron-w8 CPU MoE: torch implementation (exact, dequantises each routed expert per call); "
              "native kernel unavailable: %s", why, level=logging.WARNING)
    return fused_moe_torch(*args)
