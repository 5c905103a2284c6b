"""Small helpers shared by the benchmark scripts: timing, the result table and the JSON record."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def best_of(fn, repeat: int = 5, warmup: int = 1) -> float:
    """Best wall time of ``fn()`` in seconds (the least disturbed run on a noisy machine)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in columns))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx512vbmi",
             "amx_bf16")


def machine_record() -> dict:
    """What every result must carry: the CPU model, the instruction-set flags that choose kernels, the load."""
    import torch

    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("unknown", platform.processor()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {"platform": platform.platform(), "cpu_model": model, "isa": [f for f in ISA_FLAGS if f in flags],
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "loadavg_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def write_json(name: str, payload: dict) -> Path:
    """Write ``benchmarks/results/<name>.json`` with :func:`machine_record` (load taken now, at the end)."""
    RESULTS.mkdir(exist_ok=True)
    payload = {"machine": machine_record(), **payload}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")
    return path
