"""Table of docs/cpu-path.md: end to end on vLLM's CPU build, neuron-w8 vs the BF16 twin (``e2e-*.json``)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.readme_tables import markdown_table

LABELS = {"w8": "neuron-w8 (repack at load)", "w8-conv": "neuron-w8, pre-converted",
          "w8-vllmfp8": "neuron-w8, experts on vLLM's FP8 kernel (`VLLM_MOE_W8_CPU_KERNEL=vllm-fp8`)",
          "w8-vllmfp8-linear": "neuron-w8, experts and other FP8 layers on vLLM's FP8 kernels (`..._CPU_KERNEL`, `..._CPU_LINEAR=vllm-fp8`)", "bf16-twin": "BF16 twin (vLLM unquantised)",
          "vllm-fp8": "vLLM's own fp8 (`quantization=\"fp8\"`, no plugin)"}


def render(results_dir: Path) -> str:
    parts = []
    for path in sorted(results_dir.glob("e2e-*.json"), key=lambda p: ("-forced" in p.stem, p.stem)):
        data = json.loads(path.read_text())
        m, a = data["machine"], data["args"]
        parts.append(
            f"`{path.name}`: {m['cpu_model']}, ISA flags {' '.join(m['isa'])}, load average "
            f"{' / '.join(f'{v:.1f}' for v in m['loadavg_1_5_15'])} (1/5/15 min, at the end). Qwen3-MoE layout, "
            f"{a['layers']} layers, H {a['hidden']}, I {a['inter']}, E {a['experts']}, top-{a['top_k']}; "
            f"{'torch.compile' if a['compile'] else 'eager'}; {a['max_tokens']} new tokens per sequence; "
            f"{a.get('repeats', 1)} round(s) of all variants, alternating, medians. "
            f"In brackets: ratio to the twin (goal >= {data['goal_vs_twin']}x tokens/s at every batch).\n")
        batches = a["batches"]
        rows = []
        for name, r in data["variants"].items():
            cells = [LABELS.get(name, name), r.get("w8_cpu_impl") or "—", f"{r['startup_s']:.1f} s"]
            for b in batches:
                ratio = r.get("vs_twin", {}).get(str(b))
                mark = "" if ratio is None else f" ({ratio:.2f}x{'' if ratio >= data['goal_vs_twin'] else ', **below goal**'})"
                cells.append(f"{r['tokens_per_s'][str(b)]:.1f}{mark}")
            ratio = r.get("expert_bytes_vs_twin")
            cells.append(f"{r['expert_bytes'] / 1e6:.0f} MB" + ("" if ratio is None else f" ({ratio:.2f}x)"))
            rows.append(cells)
        failed = data.get("not_started", {})
        for name in failed:
            rows.append([LABELS.get(name, name), "—", "did not start"] + ["—"] * len(batches) + ["—"])
        table = markdown_table(["variant", "CPU MoE", "start-up"] + [f"tok/s batch {b}" for b in batches]
                               + ["expert memory"], rows)
        for name, r in failed.items():
            table += f"\n{LABELS.get(name, name)} did not start on this CPU (exit {r['exit']}): `{r['reason']}`\n"
        parts.append(table)
    return "\n".join(parts) if parts else "(no e2e-*.json recorded yet)\n"
