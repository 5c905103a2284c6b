"""Try ``LLM(path, quantization="neuron-w8")`` on several checkpoints in one process; one JSON line per case.

Run by tests/test_reliability_vllm.py as ``python reliability_load_worker.py CASES.json`` where CASES.json is
``[{"case": ..., "path": ..., "kwargs": {...}}, ...]``. Each result line is ``RESULT {"case", "loaded",
"error", "seconds"}``: ``error`` joins the exception chain (type and message of every cause), which is
what a user sees. One process for all cases saves the vLLM import (~10 s) per case; the caller sets
VLLM_ENABLE_V1_MULTIPROCESSING=0 so the engine core runs in this process and its exception, not a
generic "Engine core initialization failed", reaches us (the multi-process path is what the
``vllm serve`` test exercises).
"""

from __future__ import annotations

import json
import sys
import time


def _chain(exc: BaseException) -> str:
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return " <- ".join(parts)


def main(cases_file: str) -> None:
    from vllm import LLM, SamplingParams

    cases = json.loads(open(cases_file).read())
    for c in cases:
        t0 = time.perf_counter()
        result = {"case": c["case"], "loaded": False, "error": None}
        try:
            kwargs = dict(max_model_len=128, enforce_eager=True, max_num_seqs=4, gpu_memory_utilization=0.05)
            kwargs.update(c.get("kwargs") or {})
            llm = LLM(c["path"], quantization="neuron-w8", **kwargs)
            result["loaded"] = True
            out = llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
            result["token_ids"] = list(out[0].outputs[0].token_ids)
            del llm
        except BaseException as exc:  # noqa: BLE001 - every failure is a result
            result["error"] = _chain(exc)
        result["seconds"] = round(time.perf_counter() - t0, 2)
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
