"""Table of docs/cpu-path.md: one MoE layer, neuron-w8's CPU op vs vLLM's CPU kernels for the same checkpoint
(``moe_op-*.json``).

One block per JSON file (one machine variant / forced ISA / thread count each). Files recorded before the
comparison with the fastest vLLM kernel (only ``vllm_ms``: vLLM BF16 "vec") are rendered with that one column.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.readme_tables import markdown_table

NAMES = {"vllm_fp8": "vLLM FP8", "vllm_bf16_amx": "vLLM BF16 amx", "vllm_bf16_vec": "vLLM BF16 vec",
         "vllm_fp8_noamx": "vLLM FP8 kernel (vLLM picks it only with AMX)"}
NOT_PICKED = "vllm_fp8_noamx"  # measured, never the fastest vLLM kernel for the checkpoint (bench_moe_op)


def _files(results_dir: Path) -> list[Path]:
    """Host-chosen variants first, then forced ones, each alphabetical."""
    return sorted(results_dir.glob("moe_op-*.json"), key=lambda p: ("-forced" in p.stem, p.stem))


def _legacy(path: Path, data: dict, model: dict) -> str:
    rows = [[r["T"], r["reps"], f"{r['w8_ms']:.2f}", f"{r['vllm_ms']:.2f}", f"{r['w8_vs_vllm']:.2f}x",
             f"{r['w8_vs_vllm_cpu']:.2f}x"] for r in model["rows"]]
    return markdown_table(["T", "calls", "neuron-w8 ms", "vLLM BF16 vec ms", "w8/vLLM (wall)", "w8/vLLM (CPU time)"], rows)


def _header(path: Path, data: dict, model: dict) -> str:
    m = data["machine"]
    load = data.get("loadavg_at_start") or m["loadavg_1_5_15"]
    how = "forced on this machine" if data["forced"] else "chosen for this CPU"
    if data.get("threads_forced"):
        how += f", every implementation limited to {data['threads_forced']} thread(s)"
    if data.get("omp_bind", {}).get("mode") == "vllm":
        how += f"; OpenMP threads bound one per CPU as vLLM's CPU worker binds them (OMP_PLACES {data['omp_bind']['OMP_PLACES']})"
    elif "omp_bind" in data:
        how += "; OpenMP threads unbound"
    if "library" in data.get("vllm", {}):
        how += f"; vLLM's kernel library {data['vllm']['library']}"
    text = (f"`{path.name}`: **{data['w8_impl']}** ({how}); {m['cpu_model']}, {m['torch_threads']} threads, ISA flags "
            f"{' '.join(m['isa'])}; load average {load[0]:.1f} at start, {m['loadavg_1_5_15'][0]:.1f} at end. "
            f"{model['model']} shape (H {model['H']}, I {model['I']}, E {model['E']}, top-{model['top_k']}); expert "
            f"memory w8 / BF16 = {model['memory_ratio']:.3f} (goal <= {model['memory_goal']}: "
            f"{'met' if model['memory_goal_met'] else 'NOT met'}).")
    if "vllm" in data:
        v = data["vllm"]
        text += (f" vLLM here: FP8 MoE {v['fp8']}; BF16 MoE isa `{v['bf16_isa']}` ({v['bf16_isa_reason']}). "
                 f"neuron-w8's h: {model['w8_h_reason']}.")
    if "hugepages" in model:
        hp = model["hugepages"]
        text += (f" Resident codes in 2 MiB pages: {hp['mode']} (THP {hp['thp']}; {hp['anon_huge_bytes'] / 2**20:.0f} MiB "
                 f"of the process in huge pages, codes {hp['codes_bytes'] / 2**20:.0f} MiB).")
    if "check" in model:
        c = model["check"]
        errs = "; ".join(f"{n}: {e:.1e}" for n, e in c["errors"].items())
        text += f" Error vs float64 at T={c['T']} (BF16 in and out unless stated; {c['metric']}): {errs}."
    for r in model["rows"]:  # older records: one check row
        if "w8_max_rel_err_vs_exact_torch" in r:
            text += (f" Check at T={r['T']} ({r.get('check_dtype', 'bfloat16')} in and out): max |w8 - exact torch "
                     f"path| / max |exact| = {r['w8_max_rel_err_vs_exact_torch']:.1e}.")
    return text + "\n"


def _table(data: dict, model: dict) -> str:
    kernels = list(data["kernels"])
    exact = any("w8_exact_ms" in r for r in model["rows"])
    bf16 = "vllm_bf16_amx" if data["amx"] else "vllm_bf16_vec"
    small = any("w8_4k_ms" in r for r in model["rows"])
    head = ["T", "calls", "neuron-w8 ms"] + (["w8 exact-h ms"] if exact else []) + (["w8, codes in 4 KiB pages ms (time / w8's)"] if small else [])
    head += [f"{NAMES.get(k, k)} ms" for k in kernels]
    head += ["w8 / fastest vLLM (wall)", "(CPU time)", "goal >= 1.0x"] + ([] if data["amx"] else ["w8 / vLLM BF16, goal >= 1.3x at T <= 8"])
    head += ["w8 / vLLM FP8 kernel (not picked here)"] if NOT_PICKED in kernels else []
    rows = []
    for r in model["rows"]:
        cells = [r["T"], r["reps"], f"{r['w8_ms']:.2f}"] + ([f"{r['w8_exact_ms']:.2f}"] if exact else [])
        cells += [f"{r['w8_4k_ms']:.2f} ({r['w8_4k_ms'] / r['w8_ms']:.2f}x)"] if small else []
        cells += [f"{r[f'{k}_ms']:.2f}" for k in kernels]
        cells += [f"{r['w8_vs_fastest']:.2f}x ({NAMES.get(r['fastest_vllm'], r['fastest_vllm'])})",
                  f"{r['w8_vs_fastest_cpu']:.2f}x", "met" if r["goal_fastest_met"] else "**not met**"]
        if not data["amx"]:
            ratio = f"{r[f'w8_vs_{bf16}']:.2f}x"
            goal = r.get("goal_bf16_small_t_met")
            cells.append(ratio + ("" if goal is None else (": met" if goal else ": **not met**")))
        cells += [f"{r[f'w8_vs_{NOT_PICKED}']:.2f}x"] if NOT_PICKED in kernels else []
        rows.append(cells)
    return markdown_table(head, rows)


def render(results_dir: Path) -> str:
    parts = []
    for path in _files(results_dir):
        data = json.loads(path.read_text())
        for model in data["models"]:
            parts.append(_header(path, data, model))
            parts.append(_table(data, model) if "kernels" in data else _legacy(path, data, model))
    return "\n".join(parts) if parts else "(no moe_op-*.json recorded yet)\n"
