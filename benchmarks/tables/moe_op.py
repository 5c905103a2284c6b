"""README table: one MoE layer, neuron-w8's CPU op vs vLLM's CPU BF16 fused MoE (``moe_op-*.json``)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.readme_tables import markdown_table


def _files(results_dir: Path) -> list[Path]:
    """Host-chosen variants first, then forced ones, each alphabetical."""
    return sorted(results_dir.glob("moe_op-*.json"), key=lambda p: ("-forced" in p.stem, p.stem))


def render(results_dir: Path) -> str:
    parts = []
    for path in _files(results_dir):
        data = json.loads(path.read_text())
        m = data["machine"]
        load = data.get("loadavg_at_start") or m["loadavg_1_5_15"]
        how = "forced on this machine" if data["forced"] else "chosen for this CPU"
        if data.get("threads_forced"):
            how += f", both implementations limited to {data['threads_forced']} thread(s)"
        for model in data["models"]:
            parts.append(
                f"`{path.name}`: **{data['w8_impl']}** ({how}); {m['cpu_model']}, {m['torch_threads']} threads, ISA flags "
                f"{' '.join(m['isa'])}; load average {load[0]:.1f} at start, {m['loadavg_1_5_15'][0]:.1f} at end. "
                f"{model['model']} shape (H {model['H']}, I {model['I']}, E {model['E']}, top-{model['top_k']}); expert "
                f"memory w8 / vLLM BF16 = {model['memory_ratio']:.3f} (goal <= {model['memory_goal']}: "
                f"{'met' if model['memory_goal_met'] else 'NOT met'})."
                + "".join(f" Check at T={r['T']} ({r.get('check_dtype', 'bfloat16')} in and out): max |w8 - exact torch "
                          f"path| / max |exact| = {r['w8_max_rel_err_vs_exact_torch']:.1e}."
                          for r in model["rows"] if "w8_max_rel_err_vs_exact_torch" in r)
                + "\n")
            rows = [[r["T"], r["reps"], f"{r['w8_ms']:.2f}", f"{r['vllm_ms']:.2f}", f"{r['w8_vs_vllm']:.2f}x",
                     f"{r['w8_vs_vllm_cpu']:.2f}x", f">= {r['goal']}x: {'met' if r['goal_met'] else '**not met**'}"]
                    for r in model["rows"]]
            parts.append(markdown_table(["T", "calls", "neuron-w8 ms", "vLLM BF16 ms", "w8/vLLM (wall)",
                                         "w8/vLLM (CPU time)", "goal (wall)"], rows))
    return "\n".join(parts) if parts else "(no moe_op-*.json recorded yet)\n"
