"""Real tensor parallelism on vLLM's CPU build: ``tensor_parallel_size=2`` (two worker processes, gloo/shm
all-reduce) with ``quantization="neuron-w8"`` on a tiny Qwen3-MoE FP8 checkpoint whose
``moe_intermediate_size`` is 384, so each rank holds a ragged 192 rows of every expert (not a multiple of
the 128-row scale blocks), and the same at TP=2 with ``enable_expert_parallel=True`` (4 whole experts per
rank). Both must give the TP=1 prompt logprobs.

Each configuration runs in its own child process (``tests/_models_runner.py``); vLLM's CPU build may abort
at shutdown with TP=2 (exit 134) after its results are written, so the tests judge the results file.
"""

from __future__ import annotations

import pytest
import torch

from conftest import run_models_child

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# float32 everywhere; TP only changes the order of fp32 sums (per-rank partial outputs all-reduced),
# a relative ~1e-6 effect on logits of magnitude ~10: 1e-3 is loose for that and tight for any real
# sharding error (a wrong half of an expert or a misplaced scale tile moves logprobs by > 0.1).
LOGPROB_ATOL_TP = 1e-3

PROMPTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Mixture of experts models route every token to a few experts out of many.",
]
ARCH = "Qwen3MoeForCausalLM"
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def _run(tiny_checkpoint, tmp_path_factory, name, llm_extra, env=None):
    ckpt = tiny_checkpoint(ARCH, "block", scale_dtype=torch.bfloat16)
    llm = {"quantization": "neuron-w8", "dtype": "float32", **llm_extra}
    res = run_models_child({"runs": [{"name": name, "model": str(ckpt), "llm": llm}], "prompts": PROMPTS,
                            "max_tokens": 4, "max_model_len": 128},
                           tmp_path_factory.mktemp(name), env=env, timeout=900)
    entry = res.get(name)
    assert entry is not None and "error" not in entry, (
        f"{name}: {entry and entry.get('error')}\n{entry and entry.get('traceback', '')}\nlog:\n{res['_log']}")
    return dict(entry, _plugin_log=res["_plugin_log"])


@pytest.fixture(scope="module")
def tp1(tiny_checkpoint, tmp_path_factory):
    return _run(tiny_checkpoint, tmp_path_factory, "tp1", {})


def _compare(ref, other, label):
    diffs = [abs(a - b) for ra, rb in zip(ref["prompt_logprobs"], other["prompt_logprobs"]) for a, b in zip(ra, rb)]
    assert len(diffs) == sum(len(r) for r in ref["prompt_logprobs"]) > 20
    assert other["finite"]
    assert max(diffs) <= LOGPROB_ATOL_TP, f"{label}: max |dlogprob| {max(diffs):.3g} vs TP=1"
    assert other["tokens"] == ref["tokens"], f"{label}: greedy tokens differ from TP=1"


def _load_lines(entry, rank, tp_size):
    lines = [line for line in entry["_plugin_log"] if "loading routed experts" in line and f"TP rank {rank}/{tp_size}" in line]
    assert lines, f"no neuron-w8 load line for TP rank {rank}/{tp_size} in:\n" + "\n".join(entry["_plugin_log"])
    return lines


def test_tp2_ragged_192_rows_per_rank_matches_tp1(tp1, tiny_checkpoint, tmp_path_factory):
    tp2 = _run(tiny_checkpoint, tmp_path_factory, "tp2",
               {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}, env=TP2_ENV)
    _compare(tp1, tp2, "TP=2")
    # both ranks loaded their 192 rows on the refined 64-row scale grid (gcd(192, 128)), not the checkpoint's 128
    for rank in range(2):
        assert all("scale tile (128, 128) -> (64, 64) on this rank" in line for line in _load_lines(tp2, rank, 2))
    assert all("scale tile (128, 128) -> (128, 128) on this rank" in line for line in _load_lines(tp1, 0, 1))


def test_tp2_expert_parallel_matches_tp1(tp1, tiny_checkpoint, tmp_path_factory):
    ep2 = _run(tiny_checkpoint, tmp_path_factory, "tp2_ep",
               {"tensor_parallel_size": 2, "distributed_executor_backend": "mp", "enable_expert_parallel": True},
               env=TP2_ENV)
    _compare(tp1, ep2, "TP=2 + EP")
