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


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    import torch

    payload = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        **payload,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")
    return path
