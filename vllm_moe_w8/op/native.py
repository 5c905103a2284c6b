"""Choose, build (once per instruction set, cached) and load the native CPU MoE kernel in ``csrc/``.

Two variants of the same kernel, one per instruction-set level (:data:`ISAS`):

* ``avx512bf16`` -- ``csrc/moe_avx512bf16.cpp``: E4M3 bytes decoded to BF16 by byte-permute lookups,
  ``vdpbf16ps`` dot products (AVX-512 F/BW/VBMI + AVX512_BF16);
* ``avx2`` -- ``csrc/moe_avx2.cpp``: E4M3 bytes decoded to float32 through F16C, FMA (AVX2 + FMA + F16C).

:func:`selected_isa` picks the best variant this CPU's flags allow, or the one forced by
``VLLM_MOE_W8_CPU_ISA`` (``avx512bf16``, ``avx2``, ``torch`` for the portable torch path, ``auto``); forcing a
variant the CPU cannot run is an error naming the missing flags. ``VLLM_MOE_W8_NATIVE=0`` means ``torch``.

Each variant is a plain C++ shared library (no torch headers) loaded with ctypes; its threads are a team of the
process's OpenMP threads, torch's own pool (``moe_common.h`` ``run_phases``, ``codec/csrc/team.h``). It is compiled at first use by :mod:`vllm_moe_w8.codec.cxx_build`
into ``$TORCH_EXTENSIONS_DIR/vllm_moe_w8`` (default ``~/.cache/torch_extensions``), keyed by a hash of the
sources, flags and compiler, written atomically so concurrent workers can race safely. :func:`load` returns ``None`` (and says why, via
:func:`unavailable_reason`) when no variant fits the CPU, no C++ compiler is found or the build fails; the
caller then uses the portable torch path and logs the reason.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from vllm_moe_w8.codec import cxx_build

CSRC = Path(__file__).with_name("csrc")
ENV_ISA = "VLLM_MOE_W8_CPU_ISA"
# exact (default): h = SiLU(gate)*up exact; bf16 (opt-in): h rounded to bf16 for bf16 activations on avx512bf16.
# Not the default: a tiny bf16 Qwen3.5-MoE served with it misses the model accuracy gate (max |dlogprob| 0.35 vs the
# twin, 0.030 with the exact h; tests/test_models_accuracy.py): not a kernel error (tests/test_cpu_moe_bf16h.py) but one
# last-layer top-k near-tie on the gate's prompts that its one-ulp different hidden state crosses (docs/cpu-path.md).
ENV_H = "VLLM_MOE_W8_CPU_H"
H_CHOICES = ("exact", "bf16")


@dataclass(frozen=True)
class Isa:
    name: str
    source: str
    cpu_flags: tuple[str, ...]  # /proc/cpuinfo flags the code needs
    compile_flags: tuple[str, ...]


ISAS = {  # best first
    "avx512bf16": Isa("avx512bf16", "moe_avx512bf16.cpp", ("avx512f", "avx512bw", "avx512vl", "avx512vbmi", "avx512_bf16", "fma"),
                      ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vbmi", "-mavx512bf16", "-mfma")),
    "avx2": Isa("avx2", "moe_avx2.cpp", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
}
CHOICES = (*ISAS, "torch", "auto")

_libs: dict[str, ctypes.CDLL] = {}
_reasons: dict[str, str] = {}


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's /proc/cpuinfo flags (empty off Linux); read once."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def is_x86_64_linux() -> bool:
    return sys.platform == "linux" and os.uname().machine in ("x86_64", "AMD64")


def missing_flags(isa: str, flags: frozenset[str] | None = None) -> list[str]:
    flags = cpu_flags() if flags is None else flags
    return [f for f in ISAS[isa].cpu_flags if f not in flags]


def host_isas() -> list[str]:
    """The native variants this host can run, best first (empty off x86-64 Linux)."""
    if not is_x86_64_linux():
        return []
    flags = cpu_flags()
    return [name for name in ISAS if not missing_flags(name, flags)]


def selected_isa() -> str:
    """The variant to run: ``VLLM_MOE_W8_CPU_ISA`` if set (validated), else the host's best, else ``torch``."""
    if os.environ.get("VLLM_MOE_W8_NATIVE", "1") == "0":
        return "torch"
    choice = os.environ.get(ENV_ISA, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{ENV_ISA}={choice!r} is not a choice; set it to one of {', '.join(CHOICES)}")
    if choice == "auto":
        best = host_isas()
        return best[0] if best else "torch"
    if choice != "torch":
        if not is_x86_64_linux():
            raise RuntimeError(f"{ENV_ISA}={choice}: the native kernel is x86-64 Linux only; unset it or use torch")
        missing = missing_flags(choice)
        if missing:
            raise RuntimeError(f"{ENV_ISA}={choice}, but this CPU lacks {', '.join(missing)}; "
                               f"unset it (automatic choice) or choose one of {', '.join(host_isas() + ['torch'])}")
    return choice


def h_choice() -> str:
    """``VLLM_MOE_W8_CPU_H`` validated: ``exact`` (default) or ``bf16``."""
    choice = os.environ.get(ENV_H, "exact").strip().lower() or "exact"
    if choice not in H_CHOICES:
        raise ValueError(f"{ENV_H}={choice!r} is not a choice; set it to one of {', '.join(H_CHOICES)}")
    return choice


def unavailable_reason(isa: str | None = None) -> str | None:
    """Why the native kernel is not used for ``isa`` (default: the selected one); None if it loaded."""
    isa = isa or selected_isa()
    if isa == "torch":
        if os.environ.get("VLLM_MOE_W8_NATIVE", "1") == "0":
            return "disabled by VLLM_MOE_W8_NATIVE=0"
        if os.environ.get(ENV_ISA, "auto").strip().lower() == "torch":
            return f"{ENV_ISA}=torch"
        if not is_x86_64_linux():
            return f"native kernel is x86-64 Linux only (this is {sys.platform}/{os.uname().machine})"
        return "CPU lacks " + " / ".join(", ".join(missing_flags(name)) for name in ISAS)
    return _reasons.get(isa)


def cache_dir() -> Path:
    return cxx_build.cache_dir()


def build(isa: str, verbose: bool = False) -> Path:
    """Compile variant ``isa`` unless a cached build matches its sources, flags and compiler; returns the .so."""
    spec = ISAS[isa]
    headers = [*sorted(CSRC.glob("*.h")), cxx_build.TEAM_HEADER]
    return cxx_build.build(CSRC / spec.source, f"moe_{isa}", spec.compile_flags, headers, verbose)


def load(isa: str | None = None):
    """The ctypes library of variant ``isa`` (default: :func:`selected_isa`), or None (see unavailable_reason)."""
    isa = isa or selected_isa()
    if isa == "torch":
        return None
    if isa in _libs or isa in _reasons:
        return _libs.get(isa)
    import torch  # noqa: F401  -- torch's libgomp loaded first (the library is built with -fopenmp)

    try:
        lib = ctypes.CDLL(str(build(isa)))
    except Exception as exc:  # compiler missing, build error, load error: the caller falls back and says why
        _reasons[isa] = f"{type(exc).__name__}: {exc}"
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn = lib.moe_w8_forward
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ptr, ctypes.c_int, ctypes.c_int, i64, i64, i64, i64,  # x, x_planes, h_planes, T, H, I, E
        ptr, ptr, ptr, ptr,  # w13, w13_s, w2, w2_s
        ptr, ctypes.c_int, ptr, i64,  # topk_ids, ids_are_int32, topk_weights, k
        i64, i64, ctypes.c_float, ctypes.c_int,  # bn, bk, swiglu_limit, nthreads
        ptr, ctypes.POINTER(ctypes.c_int64),  # out, bad_id
    ]
    _libs[isa] = lib
    return lib


def reset() -> None:
    """Forget loaded variants and failure reasons (tests; a rebuilt cache is picked up on the next load)."""
    _libs.clear()
    _reasons.clear()
