"""Accuracy gate per model family: ``LLM(..., quantization="neuron-w8")`` on a tiny FP8 checkpoint in the
official layout vs vLLM's own *unquantised* run of its exactly dequantised twin (``tiny_models.write_twin``).

The twin is independent of the plugin: its weights come from torch's float8_e4m3fn conversion times the
checkpoint's scales, and vLLM runs it with no quantization at all. Both runs see the same prompts;
we compare the teacher-forced prompt logprobs (every prompt token after the first) and the offline
``generate`` output. One child process per case runs both LLMs, one after the other.

Where vLLM's CPU build runs an architecture in float32 the two runs hold bit-identical weights, so
they may only differ by fp32 summation order; Qwen3.5's Gated DeltaNet runs only in bfloat16 on CPU
("CPU GDN attention requires BF16"), so those runs carry bf16 activation rounding and get a wider,
named tolerance. GLM-5's DSA attention is refused by the CPU build ("Sparse Attention is not
supported on CPU"); its runs use dense MLA (``_models_runner.dense_mla``), which equals DSA for
prompts no longer than ``index_topk`` (64 here), so the checkpoint, its MoE and its MLA run for real.

Both runs use the same vLLM kernels on every CPU variant (AVX2-only, AVX-512, Intel AMX), so the gate compares
the plugin's MoE with vLLM's and nothing else: the MLA case asks for vLLM's reference MLA backend (``CPU_MLA``; on
AMX hosts vLLM would otherwise pick ``AMX_MLA``, which refuses fp32 weights), and the twin's MoE is pinned to vLLM's
portable ``"vec"`` kernel (``_models_runner`` ``moe_isa``; on AMX hosts vLLM would pick its ``"amx"`` BF16 kernel for
the bf16 cases, see ``LOGPROB_ATOL_BF16``). Every other kernel vLLM picks by CPU (attention ISA, GEMMs, Gated
DeltaNet) is picked alike in both runs of a case; ``test_runs_used_the_kernels_the_gate_assumes`` checks the choices
vLLM recorded.

Both runs schedule alike: the engine core runs in the child's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the
three prompts of one ``generate`` call always form one batch. (With the engine core in its own process a batch
depended on message timing; under vLLM's CPU rotary bug for MLA that made GLM-5 flaky, see
``vllm_moe_w8.vllm_glue.cpu_rope_fix`` and tests/test_mla_batch_independence.py.)
"""

from __future__ import annotations

import math

import pytest
import torch

import corrupt
from conftest import run_models_child

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# fp32 runs: identical weights; logits differ only by fp32 rounding of differently ordered sums and by
# the pow2 repack's exact-or-round-to-even halving of odd subnormal codes (measured: 3e-6 on Qwen3-MoE);
# 1e-4 leaves margin and still catches any real error: one expert's scale tile doubled in the checkpoint
# moved the max |dlogprob| by 0.53 (Qwen3-MoE), 0.79 (GLM-4 block), 0.60 (GLM-4 per-channel: one row's
# scale), 2.25 (GLM-5) (test_gate_refuses_a_broken_checkpoint).
LOGPROB_ATOL_FP32 = 1e-4
# bf16 runs (Qwen3.5): the twin holds the weights rounded to bf16 and every activation is rounded to
# bf16 in both runs, while neuron-w8 computes experts from the exact weights in fp32: the per-token
# difference is a few bf16 ulps of the hidden state carried through two layers to the logits
# (measured on Qwen3.5-MoE: max 0.031, mean 0.008). One expert's scale tile doubled in the checkpoint
# moved the max to 0.29 (Qwen3.5-MoE) and 0.23 (Qwen3.5 text, fp16 scales): the 0.1 gate catches it with a
# 2.3x margin, while the mean (0.022, 0.025) would not; the max is the gate that matters here.
# These figures hold on every CPU variant because the twin's MoE is pinned to vLLM's "vec" kernel (exact bf16 x bf16
# products summed in fp32, cpu_micro_gemm_vec.hpp), the kernel an AVX-512 or AVX2 host runs anyway: on an Intel AMX
# host vLLM's default for a bf16 twin is its "amx" kernel (X86CPUUnquantizedExperts, tile dot-products with other
# rounding), which moved the max to 0.167 (mean 0.0107) and left no margin. The two runs of a case then differ in
# the MoE only (neuron-w8's op: the same avx512bf16 kernel on EPYC and on AMX Xeons, both have avx512_bf16; avx2 on
# AVX2-only hosts, the same fp32 semantics) and vLLM's other CPU-dependent choices are the same in both runs.
LOGPROB_ATOL_BF16 = 0.1
# ... and its mean over all prompt tokens must be smaller still (no systematic bias).
LOGPROB_MEAN_ATOL_BF16 = 0.025
# The max gate applies to the positions where both runs' MoE layers chose the same experts. Where a router's k-th
# and (k+1)-th experts are within a bf16 step of the hidden state (a near-tie), the two runs' bf16 roundings may pick
# differently, and that position's logprob moves by up to 0.5 whichever run is right (benchmarks/bench_routing_flips:
# over the gate's prompts and 12 random sets, 14 of ~1,095 positions of the exact-h default routed differently from
# the twin in the last layer, max 0.50 there, 0.036 everywhere else; 3 of the 13 sets would fail a plain max gate).
# Which prompts hold a near-tie depends on the CPU's kernels, so a plain max gate would pass or fail by the host. The
# positions set aside are bounded instead: at most this fraction of a case's positions may route differently (a real
# fault that moves routing moves many positions), and the mean gate still counts every position.
ROUTING_FLIP_MAX_FRACTION = 0.1

PROMPTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Mixture of experts models route every token to a few experts out of many.",
    "What is the capital of France? Paris is the capital of France.",
]

# The MLA backend every MLA run asks for: vLLM's reference CPU MLA (any dtype). Without the request vLLM 0.32 picks
# AMX_MLA on AMX hosts (vllm/platforms/cpu.py get_attn_backend_cls), which takes bf16 only and refuses these fp32
# weights at load ("expect weight to be bfloat16, ..."); elsewhere it picks CPU_MLA anyway.
MLA_BACKEND = "CPU_MLA"
# The twin's unquantised MoE kernel (see LOGPROB_ATOL_BF16): vLLM's portable one, the same on every host.
TWIN_MOE_ISA = "vec"

# case -> (tiny_models architecture, fmt, scale dtype, vLLM dtype, dense_mla)
CASES = {
    "qwen3-moe-block-bf16scale": ("Qwen3MoeForCausalLM", "block", torch.bfloat16, "float32", False),
    "qwen3.5-moe-block": ("Qwen3_5MoeForConditionalGeneration", "block", torch.bfloat16, "bfloat16", False),
    "qwen3.5-moe-text-fp16scale": ("Qwen3_5MoeForCausalLM", "block", torch.float16, "bfloat16", False),
    "glm4-moe-block-fp32scale": ("Glm4MoeForCausalLM", "block", torch.float32, "float32", False),
    "glm4-moe-channel": ("Glm4MoeForCausalLM", "channel", torch.bfloat16, "float32", False),
    "glm5-block-dense-mla": ("GlmMoeDsaForCausalLM", "block", torch.float32, "float32", True),
}


# The cases served once more on vLLM's own FP8 W8A16 kernels: the routed experts (VLLM_MOE_W8_CPU_KERNEL=vllm-fp8;
# what auto picks on AMX hosts where the layout fits: 128 x 128 tiles, I a multiple of 128, BF16 activations) and the
# non-expert FP8 linears at 1 byte (VLLM_MOE_W8_CPU_LINEAR=vllm-fp8; auto's choice on AMX hosts where they fit). They
# round to BF16 where the op does not, like the twin's BF16 activations, so the BF16 gate applies unchanged.
VLLM_FP8_CASES = ("qwen3.5-moe-block",)
VLLM_FP8_RUN = "neuron-w8-vllm-fp8"


def vllm_fp8_missing() -> str | None:
    """Why this host's vLLM build cannot run its FP8 kernel (vLLM's AVX2 build has none), or None."""
    from vllm_moe_w8.vllm_glue import cpu_vllm_fp8, cpu_vllm_fp8_linear

    return cpu_vllm_fp8.unavailable_reason() or cpu_vllm_fp8_linear.unavailable_reason()

# Broken copies served next to each case, in the same child (one more engine start each): the gate must
# refuse them. A checkpoint's own fault passes the load-time self-check (the plugin serves what the file
# says), so only the accuracy gate can see it. name -> (what it breaks, corrupt.py function).
FAULTS = {
    "scale-tile-doubled": ("layer 1, expert 3 up_proj: its first scale tile (per-channel: row scale) x2", corrupt.double_scale_tile),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tiny_checkpoint, tiny_twin, tmp_path_factory):
    """One child per case: the neuron-w8 run, the twin's, then each broken copy's (neuron-w8)."""
    name = request.param
    arch, fmt, scale_dtype, dtype, dense = CASES[name]
    ckpt = tiny_checkpoint(arch, fmt, scale_dtype=scale_dtype)
    twin = tiny_twin(arch, fmt, dtype=torch.float32, scale_dtype=scale_dtype)
    work = tmp_path_factory.mktemp(name)
    backend = {"attention_backend": MLA_BACKEND} if dense else {}
    quant = {"quantization": "neuron-w8", "dtype": dtype, **backend}
    runs = [{"name": "neuron-w8", "model": str(ckpt), "dense_mla": dense, "llm": quant},
            {"name": "twin", "model": str(twin), "dense_mla": dense, "llm": {"dtype": dtype, **backend},
             "moe_isa": TWIN_MOE_ISA}]
    if name in VLLM_FP8_CASES and vllm_fp8_missing() is None:
        runs.append({"name": VLLM_FP8_RUN, "model": str(ckpt), "dense_mla": dense, "llm": quant,
                     "env": {"VLLM_MOE_W8_CPU_KERNEL": "vllm-fp8", "VLLM_MOE_W8_CPU_LINEAR": "vllm-fp8"}})
    for fault, (_what, breaker) in FAULTS.items():
        broken = corrupt.copy_checkpoint(ckpt, work / f"broken-{fault}")
        breaker(broken)
        runs.append({"name": fault, "model": str(broken), "dense_mla": dense, "llm": quant})
    results = run_models_child({"runs": runs, "prompts": PROMPTS, "max_tokens": 6, "max_model_len": 128},
                               work / "child", timeout=1500 + 600 * len(FAULTS),
                               env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    return name, results


def _entry(results, name):
    entry = results.get(name)
    assert entry is not None, f"run {name} did not happen; child log:\n{results['_log']}"
    assert "error" not in entry, f"run {name} failed: {entry['error']}\n{entry.get('traceback', '')}"
    return entry


def routed_alike(quant: dict, twin: dict) -> list[bool]:
    """Per predicted prompt token (the order of ``prompt_logprobs``, flattened): whether every MoE layer chose the
    same set of experts in both runs at the position that predicts it."""
    lens = twin["prompt_lens"]
    assert quant["prompt_lens"] == lens
    layers_q, layers_t = quant["routing"], twin["routing"]
    assert layers_q and len(layers_q) == len(layers_t), ("prefill routing not recorded alike", len(layers_q), len(layers_t))
    alike, start = [], 0
    for n in lens:
        for pos in range(start, start + n - 1):  # the logprob of token j + 1 is predicted at position j
            alike.append(all(set(lq[pos]) == set(lt[pos]) for lq, lt in zip(layers_q, layers_t)))
        start += n
    return alike


def logprob_gate(case: str, quant: dict, twin: dict) -> None:
    """The accuracy gate: teacher-forced prompt logprobs of a neuron-w8 run vs the dequantised twin's."""
    assert quant["finite"] and twin["finite"]
    diffs = [abs(a - b) for qa, ta in zip(quant["prompt_logprobs"], twin["prompt_logprobs"]) for a, b in zip(qa, ta)]
    assert len(diffs) == sum(len(t) for t in twin["prompt_logprobs"]) > 30
    worst, mean = max(diffs), sum(diffs) / len(diffs)
    if CASES[case][3] == "float32":
        print(f"{case}: max |dlogprob| {worst:.3g}, mean {mean:.3g}")
        assert worst <= LOGPROB_ATOL_FP32, f"{case}: max |dlogprob| {worst:.3g} > {LOGPROB_ATOL_FP32} (mean {mean:.3g})"
        return
    alike = routed_alike(quant, twin)
    assert len(alike) == len(diffs)
    flips = alike.count(False)
    worst_alike = max(d for d, a in zip(diffs, alike) if a)
    print(f"{case}: max |dlogprob| {worst_alike:.3g} where routed alike ({worst:.3g} over all), mean {mean:.3g}; "
          f"{flips} of {len(diffs)} positions routed differently")
    assert flips <= ROUTING_FLIP_MAX_FRACTION * len(diffs), (
        f"{case}: {flips} of {len(diffs)} positions routed differently from the twin (> {ROUTING_FLIP_MAX_FRACTION:.0%}); "
        f"max |dlogprob| {worst:.3g}")
    assert worst_alike <= LOGPROB_ATOL_BF16, (
        f"{case}: max |dlogprob| {worst_alike:.3g} > {LOGPROB_ATOL_BF16} where both runs routed alike (mean {mean:.3g})")
    assert mean <= LOGPROB_MEAN_ATOL_BF16, f"{case}: mean |dlogprob| {mean:.3g} > {LOGPROB_MEAN_ATOL_BF16}"


def test_prompt_logprobs_match_dequantised_twin(case):
    case, results = case
    quant, twin = _entry(results, "neuron-w8"), _entry(results, "twin")
    logprob_gate(case, quant, twin)
    # The logprobs are informative (not flat): a random-weight model far from uniform over the vocabulary.
    uniform = -math.log(512)
    assert any(abs(v - uniform) > 1.0 for row in twin["prompt_logprobs"] for v in row)


@pytest.mark.parametrize("fault", list(FAULTS))
def test_gate_refuses_a_broken_checkpoint(case, fault):
    """The gate's twin: the same checkpoint with one realistic fault, served by neuron-w8, fails it."""
    case, results = case
    broken, twin = _entry(results, fault), _entry(results, "twin")
    with pytest.raises(AssertionError, match=r"\|dlogprob\|") as err:
        logprob_gate(case, broken, twin)
    print(f"{case} / {fault} ({FAULTS[fault][0]}): {err.value}")


def test_offline_generate(case):
    case, results = case
    quant, twin = _entry(results, "neuron-w8"), _entry(results, "twin")
    assert all(len(t) == 6 for t in quant["tokens"]), quant["tokens"]
    if CASES[case][3] == "float32":
        # Same weights, fp32: greedy decoding must pick the same tokens.
        assert quant["tokens"] == twin["tokens"], (quant["text"], twin["text"])


def test_vllm_fp8_kernel_run_matches_dequantised_twin(case):
    """The MoE method's other CPU path, vLLM's FP8 kernel on the prepacked experts, asked for by name: every routed
    call ran it, the load log says so, and it passes the same gate against the twin."""
    case, results = case
    if case not in VLLM_FP8_CASES:
        pytest.skip("the vllm-fp8 run is served for the BF16 case whose layout fits vLLM's FP8 kernel")
    if vllm_fp8_missing():
        pytest.skip(f"vLLM's FP8 kernel cannot run on this host: {vllm_fp8_missing()}")
    fp8_run, twin = _entry(results, VLLM_FP8_RUN), _entry(results, "twin")
    assert fp8_run["w8_cpu_kernels"] == ["vllm-fp8"], fp8_run["w8_cpu_kernels"]
    assert fp8_run["w8_cpu_linears"] == ["vllm-fp8"], fp8_run["w8_cpu_linears"]
    assert any("routed experts on CPU: vLLM's FP8 W8A16 MoE kernel" in line for line in results["_plugin_log"])
    assert any("non-expert linear layers: " in line and "on vLLM's FP8 kernel (1 byte per weight)" in line
               and "dequantised" not in line for line in results["_plugin_log"]), results["_plugin_log"]
    logprob_gate(case, fp8_run, twin)


def test_runs_used_the_kernels_the_gate_assumes(case):
    """What vLLM recorded picking, the same on every CPU variant: the MLA case ran CPU_MLA in every run, the others
    vLLM's CPU attention with one attention ISA in all runs of the case, the twin's MoE ran vLLM's "vec" kernel and
    nothing else, and the neuron-w8 runs ran no vLLM MoE kernel at all (every routed expert through the plugin's op; the
    vllm-fp8 run through vLLM's FP8 kernel only, asked for by name)."""
    case, results = case
    names = ["neuron-w8", "twin", *FAULTS] + ([VLLM_FP8_RUN] if case in VLLM_FP8_CASES and vllm_fp8_missing() is None else [])
    entries = {name: _entry(results, name) for name in names}
    for name, entry in entries.items():
        assert entry["attention_backends"], f"{name}: no attention backend recorded (engine core not in the child?)"
        if CASES[case][4]:
            assert entry["attention_backends"] == ["CPUMLABackend"], (name, entry["attention_backends"])
        else:
            assert entry["attention_backends"] == ["CPUAttentionBackend"], (name, entry["attention_backends"])
        want_moe = [TWIN_MOE_ISA] if name == "twin" else []
        assert entry["moe_isas"] == want_moe, (name, entry["moe_isas"])
        want_w8 = [] if name == "twin" else ["vllm-fp8"] if name == VLLM_FP8_RUN else ["op"]
        assert entry["w8_cpu_kernels"] == want_w8, (name, entry["w8_cpu_kernels"])
        assert entry["w8_cpu_linears"] == (["vllm-fp8"] if name == VLLM_FP8_RUN else []), (name, entry["w8_cpu_linears"])
        # the kernels vLLM picks by CPU are picked alike in every run of the case (on AMX hosts: "amx" for bf16)
        assert entry["attention_isas"] == entries["twin"]["attention_isas"], (name, entry["attention_isas"])
