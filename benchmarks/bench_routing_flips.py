"""Where the served tiny bf16 Qwen3.5-MoE's prompt logprobs differ from its dequantised twin's, and why: routing flips.

Serves the tiny Qwen3.5-MoE FP8 checkpoint (``tiny_models``, the accuracy gate's ``qwen3.5-moe-block`` case) with
neuron-w8 and the exact h, with the BF16 h (``VLLM_MOE_W8_CPU_H=bf16``), and its twin with vLLM's own ``vec`` MoE,
one engine per run, each in its own child process (engine core in-process). Every MoE call's ``topk_ids`` is
recorded (the op's and vLLM's ``cpu_fused_moe``), so each prompt logprob is classed by whether the last MoE layer's
top-k set at the position that predicts it is the twin's. Prompt sets: the gate's own prompts
(``tests/test_models_accuracy.PROMPTS``) first, then ``--sets`` random 3-prompt sets of common words.

Writes ``benchmarks/results/routing_flips-qwen35.json``.

    .venv/bin/python -m benchmarks.bench_routing_flips --sets 12
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the of and to in is was for on that with as by at from his her an which or be are this had not but expert "
         "model token route layer memory paris france world quick brown fox lazy dog capital mixture many few").split()
RUNS = ("twin", "exact", "bf16")
GATE = 0.1  # tests/test_models_accuracy.LOGPROB_ATOL_BF16


def prompt_sets(n: int) -> list[list[str]]:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_models_accuracy import PROMPTS

    rng = random.Random(1)
    return [list(PROMPTS)] + [[" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 20))) for _ in range(3)]
                              for _ in range(n)]


def child(run: str, model: str, sets_path: str, out_path: str) -> None:
    """One engine: prompt logprobs and every MoE call's topk_ids, per prompt set."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_MOE_W8_CPU_H"] = "bf16" if run == "bf16" else "exact"
    sys.path.insert(0, str(ROOT / "tests"))
    import _models_runner as runner
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    from vllm_moe_w8.op import cpu as op_cpu

    ids_log: list = []
    native, vec = op_cpu.fused_moe_native, cpu_moe.cpu_fused_moe

    def native_spy(*a, **kw):
        ids_log.append(a[2].tolist())
        return native(*a, **kw)

    def vec_spy(*a, **kw):
        ids_log.append(a[7].tolist())
        return vec(*a, **kw)

    op_cpu.fused_moe_native, cpu_moe.cpu_fused_moe = native_spy, vec_spy
    runner._pin_moe_isa("vec" if run == "twin" else None)
    kw = dict(max_model_len=128, enforce_eager=True, gpu_memory_utilization=0.05, seed=0, dtype="bfloat16")
    if run != "twin":
        kw["quantization"] = "neuron-w8"
    llm = LLM(model=model, **kw)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    res = []
    for prompts in json.loads(Path(sets_path).read_text()):
        ids_log.clear()
        outs = llm.generate(prompts, params)  # one prefill batch: one call per MoE layer
        res.append({"lp": [runner._prompt_logprobs(o) for o in outs], "ids": list(ids_log),
                    "lens": [len(o.prompt_token_ids) for o in outs]})
    Path(out_path).write_text(json.dumps(res))


def analyse(runs: dict) -> dict:
    """Per neuron-w8 run: per-set max |dlogprob|, positions whose last-layer top-k differs, split statistics."""
    twin = runs["twin"]
    out = {}
    for name in ("exact", "bf16"):
        per_set, flipped, clean = [], [], []
        for mine, ref in zip(runs[name], twin):
            last_mine, last_ref = mine["ids"][-1], ref["ids"][-1]
            pos, worst = 0, 0.0
            for qa, ta, n in zip(mine["lp"], ref["lp"], ref["lens"]):
                for j, (a, b) in enumerate(zip(qa, ta)):  # logprob of token j + 1, predicted at position j
                    d = abs(a - b)
                    worst = max(worst, d)
                    (flipped if set(last_mine[pos + j]) != set(last_ref[pos + j]) else clean).append(d)
                pos += n
            per_set.append(worst)
        out[name] = {"per_set_max": per_set, "sets_over_gate": sum(m > GATE for m in per_set),
                     "flipped_positions": len(flipped), "flipped_max": max(flipped, default=0.0),
                     "clean_positions": len(clean), "clean_max": max(clean), "clean_mean": sum(clean) / len(clean)}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", type=int, default=12, help="random prompt sets after the gate's own")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(*a.child)
    import torch

    from benchmarks.common import write_json
    from vllm_moe_w8 import tiny_models

    work = Path(tempfile.mkdtemp(prefix="routing_flips-"))
    ckpt = tiny_models.write_checkpoint(work / "q35", "Qwen3_5MoeForConditionalGeneration", fmt="block",
                                        scale_dtype=torch.bfloat16)
    twin = tiny_models.write_twin(ckpt, work / "q35-twin", dtype=torch.float32)
    sets_path = work / "sets.json"
    sets_path.write_text(json.dumps(prompt_sets(a.sets)))
    runs = {}
    for run in RUNS:
        out = work / f"{run}.json"
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
        subprocess.run([sys.executable, "-m", "benchmarks.bench_routing_flips", "--child", run,
                        str(twin if run == "twin" else ckpt), str(sets_path), str(out)], check=True, cwd=ROOT, env=env,
                       stdout=subprocess.DEVNULL)
        runs[run] = json.loads(out.read_text())
    result = analyse(runs)
    for name, r in result.items():
        print(f"{name}: per-set max |dlogprob| (set 0 = the gate's prompts) "
              f"{' '.join(f'{m:.3f}' for m in r['per_set_max'])}; sets over {GATE}: {r['sets_over_gate']}/"
              f"{len(r['per_set_max'])}; last-layer top-k differs from the twin's at {r['flipped_positions']} positions "
              f"(max {r['flipped_max']:.3f}); elsewhere max {r['clean_max']:.3f}, mean {r['clean_mean']:.4f} "
              f"over {r['clean_positions']}")
    write_json("routing_flips-qwen35", {"gate": GATE, "sets": 1 + a.sets, "runs": result})


if __name__ == "__main__":
    main()
