"""MLA attention (GLM-5) on vLLM's CPU build: a prompt's logprobs do not depend on what it is batched with.

vLLM 0.32's CPU rotary kernel mixes tokens of a batch under MLA (``vllm_moe_w8.vllm_glue.cpu_rope_fix``). Here one child
process runs a tiny GLM-5 FP8 checkpoint with ``neuron-w8`` (dense MLA, fp32) and asks for the teacher-forced prompt
logprobs of prompt A alone, then of A batched between two others, with and without the correction. The engine core
runs in the child's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): every prompt of one ``generate`` call is
queued before the first step, so each call is one batch every time and the test cannot pass or fail by luck.

Both runs ask for vLLM's reference MLA backend, ``CPU_MLA`` (``MLA_BACKEND``), so the test means the same on every CPU
variant: on Intel AMX hosts vLLM 0.32 would otherwise pick ``AMX_MLA``, which refuses fp32 weights at load. The rotary
embedding the correction touches runs before either backend (``vllm/model_executor/layers/mla.py`` rotates q_pe and
k_pe, then calls the backend), so what is measured here is what an AMX_MLA run gets too.
"""

from __future__ import annotations

import pytest
import torch

from conftest import run_models_child

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT_A = "Mixture of experts models route every token to a few experts out of many."
OTHERS = ["Hello, world! The quick brown fox jumps over the lazy dog.", "What is the capital of France? Paris."]
# With the correction A's prompt logprobs batched and alone differ only by fp32 summation order of batch-shaped
# GEMMs (measured 9.5e-7 here); without it a token's rotation uses other tokens' positions (measured 0.44).
BATCH_ATOL = 1e-5
BUG_MIN_DIFF = 1e-3
MLA_BACKEND = "CPU_MLA"  # vLLM's reference CPU MLA (any dtype); AMX_MLA (AMX hosts' default) is bf16-only


@pytest.fixture(scope="module")
def runs(tiny_checkpoint, tmp_path_factory):
    ckpt = tiny_checkpoint("GlmMoeDsaForCausalLM", "block", scale_dtype=torch.float32)
    llm = {"quantization": "neuron-w8", "dtype": "float32", "attention_backend": MLA_BACKEND}
    spec = {"runs": [{"name": "fixed", "model": str(ckpt), "dense_mla": True, "llm": llm},
                     {"name": "unfixed", "model": str(ckpt), "dense_mla": True, "llm": llm, "rope_fix": False}],
            "prompts": [PROMPT_A], "prompt_sets": [[OTHERS[0], PROMPT_A, OTHERS[1]]],
            "max_tokens": 1, "max_model_len": 128}
    return run_models_child(spec, tmp_path_factory.mktemp("mla-batching"), env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


def _alone_vs_batched(results, name) -> float:
    entry = results.get(name)
    assert entry is not None and "error" not in entry, f"run {name}: {entry}\n{results['_log']}"
    assert entry["attention_backends"] == ["CPUMLABackend"], entry["attention_backends"]  # what vLLM ran, any CPU
    alone, batched = entry["prompt_logprobs"][0], entry["sets"][0][1]
    assert len(alone) == len(batched) > 5
    return max(abs(a - b) for a, b in zip(alone, batched))


def test_prompt_logprobs_do_not_depend_on_the_batch(runs):
    assert _alone_vs_batched(runs, "fixed") <= BATCH_ATOL


def test_without_the_correction_they_do(runs):
    """The fault twin: vLLM's kernel alone makes the same comparison fail."""
    assert _alone_vs_batched(runs, "unfixed") > BUG_MIN_DIFF
