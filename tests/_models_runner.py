"""Child process for the end-to-end model tests: runs vLLM's ``LLM`` on one or more checkpoints in turn
and writes what the tests judge (prompt logprobs, greedy tokens, errors) to a JSON file.

Run as ``python _models_runner.py ARGS.json OUT.json``. ARGS: {"runs": [{"name", "model", "llm": {...},
"dense_mla": bool, "rope_fix": bool}], "prompts": [str], "prompt_sets": [[str]], "max_tokens": int, "max_model_len": int}.
Every run is independent: a run that fails records its error and the next one still starts. Results are written
after every run, so a child that aborts at shutdown (vLLM's CPU build at TP=2) has already delivered them.

``prompt_sets`` (optional): after ``prompts``, each set is one more ``generate`` call, recorded under ``"sets"``
(prompt logprobs per prompt). With the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which the
tests set) every prompt of one call is queued before the first engine step, so each call is scheduled as one batch,
the same way every time. ``"rope_fix": false`` turns vllm_moe_w8.cpu_rope_fix's correction off for that run (the
engine core must be in-process for it to reach the model).
"""

from __future__ import annotations

import gc
import json
import math
import sys
import traceback


def dense_mla(cfg):
    """hf_overrides for GLM-5 on CPU: the same model without the DSA indexer (dense MLA).

    vLLM's CPU build refuses sparse (DSA) attention. While a sequence is no longer than ``index_topk``
    the indexer selects every token, so DSA attention equals dense MLA: the override changes no result
    for the short prompts used here. The indexer's checkpoint tensors are then dropped by vLLM's loader.
    """
    from transformers import DeepseekV3Config

    keep = {k: v for k, v in cfg.to_dict().items()
            if not k.startswith("index") and k not in ("model_type", "transformers_version", "architectures")}
    new = DeepseekV3Config(**keep)
    new.architectures = cfg.architectures
    return new


def _prompt_logprobs(output) -> list[float]:
    """Teacher-forced logprob of each prompt token after the first."""
    ids = output.prompt_token_ids
    out = []
    for pos, entry in enumerate(output.prompt_logprobs):
        if entry is None:
            continue
        out.append(entry[ids[pos]].logprob)
    return out


def run(args: dict, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    results = {}
    for spec in args["runs"]:
        kwargs = dict(max_model_len=args.get("max_model_len", 128), enforce_eager=True,
                      gpu_memory_utilization=0.05, seed=0)
        kwargs.update(spec.get("llm", {}))
        if spec.get("dense_mla"):
            kwargs["hf_overrides"] = dense_mla
        entry: dict = {}
        llm = None
        from vllm_moe_w8.vllm_glue import cpu_rope_fix

        cpu_rope_fix.enabled = spec.get("rope_fix", True)
        try:
            llm = LLM(model=spec["model"], **kwargs)
            params = SamplingParams(max_tokens=args.get("max_tokens", 4), temperature=0.0, prompt_logprobs=0, logprobs=0)
            outs = llm.generate(args["prompts"], params)
            entry["prompt_logprobs"] = [_prompt_logprobs(o) for o in outs]
            entry["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
            entry["text"] = [o.outputs[0].text for o in outs]
            entry["finite"] = all(math.isfinite(v) for row in entry["prompt_logprobs"] for v in row)
            entry["sets"] = [[_prompt_logprobs(o) for o in llm.generate(prompts, params)]
                             for prompts in args.get("prompt_sets", [])]
        except Exception as exc:  # recorded for the test to report
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()[-4000:]
        results[spec["name"]] = entry
        with open(out_path, "w") as f:
            json.dump(results, f)
        del llm
        gc.collect()


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        run(json.load(f), sys.argv[2])
