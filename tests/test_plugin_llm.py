"""A real ``LLM(...)`` on vLLM's CPU build with a tiny FP8 checkpoint (``tiny_models``), in subprocesses
(vLLM's engine processes are cleaner to judge from outside):

* ``quantization="NEURON-W8"`` (vLLM lower-cases it) with vLLM's default ``torch.compile``;
* no ``quantization`` at all, claimed by the opt-in ``VLLM_MOE_W8_AUTO=1``, ``enforce_eager=True``,
  mode chosen by ``--additional-config``-style ``additional_config={"neuron_w8": {"mode": "output-block"}}``.

Each run must generate, with finite logprobs, and log the load line and the summary line. Accuracy
against the exactly dequantised BF16 twin is gated per architecture in the end-to-end model tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from child_log import excerpt, root_cause

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RUNNER = textwrap.dedent(
    """
    import json, math, sys
    if __name__ == "__main__":
        args = json.loads(sys.argv[1])
        from vllm import LLM, SamplingParams
        llm = LLM(model=args["model"], max_model_len=256, gpu_memory_utilization=0.05, dtype="bfloat16", **args["llm"])
        outs = llm.generate(["Hello, world! How are", "The quick brown fox"],
                            SamplingParams(max_tokens=6, temperature=0, logprobs=1))
        result = []
        for o in outs:
            c = o.outputs[0]
            lps = [next(iter(d.values())).logprob for d in c.logprobs]
            result.append({"tokens": list(c.token_ids), "finite": all(math.isfinite(v) for v in lps)})
        print("RESULT " + json.dumps(result), flush=True)
    """
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from vllm_moe_w8 import tiny_models

    return str(tiny_models.write_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen3-moe-fp8", "qwen3-moe", fmt="block"))


def _run_llm(tmp_path, model: str, llm_kwargs: dict, env_extra: dict, expect_result: bool = True) -> tuple[list, str]:
    script = tmp_path / "run_llm.py"
    script.write_text(RUNNER)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", **env_extra)
    proc = subprocess.run([sys.executable, str(script), json.dumps({"model": model, "llm": llm_kwargs})],
                          capture_output=True, text=True, timeout=900, env=env)
    log = proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not expect_result:
        assert not lines and proc.returncode != 0, f"expected the engine to refuse (exit {proc.returncode}):\n{excerpt(log)}"
        return [], log
    assert lines, f"no result (exit {proc.returncode}):\n{excerpt(log)}"
    return json.loads(lines[-1][len("RESULT "):]), log


def _check(result, log, mode, source):
    assert len(result) == 2
    for r in result:
        assert len(r["tokens"]) == 6 and r["finite"]
    start = [line for line in log.splitlines() if "neuron-w8: loading routed experts" in line]
    assert start, excerpt(log)
    assert f"mode {mode} ({source})" in start[0] and "compute path" in start[0] and "local experts 8 of 8" in start[0]
    summary = [line for line in log.splitlines() if "neuron-w8: processed 2 MoE layers" in line]
    assert summary and "expert bytes" in summary[0] and "self-check passed" in summary[0]


def test_llm_with_flag_upper_case_and_torch_compile(checkpoint, tmp_path):
    result, log = _run_llm(tmp_path, checkpoint, {"quantization": "NEURON-W8"}, {"VLLM_MOE_W8_AUTO": "0"})
    _check(result, log, "pow2", "default")
    assert "enforce_eager=False" in log or "Enforce eager set" not in log


def test_llm_auto_claim_eager_with_additional_config_mode(checkpoint, tmp_path):
    """Output-block scales run on the plugin's op only (named: a run that forces vLLM's kernel refuses them, below)."""
    kwargs = {"enforce_eager": True, "additional_config": {"neuron_w8": {"mode": "output-block"}}}
    result, log = _run_llm(tmp_path, checkpoint, kwargs, {"VLLM_MOE_W8_AUTO": "1", "VLLM_MOE_W8_CPU_KERNEL": "native"})
    _check(result, log, "output-block", "additional_config neuron_w8.mode")
    assert "claiming the fp8 checkpoint automatically" in log


def test_llm_forcing_vllms_fp8_kernel_on_output_block_scales_refuses_to_start(checkpoint, tmp_path):
    """``VLLM_MOE_W8_CPU_KERNEL=vllm-fp8`` with a layout vLLM's kernel cannot run (one scale per 128 rows) is an error
    when the first MoE layer is created, on every host: the engine does not start, and the first exception in its
    output names the setting, the reason and the remedy (nothing is served on another kernel than the one asked for)."""
    kwargs = {"enforce_eager": True, "additional_config": {"neuron_w8": {"mode": "output-block"}}}
    _, log = _run_llm(tmp_path, checkpoint, kwargs, {"VLLM_MOE_W8_AUTO": "1", "VLLM_MOE_W8_CPU_KERNEL": "vllm-fp8"},
                      expect_result=False)
    cause = root_cause(log)
    assert "ValueError: VLLM_MOE_W8_CPU_KERNEL=vllm-fp8, but vLLM's FP8 MoE kernel cannot run this layer" in cause, excerpt(log)
    assert "Unset VLLM_MOE_W8_CPU_KERNEL" in cause and "neuron-w8: loading routed experts" not in log


def test_llm_on_vllms_fp8_kernel_under_torch_compile(checkpoint, tmp_path):
    """The MoE method's other CPU path (vLLM's FP8 kernel on the prepacked experts, asked for by name), with the
    non-expert FP8 linears on vLLM's FP8 linear kernel, under vLLM's default torch.compile: it loads, says which paths
    and why, and generates (accuracy: tests/test_models_accuracy.py)."""
    from vllm_moe_w8.vllm_glue import cpu_vllm_fp8

    from vllm_moe_w8.vllm_glue import cpu_vllm_fp8_linear

    missing = cpu_vllm_fp8.unavailable_reason() or cpu_vllm_fp8_linear.unavailable_reason()
    if missing:
        pytest.skip(f"vLLM's FP8 kernels cannot run on this host: {missing}")
    result, log = _run_llm(tmp_path, checkpoint, {"quantization": "neuron-w8"},
                           {"VLLM_MOE_W8_AUTO": "0", "VLLM_MOE_W8_CPU_KERNEL": "vllm-fp8", "VLLM_MOE_W8_CPU_LINEAR": "vllm-fp8"})
    _check(result, log, "pow2", "default")
    linears = [line for line in log.splitlines() if "neuron-w8: processed" in line and "non-expert linear layers" in line]
    assert linears and "on vLLM's FP8 kernel (1 byte per weight)" in linears[0] and "dequantised" not in linears[0], excerpt(log)
    assert "routed experts on CPU: vLLM's FP8 W8A16 MoE kernel (VLLM_MOE_W8_CPU_KERNEL=vllm-fp8" in log, excerpt(log)
