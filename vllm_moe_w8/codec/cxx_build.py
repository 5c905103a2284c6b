"""Compile a small C++ source (no torch headers) into a shared library at first use, cached on disk.

Used by the codec's native repack (:mod:`vllm_moe_w8.codec.repack_native`) and the op's native kernel
(:mod:`vllm_moe_w8.op.native`). The library goes to ``$TORCH_EXTENSIONS_DIR/vllm_moe_w8`` (default
``~/.cache/torch_extensions``), named by a hash of the sources, the flags and the compiler, and is written
atomically so concurrent workers can race safely. OpenMP code shares the libgomp torch loaded (same soname):
import torch before loading a library.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Shared by every library: their threads are a team of the process's OpenMP threads (see the header).
TEAM_HEADER = Path(__file__).with_name("csrc") / "team.h"
COMMON_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-fno-math-errno")


def cache_dir() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    return Path(root) / "vllm_moe_w8"


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler (g++/c++) on PATH; install g++ or set CXX")
    return cxx


def build(source: Path, name: str, extra_flags=(), headers=(), verbose: bool = False) -> Path:
    """Compile ``source`` (with ``headers`` in the cache key) unless a matching build is cached; returns the .so."""
    cxx = compiler()
    flags = [*COMMON_FLAGS, *extra_flags]
    digest = hashlib.sha256(" ".join(flags).encode() + cxx.encode())
    for path in sorted([Path(source), *map(Path, headers)]):
        digest.update(path.name.encode() + path.read_bytes())
    target = cache_dir() / f"{name}_{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [cxx, *flags, str(source), "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"building {Path(source).name} failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
        if verbose:
            print(" ".join(cmd), file=sys.stderr)
        os.replace(tmp, target)  # atomic: a concurrent builder either sees nothing or the whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def team_cpus(lib, reset: bool = False) -> frozenset[int]:
    """The CPUs (ids below 64) the threads of ``lib``'s teams ran on since the last reset (``team.h``)."""
    import ctypes

    fn = lib.team_cpus_seen
    fn.restype, fn.argtypes = ctypes.c_uint64, [ctypes.c_int]
    mask = fn(1 if reset else 0)
    return frozenset(i for i in range(64) if mask >> i & 1)
