"""Table of docs/cpu-path.md: repack throughput next to a plain copy of the same bytes (``repack-*.json``, one per
host)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.readme_tables import markdown_table


def render(results_dir: Path) -> str:
    parts = []
    for path in sorted(results_dir.glob("repack-*.json")):
        data = json.loads(path.read_text())
        m = data["machine"]
        e, n, k = data["shape"]
        parts.append(
            f"`{path.name}`: {m['cpu_model']}, ISA flags {' '.join(m['isa'])}; load average "
            f"{data['loadavg_at_start'][0]:.1f} at start, {m['loadavg_1_5_15'][0]:.1f} at end. {e} experts x [{n}, {k}] "
            f"of checkpoint-like codes ({data['blocks_shifted']} of {data['blocks']} 128x128 blocks shifted by pow2), "
            f"one repack call per expert; medians of {data['rounds']} interleaved rounds; goal: pow2 >= "
            f"{data['goal']}x the copy on every path and thread count.\n")
        rows = [[r["threads"], r["what"], f"{r['ms']:.2f}", f"{r['GB/s']:.2f}", f"{r['x copy']:.2f}x",
                 r["goal"].replace("NOT met", "**not met**") or "—"] for r in data["rows"]]
        parts.append(markdown_table(["threads", "what", "ms", "GB/s", "x copy", "goal"], rows))
    return "\n".join(parts) if parts else "(no repack-*.json recorded yet)\n"
