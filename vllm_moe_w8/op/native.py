"""Build (once, cached) and call the native CPU MoE kernel ``csrc/cpu_moe_kernel.cpp``.

The kernel is a plain C++ shared library (no torch headers: it builds in about a second with g++),
loaded with ctypes; its OpenMP threads come from the libgomp torch already loaded. It is compiled
at first use into ``$TORCH_EXTENSIONS_DIR/vllm_moe_w8`` (default ``~/.cache/torch_extensions``),
keyed by a hash of the source and flags, and written atomically so concurrent workers can race safely.

:func:`load` returns ``None`` (and says why, via :func:`unavailable_reason`) when the CPU lacks
AVX2/FMA/F16C, no C++ compiler is found, the build fails, or ``VLLM_MOE_W8_NATIVE=0`` is set; the
caller then uses the portable torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("csrc") / "cpu_moe_kernel.cpp"
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fno-math-errno"]
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")

_lib = None
_reason: str | None = None
_tried = False


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (None if it loaded or was not tried)."""
    return _reason


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cache_dir() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    return Path(root) / "vllm_moe_w8"


def build(verbose: bool = False) -> Path:
    """Compile the kernel if no cached build matches the source and flags; returns the .so path."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise RuntimeError("no C++ compiler (g++/c++) on PATH; install g++ or set CXX")
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join(FLAGS).encode() + compiler.encode()).hexdigest()[:16]
    out_dir = cache_dir()
    target = out_dir / f"cpu_moe_kernel_{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        cmd = [compiler, *FLAGS, str(SOURCE), "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
        if verbose:
            print(" ".join(cmd), file=sys.stderr)
        os.replace(tmp, target)  # atomic: a concurrent builder either sees nothing or the whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load():
    """The ctypes library, or None when the native kernel cannot run here (see unavailable_reason)."""
    global _lib, _reason, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("VLLM_MOE_W8_NATIVE", "1") == "0":
        _reason = "disabled by VLLM_MOE_W8_NATIVE=0"
        return None
    if sys.platform != "linux" or os.uname().machine not in ("x86_64", "AMD64"):
        _reason = f"native kernel is x86-64 Linux only (this is {sys.platform}/{os.uname().machine})"
        return None
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        _reason = f"CPU lacks {', '.join(missing)}"
        return None
    import torch  # noqa: F401  -- torch's libgomp must be loaded first so the kernel shares its OpenMP runtime

    try:
        lib = ctypes.CDLL(str(build()))
    except Exception as exc:  # compiler missing, build error, load error: fall back, say why
        _reason = f"{type(exc).__name__}: {exc}"
        return None
    i64, u8p = ctypes.c_int64, ctypes.c_void_p
    fn = lib.moe_w8_forward
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.c_void_p, i64, i64, i64, i64,  # x, T, H, I, E
        u8p, ctypes.c_void_p, u8p, ctypes.c_void_p,  # w13, w13_s, w2, w2_s
        ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, i64,  # topk_ids, ids_are_int32, topk_weights, k
        i64, i64, ctypes.c_float, ctypes.c_int,  # bn, bk, swiglu_limit, nthreads
        ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64),  # h scratch, out, bad_id
    ]
    _lib = lib
    return _lib
