"""Transparent huge pages for the resident expert codes the native CPU kernel streams.

Decode (a few tokens) is memory-bound: every call reads the routed experts' codes once, 3 MB per expert at
Qwen3.5-35B-A3B width, from a different place each layer. In 4 KiB pages that is one TLB miss and one hardware
prefetch restart per 4 KiB (the prefetchers stop at page boundaries); in 2 MiB pages neither.
``benchmarks/bench_moe_op.py`` records the op on collapsed codes (``w8``) and on a copy left in 4 KiB pages
(``w8_4k``) side by side: on the loaded AMD EPYC here 0.96-1.07x at T <= 8 on one thread and 1.02-1.13x on two (a
first A/B of the kernel alone at a lower load gave 1.15-1.19x; the gain shrinks when other jobs saturate memory).

:func:`ensure` is called by the op with each expert tensor it is about to read; the first time it sees a tensor it
asks Linux to back the 2 MiB-aligned interior of its memory with huge pages (``madvise(MADV_HUGEPAGE)``, then
``MADV_COLLAPSE``, Linux >= 6.1, which collapses the already-written pages at once; without it ``khugepaged``
collapses them later, at its own pace). Nothing changes in the bytes, the layout or the tensor: only how the
kernel maps them. ``VLLM_MOE_W8_CPU_HUGEPAGES``: ``collapse`` (default), ``advise`` (MADV_HUGEPAGE only: no
copy now, khugepaged later) or ``off``. The one-time cost of ``collapse`` is a copy of the codes by the kernel
(recorded here: 2.1 s for 768 MiB under load, paid once per tensor, at the first forward -- vLLM's warm-up). Where THP is
disabled (``/sys/kernel/mm/transparent_hugepage/enabled`` = never), off Linux, or for memory Linux cannot collapse
(file-backed), the call changes nothing and :func:`status` says why.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time

import torch

ENV = "VLLM_MOE_W8_CPU_HUGEPAGES"
CHOICES = ("collapse", "advise", "off")
HUGE = 2 << 20  # x86-64 PMD page
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25

_seen: dict[tuple[int, int], str] = {}
_lock = threading.Lock()
_stats = {"tensors": 0, "bytes": 0, "seconds": 0.0}


def choice() -> str:
    """``VLLM_MOE_W8_CPU_HUGEPAGES`` validated (default ``collapse``)."""
    value = os.environ.get(ENV, "collapse").strip().lower() or "collapse"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r} is not a choice; set it to one of {', '.join(CHOICES)}")
    return value


def thp_mode() -> str:
    """The system's THP setting (``always``, ``madvise``, ``never``), or ``unavailable``."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "unavailable"
    return text[text.index("[") + 1:text.index("]")] if "[" in text else text.strip()


def aligned_span(ptr: int, nbytes: int) -> tuple[int, int]:
    """The 2 MiB-aligned interior [lo, hi) of [ptr, ptr + nbytes) (lo == hi: none)."""
    lo = (ptr + HUGE - 1) // HUGE * HUGE
    hi = (ptr + nbytes) // HUGE * HUGE
    return lo, max(lo, hi)


def _madvise(lo: int, length: int, advice: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(length), advice) == 0:
        return 0
    return ctypes.get_errno() or -1


def ensure(t: torch.Tensor, mode: str | None = None) -> str:
    """Back ``t``'s memory with huge pages once (see module docstring); returns what happened to it."""
    mode = choice() if mode is None else mode
    key = (t.data_ptr(), t.nbytes)
    if key in _seen:
        return _seen[key]
    with _lock:
        if key in _seen:
            return _seen[key]
        if mode == "off":
            result = f"off ({ENV}=off)"
        elif sys.platform != "linux" or t.device.type != "cpu" or not t.is_contiguous():
            result = "not applicable (Linux CPU contiguous tensors only)"
        elif thp_mode() in ("never", "unavailable"):
            result = f"not available (transparent huge pages: {thp_mode()})"
        else:
            lo, hi = aligned_span(t.data_ptr(), t.nbytes)
            if hi == lo:
                result = "too small (no whole 2 MiB page inside)"
            else:
                start = time.perf_counter()
                err = _madvise(lo, hi - lo, MADV_HUGEPAGE)
                if err:
                    result = f"madvise(MADV_HUGEPAGE) failed (errno {err})"
                elif mode == "collapse":
                    err = _madvise(lo, hi - lo, MADV_COLLAPSE)
                    result = (f"collapsed {(hi - lo) >> 20} MiB" if not err
                              else f"advised {(hi - lo) >> 20} MiB; MADV_COLLAPSE failed (errno {err}): khugepaged later")
                else:
                    result = f"advised {(hi - lo) >> 20} MiB (khugepaged collapses it later)"
                if not err or mode == "collapse":
                    _stats["tensors"] += 1
                    _stats["bytes"] += hi - lo
                    _stats["seconds"] += time.perf_counter() - start
        _seen[key] = result
        return result


def status() -> dict:
    """Tensors and bytes advised so far, time spent, the setting and the system's THP mode."""
    return {**_stats, "mode": choice(), "thp": thp_mode()}


def huge_bytes_of_process() -> int:
    """AnonHugePages of this process (bytes; 0 where unknown): what Linux actually mapped in 2 MiB pages."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset() -> None:
    """Forget which tensors were seen and the totals (tests: a freed tensor's address may be reused)."""
    _seen.clear()
    _stats.update(tensors=0, bytes=0, seconds=0.0)
