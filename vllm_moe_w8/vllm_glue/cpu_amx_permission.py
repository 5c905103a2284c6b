"""A narrowly scoped correction for a vLLM CPU bug: its AMX kernels run without the AMX tile permission.

Linux enables Intel AMX tile data (XSTATE component 18, ``XTILEDATA``) per process and only on request:
a process calls ``arch_prctl(ARCH_REQ_XCOMP_PERM, 18)``; until then the first AMX instruction it executes is
trapped and the process dies with SIGILL (Linux ``Documentation/arch/x86/xstate.rst``). vLLM 0.32's CPU build
picks AMX kernels whenever ``torch.cpu._is_amx_tile_supported()`` says the CPU has AMX (bf16 attention:
``vllm/v1/attention/backends/cpu_attn.py`` ``_get_attn_isa`` -> ``"amx"``; bf16 MoE:
``X86CPUUnquantizedExperts`` -> ``cpu_fused_moe`` isa ``"amx"``; ``AMX_MLA``; the bf16 GEMMs of
``vllm/model_executor/layers/utils.py`` ``check_cpu_sgl_kernel``) but never requests the permission. They
work only once something else in the process has asked (oneDNN's AMX GEMM on a long prompt, vLLM's FP8 MoE
kernel), so on an AMX host ``LLM(..., dtype="bfloat16").generate(["Hi"])`` kills the process (measured on
an Intel Xeon with amx_bf16/amx_int8/amx_tile; a 20-token prompt and float32 work), with or without this
plugin's quantization method.

What this module does, and only where it applies (the CPU platform, on a host whose ``/proc/cpuinfo`` lists
``amx_tile``): it requests the permission once per process, through ``torch._C._cpu._init_amx()`` where torch
has it (torch's own request, which oneDNN uses), else through ``arch_prctl`` by ``ctypes``, then reads the
process's permitted features back (``ARCH_GET_XCOMP_PERM``) and logs one line on ``vllm.neuron_w8`` saying
whether XTILEDATA is granted. Nothing else changes: no kernel choice, no numerics. On hosts without AMX it
does nothing (vLLM picks no AMX kernel there). ``VLLM_MOE_W8_CPU_AMX_PERMISSION=0`` turns it off (to
reproduce the bug).

Installed by :func:`install` from the plugin's registration, which vLLM runs in every process it starts
(API server / ``LLM`` process, EngineCore, workers), so unquantised models served in the same environment
are protected too. The permission is process-wide (every thread, including OpenMP's), so one request at
registration is enough. Import-light: neither torch nor vLLM is imported at module import.
"""

from __future__ import annotations

import os
import platform

ENV = "VLLM_MOE_W8_CPU_AMX_PERMISSION"
CPUINFO = "/proc/cpuinfo"
AMX_FLAG = "amx_tile"  # the flag torch.cpu._is_amx_tile_supported() (vLLM's AMX test) reports
XFEATURE_XTILEDATA = 18  # XSTATE component of the AMX tile data
# Linux x86-64 ABI (arch/x86/include/uapi/asm/prctl.h, unistd_64.h)
ARCH_GET_XCOMP_SUPP, ARCH_GET_XCOMP_PERM, ARCH_REQ_XCOMP_PERM = 0x1021, 0x1022, 0x1023
SYS_ARCH_PRCTL = 158

_result: str | None = None  # what install() did in this process (it runs once)


def cpu_flags(path: str = CPUINFO) -> frozenset[str]:
    """The first ``flags`` line of ``/proc/cpuinfo`` as a set (empty where there is none: non-Linux, non-x86)."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def decide(flags: frozenset[str], env_value: str | None, is_cpu_platform: bool, device_type: str = "cpu") -> tuple[bool, str]:
    """(request the permission?, why) from the CPU's flags, ``$VLLM_MOE_W8_CPU_AMX_PERMISSION`` and the platform."""
    if env_value == "0":
        return False, f"disabled by {ENV}=0"
    if not is_cpu_platform:
        return False, f"not needed: platform {device_type!r} is not the CPU platform"
    if AMX_FLAG not in flags:
        return False, f"not needed: this CPU has no AMX ({AMX_FLAG} not in {CPUINFO}), so vLLM picks no AMX kernel"
    return True, f"this CPU has AMX ({AMX_FLAG})"


def _arch_prctl(code: int, arg) -> int:
    """``syscall(SYS_arch_prctl, code, arg)``: 0 on success, -1 on failure (errno set) or where there is no such call."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return -1
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(code), arg)


def _xcomp_mask(code: int) -> int | None:
    import ctypes

    mask = ctypes.c_uint64(0)
    return mask.value if _arch_prctl(code, ctypes.byref(mask)) == 0 else None


def kernel_supports_xtiledata() -> bool:
    """The kernel's own answer (``ARCH_GET_XCOMP_SUPP``): can a process of this host be granted AMX tile data?"""
    mask = _xcomp_mask(ARCH_GET_XCOMP_SUPP)
    return mask is not None and bool(mask >> XFEATURE_XTILEDATA & 1)


def permitted() -> bool:
    """Does this process hold the AMX tile-data permission now (``ARCH_GET_XCOMP_PERM``)?"""
    mask = _xcomp_mask(ARCH_GET_XCOMP_PERM)
    return mask is not None and bool(mask >> XFEATURE_XTILEDATA & 1)


def request_by_syscall() -> bool:
    """``arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)``: True if the kernel granted it (idempotent once granted)."""
    import ctypes

    return _arch_prctl(ARCH_REQ_XCOMP_PERM, ctypes.c_ulong(XFEATURE_XTILEDATA)) == 0


def request() -> str:
    """Request the permission for this process; return how (the caller checks :func:`permitted`)."""
    import torch

    init_amx = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
    if init_amx is not None:
        init_amx()  # torch's request (it also checks the CPU); returns whether the permission is held
        return "torch._C._cpu._init_amx()"
    request_by_syscall()
    return "arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)"


def install() -> str:
    """Request the AMX tile permission where it applies (once per process); return what was done."""
    global _result
    if _result is not None:
        return _result
    from vllm.platforms import current_platform

    wanted, why = decide(cpu_flags(), os.environ.get(ENV), current_platform.is_cpu(), str(current_platform.device_type))
    if not wanted:
        _result = why
        return _result
    how = request()
    granted = permitted()
    _result = ("granted" if granted else "refused by the kernel") + f" ({why}; via {how})"
    from vllm.logger import init_logger

    log = init_logger("vllm.neuron_w8")
    if granted:
        log.info("neuron-w8: requested the AMX tile permission for this process (vLLM's CPU AMX kernels need it and do not "
                 "ask; without it a 1-2 token bf16 prompt dies with SIGILL): granted via %s "
                 "(vllm_moe_w8.vllm_glue.cpu_amx_permission; %s=0 disables)", how, ENV)
    else:
        log.warning("neuron-w8: this CPU has AMX but the kernel did not grant the AMX tile permission (asked via %s): "
                    "vLLM's CPU AMX kernels (bf16 attention and MoE) may die with SIGILL in this process", how)
    return _result
