"""The pow2 repack's native body (``csrc/repack_pow2.cpp``): one read and one write per byte, OpenMP threads.

:func:`pow2` returns the halved-or-copied bytes with each tile's largest magnitude code and count of rounded
values, or ``None`` where the native library cannot be used (then :mod:`vllm_moe_w8.codec.fp8` runs its numpy
path, the same bytes; :func:`unavailable_reason` says why, and the first such repack logs it).
``VLLM_MOE_W8_REPACK=numpy`` forces the numpy path; ``auto`` (default) uses the native one where it builds.
Built at first use with :mod:`vllm_moe_w8.codec.cxx_build` (plain C++ vectorised by the compiler, with
``-mavx2`` where ``/proc/cpuinfo`` lists avx2, else the x86-64 baseline).
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import numpy as np
import torch

from vllm_moe_w8.codec import cxx_build

logger = logging.getLogger("vllm.vllm_moe_w8.codec.repack")
ENV = "VLLM_MOE_W8_REPACK"
CHOICES = ("auto", "numpy")
SOURCE = Path(__file__).with_name("csrc") / "repack_pow2.cpp"
_state: dict[str, object] = {}


def choice() -> str:
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r} is not a choice; set it to one of {', '.join(CHOICES)}")
    return value


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx2" in line for line in f)
    except OSError:
        return False


def _load():
    if "lib" in _state or "reason" in _state:
        return _state.get("lib")
    try:
        flags, name = (("-pthread", "-mavx2"), "repack_pow2_avx2") if _has_avx2() else (("-pthread",), "repack_pow2")
        lib = ctypes.CDLL(str(cxx_build.build(SOURCE, name, flags, [cxx_build.TEAM_HEADER])))
    except Exception as exc:  # no compiler, build or load error: numpy serves, and says why once
        _state["reason"] = f"{type(exc).__name__}: {exc}"
        logger.warning("neuron-w8 repack: native pow2 repack unavailable (%s); the numpy path runs (same bytes, slower)",
                       _state["reason"])
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.repack_pow2.restype = None
    lib.repack_pow2.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, ptr, ctypes.c_int]
    _state["lib"] = lib
    return lib


def available() -> bool:
    return choice() == "auto" and _load() is not None


def unavailable_reason() -> str | None:
    if choice() == "numpy":
        return f"{ENV}=numpy"
    _load()
    return _state.get("reason")  # type: ignore[return-value]


def reset() -> None:
    """Forget the loaded library and any failure (tests)."""
    _state.clear()


def pow2(c: np.ndarray, bn: int, bk: int):
    """(out bytes [n, k], tile_max uint8 [gn, gk], rounded int64 [gn, gk]) for contiguous uint8 ``c``, or None."""
    if choice() != "auto":
        return None
    lib = _load()
    if lib is None:
        return None
    n, k = c.shape
    gn, gk = -(-n // bn), -(-k // bk)
    out = np.empty_like(c)
    tile_max = np.empty((gn, gk), dtype=np.uint8)
    rounded = np.empty((gn, gk), dtype=np.int64)
    lib.repack_pow2(c.ctypes.data, out.ctypes.data, n, k, bn, bk, tile_max.ctypes.data, rounded.ctypes.data,
                    torch.get_num_threads())
    return out, tile_max, rounded
